"""The router over a Redis-registered cluster (real redis-server, real nodes with the tiny
random Llama, real NIXL for the PD pair, real HTTP).

- nodes register under a TTL and publish their prefix cache into the KV index, hashed as
  the router hashes (pdserve/common/block_hash.py); a SIGKILLed node leaves within its TTL;
- kv_aware sends a request sharing a prefix to the prefill node that holds it, which then
  computes only the uncached part;
- a node killed under load: requests not yet streaming are retried on another node;
- Redis killed mid-run: the router keeps answering; once Redis is back, the node
  re-registers and its index refills from its cache.
"""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
import redis

from pdserve.cluster.embedded_redis import EmbeddedRedis
from pdserve.cluster.registry import NodeRecord
from pdserve.common.block_hash import hash_prompt_blocks, root_hash
from pdserve.common.redis_keys import ClusterKeys
from pdserve.common.weights_digest import weights_digest
from tests.servers import (
    engine_state,
    free_port,
    kill_server,
    launch_server,
    start_server,
    wait_healthy,
)

MODEL = "tiny"  # served model name of every node here
NODE_ARGS = [
    "--served-model-name", MODEL, "--num-threads", "1", "--log-level", "warning",
    "--num-blocks", "128", "--heartbeat-s", "0.3", "--node-ttl-s", "1.5",
]  # fmt: skip
KEYS = ClusterKeys("pdserve")


def node_args(model_dir: str, redis_url: str, *extra: str) -> list[str]:
    return ["--model", model_dir, *NODE_ARGS, "--redis-url", redis_url, *extra]


def router_args(model_dir: str, redis_url: str, *extra: str) -> list[str]:
    return [
        "--model", model_dir, "--served-model-name", MODEL, "--redis-url", redis_url,
        "--health-interval-s", "0.5", "--log-level", "warning", *extra,
    ]  # fmt: skip


def records(r: redis.Redis) -> dict[str, NodeRecord]:
    out = {}
    for node_id in r.smembers(KEYS.nodes):
        fields = r.hgetall(KEYS.node(node_id.decode()))
        if fields:
            rec = NodeRecord.from_redis(fields)
            out[rec.url] = rec
    return out


def wait_for(what: str, cond, timeout_s: float = 60.0, every_s: float = 0.1):
    deadline = time.monotonic() + timeout_s
    while True:
        value = cond()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(every_s)


def wait_usable(router: str, n_decode: int, n_prefill: int = 0) -> None:
    def ok():
        nodes = httpx.get(f"{router}/cluster", timeout=10).json()["nodes"]
        live = [n for n in nodes if n["in_registry"] and n["breaker"] == "closed"]
        roles = [n["role"] for n in live]
        return roles.count("prefill") == n_prefill and len(live) - n_prefill == n_decode

    wait_for("the router to see the nodes", ok)


def complete(url: str, prompt: list[int], max_tokens: int = 4, **extra) -> dict:
    """A greedy completion; `logprobs: 0` so the answer names its tokens (no tokenizer)."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "logprobs": 0}  # fmt: skip
    r = httpx.post(f"{url}/v1/completions", json={**body, **extra}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.fixture(scope="module")
def cluster_redis():
    with EmbeddedRedis() as server:
        yield server


def test_node_registers_publishes_its_cache_and_expires(tiny_llama_dir, cluster_redis):
    r = redis.Redis.from_url(cluster_redis.url)
    url, proc = start_server(node_args(tiny_llama_dir, cluster_redis.url, "--node-id", "solo"))
    try:
        rec = wait_for("the record", lambda: records(r).get(url))
        assert (rec.node_id, rec.role, rec.model, rec.block_size) == (
            "solo",
            "colocated",
            MODEL,
            16,
        )
        assert rec.kv_total == 128 and rec.max_model_len == 512 and rec.vocab_size == 1024
        assert 0 < r.pttl(KEYS.node("solo")) <= 1500
        prompt = [(7 * i + 3) % 1000 for i in range(40)]
        complete(url, prompt, max_tokens=8)  # 47 tokens computed: 2 full blocks cached
        # the root is keyed by the weights' digest too, which the record carries
        assert rec.weights == weights_digest(tiny_llama_dir)
        want = hash_prompt_blocks(prompt, 16, root_hash(MODEL, 16, weights=rec.weights))
        assert len(want) == 2
        kv_key = KEYS.kv("solo", rec.epoch)
        wait_for("the index", lambda: set(want) <= r.smembers(kv_key))
        # nothing but this node's cached blocks (and the sentinel) is in its set
        assert r.smembers(kv_key) - {b""} == set(want)
        assert all(len(h) == 16 for h in want)
    finally:
        kill_server(proc)
    t0 = time.monotonic()
    wait_for("the record to expire", lambda: url not in records(r), timeout_s=10)
    assert time.monotonic() - t0 < 1.5 + 1.0  # within its TTL (plus polling slack)
    # its index set goes too (its TTL is refreshed by flushes as well: up to one beat later)
    wait_for("the index to expire", lambda: not r.exists(kv_key), timeout_s=1.5 + 1.0)


def test_kv_aware_routes_a_shared_prefix_to_the_prefill_node_holding_it(
    tiny_llama_dir, cluster_redis
):
    pytest.importorskip("nixl")
    url_r = cluster_redis.url
    prefills = []
    procs = []
    try:
        for i in range(2):
            ctl = f"tcp://127.0.0.1:{free_port()}"
            args = node_args(tiny_llama_dir, url_r, "--role", "prefill", "--kv-control", ctl,
                             "--node-id", f"p{i}")  # fmt: skip
            prefills.append(launch_server(args, free_port()))
        dec = launch_server(
            node_args(tiny_llama_dir, url_r, "--role", "decode", "--node-id", "d0"), free_port()
        )
        procs = [p for _, p in prefills] + [dec[1]]
        for u, p in [*prefills, dec]:
            wait_healthy(u, p)
        router, rproc = start_server(router_args(tiny_llama_dir, url_r), command="router")
        procs.append(rproc)
        wait_usable(router, 1, 2)
        time.sleep(1.0)  # the decode node's next heartbeat allows both prefill nodes
        before = {u: engine_state(u) for u, _ in prefills}
        prefixes = [[(11 * i + 5 * k) % 1000 + 3 for i in range(160)] for k in range(2)]
        owner = {}
        for k, prefix in enumerate(prefixes):  # 10 blocks each, on whichever node
            complete(router, prefix + [1, 2, 3])
            after = {u: engine_state(u) for u, _ in prefills}
            (got,) = [u for u in after if after[u]["pd_orders"] > before[u]["pd_orders"]]
            owner[k], before = got, after
        time.sleep(0.5)  # the index flushes every 50 ms
        for k, prefix in enumerate(prefixes):
            tail = [(13 * i + k) % 1000 + 3 for i in range(40)]  # > local_prefill_max_tokens
            complete(router, prefix + tail)
            after = {u: engine_state(u) for u, _ in prefills}
            for u in after:
                orders = after[u]["pd_orders"] - before[u]["pd_orders"]
                hits = after[u]["prefix_hit_tokens"] - before[u]["prefix_hit_tokens"]
                if u == owner[k]:  # went to the node holding the prefix ...
                    assert orders == 1, (k, u, after[u])
                    assert hits == 160  # ... which computed only the uncached part
                else:
                    assert orders == 0, (k, u, after[u])
            before = after
        metrics = httpx.get(f"{router}/metrics", timeout=10).text
        assert 'pdserve_router_prefills_total{where="remote"} 4.0' in metrics

        def share():  # the decode node's record (refreshed by its heartbeat), as /cluster shows it
            nodes = httpx.get(f"{router}/cluster", timeout=10).json()["nodes"]
            (d,) = [n for n in nodes if n["node_id"] == "d0"]
            return d["remote_prefill_share"] == 1.0

        wait_for("the decode node's remote-prefill share", share, timeout_s=15)
    finally:
        for p in procs:
            kill_server(p)


def test_killed_node_leaves_and_its_requests_are_retried(tiny_llama_dir, cluster_redis):
    url_r = cluster_redis.url
    r = redis.Redis.from_url(url_r)
    a = start_server(node_args(tiny_llama_dir, url_r, "--node-id", "a"))
    b = start_server(node_args(tiny_llama_dir, url_r, "--node-id", "b"))
    router, rproc = start_server(
        router_args(tiny_llama_dir, url_r, "--decode-policy", "round_robin"), command="router"
    )
    rproc2 = None
    try:
        wait_usable(router, 2)
        prompt = list(range(3, 40))

        async def burst(n: int, max_tokens: int):
            async with httpx.AsyncClient(timeout=120) as c:
                body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                        "ignore_eos": True, "logprobs": 0}  # fmt: skip
                return await asyncio.gather(
                    *(c.post(f"{router}/v1/completions", json=body) for _ in range(n))
                )

        async def kill_a_during_burst():
            task = asyncio.create_task(burst(8, 300))
            deadline = time.monotonic() + 180  # a loaded 2-core box is slow to start it
            # polled off the loop: the burst's requests must go out meanwhile
            while (await asyncio.to_thread(engine_state, a[0]))["num_running"] == 0:
                assert time.monotonic() < deadline, "a never generated"
                await asyncio.sleep(0.02)
            kill_server(a[1])
            return await task

        answers = asyncio.run(kill_a_during_burst())
        assert [x.status_code for x in answers] == [200] * 8, [x.text for x in answers]
        tokens = {tuple(x.json()["choices"][0]["logprobs"]["tokens"]) for x in answers}
        assert len(tokens) == 1  # greedy: the retried answers equal the others
        t0 = time.monotonic()
        wait_for("a to leave the registry", lambda: a[0] not in records(r), timeout_s=10)
        assert time.monotonic() - t0 < 1.5 + 1.0
        wait_usable(router, 1)
        metrics = httpx.get(f"{router}/metrics", timeout=10).text
        assert "pdserve_router_retries_total" in metrics
        before = engine_state(b[0])["generated_tokens"]
        for x in asyncio.run(burst(4, 4)):
            assert x.status_code == 200
        assert engine_state(b[0])["generated_tokens"] - before == 16  # all on b
        # A second router on the same Redis serves the same cluster; either can die.
        router2, rproc2 = start_server(router_args(tiny_llama_dir, url_r), command="router")
        wait_usable(router2, 1)
        kill_server(rproc)
        first4 = list(next(iter(tokens)))[:4]
        assert complete(router2, prompt)["choices"][0]["logprobs"]["tokens"] == first4
    finally:
        for p in (a[1], b[1], rproc, rproc2):
            if p is not None:
                kill_server(p)


def test_redis_down_router_keeps_serving_and_index_refills(tiny_llama_dir):
    server = EmbeddedRedis().start()
    port = server.port
    node, nproc = start_server(node_args(tiny_llama_dir, server.url, "--node-id", "n"))
    router, rproc = start_server(router_args(tiny_llama_dir, server.url), command="router")
    try:
        wait_usable(router, 1)
        prompt = [(5 * i + 1) % 1000 for i in range(48)]  # 3 full blocks
        first = complete(router, prompt)
        root = root_hash(MODEL, 16, weights=weights_digest(tiny_llama_dir))
        want = set(hash_prompt_blocks(prompt, 16, root))
        r = redis.Redis.from_url(server.url)
        epoch = records(r)[node].epoch
        wait_for("the index", lambda: want <= r.smembers(KEYS.kv("n", epoch)))
        server.stop()
        for _ in range(3):  # served from the router's last view, load-only
            assert complete(router, prompt)["choices"] == first["choices"]
        wait_for(
            "the router to notice",
            lambda: not httpx.get(f"{router}/cluster", timeout=10).json()["redis"]["up"],
            timeout_s=10,
        )
        assert complete(router, prompt + [9])["usage"]["prompt_tokens"] == 49
        server = EmbeddedRedis(port=port).start()  # an empty Redis on the same port
        r = redis.Redis.from_url(server.url)
        wait_for("the node to re-register", lambda: node in records(r), timeout_s=15)
        assert records(r)[node].epoch == epoch  # same boot, same epoch
        wait_for("the index to refill", lambda: want <= r.smembers(KEYS.kv("n", epoch)))
        wait_for(
            "the router to recover",
            lambda: httpx.get(f"{router}/cluster", timeout=10).json()["redis"]["up"],
            timeout_s=10,
        )
        assert complete(router, prompt)["choices"] == first["choices"]
    finally:
        kill_server(rproc)
        kill_server(nproc)
        server.stop()
