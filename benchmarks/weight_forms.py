"""Each projection of the default model through each form of its weight the engine holds.

    python benchmarks/weight_forms.py --dtypes float32,bfloat16 --out results/weight_forms.json

A CPU engine keeps up to three forms of every projection weight (issue 32, "one copy of
every weight"): the plain [out, in] weight, which the native GEMV streams for decode steps of
1-8 rows (kernels/gemv.py); oneDNN's packed copy, which every step with prompt tokens runs
(engine/models/cpu_linear.py); and the panel-packed copy of the batched decode forward and
its lm_head (kernels/gemm_packed.py). Which one form could serve every row count is a
question of speed per row count, measured here on the shapes of the default model's
config (qkv, o, gate_up with SiLU * up fused, down, the tied lm_head) with random weights:
median microseconds of a call, per form and row count, on `--threads` threads. The lm_head
also gets its fp32 logits two ways: `panel_f32` through the caches, `logits` written with
non-temporal stores (the engine's, `Packed.logits`). The GEMV
has no fused SiLU, so gate_up has no GEMV figure. Prints a table; writes JSON with the
CPU's model name and ISA flags.

`--cold N` times the panel form alone with its weight cold, as a decode step reads it:
each call takes the next of N packed copies (N distinct weights, the default model's 30
layers: N 30, over 400 MB in fp32), so its panels stream from DRAM, not from L3 as
when one weight is called again and again (the lm_head, 113 MB in fp32, is cold with one).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pdserve.engine.models import cpu_linear  # noqa: E402
from pdserve.kernels import gemm_packed, gemv  # noqa: E402

ROWS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")


def shapes(model: str) -> dict[str, tuple[int, int]]:
    """name -> (out, in) of each projection of `model` (its config.json)."""
    from pdserve.common.model_files import resolve_model

    cfg = json.loads((Path(resolve_model(model)) / "config.json").read_text())
    h, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    d = cfg.get("head_dim", h // heads)
    kv = cfg.get("num_key_value_heads", heads) * d
    return {
        "qkv": (heads * d + 2 * kv, h),
        "o": (h, heads * d),
        "gate_up": (2 * cfg["intermediate_size"], h),
        "down": (h, cfg["intermediate_size"]),
        "lm_head": (cfg["vocab_size"], h),
    }


def median_us(fn, budget_s: float) -> float:
    fn()
    fn()
    times: list[float] = []
    t_end = time.perf_counter() + budget_s
    while len(times) < 5 or (time.perf_counter() < t_end and len(times) < 400):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def cpu() -> dict:
    info = {"machine": platform.machine(), "model": platform.processor(), "flags": []}
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return info
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "model name":
            info["model"] = value.strip()
        elif key.strip() == "flags":
            have = set(value.split())
            info["flags"] = [f for f in FLAGS if f in have]
            break
    return info


def run(
    dtype: torch.dtype,
    name: str,
    out_in: tuple[int, int],
    budget_s: float,
    rows_wanted: tuple[int, ...] = ROWS,
    cold: int = 0,
) -> list[dict]:
    if cold:
        return run_cold(dtype, name, out_in, budget_s, rows_wanted, cold)
    n, k = out_in
    silu = name == "gate_up"
    w = torch.randn(n, k).mul_(0.05).to(dtype)
    panel = gemm_packed.Packed(w, silu=silu)
    gate_up = None
    if silu:
        gate_up = cpu_linear.PackedGateUp(k, n, bias=False, dtype=dtype)
        gate_up.weight.data.copy_(w)
        onednn = gate_up.pack()
    else:
        onednn = cpu_linear.pack_weight(w)
    rows = []
    for m in rows_wanted:
        x = torch.randn(m, k).to(dtype)
        row = {"dtype": str(dtype).removeprefix("torch."), "weight": name, "shape": [n, k]}
        row["rows"] = m
        row["panel_us"] = median_us(lambda x=x: panel.gemm(x), budget_s)
        if name == "lm_head":  # fp32 logits: through the caches, and the engine's streamed path
            row["panel_f32_us"] = median_us(
                lambda x=x: panel.gemm(x, out_dtype=torch.float32), budget_s
            )
            row["logits_us"] = median_us(lambda x=x: panel.logits(x), budget_s)
        if onednn and silu:
            row["onednn_us"] = median_us(lambda x=x: gate_up.silu_mul(x), budget_s)
        elif onednn:
            row["onednn_us"] = median_us(lambda x=x: cpu_linear.linear(x, w, None, False), budget_s)
        if not silu and m <= gemv.MAX_ROWS and gemv.available():
            row["gemv_us"] = median_us(lambda x=x: gemv.linear(x, w, None), budget_s)
        rows.append(row)
        cells = " ".join(f"{f}={row[f + '_us']:9.1f}"
                         for f in ("gemv", "onednn", "panel", "panel_f32", "logits")
                         if f + "_us" in row)  # fmt: skip
        print(f"{row['dtype']:9s} {name:8s} rows={m:4d}  {cells}", flush=True)
    return rows


def run_cold(dtype, name, out_in, budget_s, rows_wanted, copies) -> list[dict]:
    """The panel form with its weight cold: each call the next of `copies` weights (the
    lm_head, larger than L3, one)."""
    n, k = out_in
    copies = 1 if name == "lm_head" else copies
    panel = [
        gemm_packed.Packed(torch.randn(n, k).mul_(0.05).to(dtype), silu=name == "gate_up")
        for _ in range(copies)
    ]
    rows = []
    for m in rows_wanted:
        x = torch.randn(m, k).to(dtype)
        order = itertools.cycle(panel)

        def call(x=x, order=order):
            p = next(order)
            return p.logits(x) if name == "lm_head" else p.gemm(x)

        row = {"dtype": str(dtype).removeprefix("torch."), "weight": name, "shape": [n, k]}
        row.update(rows=m, cold_copies=len(panel), panel_cold_us=median_us(call, budget_s))
        rows.append(row)
        print(
            f"{row['dtype']:9s} {name:8s} rows={m:4d}  panel_cold={row['panel_cold_us']:9.1f}"
            f"  (x{len(panel)})",
            flush=True,
        )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--dtypes", default="float32")
    ap.add_argument("--threads", type=int, default=0, help="0: torch's default")
    ap.add_argument("--budget-s", type=float, default=0.3, help="timing per cell")
    ap.add_argument("--rows", default=",".join(map(str, ROWS)),
                    help="comma list of row counts (a prompt step of C: 4096)")  # fmt: skip
    ap.add_argument("--cold", type=int, default=0, metavar="N",
                    help="time the panel form alone, each call on the next of N weights")  # fmt: skip
    ap.add_argument("--out", default="results/weight_forms.json")
    args = ap.parse_args()
    if args.cold < 0:
        ap.error(f"--cold must be 0 (hot) or a number of copies, got {args.cold}")
    rows_wanted = tuple(int(r) for r in args.rows.split(","))
    if args.threads:
        torch.set_num_threads(args.threads)
    if not gemm_packed.available():
        raise SystemExit("the gemm_packed library cannot be built on this machine")
    torch.manual_seed(0)
    rows: list[dict] = []
    for dt in args.dtypes.split(","):
        for name, out_in in shapes(args.model).items():
            rows += run(getattr(torch, dt), name, out_in, args.budget_s, rows_wanted, args.cold)
    result = {"cpu": cpu(), "threads": torch.get_num_threads(), "model": args.model}
    result["march"] = os.environ.get("PDSERVE_KERNEL_MARCH") or "native"
    result["rows"] = rows
    out = Path(args.out)
    if not out.is_absolute():
        out = Path(__file__).resolve().parent / out
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
