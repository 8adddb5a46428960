"""Eager vs compiled model step, side by side in one process on the same weights (robust
to a noisy box: the variants alternate and each keeps its fastest of `--rounds`).

    python benchmarks/compiled_step_ab.py --dtype float32 --out results/compiled_step_ab.json

Variants: `plain` (eager, F.linear: no prepacked weights), `eager` (eager, prepacked
oneDNN GEMMs), `compiled` (prepacked + the decode step compiled whole per batch bucket).
Steps: one decode row (workload A's step), 32 and 30 decode rows (B's decode step; 30
is padded to the 32-row bucket), each row over a context of `--context` tokens; the
model forward and the rows' logits. (Prompt steps run eager in compiled mode too.)
`--threads` sets torch's thread count (default: torch's own).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pdserve.engine import LLM  # noqa: E402
from pdserve.engine.attention import AttentionMetadata  # noqa: E402
from pdserve.engine.compiled_model import CompiledDecode, warm_up_compiled  # noqa: E402
from pdserve.engine.models import cpu_linear  # noqa: E402

STEPS = {"decode_1": 1, "decode_32": 32, "decode_30": 30}


def decode_batch(rows: int, context: int, kv_cache: torch.Tensor, block_size: int):
    """`rows` decode rows, each at position `context - 1` over its own blocks; the new
    K/V is not stored (slot -1), so every call sees the same cache."""
    width = -(-context // block_size)
    tables = torch.arange(rows * width, dtype=torch.int32).reshape(rows, width)
    tables %= kv_cache.shape[2]
    lens = torch.full((rows,), context, dtype=torch.int32)
    meta = AttentionMetadata(
        slot_mapping=torch.full((rows,), -1),
        num_decode_tokens=rows,
        decode_block_tables=tables,
        decode_context_lens=lens,
        prefill_block_tables=tables[:0],
        prefill_query_start_loc=torch.zeros(1, dtype=torch.int32),
        prefill_seq_lens=lens[:0],
    )
    return torch.zeros(rows, dtype=torch.int64), torch.full((rows,), context - 1), kv_cache, meta


@torch.inference_mode()
def step_s(model, batch, rows: int) -> float:
    t0 = time.perf_counter()
    hidden = model(*batch)
    model.compute_logits(hidden[-rows:])
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--context", type=int, default=150)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--out", default="results/compiled_step_ab.json")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    llm = LLM(args.model, dtype=args.dtype, enforce_eager=True, num_blocks=32 * 10 + 8)
    runner = llm.engine.runner
    model, kv, bs = runner.model, runner.kv_cache, runner.block_size
    packed = dict(cpu_linear._PACKED)
    compiled = CompiledDecode(model, 32, -(-args.context // bs))
    compiled.buckets = [1, 32]  # only the buckets measured
    t0 = time.perf_counter()
    warm_up_compiled(compiled, kv, bs)
    compile_s = time.perf_counter() - t0
    variants = {"plain": (None, {}), "eager": (None, packed), "compiled": (compiled, packed)}
    variants["compiled_guards"] = (compiled, packed)  # every dynamo guard checked
    best = {(v, s): float("inf") for v in variants for s in STEPS}
    for _ in range(args.rounds):
        for name, rows in STEPS.items():
            batch = decode_batch(rows, args.context, kv, bs)
            for v, (step, packs) in variants.items():
                model.compiled_decode = step
                compiled.skip_guards = v != "compiled_guards"
                cpu_linear._PACKED.clear()
                cpu_linear._PACKED.update(packs)
                step_s(model, batch, rows)  # this variant's caches warm
                best[v, name] = min(best[v, name], step_s(model, batch, rows))
    out = {"dtype": args.dtype, "threads": torch.get_num_threads(), "compile_s": compile_s}
    out["context"] = args.context
    for name in STEPS:
        out[name] = {v: round(best[v, name] * 1e3, 2) for v in variants}
        out[name]["compiled_vs_eager"] = round(best["eager", name] / best["compiled", name], 2)
        out[name]["eager_vs_plain"] = round(best["plain", name] / best["eager", name], 2)
        print(name, json.dumps(out[name]), flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
