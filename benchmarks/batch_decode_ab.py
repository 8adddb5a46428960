"""A real decode step of many rows: the batched forward (packed GEMMs, one parallel region)
vs the per-layer loop (oneDNN GEMMs, a parallel region per kernel), side by side.

    python benchmarks/batch_decode_ab.py --rows 32 --threads 1 --out results/batch_decode_ab.json
    python benchmarks/batch_decode_ab.py --rows 64 --threads 2     # quiet box only

Runs `--rows` prompts of 128 tokens for `--context` decode steps (`--dtype`, default fp32,
SmolLM2-135M), captures
the last decode step's inputs, and replays that step's forward + lm_head `--rounds` times,
the two variants alternating round by round (same weights, cache, inputs): thread CPU time
with one thread (a busy box's waiting for a core left out), wall time with more (meaningful on
a quiet box only). Prints the medians, the ratio and whether both give the same greedy tokens.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.decode_parts import capture_decode_step  # noqa: E402
from pdserve.engine import LLM  # noqa: E402
from pdserve.engine.models.fused_decode import FusedDecode  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--context", type=int, default=64, help="decode steps before the capture")
    ap.add_argument("--rounds", type=int, default=11)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    llm = LLM(
        args.model,
        dtype=args.dtype,
        num_threads=args.threads,
        max_num_seqs=max(64, args.rows),
        max_num_batched_tokens=4096,
    )
    clock = time.thread_time if args.threads == 1 else time.perf_counter
    model = llm.engine.runner.model
    ids, pos, kv, meta = capture_decode_step(llm, args.rows, args.context)
    variants = {"batched": model.fused_decode, "by_layer": FusedDecode.build(model, batch=False)}
    times: dict[str, list[float]] = {name: [] for name in variants}
    tokens: dict[str, torch.Tensor] = {}
    with torch.inference_mode():
        for _ in range(args.rounds):
            for name, fused in variants.items():
                model.fused_decode = fused
                t0 = clock()
                logits = model.compute_logits(model(ids, pos, kv, meta))
                times[name].append(clock() - t0)
                tokens[name] = logits.argmax(-1)
    model.fused_decode = variants["batched"]
    assert variants["batched"].batch_steps >= args.rounds, "the batched forward did not run"
    med = {name: statistics.median(t) * 1e3 for name, t in times.items()}
    result = {
        "rows": args.rows,
        "context": int(meta.decode_context_lens.max()),
        "threads": args.threads,
        "dtype": args.dtype,
        "clock": "thread_time" if args.threads == 1 else "wall",
        "ms": {k: round(v, 2) for k, v in med.items()},
        "by_layer_over_batched": round(med["by_layer"] / med["batched"], 3),
        "same_tokens": bool(torch.equal(tokens["batched"], tokens["by_layer"])),
    }
    print(json.dumps(result))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
