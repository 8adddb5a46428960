"""Workload A with and without the native decode GEMV, side by side in one engine.

    python benchmarks/gemv_engine_ab.py --dtypes float32,bfloat16 --threads 2 --out results/gemv_engine_ab.json

Workload A of benchmarks/engine_throughput.py (1 prompt x 32 tokens -> 128 new, greedy,
EOS ignored, prefix cache reset so each run prefills), one engine per dtype; between runs
the small-M dispatch of engine/models/cpu_linear.py is switched: `onednn` = every GEMM
through the prepacked oneDNN weights (`pdserve.kernels.cpu_gemv.MAX_ROWS = 0`, main before the
GEMV), `gemv` = rows up to MAX_ROWS through kernels/csrc/gemv.cpp, `gemv_fused` = that and
each norm with the projection after it and the gate_up GEMV with SiLU * up as one call
(`cpu_ops.norm_linear`, `cpu_ops.gate_up_silu`), `fused_decode` = the whole decode forward
of those kernels as one native call (engine/models/fused_decode.py; the others run the
model op by op). `--variants` picks some. The variants alternate
run by run (`--rounds` each); reported per variant: median out tok/s (wall) and process
CPU ms per output token (with one thread the work itself, even on a busy machine), and
whether both produced the same tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.engine_throughput import WORKLOADS, make_prompts  # noqa: E402
from pdserve.engine import LLM, SamplingParams  # noqa: E402
from pdserve.kernels import cpu_gemv, cpu_ops  # noqa: E402


def run(llm: LLM, prompts, new: int) -> tuple[float, float, list]:
    params = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)
    llm.engine.kv.pool.reset_prefix_cache()
    c0, w0 = time.process_time(), time.perf_counter()
    out = llm.generate(prompts, params)
    return time.process_time() - c0, time.perf_counter() - w0, [o.token_ids for o in out]


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--variants", default="onednn,gemv,gemv_fused,fused_decode")
    ap.add_argument("--out", default="results/gemv_engine_ab.json")
    args = ap.parse_args()
    n, prompt_len, new = WORKLOADS["A"]
    # name -> (MAX_ROWS, gate_up + SiLU fused, whole forward in one call)
    variants = {"onednn": (0, False, False), "gemv": (cpu_gemv.MAX_ROWS, False, False)}
    variants["gemv_fused"] = (cpu_gemv.MAX_ROWS, True, False)
    variants["fused_decode"] = (cpu_gemv.MAX_ROWS, True, True)
    variants = {v: variants[v] for v in args.variants.split(",")}
    base = next(iter(variants))
    default_rows = cpu_gemv.MAX_ROWS
    results = []
    for dtype in args.dtypes.split(","):
        llm = LLM(args.model, dtype=dtype, num_threads=args.threads, kv_cache_bytes=1 << 30)
        prompts = make_prompts(n, prompt_len, llm.engine.vocab_size)
        model = llm.engine.runner.model
        fused_decode = model.fused_decode
        run(llm, prompts, 4)  # warm-up
        rows: dict[str, list[dict]] = {v: [] for v in variants}
        tokens = {}
        for _ in range(args.rounds):
            for name, (max_rows, fused, whole) in variants.items():
                model.fused_decode = fused_decode if whole else None
                cpu_gemv.MAX_ROWS = max_rows
                cpu_ops.gate_up_silu = cpu_gemv.gate_up_silu if fused else None
                cpu_ops.norm_linear = cpu_gemv.norm_linear if fused else None
                c, w, tokens[name] = run(llm, prompts, new)
                rows[name].append(
                    {
                        "tok_s": round(n * new / w, 2),
                        "cpu_ms_per_tok": round(c / (n * new) * 1e3, 2),
                    }
                )
                print(dtype, name, json.dumps(rows[name][-1]), flush=True)
        model.fused_decode = fused_decode
        cpu_gemv.MAX_ROWS, cpu_ops.gate_up_silu = default_rows, cpu_gemv.gate_up_silu
        cpu_ops.norm_linear = cpu_gemv.norm_linear
        med = {v: {k: statistics.median(r[k] for r in rows[v]) for k in rows[v][0]} for v in rows}
        summary = {
            "dtype": dtype,
            "threads": args.threads,
            "median": med,
            "tok_s_ratio": {v: round(med[v]["tok_s"] / med[base]["tok_s"], 3) for v in variants},
            "cpu_ratio": {
                v: round(med[base]["cpu_ms_per_tok"] / med[v]["cpu_ms_per_tok"], 3)
                for v in variants
            },
            "same_tokens": {v: tokens[v] == tokens[base] for v in variants},
            "rounds": rows,
            "loadavg_at_end": os.getloadavg()[0],
        }
        print(json.dumps({k: v for k, v in summary.items() if k != "rounds"}), flush=True)
        results.append(summary)
        del llm
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
