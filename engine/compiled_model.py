"""The decode step compiled whole with torch.compile (inductor), at a fixed set of batch sizes.

What is compiled: the model's whole forward (embedding, every layer, final norm) as ONE
graph per decode bucket. Paged attention is one opaque node in it, the custom op
`pdserve::paged_attention` (engine/attention.py), which stores this step's K/V into
the cache in place and runs the native (or Triton) kernel; the GEMMs are the
prepacked-oneDNN custom op (engine/models/cpu_linear.py); inductor fuses the rest (norms,
RoPE, SiLU*mul, residual adds) into C++ loops. One compiled call per step: the earlier
piecewise compile (two graphs per layer around eager attention) paid dynamo's guards and
wrapper ~61 times a step and lost to eager (docs/benchmarks-history.md, "Piecewise
design").

Shapes are static. A decode-only step of n rows is padded to the smallest bucket
>= n (1, 2, 4, ..., up to `max_num_seqs`): padded rows have token 0 at position 0, KV
slot -1 (nothing is stored) and a context of one token, and their outputs are dropped
(rows never mix: every op but attention is row-wise, and attention reads only its own
row's blocks). Block tables are padded to the widest a sequence can have
(`max_model_len / block_size` blocks), so a bucket's graph never sees another shape and
serving never recompiles (tests check dynamo's graph count). The same fixed shapes are
what CUDA graphs need on a GPU.

Steps with prompt tokens (prefill chunks, mixed steps) run eager: their time is the
GEMMs on many rows, where the per-op overhead compiling removes is negligible, and their
shapes (tokens, chunk boundaries) vary too much to bucket cheaply.

Compiled code is cached on disk by inductor's FX graph and AOT caches under `cache_dir`,
so a restarted node loads its buckets instead of compiling them.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time

import torch

from pdserve.engine.attention import AttentionMetadata
from pdserve.engine.step_plan import PER_OP

logger = logging.getLogger(__name__)


def set_compile_cache_dir(path: str) -> None:
    """Inductor's on-disk caches (FX graphs, AOT autograd, C++ builds) live under `path`.

    Inductor reads TORCHINDUCTOR_CACHE_DIR whenever it looks a cache up (and sets it
    itself to /tmp/torchinductor_$USER when unset), so the configured directory is
    written there before the first compile, replacing any earlier value.
    """
    os.makedirs(path, exist_ok=True)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = path
    torch._inductor.config.fx_graph_cache = True
    torch._functorch.config.enable_autograd_cache = True


def decode_buckets(max_rows: int) -> list[int]:
    """Powers of two below `max_rows`, then `max_rows` itself: 1, 2, 4, ..., max_rows."""
    buckets = []
    b = 1
    while b < max_rows:
        buckets.append(b)
        b *= 2
    return [*buckets, max_rows]


class CompiledDecode:
    """`model`'s forward for decode-only steps, compiled once per bucket of rows.

    `__call__(input_ids, positions, kv_cache, meta)` returns the hidden states of the
    step, or None when the step is not one it runs (prompt tokens in it, more rows than
    the largest bucket, a block table wider than `max_blocks`): the caller runs eager.
    """

    def __init__(self, model: torch.nn.Module, max_rows: int, max_blocks: int) -> None:
        self.model = model
        self.buckets = decode_buckets(max_rows)
        self.max_blocks = max_blocks
        # one graph per bucket, all under this one function: let dynamo keep them all
        limit = len(self.buckets) + 2
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, limit)
        self._step = torch.compile(self._forward, dynamic=False, fullgraph=True)
        # Once every bucket is compiled (`warm_up_compiled`), dynamo checks only the guards
        # that tell the buckets apart (the row count), not the ~300 tensor guards on the
        # weights and inputs whose properties never change while serving.
        self.skip_guards = False

    def _forward(self, input_ids, positions, kv_cache, slot_mapping, block_tables, context_lens):
        meta = AttentionMetadata(
            slot_mapping=slot_mapping,
            num_decode_tokens=input_ids.shape[0],
            decode_block_tables=block_tables,
            decode_context_lens=context_lens,
            prefill_block_tables=block_tables[:0],
            prefill_query_start_loc=context_lens[:1] * 0,
            prefill_seq_lens=context_lens[:0],
        )
        return self.model(input_ids, positions, kv_cache, meta, PER_OP)

    def takes(self, meta: AttentionMetadata) -> bool:
        """Whether a step of `meta` is one this runs: decode rows only, no more than the
        largest bucket, block tables no wider than `max_blocks`."""
        n = meta.num_decode_tokens
        tables = meta.decode_block_tables
        return (
            not meta.num_prefills
            and self.bucket(n) is not None
            and tables.shape[1] <= self.max_blocks
        )

    def bucket(self, rows: int) -> int | None:
        """The bucket a decode step of `rows` rows is padded to (None: larger than all)."""
        return next((b for b in self.buckets if b >= rows), None)

    def __call__(
        self,
        input_ids: torch.Tensor,  # [n]
        positions: torch.Tensor,  # [n]
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor | None:  # [n, hidden]
        n = input_ids.shape[0]
        if n != meta.num_decode_tokens or not self.takes(meta):
            return None
        b = self.bucket(n)
        tables = meta.decode_block_tables
        # fresh inputs, all made under inference mode (whatever the caller's tensors are,
        # dynamo's guards see the same kind of tensor every step: no recompile)
        stance = (
            torch.compiler.set_stance(skip_guard_eval_unsafe=True)
            if self.skip_guards
            else contextlib.nullcontext()
        )
        with torch.inference_mode(), stance:
            dev = input_ids.device
            block_tables = torch.zeros((b, self.max_blocks), dtype=torch.int32, device=dev)
            block_tables[:n, : tables.shape[1]] = tables
            context_lens = torch.ones(b, dtype=torch.int32, device=dev)
            context_lens[:n] = meta.decode_context_lens
            hidden = self._step(
                _pad(input_ids, b, 0),
                _pad(positions, b, 0),
                kv_cache,
                _pad(meta.slot_mapping, b, -1),
                block_tables,
                context_lens,
            )
        return hidden[:n]


def _pad(t: torch.Tensor, rows: int, value: int) -> torch.Tensor:
    """A new 1-D tensor: `t`, then `value` up to `rows` entries."""
    out = t.new_full((rows,), value)
    out[: t.shape[0]] = t
    return out


def compiled_graph_count() -> int:
    """Graphs dynamo has compiled in this process (grows on any recompile)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def warm_up_compiled(compiled: CompiledDecode, kv_cache: torch.Tensor, block_size: int) -> None:
    """Compile (or load from the disk cache) every bucket's graph: one dummy decode step
    per bucket, whose KV slots are -1 (the cache is untouched)."""
    from pdserve.engine.warmup import dummy_batch

    t0 = time.perf_counter()
    logger.info(
        "compiling the decode step for %d batch sizes %s (cached on disk for the next start)",
        len(compiled.buckets),
        compiled.buckets,
    )
    with torch.inference_mode():
        for b in compiled.buckets:
            t1 = time.perf_counter()
            if compiled(*dummy_batch([1] * b, 1, kv_cache, block_size)) is None:
                raise RuntimeError(f"bucket {b} did not run compiled")
            logger.info("decode bucket %d ready in %.1f s", b, time.perf_counter() - t1)
    compiled.skip_guards = True
    logger.info("compile warm-up done in %.1f s", time.perf_counter() - t0)
