"""Soak: a launched cluster under mixed load for a long time, one node restarted midway.

Launches a cluster (embedded Redis, router, 2 prefill + 1 decode nodes; the harness of
the fault drills, tests/faults/harness.py) and keeps `--clients` clients sending
completions through the router: mixed prompt lengths on a few shared prefixes, half of
them streamed, `--disconnect-rate` of the streams closed by the client early (before the
first token or mid-stream: aborts). Halfway through, prefill-0 is SIGKILLed (the launcher
restarts it). At the end: requests sent, completed, failed by reason, p50/p99 latency and
TTFT per window (a PNG), and leaked KV blocks (must be 0: blocks in use on every node
once idle, with `check_integrity()` holding).

    .venv/bin/python benchmarks/soak.py                      # 10 minutes, SmolLM2
    .venv/bin/python benchmarks/soak.py --duration-s 60 --model tiny   # CI-sized

Writes results/soak.json and results/soak.png (or --out).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.faults.harness import Cluster, Load, Outcome, wait_serving  # noqa: E402


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def windows(outcomes: list[Outcome], t0: float, width_s: float) -> list[dict]:
    """p50/p99 end-to-end latency (completed requests) and TTFT (streams) per window."""
    rows: dict[int, list[Outcome]] = {}
    for o in outcomes:
        rows.setdefault(int((o.ended - t0) // width_s), []).append(o)
    out = []
    for i in sorted(rows):
        done = [o for o in rows[i] if o.kind == "ok"]
        e2e = [o.ended - o.started for o in done]
        ttft = [o.first_token - o.started for o in done if o.first_token is not None]
        out.append({
            "t_s": (i + 0.5) * width_s,
            "requests": len(rows[i]),
            "failed": sum(o.kind not in ("ok", "disconnected") for o in rows[i]),
            "e2e_p50_s": percentile(e2e, 0.5), "e2e_p99_s": percentile(e2e, 0.99),
            "ttft_p50_s": percentile(ttft, 0.5), "ttft_p99_s": percentile(ttft, 0.99),
        })  # fmt: skip
    return out


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    w = report["windows"]
    fig, ax = plt.subplots(figsize=(9, 4.5))
    for key, style in (("e2e_p99_s", "-"), ("e2e_p50_s", "--"), ("ttft_p99_s", ":")):
        pts = [(r["t_s"], r[key]) for r in w if r[key] is not None]
        if pts:
            ax.plot(*zip(*pts), style, label=key.replace("_s", " (s)"))
    ax.axvline(report["restart_at_s"], color="red", alpha=0.5, label="prefill-0 SIGKILL")
    ax.set_xlabel("time (s)")
    ax.set_ylabel("latency (s)")
    ax.set_title(
        f"soak: {report['sent']} requests, {report['completed']} completed, "
        f"leaked blocks {report['leaked_blocks']}"
    )
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def tiny_model(directory: Path) -> str:
    from tests.conftest import make_tiny_llama

    return make_tiny_llama(str(directory / "tiny_llama"))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--duration-s", type=float, default=600.0)
    p.add_argument("--model", default="smollm2-135m-instruct", help="or `tiny` (random Llama)")
    p.add_argument("--clients", type=int, default=6)
    p.add_argument("--disconnect-rate", type=float, default=0.2)
    p.add_argument("--window-s", type=float, default=None, help="default: duration / 20")
    p.add_argument("--out", default=str(ROOT / "results" / "soak"))
    args = p.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="pdserve-soak-"))
    model = tiny_model(work) if args.model == "tiny" else args.model
    cluster = Cluster(model, work)
    try:
        cluster.wait_up(600)
        wait_serving(cluster.router_url, 300)
        load = Load([cluster.router_url], clients=args.clients,
                    disconnect_rate=args.disconnect_rate, seed=1).start()  # fmt: skip
        t0 = time.monotonic()
        time.sleep(args.duration_s / 2)
        restart_at = time.monotonic() - t0
        os.killpg(cluster.service("prefill-0")["pid"], signal.SIGKILL)
        time.sleep(args.duration_s / 2)
        load.stop()
        cluster.wait_up(300)
        used = cluster.wait_blocks_idle(120)
        cluster.wait_no_dead_epochs(30)
    finally:
        cluster.stop()
    counts = load.summary()
    report = {
        "model": args.model,
        "duration_s": args.duration_s,
        "clients": args.clients,
        "sent": len(load.outcomes),
        "completed": counts.get("ok", 0),
        "disconnected_by_client": counts.get("disconnected", 0),
        "failed_by_reason": {k: v for k, v in counts.items() if k not in ("ok", "disconnected")},
        "without_terminal_answer": sum(not o.terminal for o in load.outcomes),
        "restart_at_s": round(restart_at, 1),
        "leaked_blocks": sum(used.values()),
        "windows": windows(load.outcomes, t0, args.window_s or args.duration_s / 20),
    }
    out.with_suffix(".json").write_text(json.dumps(report, indent=1))
    plot(report, out.with_suffix(".png"))
    summary = {k: v for k, v in report.items() if k != "windows"}
    print(json.dumps(summary, indent=1))
    print(f"wrote {out.with_suffix('.json')} and {out.with_suffix('.png')}")
    if report["leaked_blocks"] or report["without_terminal_answer"]:
        sys.exit(1)


if __name__ == "__main__":
    main()
