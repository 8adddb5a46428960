"""The packed-panel GEMM (kernels/csrc/gemm_packed.cpp) vs oneDNN's prepacked matmul at
SmolLM2-135M's decode shapes, side by side in one process, fp32 or bf16.

    python benchmarks/packed_gemm.py --rows 32 --threads 1 [--dtype bfloat16] \
        --out results/packed_gemm.json

For each projection (qkv, o, gate_up with SiLU * up, down, lm_head) `--layers` copies of
the weight (so each call streams its weight from DRAM, as a real step does), both
implementations alternating round by round; thread CPU time with one thread, wall time
with more (quiet box only). Prints GFLOP/s per implementation and the ratio.
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

from pdserve.kernels import gemm_packed  # noqa: E402

SHAPES = {  # name: (outputs, inputs, gate_up)
    "qkv": (960, 576, False),
    "o": (576, 576, False),
    "gate_up": (1536, 576, True),
    "down": (576, 1536, False),
    "lm_head": (49152, 576, False),
}


def run(impl: str, x: torch.Tensor, w) -> None:
    linear = torch.ops.mkldnn._linear_pointwise
    if impl == "packed":
        w.linear(x)
    elif isinstance(w, tuple):  # oneDNN gate_up: SiLU(gate) * up as post-ops
        gate = linear(x, w[0], None, "swish", [], "")
        linear.binary(x, gate, w[1], None, "mul")
    else:
        linear(x, w, None, "none", [], "")


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    clock = time.thread_time if args.threads == 1 else time.perf_counter
    reorder = torch.ops.mkldnn._reorder_linear_weight
    results = []
    for name, (n, k, silu) in SHAPES.items():
        copies = 2 if name == "lm_head" else args.layers
        dtype = getattr(torch, args.dtype)
        weights = [(torch.randn(2 * n if silu else n, k) * 0.05).to(dtype) for _ in range(copies)]
        if silu:
            dnn = [(reorder(w[:n].contiguous(), None), reorder(w[n:].contiguous(), None))
                   for w in weights]  # fmt: skip
        else:
            dnn = [reorder(w, None) for w in weights]
        ours = [gemm_packed.Packed(w, silu=silu) for w in weights]
        x = torch.randn(args.rows, k).to(dtype)

        times: dict[str, list[float]] = {"onednn": [], "packed": []}
        for _ in range(args.rounds):
            for impl, weights_of in (("onednn", dnn), ("packed", ours)):
                t0 = clock()
                for w in weights_of:
                    run(impl, x, w)
                times[impl].append((clock() - t0) / copies)
        flop = 2 * args.rows * k * (2 * n if silu else n)
        med = {impl: statistics.median(t) for impl, t in times.items()}
        row = {
            "op": name,
            "rows": args.rows,
            "threads": args.threads,
            "dtype": args.dtype,
            "us": {impl: round(t * 1e6, 1) for impl, t in med.items()},
            "gflops": {impl: round(flop / t / 1e9, 1) for impl, t in med.items()},
            "onednn_over_packed": round(med["onednn"] / med["packed"], 3),
        }
        print(json.dumps(row))
        results.append(row)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
