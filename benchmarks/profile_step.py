"""Torch profiler table of workload B's decode step (32 rows, context ~130-150), eager or
compiled, so docs/benchmarks.md can show where a step goes before and after.

    python benchmarks/profile_step.py --mode eager --dtype float32 --steps 8

Adds 32 prompts of 128 tokens, runs engine steps until every prompt is prefilled and
has decoded a few tokens, then profiles `--steps` decode steps and prints the per-op
table (self CPU time summed over the profiled steps, and its mean per step).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.engine_throughput import make_prompts  # noqa: E402
from engine import LLM, SamplingParams  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--mode", choices=["eager", "compiled"], default="eager")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--rows", type=int, default=30)
    args = ap.parse_args()
    llm = LLM(
        args.model,
        dtype=args.dtype,
        max_num_seqs=64,
        max_num_batched_tokens=4096,
        enforce_eager=args.mode == "eager",
    )
    eng = llm.engine
    params = SamplingParams(temperature=0, max_tokens=args.steps + 8, ignore_eos=True)
    for i, p in enumerate(make_prompts(32, 128, eng.vocab_size, seed=ord("B"))):
        eng.add_request(str(i), p, params)
    for _ in range(4):  # prefill, then a few decode steps
        eng.step()
    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(args.steps):
            eng.step()
    step_ms = (time.perf_counter() - t0) / args.steps * 1e3
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows))
    print(json.dumps({"mode": args.mode, "dtype": args.dtype, "decode_step_ms": round(step_ms, 1)}))


if __name__ == "__main__":
    main()
