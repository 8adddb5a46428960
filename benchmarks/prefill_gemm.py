"""Prefill-sized GEMMs: oneDNN prepacked weights vs `F.linear` (MKL), at M = 512..4096 rows.

    python benchmarks/prefill_gemm.py --dtype float32 --out results/prefill_gemm_fp32.json

For each of the default model's projections (qkv 576->960, o 576->576, gate_up
576->3072, down 1536->576) and each row count M, times in one process, round-robin
(so load on a shared box hits every variant alike), fastest of `--rounds`:
  linear:   F.linear(x, W)                               (MKL sgemm / bf16 oneDNN)
  packed:   mkldnn._linear_pointwise, weight reordered with no batch hint (what serving
            uses since cpu_linear.py; oneDNN picks a layout for an unknown M)
  packed_M: the same with the weight reordered for batch size M
Prints one JSON line per (op, M) with ms and GFLOP/s.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F

SHAPES = {"qkv": (576, 960), "o": (576, 576), "gate_up": (576, 3072), "down": (1536, 576)}


def best_ms(fn, reps: int) -> float:
    t = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        t = min(t, time.perf_counter() - t0)
    return t * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--rows", default="512,1024,2048,4096")
    ap.add_argument("--ops", default=",".join(SHAPES))
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    pack = torch.ops.mkldnn._reorder_linear_weight
    lin = torch.ops.mkldnn._linear_pointwise
    results = []
    torch.manual_seed(0)
    for name in args.ops.split(","):
        k, n = SHAPES[name]
        w = (torch.randn(n, k) * 0.02).to(dtype)
        for m in map(int, args.rows.split(",")):
            x = torch.randn(m, k).to(dtype)
            pw, pm = pack(w, None), pack(w, m)
            variants = {
                "linear": lambda x=x, w=w: F.linear(x, w),
                "packed": lambda x=x, pw=pw: lin(x, pw, None, "none", [], ""),
                "packed_M": lambda x=x, pm=pm: lin(x, pm, None, "none", [], ""),
            }
            ref = F.linear(x.float(), w.float())
            err = {v: float((f().float() - ref).abs().max()) for v, f in variants.items()}
            best = {v: float("inf") for v in variants}
            with torch.inference_mode():
                for _ in range(args.rounds):
                    for v, f in variants.items():
                        best[v] = min(best[v], best_ms(f, args.reps))
            flop = 2 * m * k * n
            row = {"op": name, "m": m, "k": k, "n": n, "dtype": args.dtype}
            for v, ms in best.items():
                row[f"{v}_ms"] = round(ms, 3)
                row[f"{v}_gflops"] = round(flop / ms / 1e6, 1)
            row["max_abs_err"] = {v: round(e, 6) for v, e in err.items()}
            print(json.dumps(row), flush=True)
            results.append(row)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(
            json.dumps({"threads": args.threads, "results": results}, indent=2)
        )


if __name__ == "__main__":
    main()
