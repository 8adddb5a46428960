"""Eager vs compiled model step, side by side in one process on the same weights (robust
to a noisy box: the variants alternate and each keeps its fastest of `--rounds`).

    python benchmarks/compiled_step_ab.py --dtype float32 --out results/compiled_step_ab.json

Variants: `plain` (eager, F.linear: no prepacked weights), `eager` (eager, prepacked
oneDNN GEMMs), `compiled` (prepacked + the piecewise-compiled step). Steps: one decode
row (workload A's step), 32 decode rows (B's decode step) and a 512-token prompt chunk
(C-like prefill); the model forward and the sampled rows' logits, attention on fresh
rows (the same in every variant).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine import LLM  # noqa: E402
from engine.compiled_model import CompiledPieces, warm_up_compiled  # noqa: E402
from engine.models import cpu_linear  # noqa: E402
from engine.models.llama import EagerPieces  # noqa: E402
from engine.warmup import dummy_batch  # noqa: E402

STEPS = {"decode_1": [1], "decode_32": [1] * 32, "prefill_512": [512]}


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
    ap.add_argument("--out", default="results/compiled_step_ab.json")
    args = ap.parse_args()
    llm = LLM(args.model, dtype=args.dtype, enforce_eager=True, num_blocks=128)
    runner = llm.engine.runner
    model, kv, bs = runner.model, runner.kv_cache, runner.block_size
    packed = dict(cpu_linear._PACKED)
    compiled = CompiledPieces()
    model.pieces = compiled
    t0 = time.perf_counter()
    warm_up_compiled(model, kv, bs)
    compile_s = time.perf_counter() - t0
    variants = {"plain": (EagerPieces, {}), "eager": (EagerPieces, packed)}
    variants["compiled"] = (compiled, packed)
    best = {(v, s): float("inf") for v in variants for s in STEPS}
    for _ in range(args.rounds):
        for name, q_lens in STEPS.items():
            batch = dummy_batch(q_lens, 1, kv, bs)
            rows = len(q_lens)
            for v, (pieces, packs) in variants.items():
                model.pieces = pieces
                cpu_linear._PACKED.clear()
                cpu_linear._PACKED.update(packs)
                step_s(model, batch, rows)  # this variant's caches warm
                best[v, name] = min(best[v, name], step_s(model, batch, rows))
    out = {"dtype": args.dtype, "threads": torch.get_num_threads(), "compile_s": compile_s}
    for name in STEPS:
        out[name] = {v: round(best[v, name] * 1e3, 2) for v in variants}
        out[name]["compiled_vs_eager"] = round(best["eager", name] / best["compiled", name], 2)
        out[name]["eager_vs_plain"] = round(best["plain", name] / best["eager", name], 2)
        print(name, json.dumps(out[name]), flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
