"""PNG plots of a serving benchmark report (matplotlib, Agg backend).

- `<stem>_cdf.png`: CDFs of TTFT, TPOT, ITL and E2E, one line per request rate.
- `<stem>_sweep.png` (two or more rates): output tok/s, p99 TTFT and p99 TPOT against
  the achieved request rate.
- `<stem>_stages.png` (when the server returned timings): mean TTFT per stage, stacked,
  one bar per request rate.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _samples(run: dict, metric: str) -> list[float]:
    ok = [r for r in run["requests"] if r["ok"]]
    if metric == "ttft":
        return [r["ttft"] * 1e3 for r in ok if r["ttft"] is not None]
    if metric == "tpot":
        return [r["tpot"] * 1e3 for r in ok if r["tpot"] is not None]
    if metric == "e2el":
        return [r["e2e"] * 1e3 for r in ok if r["e2e"] is not None]
    return [(b - a) * 1e3 for r in ok for a, b in zip(r["chunk_times"], r["chunk_times"][1:])]


def plot_serve(report: dict, stem: Path) -> list[Path]:
    plt = _plt()
    written = []
    runs = report["runs"]
    fig, axes = plt.subplots(1, 4, figsize=(16, 3.8))
    for ax, metric in zip(axes, ("ttft", "tpot", "itl", "e2el")):
        for run in runs:
            v = np.sort(_samples(run, metric))
            if len(v):
                frac = np.arange(1, len(v) + 1) / len(v)
                ax.step(v, frac, where="post", label=f"rate {run['request_rate']}")
        ax.set_xlabel(f"{metric.upper()} (ms)")
        ax.set_ylabel("fraction of requests")
        ax.grid(True, alpha=0.3)
    if axes[0].get_lines():
        axes[0].legend(fontsize=8)
    fig.suptitle(f"latency CDFs: {report.get('label', '')}")
    fig.tight_layout()
    written.append(_save(fig, plt, stem, "_cdf"))
    if len(runs) >= 2:
        x = [r["metrics"]["request_throughput"] for r in runs]
        fig, axes = plt.subplots(1, 3, figsize=(14, 3.8))
        for ax, (title, get) in zip(axes, (
            ("output tok/s", lambda m: m["output_throughput"]),
            ("p99 TTFT (ms)", lambda m: m["ttft_ms"].get("p99")),
            ("p99 TPOT (ms)", lambda m: m["tpot_ms"].get("p99")),
        )):  # fmt: skip
            ax.plot(x, [get(r["metrics"]) for r in runs], marker="o")
            ax.set_xlabel("achieved request rate (req/s)")
            ax.set_ylabel(title)
            ax.grid(True, alpha=0.3)
        fig.suptitle(f"rate sweep: {report.get('label', '')}")
        fig.tight_layout()
        written.append(_save(fig, plt, stem, "_sweep"))
    stage_runs = [r for r in runs if r["metrics"].get("ttft_stages_ms")]
    if stage_runs:
        names = list(dict.fromkeys(n for r in stage_runs for n in r["metrics"]["ttft_stages_ms"]))
        fig, ax = plt.subplots(figsize=(2.5 + 1.2 * len(stage_runs), 4.5))
        labels = [f"{r['request_rate']} req/s" for r in stage_runs]  # text, not numbers
        bottom = np.zeros(len(stage_runs))
        for name in names:
            h = np.array([
                max(r["metrics"]["ttft_stages_ms"].get(name, {}).get("mean", 0.0), 0.0)
                for r in stage_runs
            ])  # fmt: skip
            ax.bar(labels, h, bottom=bottom, label=name)
            bottom += h
        ax.set_xlabel("request rate")
        ax.set_ylabel("mean TTFT per stage (ms)")
        ax.legend(fontsize=8)
        ax.set_title("where the first token's time went")
        fig.tight_layout()
        written.append(_save(fig, plt, stem, "_stages"))
    return written


def _save(fig, plt, stem: Path, suffix: str) -> Path:
    path = stem.with_name(stem.name + suffix + ".png")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_kv(report: dict, path: Path) -> Path:
    """Bandwidth and p50 latency against request KV bytes, one line per method."""
    plt = _plt()
    fig, (ax_bw, ax_lat) = plt.subplots(1, 2, figsize=(11, 4.2))
    methods = list(dict.fromkeys(r["method"] for r in report["results"]))
    for method in methods:
        rows = [r for r in report["results"] if r["method"] == method]
        mib = [r["bytes"] / 2**20 for r in rows]
        ax_bw.plot(mib, [r["gbps"] for r in rows], marker="o", label=method)
        ax_lat.plot(mib, [r["p50_ms"] for r in rows], marker="o", label=f"{method} p50")
    for ax in (ax_bw, ax_lat):
        ax.set_xscale("log")
        ax.set_xlabel("request KV bytes (MiB)")
        ax.grid(True, which="both", alpha=0.3)
    ax_lat.set_yscale("log")
    ax_bw.set_ylabel("GB/s (bytes / p50)")
    ax_lat.set_ylabel("latency (ms)")
    cfg = report["config"]
    fig.suptitle(f"KV transfer to {cfg['peer']}, {cfg['model']} {cfg['dtype']}, UCX err mode "
                 f"{cfg['ucx_error_handling_mode']}, progress thread {cfg['progress_thread']} "
                 f"{cfg['ucx_env'] or ''}", fontsize=9)  # fmt: skip
    ax_bw.legend()
    fig.tight_layout()
    return _save(fig, plt, path.with_suffix(""), "")
