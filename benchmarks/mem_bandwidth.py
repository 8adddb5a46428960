"""This box's memory bandwidth as torch sees it, and what it allows workload A.

    python benchmarks/mem_bandwidth.py --threads 1,2 --out results/mem_bandwidth.json

A (one sequence) reads every fp32 weight once per token: SmolLM2-135M's 30 layers are
425 MB and the tied embedding read as lm_head 113 MB, so ~538 MB a token (its KV, ~1 MB,
aside). Its tok/s cannot pass read-bandwidth / 538 MB. Measured per thread count, best of
`--repeats` over a 512 MiB buffer (far beyond any cache): `sum` (read only, the GEMV
pattern), `copy` (read + write, STREAM-copy-like), and a 1-row GEMV over a [106496, 576] fp32
weight (245 MB) as `F.linear`, as prepacked oneDNN runs it, and as the native decode GEMV
(kernels/gemv.py, what the model's projections run at 1-8 rows).
Writes JSON to results/mem_bandwidth.json (or --out).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pdserve.kernels import gemv as gemv_kernel  # noqa: E402

A_BYTES_PER_TOKEN = 538e6


def best(fn, repeats: int) -> float:
    fn()
    t = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        t = min(t, time.perf_counter() - t0)
    return t


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--out", default="results/mem_bandwidth.json")
    args = ap.parse_args()
    n = 128 << 20  # 512 MiB of fp32
    a, b = torch.randn(n), torch.empty(n)
    w = a[: 106496 * 576].view(106496, 576)
    x = torch.randn(1, 576)
    packed_w = torch.ops.mkldnn._reorder_linear_weight(w, None)

    def prepacked():
        return torch.ops.mkldnn._linear_pointwise(x, packed_w, None, "none", [], "")

    rows = []
    for threads in [int(t) for t in args.threads.split(",")]:
        torch.set_num_threads(threads)
        read = a.numel() * 4 / best(a.sum, args.repeats) / 1e9
        copy = 2 * a.numel() * 4 / best(lambda: b.copy_(a), args.repeats) / 1e9
        gemv = w.numel() * 4 / best(lambda: F.linear(x, w), args.repeats) / 1e9
        packed = w.numel() * 4 / best(prepacked, args.repeats) / 1e9
        native = 0.0
        if gemv_kernel.available():
            native = (
                w.numel() * 4 / best(lambda: gemv_kernel.linear(x, w, None), args.repeats) / 1e9
            )
        row = {
            "threads": threads,
            "read_GBps": round(read, 1),
            "copy_GBps": round(copy, 1),
            "gemv_F_linear_GBps": round(gemv, 1),
            "gemv_prepacked_GBps": round(packed, 1),
            "gemv_native_GBps": round(native, 1),
            "A_ceiling_tok_s": round(max(read, gemv, packed, native) * 1e9 / A_BYTES_PER_TOKEN, 1),
        }
        rows.append(row)
        print(json.dumps(row), flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
