"""Torch profiler table of one engine step, eager or compiled, so docs/benchmarks.md can
show where a step goes before and after.

    python benchmarks/profile_step.py --workload C --dtype float32   # prefill of 32 x 128
    python benchmarks/profile_step.py --workload B --steps 8         # decode, 32 rows

C: profiles the prefill of 32 prompts of 128 tokens (one step at the default 4096-token
budget), repeated `--steps` times with the prefix cache reset in between. B: adds the
same prompts, runs steps until every prompt is prefilled and has decoded a few tokens,
then profiles `--steps` decode steps (context ~130-150). Prints the per-op table (self CPU
time summed over the profiled steps), the GEMMs grouped by input shape, and a JSON line
with the mean step time and the step's phases (`record_function` scopes).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.engine_throughput import make_prompts  # noqa: E402
from pdserve.engine import LLM, SamplingParams  # noqa: E402

GEMM_OPS = ("mkldnn::_linear_pointwise", "aten::mm", "aten::addmm", "aten::linear")


def gemm_table(prof, rows: int) -> str:
    """GEMM ops grouped by input shape, self time summed."""
    lines = ["| op | input shapes | calls | self CPU ms |", "|---|---|---:|---:|"]
    evs = [e for e in prof.key_averages(group_by_input_shape=True) if e.key in GEMM_OPS]
    evs.sort(key=lambda e: -e.self_cpu_time_total)
    for e in evs[:rows]:
        shapes = str(e.input_shapes)[:80]
        lines.append(f"| {e.key} | {shapes} | {e.count} | {e.self_cpu_time_total / 1e3:.1f} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--workload", choices=["B", "C"], default="B")
    ap.add_argument("--mode", choices=["eager", "compiled"], default="eager")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--rows", type=int, default=30)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--max-num-batched-tokens", type=int, default=4096)
    ap.add_argument("--out", default=None, help="also write the JSON line here")
    args = ap.parse_args()
    llm = LLM(
        args.model,
        dtype=args.dtype,
        max_num_seqs=64,
        max_num_batched_tokens=args.max_num_batched_tokens,
        num_threads=args.threads,
        enforce_eager=args.mode == "eager",
    )
    eng = llm.engine
    prompts = make_prompts(32, 128, eng.vocab_size, seed=ord(args.workload))
    ids = iter(range(1 << 30))

    def add_all(max_tokens: int) -> None:
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        for p in prompts:
            eng.add_request(str(next(ids)), p, params)

    def prefill_round() -> int:
        eng.kv.pool.reset_prefix_cache()
        add_all(1)
        n = 0
        while eng.has_unfinished:
            eng.step()
            n += 1
        return n

    if args.workload == "C":
        prefill_round()  # warm
        steps = 0
        t0 = time.perf_counter()
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            for _ in range(args.steps):
                steps += prefill_round()
        rounds = args.steps
    else:
        add_all(args.steps + 8)
        for _ in range(4):  # prefill, then a few decode steps
            eng.step()
        steps = rounds = args.steps
        t0 = time.perf_counter()
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            for _ in range(args.steps):
                eng.step()
    round_ms = (time.perf_counter() - t0) / rounds * 1e3
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows))
    print(gemm_table(prof, 12))
    phases = {
        e.key: round(e.cpu_time_total / rounds / 1e3, 1)
        for e in prof.key_averages()
        if e.key.startswith("step.")
    }
    res = {
        "workload": args.workload,
        "mode": args.mode,
        "dtype": args.dtype,
        "threads": torch.get_num_threads(),
        "steps_per_round": steps / rounds,
        "round_ms": round(round_ms, 1),
        "phases_ms_per_round": phases,
    }
    print(json.dumps(res))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
