"""Latency the router adds: the same requests direct to a decode node and through the router,
interleaved in one run (so machine noise hits both alike).

The decode node is a fake node (benchmarks/fake_fleet.py: real HTTP, answers after its
model-derived latency), so what differs between the two paths is only the router: its
parsing, checks, tokenization-free token-id path, node choice and relay. Two routers are
measured: static nodes with round_robin (no Redis), and Redis registry with kv_aware
(one KV index round trip per request). Reported per path: p50/p99 of the whole request
(JSON) and of TTFT (SSE), and the p50 of the per-pair difference.

    python benchmarks/router_overhead.py --requests 300 --out results/router_overhead.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time
from pathlib import Path

import httpx
import redis

from benchmarks.router_fleet import (
    spawn,
    start_router,
    usable_nodes,
    wait_until,
    write_tokenizerless_model,
)
from cluster.embedded_redis import EmbeddedRedis


def wait_for_fake_node(redis_url: str) -> str:
    """The url of the one fake node, once it has registered."""
    r = redis.Redis.from_url(redis_url)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        for node_id in r.smembers("pdserve:nodes"):
            url = r.hget(f"pdserve:node:{node_id.decode()}", "url")
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


def measure(direct: str, routed: str, n: int, stream: bool) -> dict:
    rng = random.Random(0)
    d, r, diff = [], [], []
    with httpx.Client(timeout=30) as client:
        for i in range(n + 20):
            body = {"prompt": [rng.randrange(1000) for _ in range(64)], "max_tokens": 2,
                    "temperature": 0, "stream": stream}  # fmt: skip
            order = (direct, routed) if i % 2 else (routed, direct)
            t = {u: one(client, u, body) for u in order}
            if i >= 20:  # warm-up excluded
                d.append(t[direct])
                r.append(t[routed])
                diff.append(t[routed] - t[direct])
    return {
        "direct_ms": {"p50": ms(d, 0.5), "p99": ms(d, 0.99)},
        "routed_ms": {"p50": ms(r, 0.5), "p99": ms(r, 0.99)},
        "added_ms": {
            "p50_of_pair_differences": ms(diff, 0.5),
            "p50_routed_minus_p50_direct": round(ms(r, 0.5) - ms(d, 0.5), 3),
            "mean": round(statistics.fmean(diff) * 1000, 3),
        },  # fmt: skip
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--out", default="results/router_overhead.json")
    args = ap.parse_args()
    model = str(write_tokenizerless_model())
    procs = []
    results = {}
    with EmbeddedRedis() as redis:
        try:
            procs.append(spawn(["-m", "benchmarks.fake_fleet", "--redis-url", redis.url,
                                "--prefill", "0", "--decode", "1"]))  # fmt: skip
            node = wait_for_fake_node(redis.url)
            static, p1 = start_router(["--model", model, "--served-model-name", "fake",
                                       "--decode", node, "--decode-policy", "round_robin",
                                       "--prefill-policy", "round_robin"])  # fmt: skip
            kv, p2 = start_router(["--model", model, "--served-model-name", "fake",
                                   "--redis-url", redis.url])  # fmt: skip
            procs += [p1, p2]
            wait_until("routers", lambda: usable_nodes(static) == 1 and usable_nodes(kv) == 1)
            for name, url in (("static_round_robin", static), ("redis_kv_aware", kv)):
                results[name] = {
                    "json": measure(node, url, args.requests, stream=False),
                    "sse_ttft": measure(node, url, args.requests, stream=True),
                }
        finally:
            for p in procs:
                p.kill()
                p.wait()
    results["requests_per_case"] = args.requests
    results["load_average"] = os.getloadavg()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2))
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
