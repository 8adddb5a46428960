"""Decode GEMMs at this model's shapes: prepacked oneDNN vs the native small-M kernel.

    python benchmarks/gemv_ab.py --threads 1,2 --rows 1,2,4,8 --out results/gemv_ab.json

SmolLM2-135M's projections, as a decode step meets them: 30 layers' qkv [960, 576],
o [576, 576], gate_up [3072, 576] and down [576, 1536] weights (425 MB in fp32, far
beyond the L3) and the tied lm_head [49152, 576] (113 MB), each read once per call in
layer order, so the weights stream from DRAM as in the engine. Per dtype, thread count and
row count, the two implementations alternate round by round in this process (`--rounds`,
best round kept) and each shape's figure is its weights' bytes over its summed call time
(GB/s). Time is this process's CPU time with one thread (a busy machine's waiting for a
core left out) and wall time with more (`--clock` overrides). The native kernel's result
is checked against oneDNN's on every shape (`max_rel_err`).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pdserve.engine.models.cpu_linear import onednn_available  # noqa: E402
from pdserve.kernels import cpu_gemv  # noqa: E402

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}
LAYERS = 30
VOCAB = 49152


def make_weights(dtype: torch.dtype) -> dict[str, list[torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    ws = {
        name: [(torch.randn(n, k, generator=g) * 0.05).to(dtype) for _ in range(LAYERS)]
        for name, (n, k) in SHAPES.items()
    }
    ws["lm_head"] = [(torch.randn(VOCAB, 576, generator=g) * 0.05).to(dtype)]
    return ws


def impls(ws: dict[str, list[torch.Tensor]]) -> dict:
    packed = {
        id(w): torch.ops.mkldnn._reorder_linear_weight(w, None) for v in ws.values() for w in v
    }

    def onednn(x, w):
        return torch.ops.mkldnn._linear_pointwise(x, packed[id(w)], None, "none", [], "")

    def native(x, w):
        y = cpu_gemv.linear(x, w, None)
        assert y is not None
        return y

    return {"onednn": onednn, "native": native}


def run_round(fn, ws, xs, clock) -> dict[str, float]:
    """Seconds per shape, summed over a model's worth of calls in layer order."""
    t = dict.fromkeys(ws, 0.0)
    for i in range(LAYERS):
        for name in SHAPES:
            t0 = clock()
            fn(xs[name], ws[name][i])
            t[name] += clock() - t0
    t0 = clock()
    fn(xs["lm_head"], ws["lm_head"][0])
    t["lm_head"] += clock() - t0
    return t


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--rows", default="1,2,4,8")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--clock", choices=["auto", "cpu", "wall"], default="auto")
    ap.add_argument("--out", default="results/gemv_ab.json")
    args = ap.parse_args()
    if not cpu_gemv.available():
        sys.exit("the native gemv kernel could not be built here")
    results = []
    cpu_gemv.MAX_ROWS = max(int(r) for r in args.rows.split(","))  # time it past its threshold
    for dtype in [getattr(torch, d) for d in args.dtypes.split(",")]:
        if not onednn_available(torch.device("cpu"), dtype):
            print(f"skipping {dtype}: no prepacked oneDNN path on this CPU", flush=True)
            continue
        ws = make_weights(dtype)
        fns = impls(ws)
        nbytes = {name: sum(w.numel() * w.element_size() for w in v) for name, v in ws.items()}
        for threads in [int(t) for t in args.threads.split(",")]:
            torch.set_num_threads(threads)
            cpu = args.clock == "cpu" or (args.clock == "auto" and threads == 1)
            clock = time.process_time if cpu else time.perf_counter
            for rows in [int(r) for r in args.rows.split(",")]:
                xs = {name: torch.randn(rows, w[0].shape[1]).to(dtype) for name, w in ws.items()}
                err = 0.0
                for name, w in ws.items():
                    ref = fns["onednn"](xs[name], w[0]).float()
                    got = fns["native"](xs[name], w[0]).float()
                    err = max(err, ((got - ref).abs().max() / ref.abs().max()).item())
                best = {k: dict.fromkeys(ws, float("inf")) for k in fns}
                with torch.inference_mode():
                    for _ in range(args.rounds):
                        for impl, fn in fns.items():  # alternating, same process
                            for name, sec in run_round(fn, ws, xs, clock).items():
                                best[impl][name] = min(best[impl][name], sec)
                row = {"dtype": str(dtype).removeprefix("torch."), "threads": threads}
                row.update({"rows": rows, "clock": "cpu" if cpu else "wall"})
                for impl in fns:
                    total = sum(best[impl].values())
                    row[f"{impl}_ms_per_token"] = round(total * 1e3, 2)
                    row[f"{impl}_GBps"] = {
                        n: round(nbytes[n] / best[impl][n] / 1e9, 1) for n in ws
                    } | {"all": round(sum(nbytes.values()) / total / 1e9, 1)}
                row["speedup"] = round(row["onednn_ms_per_token"] / row["native_ms_per_token"], 3)
                row["max_rel_err"] = float(f"{err:.2e}")
                results.append(row)
                print(json.dumps(row), flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
