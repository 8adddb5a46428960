"""Text tables: one run's summary, and two runs side by side (`pdserve bench compare`)."""

from __future__ import annotations

import math

# (label, path into a run's metrics, format)
ROWS: list[tuple[str, tuple[str, ...], str]] = [
    ("request rate (req/s)", ("@rate",), "{:g}"),
    ("completed / failed", ("@done",), "{}"),
    ("duration (s)", ("duration_s",), "{:.2f}"),
    ("request throughput (req/s)", ("request_throughput",), "{:.3f}"),
    ("goodput (req/s)", ("goodput", "request_goodput"), "{:.3f}"),
    ("input tok/s", ("input_throughput",), "{:.1f}"),
    ("output tok/s", ("output_throughput",), "{:.1f}"),
    ("max concurrent requests", ("max_concurrent_requests",), "{}"),
    ("mean TTFT (ms)", ("ttft_ms", "mean"), "{:.1f}"),
    ("median TTFT (ms)", ("ttft_ms", "median"), "{:.1f}"),
    ("p99 TTFT (ms)", ("ttft_ms", "p99"), "{:.1f}"),
    ("mean TPOT (ms)", ("tpot_ms", "mean"), "{:.1f}"),
    ("median TPOT (ms)", ("tpot_ms", "median"), "{:.1f}"),
    ("p99 TPOT (ms)", ("tpot_ms", "p99"), "{:.1f}"),
    ("median ITL (ms)", ("itl_ms", "median"), "{:.1f}"),
    ("p99 ITL (ms)", ("itl_ms", "p99"), "{:.1f}"),
    ("median E2E (ms)", ("e2el_ms", "median"), "{:.1f}"),
    ("p99 E2E (ms)", ("e2el_ms", "p99"), "{:.1f}"),
]


def value(run: dict, path: tuple[str, ...]):
    m = run["metrics"]
    if path == ("@rate",):
        rate = run["request_rate"]
        return float(rate) if isinstance(rate, str) else rate
    if path == ("@done",):
        return f"{m['completed']} / {m['failed']}"
    v = m
    for key in path:
        if not isinstance(v, dict) or key not in v:
            return None
        v = v[key]
    return v


def _fmt(v, fmt: str) -> str:
    if v is None:
        return "-"
    try:
        return fmt.format(v)
    except (ValueError, TypeError):
        return str(v)


def format_summary(run: dict) -> str:
    m = run["metrics"]
    lines = [f"{'=' * 20} serving benchmark: rate {run['request_rate']} {'=' * 20}"]
    for label, path, fmt in ROWS:
        lines.append(f"{label:<32}{_fmt(value(run, path), fmt):>14}")
    if m.get("failure_reasons"):
        lines.append("failures: " + ", ".join(f"{k}={v}" for k, v in m["failure_reasons"].items()))
        for kind, example in m["failure_examples"].items():
            lines.append(f"  {kind}: {example[:160]}")
    stages = m.get("ttft_stages_ms")
    if stages:
        lines.append("TTFT stages (server timings, mean ms):")
        for name, s in stages.items():
            lines.append(f"  {name:<28}{s['mean']:>12.1f}   (n={s['n']})")
    moved = {url: d for url, d in run.get("server_counters", {}).get("delta", {}).items() if d}
    for url, d in moved.items():
        lines.append(f"server counters moved at {url}:")
        for k, v in sorted(d.items())[:30]:
            lines.append(f"  {k:<50}{v:>14g}" if isinstance(v, float) else f"  {k}: {v}")
    return "\n".join(lines)


def compare_table(a: dict, b: dict) -> str:
    """Markdown table of runs paired by position: A, B and B/A for every row."""
    la, lb = a.get("label", "A"), b.get("label", "B")
    out = []
    for i, (ra, rb) in enumerate(zip(a["runs"], b["runs"])):
        out.append(f"\nrun {i + 1}: rate {ra['request_rate']} vs {rb['request_rate']}\n")
        out.append(f"| metric | {la} | {lb} | B/A |")
        out.append("|---|---:|---:|---:|")
        for label, path, fmt in ROWS:
            va, vb = value(ra, path), value(rb, path)
            ratio = "-"
            if isinstance(va, (int, float)) and isinstance(vb, (int, float)) and va:
                if math.isfinite(va) and math.isfinite(vb) and path != ("@rate",):
                    ratio = f"{vb / va:.2f}"
            out.append(f"| {label} | {_fmt(va, fmt)} | {_fmt(vb, fmt)} | {ratio} |")
    if len(a["runs"]) != len(b["runs"]):
        out.append(f"\n({len(a['runs'])} vs {len(b['runs'])} runs: only the first "
                   f"{min(len(a['runs']), len(b['runs']))} are paired)")  # fmt: skip
    return "\n".join(out).lstrip("\n")
