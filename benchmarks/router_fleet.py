"""A simulated fleet behind the real router: 64 prefill + 64 decode fake nodes at a few hundred
requests/s (embedded redis-server, benchmarks/fake_fleet.py, `pdserve router` processes).

Fake nodes register and publish KV events like real ones and answer at model-derived
latencies; requests share a pool of long prefixes, so kv_aware routing has something to
find. Open-loop Poisson arrivals, streamed answers. Reported: errors, end-to-end and TTFT
percentiles, the router's decision time (its own histogram), and the router's CPU seconds
per request (from /proc, so only the router process counts).

    python benchmarks/router_fleet.py --rate 300 --duration 20 --out results/router_fleet.json
    python benchmarks/router_fleet.py --rate 40 --duration 15 \
        --router-root /path/to/old/checkout --router-root . --out results/router_fleet_ab.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from bench.arrivals import arrival_offsets
from cluster.embedded_redis import EmbeddedRedis

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (from /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def spawn(args: list[str], root: Path = ROOT) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(root)}
    return subprocess.Popen([sys.executable, *args], cwd=root, env=env)


def wait_until(what: str, cond, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not ready in {timeout_s} s")
        time.sleep(0.2)


def usable_nodes(router: str) -> int:
    try:
        nodes = httpx.get(f"{router}/cluster", timeout=5).json()["nodes"]
    except (httpx.HTTPError, ValueError):
        return 0
    return sum(1 for n in nodes if n["in_registry"] or n["healthy"])


def start_router(args: list[str], root: Path = ROOT) -> tuple[str, subprocess.Popen]:
    port = free_port()
    argv = ["-m", "pdserve", "router", "--port", str(port), "--log-level", "warning", *args]
    proc = spawn(argv, root)
    return f"http://127.0.0.1:{port}", proc


def decision_stats(router: str, text: str | None = None) -> dict:
    """Mean and bucket-estimated p50/p99 of the router's decision-time histogram."""
    if text is None:
        text = httpx.get(f"{router}/metrics", timeout=10).text
    buckets, total, count = [], 0.0, 0.0
    for line in text.splitlines():
        if line.startswith("pdserve_router_decision_seconds_bucket"):
            le = line.split('le="')[1].split('"')[0]
            buckets.append((float(le), float(line.rsplit(" ", 1)[1])))
        elif line.startswith("pdserve_router_decision_seconds_sum"):
            total = float(line.rsplit(" ", 1)[1])
        elif line.startswith("pdserve_router_decision_seconds_count"):
            count = float(line.rsplit(" ", 1)[1])

    def quantile(q: float) -> float | None:
        for le, c in buckets:
            if count and c >= q * count:
                return le
        return None

    return {
        "count": int(count),
        "mean_us": round(total / count * 1e6, 1) if count else None,
        "p50_bucket_upper_us": (quantile(0.5) or 0) * 1e6,
        "p99_bucket_upper_us": (quantile(0.99) or 0) * 1e6,
    }


def pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return round(xs[min(len(xs) - 1, int(q * len(xs)))] * 1000, 2)


async def drive(url: str, prompts: list[list[int]], rate: float, duration: float, stream: bool):
    n = int(rate * duration)
    offsets = arrival_offsets(n, rate, seed=1)
    rng = random.Random(2)
    e2e, ttft, errors = [], [], []
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=512)
    async with httpx.AsyncClient(timeout=60, limits=limits) as client:
        t0 = time.monotonic()

        async def one(offset: float) -> None:
            await asyncio.sleep(max(0.0, t0 + offset - time.monotonic()))
            body = {"prompt": rng.choice(prompts) + [rng.randrange(1000) for _ in range(32)],
                    "max_tokens": 8, "temperature": 0, "stream": stream}  # fmt: skip
            start = time.monotonic()
            try:
                if stream:
                    async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
                        if r.status_code != 200:
                            errors.append(f"status {r.status_code}")
                            return
                        first = None
                        async for chunk in r.aiter_bytes():
                            if first is None:
                                first = time.monotonic()
                            if b'"error"' in chunk:
                                errors.append("error event")
                        ttft.append(first - start)
                else:
                    r = await client.post(f"{url}/v1/completions", json=body)
                    if r.status_code != 200:
                        errors.append(f"status {r.status_code}")
                        return
                e2e.append(time.monotonic() - start)
            except httpx.HTTPError as e:
                errors.append(type(e).__name__)

        await asyncio.gather(*(one(o) for o in offsets))
        elapsed = time.monotonic() - t0
    return {
        "requests": n,
        "achieved_rate": round(n / elapsed, 1),
        "errors": len(errors),
        "error_kinds": sorted(set(errors)),
        "e2e_ms": {"p50": pct(e2e, 0.5), "p99": pct(e2e, 0.99)},
        "ttft_ms": {"p50": pct(ttft, 0.5), "p99": pct(ttft, 0.99)},
    }


def measure(args, redis_url: str, prompts: list[list[int]], root: Path) -> dict:
    """Start a router from the code at `root` on the running fleet, drive it, stop it."""
    router, rproc = start_router(
        ["--model", str(write_tokenizerless_model()), "--served-model-name", "fake",
         "--redis-url", redis_url, "--prefill-policy", args.policy,
         "--decode-policy", args.policy],
        root,
    )  # fmt: skip
    try:
        total = args.prefill + args.decode
        wait_until("the fleet", lambda: usable_nodes(router) == total)
        asyncio.run(drive(router, prompts, 20, 2, not args.no_stream))  # warm-up
        cpu0, t0 = cpu_seconds(rproc.pid), time.monotonic()
        load = asyncio.run(drive(router, prompts, args.rate, args.duration, not args.no_stream))
        cpu = cpu_seconds(rproc.pid) - cpu0
        wall = time.monotonic() - t0
        metrics = httpx.get(f"{router}/metrics", timeout=10).text
    finally:
        rproc.kill()
        rproc.wait()
    remote = [ln for ln in metrics.splitlines() if ln.startswith("pdserve_router_prefills")]
    return {
        "router_code": str(root),
        "fleet": {"prefill": args.prefill, "decode": args.decode},
        "policy": args.policy,
        "stream": not args.no_stream,
        "offered_rate": args.rate,
        "duration_s": args.duration,
        **load,
        "router_cpu_s_per_request_ms": round(cpu / load["requests"] * 1000, 3),
        "router_cpu_utilisation": round(cpu / wall, 3),
        "decision": decision_stats(router, metrics),
        "prefill_counts": remote,
        "load_average": os.getloadavg(),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prefill", type=int, default=64)
    ap.add_argument("--decode", type=int, default=64)
    ap.add_argument("--rate", type=float, default=300.0)
    ap.add_argument("--duration", type=float, default=20.0)
    ap.add_argument("--policy", default="kv_aware")
    ap.add_argument("--no-stream", action="store_true")
    ap.add_argument(
        "--router-root",
        action="append",
        default=[],
        metavar="DIR",
        help="run the router from this checkout (repeatable: each in turn, on the same fleet "
        "and load, for side-by-side comparisons); default: this one",
    )
    ap.add_argument("--out", default="results/router_fleet.json")
    args = ap.parse_args()
    rng = random.Random(0)
    prompts = [[rng.randrange(1000) for _ in range(512)] for _ in range(64)]  # shared prefixes
    roots = [Path(r).resolve() for r in args.router_root] or [ROOT]
    with EmbeddedRedis() as redis:
        fleet = spawn(["-m", "benchmarks.fake_fleet", "--redis-url", redis.url,
                       "--prefill", str(args.prefill), "--decode", str(args.decode)])  # fmt: skip
        try:
            runs = [measure(args, redis.url, prompts, root) for root in roots]
        finally:
            fleet.kill()
            fleet.wait()
    result = runs[0] if len(runs) == 1 else {"runs": runs}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))


def write_tokenizerless_model() -> Path:
    """A model directory with only a config.json: the router then takes token ids only."""
    d = Path("/tmp/pdserve-fake-model")
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": 50000}))
    return d


if __name__ == "__main__":
    main()
