"""A tensor-parallel node: N ranks execute every step together, rank 0 in the engine.

The engine core schedules once. Rank 0 is the `TPRunner` in the engine process: an
ordinary `ModelRunner` whose model is this node's shard (engine/tp_shard.py) behind a
`_Leader` front. Ranks 1..N-1 are worker processes it spawned (`_worker_main`); each
holds its shard and its slice of the KV cache (the same blocks, its KV heads).

Per step the leader sends the workers the step's flattened inputs (token ids, positions,
slots, block tables, context lengths: one int64 buffer) over a local pipe to each child
(raw bytes, no pickle), then every rank runs the forward pass; the all-reduces inside it
run over the node's process group (gloo on CPU, NCCL on CUDA). For the rows that sample,
the leader sends the final hidden rows; each rank computes the logits of its vocab slice
and they are gathered on rank 0, which samples once. Prompt logprobs go the same way.

Failure: every collective fails after `COLLECTIVE_TIMEOUT_S` (a dead peer usually fails
it at once: its sockets close); a worker whose pipe closes (the engine died) exits; a
worker whose step fails exits, which fails the leader's next collective: the engine
process raises out of its step and the node goes down as on any engine fault.
On CPU each rank runs `threads // N` torch threads (at least one). The fused native
decode and the compiled step are off under TP (they run whole layers with no all-reduce).
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import os
import shutil
import signal
import tempfile
import time
import weakref

import numpy as np
import torch

from pdserve.common.errors import ConfigError
from pdserve.common.parent_death import die_with_parent
from pdserve.engine.attention import AttentionMetadata
from pdserve.engine.config import EngineConfig
from pdserve.engine.kv_tensor import KVRanks, shared_kv_cache
from pdserve.engine.model_arch import ModelArch
from pdserve.engine.model_build import build_model
from pdserve.engine.model_runner import ModelRunner
from pdserve.engine.step_plan import StepPlan
from pdserve.engine.tp_shard import Comm, Shard, check_divides, parallelize
from pdserve.engine.weights import iter_safetensors

logger = logging.getLogger(__name__)

COLLECTIVE_TIMEOUT_S = 120.0  # no rank waits longer on a peer inside a step
START_TIMEOUT_S = 600.0  # workers loading their shard
# int64 words: op, T, nd, n_prefill, table width, gemv, rows, cols; a forward's "rows":
# its out_rows' count, -1 for none
_HEADER = 8
_FORWARD, _LOGITS, _STOP = 1, 2, 3


class TPRank(ModelRunner):
    """A `ModelRunner` over one rank's shard; rank 0 is the engine's (`TPRunner`)."""

    single_device = False

    def __init__(
        self, config, arch, model_dir, num_blocks, rank: int, store_path: str, kv_path: str = ""
    ):
        world = config.tensor_parallel_size
        self._kv_path = kv_path  # CPU: this rank's KV cache file, mapped by rank 0 too
        self.shard = Shard(arch, rank, world)
        device = torch.device(config.model.device)
        if device.type == "cuda":  # rank r: the GPU r after the node's own
            device = torch.device("cuda", (device.index or 0) + rank)
            torch.cuda.set_device(device)
            config = _with_device(config, str(device))
        self.config = config
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # the node's ranks talk on loopback
        torch.set_num_threads(max(1, config.threads // world))
        workers = getattr(self, "workers", [])  # rank 0: its spawned ranks
        self.comm = Comm(
            store_path, rank, world, device, COLLECTIVE_TIMEOUT_S, START_TIMEOUT_S,
            lambda: all(p.is_alive() for p in workers),
        )  # fmt: skip
        super().__init__(config, arch, model_dir, num_blocks)

    def _local_arch(self, arch: ModelArch) -> ModelArch:
        return self.shard.local_arch()

    def _allocate_kv(self, local: ModelArch, num_blocks: int) -> torch.Tensor:
        if not self._kv_path:
            return super()._allocate_kv(local, num_blocks)
        return shared_kv_cache(
            self.kv_layout, self._kv_path, local.num_hidden_layers, num_blocks,
            self.block_size, local.num_key_value_heads, local.head_dim, self.dtype,
        )  # fmt: skip

    def _load_model(self, arch: ModelArch, ops, model_dir: str) -> torch.nn.Module:
        model = build_model(self.shard.local_arch(), ops, self.device, self.dtype)
        parallelize(model, self.shard, self.comm)
        model.load_weights(self.shard.shard_weights(iter_safetensors(model_dir)))
        model.init_rope(self.device)
        return model

    # -- the worker side ----------------------------------------------------------------
    @torch.inference_mode()
    def serve(self, conn) -> None:
        """Run the leader's orders until it says stop or its pipe closes."""
        while True:
            try:
                msg = conn.recv_bytes()
            except (EOFError, OSError):
                return
            head = np.frombuffer(msg, np.int64, _HEADER)
            op = int(head[0])
            if op == _STOP:
                return
            if op == _FORWARD:
                body = np.frombuffer(msg, np.int64, offset=8 * _HEADER)
                ids, pos, meta, out_rows = _unpack(head, body)
                dev = self.device
                meta = _meta_to(meta, dev)
                plan = StepPlan(gemv=bool(head[5]))
                if out_rows is not None:
                    out_rows = out_rows.to(dev)
                self.model(ids.to(dev), pos.to(dev), self.kv_cache, meta, plan, out_rows)
            elif op == _LOGITS:
                rows, cols = int(head[6]), int(head[7])
                hidden = torch.frombuffer(bytearray(msg[8 * _HEADER :]), dtype=self.dtype)
                hidden = hidden.view(rows, cols).to(self.device)
                self.comm.gather(self.model.compute_logits(hidden, StepPlan(gemv=bool(head[5]))))


class TPRunner(TPRank):
    """Rank 0: spawns ranks 1..N-1, then runs as a `ModelRunner` whose model drives them."""

    def __init__(self, config: EngineConfig, arch: ModelArch, model_dir: str, num_blocks: int):
        world = config.tensor_parallel_size
        check_divides(arch, world)
        self._dir = tempfile.mkdtemp(prefix="pdserve-tp-")
        store = os.path.join(self._dir, "store")
        self._kv_fds = _kv_files(config, arch, num_blocks)
        paths = [f"/proc/{os.getpid()}/fd/{fd}" for fd in self._kv_fds] or [""] * world
        self._arch, self._num_blocks, self._ranks = arch, num_blocks, None
        ctx = mp.get_context("spawn")
        self.workers, self.pipes = [], []
        with _may_have_children():
            for rank in range(1, world):
                ours, theirs = ctx.Pipe()
                args = (config, arch, model_dir, num_blocks, rank, store, paths[rank])
                p = ctx.Process(
                    target=_worker_main,
                    args=(*args, theirs, os.getpid()),
                    name=f"pdserve-tp-rank{rank}",
                    daemon=True,
                )
                p.start()
                theirs.close()
                self.workers.append(p)
                self.pipes.append(ours)
        self._finalizer = weakref.finalize(
            self, _stop, self.pipes, self.workers, self._dir, self._kv_fds
        )
        try:
            super().__init__(config, arch, model_dir, num_blocks, 0, store, paths[0])
            self._wait_ready()
        except BaseException:
            self.close()
            raise
        self.model = _Leader(self.model, self)
        logger.info(
            "tensor parallel: %d ranks (workers %s), %d thread(s) each",
            world,
            [p.pid for p in self.workers],
            torch.get_num_threads(),
        )

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        for rank, (conn, proc) in enumerate(zip(self.pipes, self.workers), 1):
            while not conn.poll(0.2):
                if not proc.is_alive():
                    raise RuntimeError(f"TP rank {rank} exited with {proc.exitcode} while loading")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"TP rank {rank} not ready in {START_TIMEOUT_S:.0f} s")
            msg = conn.recv_bytes()
            if msg != b"ready":
                raise RuntimeError(f"TP rank {rank}: {msg.decode(errors='replace')}")

    def send(self, payload: bytes) -> None:
        for conn in self.pipes:
            conn.send_bytes(payload)

    def close(self) -> None:
        """Stop the workers (idempotent; also run when the runner is collected)."""
        self._finalizer()

    @property
    def worker_pids(self) -> list[int]:
        return [p.pid for p in self.workers]

    @property
    def kv_ranks(self) -> KVRanks | None:
        """Every rank's KV cache, mapped here (CPU; None on CUDA, where each rank's cache
        is on its own device): what a PD node's connector registers and moves."""
        if self._ranks is None and self._kv_fds:
            world = len(self._kv_fds)
            caches = [self.kv_cache] + [
                _map_rank(self, r, f"/proc/self/fd/{self._kv_fds[r]}") for r in range(1, world)
            ]
            starts = [Shard(self._arch, r, world).kv_head_start for r in range(world)]
            self._ranks = KVRanks(tuple(caches), tuple(starts), self._arch.num_key_value_heads)
        return self._ranks


class _Leader:
    """Rank 0's model as the runner sees it: the forward pass and the logits, each
    first announced to the workers so that all ranks run it."""

    compiled_decode = None
    fused_decode = None

    def __init__(self, model: torch.nn.Module, runner: TPRunner):
        self.model = model
        self.runner = runner
        self.vocab = runner.shard.arch.vocab_size

    def __getattr__(self, name):
        return getattr(self.model, name)

    def __call__(
        self, input_ids, positions, kv_cache, meta: AttentionMetadata, plan=None, out_rows=None
    ):
        gemv = True if plan is None else plan.gemv
        if out_rows is not None and out_rows.numel() == 0:
            # no row samples: still one row through the last layer, whose o_proj all-reduce
            # is what makes rank 0 wait for every rank's last K/V store before the step's
            # blocks are hashed or sent (an empty step would return before it)
            out_rows = torch.tensor([input_ids.shape[0] - 1], device=input_ids.device)
        self.runner.send(_pack(input_ids, positions, meta, gemv, out_rows))
        return self.model(input_ids, positions, kv_cache, meta, plan, out_rows)

    def compute_logits(self, hidden: torch.Tensor, plan: StepPlan | None = None) -> torch.Tensor:
        gemv = plan is None or plan.gemv
        rows, cols = hidden.shape
        head = np.array([_LOGITS, 0, 0, 0, 0, gemv, rows, cols], np.int64)
        body = hidden.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes()
        self.runner.send(head.tobytes() + body)
        parts = self.runner.comm.gather(self.model.compute_logits(hidden, plan))
        return torch.cat(parts, dim=-1)[:, : self.vocab]


def _pack(input_ids, positions, meta: AttentionMetadata, gemv: bool, out_rows=None) -> bytes:
    nd, np_ = meta.num_decode_tokens, meta.num_prefills
    tables = torch.cat([meta.decode_block_tables, meta.prefill_block_tables])
    parts = [
        input_ids,
        positions,
        meta.slot_mapping,
        tables.reshape(-1),
        meta.decode_context_lens,
        meta.prefill_query_start_loc,
        meta.prefill_seq_lens,
    ]
    n_out = -1
    if out_rows is not None:  # every rank prunes its last layer to the same rows
        parts.append(out_rows)
        n_out = out_rows.shape[0]
    body = torch.cat([p.reshape(-1).to("cpu", torch.int64) for p in parts]).numpy()
    head = np.array(
        [_FORWARD, input_ids.shape[0], nd, np_, tables.shape[1], gemv, n_out, 0], np.int64
    )
    return head.tobytes() + body.tobytes()


def _unpack(head, body: np.ndarray):
    t, nd, np_, width = (int(x) for x in head[1:5])
    n_out = int(head[6])
    sizes = [t, t, t, (nd + np_) * width, nd, np_ + 1, np_, max(n_out, 0)]
    ids, pos, slots, tables, dcl, qsl, psl, rows = np.split(body, np.cumsum(sizes)[:-1])
    tables = torch.from_numpy(tables.astype(np.int32)).view(nd + np_, width)
    i32 = lambda a: torch.from_numpy(a.astype(np.int32))  # noqa: E731
    meta = AttentionMetadata(
        slot_mapping=torch.from_numpy(slots.copy()),
        num_decode_tokens=nd,
        decode_block_tables=tables[:nd],
        decode_context_lens=i32(dcl),
        prefill_block_tables=tables[nd:],
        prefill_query_start_loc=i32(qsl),
        prefill_seq_lens=i32(psl),
    )
    out_rows = torch.from_numpy(rows.copy()) if n_out >= 0 else None
    return torch.from_numpy(ids.copy()), torch.from_numpy(pos.copy()), meta, out_rows


def _meta_to(meta: AttentionMetadata, dev: torch.device) -> AttentionMetadata:
    if dev.type == "cpu":
        return meta
    return AttentionMetadata(
        **{k: (v.to(dev) if torch.is_tensor(v) else v) for k, v in vars(meta).items()}
    )


def _with_device(config: EngineConfig, device: str) -> EngineConfig:
    import dataclasses

    return dataclasses.replace(config, model=dataclasses.replace(config.model, device=device))


@contextlib.contextmanager
def _may_have_children():
    """The node's engine process is a daemon (engine/core_client.py), which
    multiprocessing forbids to start children; its workers die with it anyway (each sets
    PDEATHSIG, and as daemons they are terminated when it exits), so the flag is lifted
    while they start."""
    config = mp.current_process()._config
    daemon = config.get("daemon")
    config["daemon"] = False
    try:
        yield
    finally:
        if daemon is not None:
            config["daemon"] = daemon


def _worker_main(config, arch, model_dir, num_blocks, rank, store, kv_path, conn, parent) -> None:
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s tp{rank} %(name)s: %(message)s")
    for sig in (signal.SIGINT, signal.SIGTERM):  # the leader stops us (see core_proc)
        signal.signal(sig, signal.SIG_IGN)
    die_with_parent(parent)
    try:
        runner = TPRank(config, arch, model_dir, num_blocks, rank, store, kv_path)
    except BaseException as e:  # the leader raises it at start
        conn.send_bytes(f"{type(e).__name__}: {e}".encode())
        return
    conn.send_bytes(b"ready")
    try:
        runner.serve(conn)
    except Exception:  # a failed collective (a peer died, a timeout): take the node down
        logger.exception("TP rank %d: step failed; exiting", rank)
        os._exit(1)


def _kv_files(config: EngineConfig, arch: ModelArch, num_blocks: int) -> list[int]:
    """CPU: one zero-filled shared-memory file (memfd) per rank, sized for its KV cache;
    rank r maps `/proc/<engine pid>/fd/<fd r>`. CUDA: none (each rank allocates its own)."""
    if torch.device(config.model.device).type != "cpu":
        return []
    world, fds = config.tensor_parallel_size, []
    itemsize = torch.empty((), dtype=config.model.torch_dtype).element_size()
    for rank in range(world):
        local = Shard(arch, rank, world).local_arch()
        n = local.num_hidden_layers * 2 * num_blocks * config.cache.block_size
        fd = os.memfd_create(f"pdserve-tp-kv{rank}")
        os.ftruncate(fd, n * local.num_key_value_heads * local.head_dim * itemsize)
        fds.append(fd)
    return fds


def _map_rank(runner: TPRank, rank: int, path: str) -> torch.Tensor:
    local = Shard(runner.shard.arch, rank, runner.shard.world).local_arch()
    return shared_kv_cache(
        runner.kv_layout, path, local.num_hidden_layers, runner.kv_cache.shape[2],
        runner.block_size, local.num_key_value_heads, local.head_dim, runner.dtype,
    )  # fmt: skip


def _stop(pipes, workers, tmpdir: str, kv_fds: list[int]) -> None:
    stop = np.array([_STOP] + [0] * (_HEADER - 1), np.int64).tobytes()
    for conn in pipes:
        try:
            conn.send_bytes(stop)
            conn.close()
        except OSError:
            pass
    for p in workers:
        p.join(timeout=10)
        if p.is_alive():
            p.kill()
            p.join(timeout=5)
    shutil.rmtree(tmpdir, ignore_errors=True)
    for fd in kv_fds:  # the mappings stay valid; the memory goes with the last of them
        with contextlib.suppress(OSError):
            os.close(fd)


def refuse_unsupported(config: EngineConfig) -> None:
    """What a TP node does not run yet: a KV store (its connector registers one rank's
    cache), or a PD role with LMCache or on CUDA (a PD TP node's one NIXL agent moves every
    rank's blocks through the ranks' shared-memory caches, a CPU node's)."""
    if config.tensor_parallel_size <= 1:
        return
    if config.has_prefix_store:
        raise ConfigError(
            "tensor_parallel_size", "a node with tensor_parallel_size > 1 has no KV store (yet)"
        )
    if config.kv_transfer.role == "colocated":
        return
    if config.kv_transfer.connector != "nixl":
        raise ConfigError(
            "kv_transfer.connector",
            "a PD node with tensor_parallel_size > 1 moves its KV through NIXL only",
        )
    if torch.device(config.model.device).type != "cpu":
        raise ConfigError(
            "tensor_parallel_size", "a PD node with tensor_parallel_size > 1 runs on CPU (for now)"
        )
