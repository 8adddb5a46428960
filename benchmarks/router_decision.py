"""Routing decision time with a large registry and KV index (real Redis, in-process router).

Registers N nodes (half prefill, half decode) in a fresh embedded redis-server and indexes
about `--blocks` block hashes: `--prefixes` distinct 1024-token prompts, each held by
`--holders` random nodes. Then times the router's `Selector.select()` (kv_aware on both
roles: hash the prompt, one pipelined SMISMEMBER round trip per decision, both policies)
for prompts made of a random indexed prefix plus a fresh suffix, and, apart, the parts:
hashing the chain, and the two policies given the hits.

    python benchmarks/router_decision.py --out results/router_decision.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import time
from pathlib import Path

from redis.asyncio import Redis

from pdserve.cluster.embedded_redis import EmbeddedRedis
from pdserve.cluster.redis_client import connect
from pdserve.cluster.registry import NodeRecord
from pdserve.common.block_hash import hash_prompt_blocks, root_hash
from pdserve.common.redis_keys import ClusterKeys
from pdserve.router.config import RouterConfig
from pdserve.router.membership import Membership
from pdserve.router.nodes import ClusterView
from pdserve.router.policies import Context
from pdserve.router.selector import Selector

MODEL, BS, PROMPT_BLOCKS = "bench", 16, 64


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def summary(xs: list[float]) -> dict:
    us = [x * 1e6 for x in xs]
    return {
        "p50_us": round(pct(us, 0.5), 1),
        "p99_us": round(pct(us, 0.99), 1),
        "mean_us": round(statistics.fmean(us), 1),
        "max_us": round(max(us), 1),
    }


async def populate(redis: Redis, keys: ClusterKeys, args, rng: random.Random):
    root = root_hash(MODEL, BS)
    records = []
    for i in range(args.nodes):
        role = "prefill" if i < args.nodes // 2 else "decode"
        records.append(
            NodeRecord(
                node_id=f"n{i}",
                role=role,
                url=f"http://10.0.0.{i}:8000",
                model=MODEL,
                block_size=BS,
                epoch=1,
                kv_control=f"tcp://10.0.0.{i}:7000",
                max_model_len=8192,
                vocab_size=50_000,
                local_prefill_max_tokens=16,
                kv_total=100_000,
                updated=time.time(),
            )  # fmt: skip
        )
    prefixes, holders = [], []
    for _ in range(args.prefixes):
        tokens = [rng.randrange(50_000) for _ in range(PROMPT_BLOCKS * BS)]
        prefixes.append(tokens)
        holders.append(rng.sample(range(args.nodes), args.holders))
    per_node: dict[int, list[bytes]] = {i: [] for i in range(args.nodes)}
    for tokens, hs in zip(prefixes, holders):
        chain = hash_prompt_blocks(tokens, BS, root)
        for i in hs:
            per_node[i].extend(chain)
    pipe = redis.pipeline(transaction=False)
    for rec in records:
        pipe.hset(keys.node(rec.node_id), mapping=rec.to_redis())
        pipe.sadd(keys.nodes, rec.node_id)
        pipe.sadd(keys.kv(rec.node_id, rec.epoch), b"", *per_node[int(rec.node_id[1:])])
    await pipe.execute()
    indexed = sum(len(v) for v in per_node.values())
    return prefixes, holders, indexed


async def run(args) -> dict:
    rng = random.Random(0)
    with EmbeddedRedis() as server:
        redis = Redis.from_url(server.url)
        keys = ClusterKeys("pdserve")
        prefixes, holders, indexed = await populate(redis, keys, args, rng)
        config = RouterConfig(redis_url=server.url, model=MODEL)
        view = ClusterView(config)
        membership = Membership(config, view)
        membership.redis = connect(server.url)  # the router's own client (hiredis packing)
        await membership.refresh_registry()
        assert membership.redis_ok and len(view.nodes) == args.nodes
        selector = Selector(config, view, membership)
        total, hashing, policy, on_holder = [], [], [], 0
        for k in range(args.requests + 100):
            j = rng.randrange(len(prefixes))
            tokens = prefixes[j] + [rng.randrange(50_000) for _ in range(64)]
            t0 = time.perf_counter()
            d = await selector.select(tokens, set())
            t1 = time.perf_counter()
            hash_prompt_blocks(tokens, BS, root_hash(MODEL, BS))
            t2 = time.perf_counter()
            ctx = Context(len(tokens) // BS, d.hits, 8.0)
            selector.decode_policy(view.usable(True), ctx)
            selector.prefill_policy(view.usable(False), ctx)
            t3 = time.perf_counter()
            if k >= 100:  # warm-up excluded
                total.append(t1 - t0)
                hashing.append(t2 - t1)
                policy.append(t3 - t2)
                chosen = int(d.prefill.record.node_id[1:]) if d.prefill else None
                held_by_prefill = [i for i in holders[j] if i < args.nodes // 2]
                on_holder += chosen in held_by_prefill if held_by_prefill else 1
        pings = []
        for _ in range(500):  # the bare round trip, for scale
            t0 = time.perf_counter()
            await redis.ping()
            pings.append(time.perf_counter() - t0)
        stats = await redis.info("commandstats")
        server_us = stats.get("cmdstat_evalsha", {}).get("usec_per_call")
        await membership.redis.aclose()
        await view.aclose()  # the nodes' aiohttp sessions
        await redis.aclose()
    return {
        "nodes": args.nodes,
        "indexed_blocks": indexed,
        "prompt_tokens": PROMPT_BLOCKS * BS + 64,
        "requests": args.requests,
        "decision_total": summary(total),
        "hash_chain": summary(hashing),
        "policies_only": summary(policy),
        "redis_ping": summary(pings),
        "index_script_server_us_per_call": server_us,
        "prefill_on_a_holder_fraction": on_holder / args.requests,
        "load_average": os.getloadavg(),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", type=int, default=64)
    ap.add_argument("--prefixes", type=int, default=200)
    ap.add_argument("--holders", type=int, default=8)
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--out", default="results/router_decision.json")
    args = ap.parse_args()
    result = asyncio.run(run(args))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
