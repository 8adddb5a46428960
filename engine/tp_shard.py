"""Megatron-style sharding of a Llama-family model over the ranks of a tensor-parallel node.

Rank r of N holds (H query heads, Hkv KV heads, I intermediate, V vocab):

- q rows of heads [r H/N, (r+1) H/N); k and v rows of its KV heads: Hkv/N of them when
  Hkv >= N, else the one KV head its query heads read (replicated over N/Hkv ranks);
  gate and up rows [r I/N, (r+1) I/N): column-parallel, no communication;
- o_proj and down_proj columns of the same slices: row-parallel, their partial outputs
  summed by an all-reduce (a forward hook on the module, so every path the layer takes,
  the fused norm+GEMV ones included, sees the summed output);
- embed_tokens (and lm_head, tied or not) rows [r Vl, (r+1) Vl), Vl = ceil(V/N), the last
  shard zero-padded: the embedding looks its own ids up, zeroes the others and
  all-reduces; the logits of each rank are gathered to rank 0 (engine/tp_runner.py).

The KV cache of a rank is `[L, 2, N, bs, Hkv_local, D]`: sharded by KV heads.
The rank's model is the ordinary model class built from `local_arch` (fewer heads, a
narrower MLP and vocab), loaded from the full checkpoint through `shard_weights`.
"""

from __future__ import annotations

import dataclasses
import datetime
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.common.errors import ConfigError
from pdserve.engine.model_arch import ModelArch


def check_divides(arch: ModelArch, tp: int, field: str = "tensor_parallel_size") -> None:
    """Raise ConfigError naming `field` unless `arch` shards over `tp` ranks."""
    if tp < 1:
        raise ConfigError(field, f"must be >= 1, got {tp}")
    h, hkv, i = arch.num_attention_heads, arch.num_key_value_heads, arch.intermediate_size
    if h % tp:
        raise ConfigError(field, f"{tp} does not divide the model's {h} attention heads")
    if hkv % tp and tp % hkv:
        raise ConfigError(field, f"{tp} and the model's {hkv} KV heads: neither divides the other")
    if i % tp:
        raise ConfigError(field, f"{tp} does not divide the model's intermediate size {i}")


@dataclass(frozen=True)
class Shard:
    """What rank `rank` of `world` holds of `arch`."""

    arch: ModelArch
    rank: int
    world: int

    @property
    def heads(self) -> int:
        return self.arch.num_attention_heads // self.world

    @property
    def kv_heads(self) -> int:
        return max(1, self.arch.num_key_value_heads // self.world)

    @property
    def kv_head_start(self) -> int:
        hkv, n = self.arch.num_key_value_heads, self.world
        return self.rank * self.kv_heads if hkv >= n else self.rank // (n // hkv)

    @property
    def inter(self) -> int:
        return self.arch.intermediate_size // self.world

    @property
    def vocab(self) -> int:
        return -(-self.arch.vocab_size // self.world)

    @property
    def vocab_start(self) -> int:
        return self.rank * self.vocab

    def local_arch(self) -> ModelArch:
        return dataclasses.replace(
            self.arch,
            num_attention_heads=self.heads,
            num_key_value_heads=self.kv_heads,
            intermediate_size=self.inter,
            vocab_size=self.vocab,
            head_dim=self.arch.head_dim,
        )

    def shard_weights(
        self, weights: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """The HF-named checkpoint tensors cut to this rank's slices."""
        d, r = self.arch.head_dim, self.rank
        q = slice(r * self.heads * d, (r + 1) * self.heads * d)
        kv = slice(self.kv_head_start * d, (self.kv_head_start + self.kv_heads) * d)
        mlp = slice(r * self.inter, (r + 1) * self.inter)
        for name, t in weights:
            if ".q_proj." in name:
                t = t[q]
            elif ".k_proj." in name or ".v_proj." in name:
                t = t[kv]
            elif ".gate_proj." in name or ".up_proj." in name:
                t = t[mlp]
            elif ".o_proj." in name:
                t = t[:, q]
            elif ".down_proj." in name:
                t = t[:, mlp]
            elif name in ("model.embed_tokens.weight", "lm_head.weight"):
                t = self._vocab_rows(t)
            yield name, t

    def _vocab_rows(self, t: torch.Tensor) -> torch.Tensor:
        rows = t[self.vocab_start : self.vocab_start + self.vocab]
        if rows.shape[0] == self.vocab:
            return rows
        return torch.cat([rows, rows.new_zeros(self.vocab - rows.shape[0], *rows.shape[1:])])


class Comm:
    """The node's collectives over a process group of its own (not torch.distributed's
    default group: several TP engines may live in one process, as in the tests).
    gloo on CPU, NCCL on CUDA; every collective fails after `timeout_s`. The ranks first
    wait for each other in the store for up to `start_timeout_s` (a worker starting on a
    loaded box can take longer than a collective may), polling `peers_alive` each second."""

    def __init__(
        self, store_path: str, rank: int, world: int, device: torch.device, timeout_s,
        start_timeout_s: float = 600.0, peers_alive=lambda: True,
    ):  # fmt: skip
        import torch.distributed as dist

        self.rank, self.world = rank, world
        store = dist.FileStore(store_path, world)
        store.set(f"present/{rank}", b"1")
        keys = [f"present/{r}" for r in range(world)]
        deadline = time.monotonic() + start_timeout_s
        while True:
            try:
                store.wait(keys, datetime.timedelta(seconds=1))
                break
            except RuntimeError:  # not every rank yet (DistStoreError: "Wait timeout")
                if not peers_alive():
                    raise RuntimeError(f"TP rank {rank}: a peer exited while starting") from None
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"TP rank {rank}: not every rank started in {start_timeout_s:.0f} s"
                    ) from None
        timeout = datetime.timedelta(seconds=timeout_s)
        if device.type == "cuda":
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timeout
            self.pg = dist.ProcessGroupNCCL(store, rank, world, opts)
        else:
            self.pg = dist.ProcessGroupGloo(store, rank, world, timeout)
        # all-reduces run, and the seconds spent in them (benchmarks/engine_throughput.py)
        self.reduced = 0
        self.reduce_s = 0.0

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        t0 = time.perf_counter()
        self.pg.allreduce([t]).wait()
        self.reduce_s += time.perf_counter() - t0  # waiting for the slowest rank included
        self.reduced += 1
        return t

    def gather(self, t: torch.Tensor) -> list[torch.Tensor] | None:
        """Every rank's `t` on rank 0 (None elsewhere)."""
        import torch.distributed as dist

        opts = dist.GatherOptions()
        opts.rootRank = 0
        out = [[torch.empty_like(t) for _ in range(self.world)]] if self.rank == 0 else []
        self.pg.gather(out, [t], opts).wait()
        return out[0] if self.rank == 0 else None


class VocabParallelEmbedding(nn.Embedding):
    """This rank's rows [start, start + Vl) of the embedding; ids elsewhere give zeros,
    and the all-reduce adds the rank that holds them."""

    def __init__(self, weight: nn.Parameter, start: int, comm: Comm):
        super().__init__(weight.shape[0], weight.shape[1], _weight=weight)
        self.start = start
        self.comm = comm

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        outside = (local < 0) | (local >= self.num_embeddings)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out.masked_fill_(outside[:, None], 0)
        return self.comm.all_reduce(out)


def parallelize(model: nn.Module, shard: Shard, comm: Comm) -> None:
    """Make `model` (built from `shard.local_arch()`) a rank of the node: the vocab-parallel
    embedding, and the all-reduce after every row-parallel projection."""
    inner = model.model
    inner.embed_tokens = VocabParallelEmbedding(inner.embed_tokens.weight, shard.vocab_start, comm)

    def reduce(_module, _args, out):
        return comm.all_reduce(out)

    for layer in inner.layers:
        layer.self_attn.o_proj.register_forward_hook(reduce)
        layer.mlp.down_proj.register_forward_hook(reduce)
