"""Latency the router adds: the same requests direct to a decode node and through the router,
interleaved in one run (so machine noise hits both alike).

The decode node is a fake node (benchmarks/_fake_fleet.py: real HTTP, answers after its
model-derived latency), so what differs between the two paths is only the router: its
parsing, checks, tokenization-free token-id path, node choice and relay. Two routers are
measured: static nodes with round_robin (no Redis), and Redis registry with kv_aware
(one KV index round trip per request). Reported per path: p50/p99 of the whole request
(JSON) and of TTFT (SSE), the p50 of the per-pair difference, and the router process's CPU
time per request (from /proc/<pid>/task/*/schedstat, nanoseconds; robust to a loaded box).

Each prompt is sent once to the node, unmeasured, before its pair: the fake node keeps a
prefix cache, so otherwise the first request of each pair would pay the prompt's prefill
and the second would not, splitting the pair differences into two modes around the
router's cost.

    python benchmarks/router_overhead.py --requests 300 --out results/router_overhead.json
    # two trees in one run, taking turns (before/after on a loaded box)
    python benchmarks/router_overhead.py --router-root /tmp/before --router-root .
    # with a cluster secret: Redis wants a password, records are signed, this tree's
    # routers check every signature (an older tree's routers ignore the signature)
    python benchmarks/router_overhead.py --secure --router-root /tmp/before --router-root .
    # one tree, router flags as variants: what serving JSON requests as relayed streams
    # (router.migrate_buffered, on by default) adds
    python benchmarks/router_overhead.py --router-flags= --router-flags=--no-migrate-buffered

Writes results/router_overhead.json (or --out).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys  # noqa: E402
import time
from pathlib import Path

import httpx
import redis
import redis as redis_client

from pdserve.cluster.embedded_redis import EmbeddedRedis
from pdserve.common.redis_auth import with_password
from pdserve.common.redis_keys import ClusterKeys

# run as a script: benchmarks/ is not installed, the repository root holds it
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.router_fleet import (
    ROOT,
    spawn,
    start_router,
    usable_nodes,
    wait_until,
    write_tokenizerless_model,
)


def wait_for_fake_node(redis_url: str) -> str:
    """The url of the one fake node, once it has registered."""
    r = redis.Redis.from_url(redis_url)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        for node_id in r.smembers(ClusterKeys().nodes):
            url = r.hget(ClusterKeys().node(node_id.decode()), "url")
            if url:
                return url.decode()
        time.sleep(0.2)
    raise TimeoutError("the fake node did not register")


def ms(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return round(xs[min(len(xs) - 1, int(q * len(xs)))] * 1000, 3)


def one(client: httpx.Client, url: str, body: dict) -> float:
    """Seconds to the whole answer (JSON) or to the first token event (SSE)."""
    t0 = time.perf_counter()
    if not body.get("stream"):
        r = client.post(f"{url}/v1/completions", json=body)
        assert r.status_code == 200, r.text
        return time.perf_counter() - t0
    dt = None
    with client.stream("POST", f"{url}/v1/completions", json=body) as r:
        assert r.status_code == 200
        for _ in r.iter_bytes():
            if dt is None:
                dt = time.perf_counter() - t0
    return dt


def cpu_ns(pid: int) -> int:
    """CPU time of every thread of a process so far, in nanoseconds."""
    total = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            total += int(Path(f"/proc/{pid}/task/{tid}/schedstat").read_text().split()[0])
        except (OSError, ValueError):  # a thread that just ended
            pass
    return total


def lookups(r: redis.Redis) -> int:
    """KV index lookups Redis has served so far (EVALSHA + EVAL calls)."""
    stats = r.info("commandstats")
    return sum(stats.get(f"cmdstat_{c}", {}).get("calls", 0) for c in ("evalsha", "eval"))


def measure(
    direct: str, routers: list[tuple[str, int]], n: int, stream: bool, salt: str | None = None
) -> list[dict]:
    """Per router (url, pid): its figures against `direct`, every router and the direct
    path taking turns on each prompt (the order rotating per prompt)."""
    rng = random.Random(0)
    urls = [direct] + [u for u, _ in routers]
    t: dict[str, list[float]] = {u: [] for u in urls}
    with httpx.Client(timeout=30) as client:
        for i in range(n + 20):
            if i == 20:
                cpu0 = [cpu_ns(pid) for _, pid in routers]
            body = {"prompt": [rng.randrange(1000) for _ in range(64)], "max_tokens": 2,
                    "temperature": 0, "stream": stream}  # fmt: skip
            if salt is not None:
                body["cache_salt"] = salt
            warm = client.post(f"{direct}/v1/completions", json={**body, "stream": False})
            assert warm.status_code == 200, warm.text  # every measured request hits the cache
            k = i % len(urls)
            for u in urls[k:] + urls[:k]:
                dt = one(client, u, body)
                if i >= 20:  # warm-up excluded
                    t[u].append(dt)
    out = []
    d = t[direct]
    for (url, pid), c0 in zip(routers, cpu0):
        r = t[url]
        diff = [a - b for a, b in zip(r, d)]
        out.append({
            "direct_ms": {"p50": ms(d, 0.5), "p99": ms(d, 0.99)},
            "routed_ms": {"p50": ms(r, 0.5), "p99": ms(r, 0.99)},
            "added_ms": {
                "p50_of_pair_differences": ms(diff, 0.5),
                "p50_routed_minus_p50_direct": round(ms(r, 0.5) - ms(d, 0.5), 3),
                "mean": round(statistics.fmean(diff) * 1000, 3),
            },
            # includes its background work (registry reads, health probes)
            "router_cpu_us_per_request": round((cpu_ns(pid) - c0) / n / 1000, 1),
        })  # fmt: skip
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument(
        "--router-root", action="append", default=[], metavar="DIR",
        help="run routers from this checkout (repeat to compare trees in one run, taking "
        "turns per prompt; default: this tree)",
    )  # fmt: skip
    ap.add_argument(
        "--router-flags", action="append", default=[], metavar="FLAGS",
        help="router flags of one variant, e.g. '' and '--no-migrate-buffered' (repeatable: "
        "each variant's routers take turns with the others in one run)",
    )  # fmt: skip
    ap.add_argument("--out", default="results/router_overhead.json")
    ap.add_argument("--cache-salt", default=None, help="send this cache_salt in every request")
    ap.add_argument(
        "--secure", action="store_true",
        help="Redis with a password (in the routers' URL, so older trees connect too), "
        "registry records signed with a cluster secret that the routers check",
    )  # fmt: skip
    args = ap.parse_args()
    if args.secure:  # every process spawned below inherits it: fleet signs, routers check
        os.environ["PDSERVE_CLUSTER_SECRET"] = "router-overhead-benchmark-secret"
    roots = [Path(r).resolve() for r in args.router_root] or [ROOT]
    model = str(write_tokenizerless_model())
    procs = []
    results: dict = {}
    password = "router-overhead-redis-password" if args.secure else None
    with EmbeddedRedis(password=password) as redis:
        url = with_password(redis.url, password)
        try:
            procs.append(spawn(["-m", "benchmarks._fake_fleet", "--redis-url", url,
                                "--prefill", "0", "--decode", "1"]))  # fmt: skip
            node = wait_for_fake_node(url)
            routers: dict[str, list[tuple[str, int]]] = {"static_round_robin": [],
                                                         "redis_kv_aware": []}  # fmt: skip
            combos = [(root, flags) for root in roots for flags in args.router_flags or [""]]
            for root, flags in combos:
                extra = flags.split()
                static, p1 = start_router(["--model", model, "--served-model-name", "fake",
                                           "--decode", node, "--decode-policy", "round_robin",
                                           "--prefill-policy", "round_robin", *extra],
                                          root)  # fmt: skip
                kv, p2 = start_router(["--model", model, "--served-model-name", "fake",
                                       "--redis-url", url, *extra], root)  # fmt: skip
                procs += [p1, p2]
                routers["static_round_robin"].append((static, p1.pid))
                routers["redis_kv_aware"].append((kv, p2.pid))
            every = [u for rs in routers.values() for u, _ in rs]
            wait_until("routers", lambda: all(usable_nodes(u) == 1 for u in every))
            counter = redis_client.Redis.from_url(url)
            for name, rs in routers.items():
                before = lookups(counter)
                json_, sse = (
                    measure(node, rs, args.requests, s, args.cache_salt) for s in (False, True)
                )
                routed = 2 * (args.requests + 20) * len(rs)  # JSON + SSE, warm-up included
                results[f"{name}_redis_lookups_per_request"] = round(
                    (lookups(counter) - before) / routed, 3
                )
                for (root, flags), j, e in zip(combos, json_, sse):
                    case = {"json": j, "sse_ttft": e}
                    if len(combos) == 1:
                        results[name] = case
                    else:
                        results.setdefault(name, {})[f"{root} {flags}".strip()] = case
        finally:
            for p in procs:
                p.kill()
                p.wait()
    results["requests_per_case"] = args.requests
    results["secure"] = args.secure
    results["cache_salt"] = args.cache_salt
    results["load_average"] = os.getloadavg()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2))
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
