"""Executes one scheduled step: builds the flattened batch, runs the model, samples.

The KV cache is one preallocated tensor `[num_layers, 2, num_blocks, block_size,
num_kv_heads, head_dim]`, sized from the configured byte budget and stored in the
`cache.kv_layout` order (engine/kv_tensor.py); KV connectors register it whole. Logits are computed only for rows that sample (the last token of a sequence
whose known tokens are all computed after this step), and, for a request that asked for
prompt logprobs, at its prompt positions in the same forward pass.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from types import ModuleType

import numpy as np
import torch
from torch.profiler import record_function

from pdserve.common.errors import ConfigError
from pdserve.common.model_files import default_cache_dir
from pdserve.engine.attention import AttentionMetadata
from pdserve.engine.config import EngineConfig
from pdserve.engine.kv_tensor import allocate_kv_cache
from pdserve.engine.model_arch import ModelArch
from pdserve.engine.model_build import build_model, pack_weights, resolve_device
from pdserve.engine.request import Request
from pdserve.engine.sampler import Sampled, prompt_logprobs, sample
from pdserve.engine.scheduler import SchedulerOutput
from pdserve.engine.step_plan import StepPlan, plan_step
from pdserve.engine.warmup import warm_up_kernels
from pdserve.engine.weights import load_model_weights
from pdserve.kernels import hugepages
from pdserve.kernels.fault_in import BackgroundFault
from pdserve.kernels.ops import (
    default_backend,
    get_ops,
    unsupported_head_dim,
)

logger = logging.getLogger(__name__)

_PROMPT_LOGITS_ROWS = 256  # prompt positions per lm_head call (bounds [rows, vocab] memory)


_NO_PHASE = contextlib.nullcontext()


def _phase(name: str):
    """A profiler label for a phase of the step, only while a profiler runs: each
    record_function is a torch op, and after a decode step's weights have streamed through
    the caches the step's own Python runs cold, so labels are added only when profiling."""
    return record_function(name) if torch.autograd._profiler_enabled() else _NO_PHASE


def _is_decode(s) -> bool:
    """A scheduled row that decodes: one new token, past the prompt."""
    return s.num_new_tokens == 1 and s.request.num_computed_tokens >= s.request.num_prompt_tokens


class ModelRunner:
    def __init__(self, config: EngineConfig, arch: ModelArch, model_dir: str, num_blocks: int):
        mc = config.model
        self.device = resolve_device(mc.device)
        self.dtype = mc.torch_dtype
        self.block_size = config.cache.block_size
        self.kernel_backend = mc.kernel_backend or default_backend(mc.device)
        reason = unsupported_head_dim(self.kernel_backend, arch.head_dim)
        if reason is not None:  # refuse at load, not at the first forward pass
            raise ConfigError("head_dim", f"{reason} (from {model_dir}/config.json)")
        ops = get_ops(self.kernel_backend)
        if self.device.type == "cuda":
            # Triton launches on the current device: make it ours (cuda:1 must not run
            # its kernels on GPU 0 with pointers into GPU 1). `execute` also guards it.
            torch.cuda.set_device(self.device)
        torch.manual_seed(mc.seed)
        # The KV cache first: on CPU its pages fault in on a thread while the model loads
        # and packs, and on after the engine is ready (kernels/fault_in.py).
        local = self._local_arch(arch)
        self.kv_layout = config.cache.kv_layout
        self.kv_cache = self._allocate_kv(local, num_blocks)
        self.kv_fault: BackgroundFault | None = None
        populated = self._populate_kv(config.cache.kv_populate)
        t0 = time.perf_counter()
        try:
            model = self._load_model(arch, ops, model_dir)
        except BaseException:
            if self.kv_fault is not None:  # no engine: let the cache go
                self.kv_fault.stop()
            raise
        self.load_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        pack_weights(model, config, arch, self.device, self.dtype, self.single_device)
        self.model = model.train(False)  # inference only (no dropout in these models anyway)
        self.pack_s = time.perf_counter() - t0
        logger.info("model weights loaded in %.1f s, packed in %.1f s", self.load_s, self.pack_s)
        attn = model.model.layers[0].self_attn
        assert (attn.num_kv_heads, attn.head_dim) == tuple(self.kv_cache.shape[4:])
        # Recorded after each step's forward pass: its KV writes are done once it is.
        self._step_done = torch.cuda.Event() if self.device.type == "cuda" else None
        logger.info(
            "KV cache: %d blocks x %d tokens, %s, %.1f MiB%s, kernels=%s, %s %s",
            num_blocks,
            self.block_size,
            self.kv_layout,
            self.kv_cache.numel() * self.kv_cache.element_size() / 2**20,
            populated,
            self.kernel_backend,
            self.device,
            mc.dtype_name,
        )
        if self.device.type == "cuda":
            self.warm_up()
        if mc.compiled and self.single_device:
            self._compile(config, mc.max_model_len or arch.max_position_embeddings)

    # False for a rank of a tensor-parallel node (engine/tp_runner.py): the fused native
    # decode and the compiled step run a whole layer stack with no all-reduce in it.
    single_device = True

    def _load_model(self, arch: ModelArch, ops: ModuleType, model_dir: str) -> torch.nn.Module:
        """The model on this runner's device with its weights loaded and RoPE table built."""
        model = build_model(arch, ops, self.device, self.dtype)
        if self.device.type == "cpu":  # empty storage on huge pages, the weights load into it
            hugepages.move_parameters(model, keep_values=False)
        load_model_weights(model, model_dir)
        model.init_rope(self.device)  # fp32
        return model

    def _allocate_kv(self, local: ModelArch, num_blocks: int) -> torch.Tensor:
        """This runner's zeroed KV cache (a tensor-parallel rank: in shared memory)."""
        return allocate_kv_cache(
            self.kv_layout,
            local.num_hidden_layers,
            num_blocks,
            self.block_size,
            local.num_key_value_heads,
            local.head_dim,
            dtype=self.dtype,
            device=self.device,
        )

    def _local_arch(self, arch: ModelArch) -> ModelArch:
        """The shape of this runner's own model (a tensor-parallel rank: its shard's)."""
        return arch

    def _populate_kv(self, wanted: bool) -> str:
        """CPU: fault the KV cache's pages in (`cache.kv_populate`), so that the first
        requests' KV writes do not each pay page faults, which in a VM can cost seconds per
        GiB: on a thread, lowest blocks first (kernels/fault_in.py), where the kernel has
        MADV_POPULATE_WRITE; else zero-filled now. Returns what the start log says."""
        if self.device.type != "cpu" or not wanted:
            return ""
        if os.environ.get("PDSERVE_KV_POPULATE", "1") == "0":
            return ", not populated (PDSERVE_KV_POPULATE=0)"
        fault = BackgroundFault(self.kv_cache)
        if fault.start():
            self.kv_fault = fault
            return ", faulting in on a thread"
        t0 = time.perf_counter()
        self.kv_cache.zero_()  # no MADV_POPULATE_WRITE here: writing faults them in too
        return f", zero-filled in {time.perf_counter() - t0:.1f} s"

    def _compile(self, config: EngineConfig, max_model_len: int) -> None:
        """Compile the decode step per batch bucket and warm it up (or load it from the
        disk cache); on any failure serve eager."""
        from pdserve.engine.compiled_model import (
            CompiledDecode,
            set_compile_cache_dir,
            warm_up_compiled,
        )

        cache_dir = config.model.compile_cache_dir or str(default_cache_dir() / "compile")
        t0 = time.perf_counter()
        try:  # e.g. no C++ compiler here, a cache dir that cannot be made: serve eager, loudly
            set_compile_cache_dir(cache_dir)
            max_blocks = -(-max_model_len // self.block_size)
            compiled = CompiledDecode(self.model, config.scheduler.max_num_seqs, max_blocks)
            warm_up_compiled(compiled, self.kv_cache, self.block_size)
        except Exception:
            logger.exception("compiling the model step (cache %s) failed; running eager", cache_dir)
            return
        self.model.compiled_decode = compiled
        logger.info(
            "compiled decode step ready in %.1f s (cache %s; --enforce-eager to skip)",
            time.perf_counter() - t0,
            cache_dir,
        )

    def device_guard(self):
        """Makes this runner's GPU the current device (Triton launches there); CPU: no-op."""
        if self.device.type == "cuda":
            return torch.cuda.device(self.device)
        return contextlib.nullcontext()

    def wait_step_done(self) -> None:
        """Block until the last step's kernels, KV cache writes included, have finished.

        Call before posting NIXL WRITEs of that step's blocks: the NIC reads device memory
        directly and is not ordered after work queued on a CUDA stream. No-op on CPU.
        """
        if self._step_done is not None:
            self._step_done.synchronize()

    def warm_up(self) -> None:
        """Compile every kernel variant serving will use (engine/warmup.py)."""
        t0 = time.perf_counter()
        with self.device_guard():
            warm_up_kernels(self.model, self.kv_cache, self.block_size)
        logger.info("warm-up: kernels compiled in %.1f s", time.perf_counter() - t0)

    def execute(
        self, out: SchedulerOutput, block_ids: dict[str, list[int]]
    ) -> tuple[dict[str, Sampled], dict[str, str]]:
        """Run one step. Returns ({request_id: sampled} for rows that sample,
        {request_id: error} for rows whose sampling failed)."""
        with self.device_guard():
            return self._execute(out, block_ids)

    @torch.inference_mode()
    def _execute(
        self, out: SchedulerOutput, block_ids: dict[str, list[int]]
    ) -> tuple[dict[str, Sampled], dict[str, str]]:
        # Decode rows first: one new token that is not a prompt token. A prompt's last token
        # alone (the rest cached) is a prefill row, computed by the kernels a whole prompt
        # gets (prefill attention; with prompt tokens in the step, prepacked GEMMs and no
        # decode GEMV, engine/step_plan.py): a prompt gets the same bits cached or not.
        rows = sorted(out.scheduled, key=lambda s: not _is_decode(s))
        if not rows:
            return {}, {}
        nd = sum(map(_is_decode, rows))
        with _phase("step.prepare"):
            input_ids, positions, meta, cu = self._prepare(rows, block_ids, nd)
        # the forward path, chosen once for the whole step (compiled / fused / per op, GEMV)
        plan = plan_step(
            self.model,
            meta,
            prompt_tokens=nd < len(rows)
            and any(s.request.num_computed_tokens < s.request.num_prompt_tokens for s in rows),
        )
        sampling = [i for i, s in enumerate(rows) if s.samples]
        # the rows whose hidden state is used: the last row of each sequence that samples,
        # unless a prompt's logprobs need every row (else every row is one token, and samples)
        last_rows = None
        if len(sampling) < len(input_ids):
            last_rows = torch.as_tensor(cu[1:][sampling] - 1, device=self.device)
        prompt_lp = any(s.request.wants_prompt_logprobs for s in rows)
        # the model prunes its last layer to them (engine/models/llama.py, `out_rows`)
        prune = last_rows is not None and not prompt_lp
        with _phase("step.forward"):
            hidden = self.model(
                input_ids, positions, self.kv_cache, meta, plan, last_rows if prune else None
            )
        if self._step_done is not None:
            self._step_done.record()
        if prompt_lp:
            for i, s in enumerate(rows):
                if s.request.wants_prompt_logprobs:
                    hid = hidden[cu[i] : cu[i + 1]]
                    self._prompt_logprobs(s.request, hid, s.num_new_tokens, plan)
        if not sampling:
            return {}, {}
        with _phase("step.logits"):
            if last_rows is not None and not prune:
                hidden = hidden[last_rows]
            logits = self.model.compute_logits(hidden, plan)
        reqs = [rows[i].request for i in sampling]
        with _phase("step.sample"):
            sampled, errors = sample(logits, reqs)
        return (
            {reqs[j].request_id: x for j, x in sampled.items()},
            {reqs[j].request_id: e for j, e in errors.items()},
        )

    def _prepare(self, rows, block_ids: dict[str, list[int]], nd: int):
        """The step's flattened inputs: (input_ids, positions, metadata, cu_seqlens); the
        first `nd` rows are decode rows."""
        if nd == len(rows):
            return self._prepare_decode(rows, block_ids)
        bs = self.block_size
        q_lens = np.array([s.num_new_tokens for s in rows], dtype=np.int64)
        starts = np.array([s.request.num_computed_tokens for s in rows], dtype=np.int64)
        seq_lens = starts + q_lens
        cu = np.zeros(len(rows) + 1, dtype=np.int64)
        np.cumsum(q_lens, out=cu[1:])
        total = int(cu[-1])
        # positions: for each row, start .. start + q_len - 1
        row_of_tok = np.repeat(np.arange(len(rows)), q_lens)
        positions = np.arange(total, dtype=np.int64) - cu[:-1][row_of_tok] + starts[row_of_tok]
        input_ids = np.empty(total, dtype=np.int64)
        for i, s in enumerate(rows):
            r = s.request
            input_ids[cu[i] : cu[i + 1]] = r.all_token_ids[
                r.num_computed_tokens : r.num_computed_tokens + s.num_new_tokens
            ]
        tables = [block_ids[s.request.request_id] for s in rows]
        width = max(len(t) for t in tables)
        block_table = np.zeros((len(rows), width), dtype=np.int32)
        for i, t in enumerate(tables):
            block_table[i, : len(t)] = t
        slots = block_table[row_of_tok, positions // bs].astype(np.int64) * bs + positions % bs

        dev = self.device
        bt = torch.from_numpy(block_table).to(dev)
        seq_t = torch.from_numpy(seq_lens.astype(np.int32)).to(dev)
        meta = AttentionMetadata(
            slot_mapping=torch.from_numpy(slots).to(dev),
            num_decode_tokens=nd,
            decode_block_tables=bt[:nd],
            decode_context_lens=seq_t[:nd],
            prefill_block_tables=bt[nd:],
            prefill_query_start_loc=torch.from_numpy((cu[nd:] - cu[nd]).astype(np.int32)).to(dev),
            prefill_seq_lens=seq_t[nd:],
        )
        ids_t = torch.from_numpy(input_ids).to(dev)
        return ids_t, torch.from_numpy(positions).to(dev), meta, cu

    def _prepare_decode(self, rows, block_ids: dict[str, list[int]]):
        """`_prepare` for a step whose rows all decode (one new token each), in fewer numpy
        and torch ops: this runs right after the previous step streamed the weights through
        the caches, where every op runs cold: fewer ops is what makes it cheap."""
        bs, n, dev = self.block_size, len(rows), self.device
        reqs = [s.request for s in rows]
        positions = np.fromiter((r.num_computed_tokens for r in reqs), np.int64, n)
        input_ids = np.fromiter((r.all_token_ids[r.num_computed_tokens] for r in reqs), np.int64, n)
        tables = [block_ids[r.request_id] for r in reqs]
        block_table = np.zeros((n, max(len(t) for t in tables)), dtype=np.int32)
        for i, t in enumerate(tables):
            block_table[i, : len(t)] = t
        slots = block_table[np.arange(n), positions // bs].astype(np.int64) * bs + positions % bs
        as_t = torch.from_numpy if dev.type == "cpu" else lambda a: torch.from_numpy(a).to(dev)
        bt = as_t(block_table)
        seq_t = as_t((positions + 1).astype(np.int32))
        meta = AttentionMetadata(
            slot_mapping=as_t(slots),
            num_decode_tokens=n,
            decode_block_tables=bt,
            decode_context_lens=seq_t,
            prefill_block_tables=bt[n:],
            prefill_query_start_loc=as_t(np.zeros(1, dtype=np.int32)),
            prefill_seq_lens=seq_t[n:],
        )
        return as_t(input_ids), as_t(positions), meta, np.arange(n + 1, dtype=np.int64)

    def _prompt_logprobs(
        self, req: Request, hidden: torch.Tensor, num_new: int, plan: StepPlan
    ) -> None:
        """Logprobs of the prompt tokens this chunk's positions predict, appended to the
        request (positions already done before a preemption are skipped)."""
        start = req.num_computed_tokens
        first = max(start, len(req.prompt_logprobs))
        end = min(start + num_new, req.num_prompt_tokens - 1)  # the last position samples
        k = req.sampling_params.prompt_logprobs or 0
        for a in range(first, end, _PROMPT_LOGITS_ROWS):
            b = min(a + _PROMPT_LOGITS_ROWS, end)
            logits = self.model.compute_logits(hidden[a - start : b - start], plan)
            req.prompt_logprobs.extend(
                prompt_logprobs(logits, req.prompt_token_ids[a + 1 : b + 1], k)
            )
