"""A simulated fleet behind the real router: 64 prefill + 64 decode fake nodes at a few hundred
requests/s (embedded redis-server, benchmarks/_fake_fleet.py, `pdserve router` processes).

Fake nodes register and publish KV events like real ones and answer at model-derived
latencies; requests share a pool of long prefixes, so kv_aware routing has something to
find. Open-loop Poisson arrivals (one or several `--rate`s in turn), streamed answers,
sent by a lean client (the router's own HTTP/1.1 pool) spread over `--routers` replicas on
one Redis; the fake nodes may be spread over `--fleet-procs` processes. Reported per rate:
errors, achieved rate, end-to-end and TTFT percentiles, the routers' decision time (their
own histograms) and the routers' CPU time per request (from /proc: only the router
processes count), hence the requests/s one core of router sustains.

    python benchmarks/router_fleet.py --rate 300 --duration 20 --out results/router_fleet.json
    python benchmarks/router_fleet.py --rate 50 100 200 300 --duration 10 --routers 2
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
import msgspec

from pdserve.bench.arrivals import arrival_offsets
from pdserve.cluster.embedded_redis import EmbeddedRedis
from pdserve.router.node_http import NodePool

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


def _histogram(text: str) -> tuple[dict[float, float], float, float]:
    buckets, total, count = {}, 0.0, 0.0
    for line in text.splitlines():
        if line.startswith("pdserve_router_decision_seconds_bucket"):
            le = line.split('le="')[1].split('"')[0]
            buckets[float(le)] = float(line.rsplit(" ", 1)[1])
        elif line.startswith("pdserve_router_decision_seconds_sum"):
            total = float(line.rsplit(" ", 1)[1])
        elif line.startswith("pdserve_router_decision_seconds_count"):
            count = float(line.rsplit(" ", 1)[1])
    return buckets, total, count


def decision_stats(before: list[str], after: list[str]) -> dict:
    """Mean and bucket-estimated p50/p99 of the routers' decision-time histograms, over what
    they observed between the two scrapes (one metrics text per router in each)."""
    buckets: dict[float, float] = {}
    total = count = 0.0
    for b_text, a_text in zip(before, after):
        (bb, bt, bc), (ab, at, ac) = _histogram(b_text), _histogram(a_text)
        for le, c in ab.items():
            buckets[le] = buckets.get(le, 0.0) + c - bb.get(le, 0.0)
        total += at - bt
        count += ac - bc

    def quantile(q: float) -> float | None:
        for le, c in sorted(buckets.items()):
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


async def drive(urls: list[str], prompts: list[list[int]], rate: float, duration: float,
                stream: bool) -> dict:  # fmt: skip
    """Open-loop Poisson arrivals, spread in turn over the routers in `urls`. The client is
    the router's own lean HTTP/1.1 client (router/node_http.py: keep-alive pool, C parser),
    so that the load generator costs the shared cores as little as it can."""
    n = int(rate * duration)
    offsets = arrival_offsets(n, rate, seed=1)
    rng = random.Random(2)
    e2e, ttft, errors = [], [], []
    pools = [NodePool(u, {"Content-Type": "application/json"}, None, 10.0, 60.0) for u in urls]
    t0 = time.monotonic()

    async def one(i: int, offset: float) -> None:
        await asyncio.sleep(max(0.0, t0 + offset - time.monotonic()))
        body = msgspec.json.encode(
            {"prompt": rng.choice(prompts) + [rng.randrange(1000) for _ in range(32)],
             "max_tokens": 8, "temperature": 0, "stream": stream}
        )  # fmt: skip
        start = time.monotonic()
        try:
            resp = await pools[i % len(pools)].post("/v1/completions", body, {})
            try:
                first = None
                async for chunk in resp:
                    if first is None:
                        first = time.monotonic()
                    if b'"error"' in chunk:
                        errors.append("error event")
            finally:
                resp.release()
            if resp.status != 200:
                errors.append(f"status {resp.status}")
                return
            if stream:
                ttft.append(first - start)
            e2e.append(time.monotonic() - start)
        except (OSError, asyncio.TimeoutError) as e:
            errors.append(type(e).__name__)

    await asyncio.gather(*(one(i, o) for i, o in enumerate(offsets)))
    elapsed = time.monotonic() - t0
    for pool in pools:
        pool.close()
    return {
        "requests": n,
        "achieved_rate": round(len(e2e) / elapsed, 1),
        "errors": len(errors),
        "error_kinds": sorted(set(errors)),
        "e2e_ms": {"p50": pct(e2e, 0.5), "p99": pct(e2e, 0.99)},
        "ttft_ms": {"p50": pct(ttft, 0.5), "p99": pct(ttft, 0.99)},
    }


def measure(args, redis_url: str, prompts: list[list[int]], root: Path) -> list[dict]:
    """Start `--routers` routers from the code at `root` on the running fleet, drive them at
    each rate, stop them."""
    routers = [
        start_router(
            [
                "--model",
                str(write_tokenizerless_model()),
                "--served-model-name",
                "fake",
                "--redis-url",
                redis_url,
                "--prefill-policy",
                args.policy,
                "--decode-policy",
                args.policy,
            ],
            root,
        )  # fmt: skip
        for _ in range(args.routers)
    ]
    urls = [u for u, _ in routers]
    pids = [p.pid for _, p in routers]
    runs = []
    try:
        total = args.prefill + args.decode
        for u in urls:
            wait_until("the fleet", lambda u=u: usable_nodes(u) == total)
        asyncio.run(drive(urls, prompts, 20, 2, not args.no_stream))  # warm-up
        # background work (registry reads, probes), measured idle, is reported apart
        cpu0, t0 = sum(map(cpu_seconds, pids)), time.monotonic()
        time.sleep(5)
        idle = (sum(map(cpu_seconds, pids)) - cpu0) / (time.monotonic() - t0)
        for rate in args.rate:
            before = [_get_metrics(u) for u in urls]
            cpu0, t0 = sum(map(cpu_seconds, pids)), time.monotonic()
            load = asyncio.run(drive(urls, prompts, rate, args.duration, not args.no_stream))
            cpu = sum(map(cpu_seconds, pids)) - cpu0
            wall = time.monotonic() - t0
            net = cpu - idle * wall
            after = [_get_metrics(u) for u in urls]
            runs.append({
                "router_code": str(root),
                "routers": args.routers,
                "fleet": {"prefill": args.prefill, "decode": args.decode,
                          "processes": args.fleet_procs},
                "policy": args.policy,
                "stream": not args.no_stream,
                "offered_rate": rate,
                "duration_s": args.duration,
                **load,
                "router_cpu_s_per_request_ms": round(cpu / max(load["requests"], 1) * 1000, 3),
                "router_cpu_utilisation": round(cpu / wall, 3),
                "router_idle_cpu_utilisation": round(idle, 4),
                # without the idle background: what each further request costs
                "router_cpu_per_request_net_ms": round(net / max(load["requests"], 1) * 1000, 3),
                "router_capacity_per_core_req_s": round(load["requests"] / net, 1) if net > 0 else None,
                "decision": decision_stats(before, after),
                "prefill_counts": [ln for ln in after[0].splitlines()
                                   if ln.startswith("pdserve_router_prefills_total")],
                "load_average": os.getloadavg(),
            })  # fmt: skip
            print(json.dumps(runs[-1]), flush=True)
    finally:
        for _, p in routers:
            p.kill()
            p.wait()
    return runs


def _get_metrics(router: str) -> str:
    return httpx.get(f"{router}/metrics", timeout=10).text


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prefill", type=int, default=64)
    ap.add_argument("--decode", type=int, default=64)
    ap.add_argument(
        "--rate", type=float, nargs="+", default=[300.0],
        help="offered requests/s; several: one run each, in order, on the same routers",
    )  # fmt: skip
    ap.add_argument("--duration", type=float, default=20.0)
    ap.add_argument("--policy", default="kv_aware")
    ap.add_argument("--no-stream", action="store_true")
    ap.add_argument("--routers", type=int, default=1, help="router replicas on one Redis")
    ap.add_argument(
        "--fleet-procs", type=int, default=1,
        help="processes the fake nodes are spread over (one per core on a bigger machine)",
    )  # fmt: skip
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
        fleet = [
            spawn(
                [
                    "-m",
                    "benchmarks._fake_fleet",
                    "--redis-url",
                    redis.url,
                    "--prefill",
                    str(_share(args.prefill, args.fleet_procs, k)),
                    "--decode",
                    str(_share(args.decode, args.fleet_procs, k)),
                    "--first-index",
                    str(k * -(-max(args.prefill, args.decode) // args.fleet_procs)),
                ]
            )  # fmt: skip
            for k in range(args.fleet_procs)
        ]
        try:
            runs = [run for root in roots for run in measure(args, redis.url, prompts, root)]
        finally:
            for p in fleet:
                p.kill()
                p.wait()
    result = runs[0] if len(runs) == 1 else {"runs": runs}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))


def _share(total: int, parts: int, k: int) -> int:
    """Nodes of `total` that process `k` of `parts` runs."""
    return total // parts + (1 if k < total % parts else 0)


def write_tokenizerless_model() -> Path:
    """A model directory with only a config.json: the router then takes token ids only."""
    d = Path("/tmp/pdserve-fake-model")
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": 50000}))
    return d


if __name__ == "__main__":
    main()
