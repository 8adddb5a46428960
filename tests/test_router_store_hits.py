"""The router's kv_aware policy counts blocks in the shared KV store (real redis-server,
real nodes with the LMCache prefix store, real router, real HTTP).

Node A computes a prompt and saves it to the store, which lists its full-chunk blocks in
the KV index under `{prefix}:kv:store:{store id}`; A then dies. Node B has never seen the
prompt, but it loads from the same store: the router predicts the whole stored prefix as
B's hit, and B indeed loads it from the store and computes only the tail.
"""

from __future__ import annotations

import httpx
import pytest
import redis

from pdserve.cluster.registry import NodeRecord
from pdserve.common.block_hash import hash_prompt_blocks, root_hash
from tests.servers import engine_state, kill_server, start_server
from tests.test_router_cluster import (
    KEYS,
    MODEL,
    cluster_redis,  # noqa: F401  (fixture)
    complete,
    node_args,
    records,
    router_args,
    wait_for,
    wait_usable,
)

pytest.importorskip("lmcache")

STORE = ["--kv-store", "lmcache", "--kv-store-url", "cluster", "--kv-store-chunk-size", "32"]


def test_kv_aware_counts_the_store_hits_of_a_node_that_never_saw_the_prompt(
    tiny_llama_dir,
    cluster_redis,  # noqa: F811
):
    url_r = cluster_redis.url
    r = redis.Redis.from_url(url_r)
    prefix = [(7 * i) % 1000 + 3 for i in range(160)]  # 10 blocks, 5 chunks of 32
    procs = []
    try:
        a_url, a = start_server(node_args(tiny_llama_dir, url_r, "--node-id", "a", *STORE))
        procs.append(a)
        rec_a: NodeRecord = wait_for("a's record", lambda: records(r).get(a_url))
        assert rec_a.kv_store  # it names the store it loads from
        complete(a_url, prefix + [1, 2, 3])  # computed on A, saved to the store
        store_key = KEYS.kv_store(rec_a.kv_store)
        chain = hash_prompt_blocks(prefix, 16, root_hash(MODEL, 16, weights=rec_a.weights))
        wait_for("the store's index", lambda: r.smismember(store_key, chain) == [1] * 10)
        kill_server(a)
        wait_for("a to leave", lambda: a_url not in records(r), timeout_s=10)

        b_url, b = start_server(node_args(tiny_llama_dir, url_r, "--node-id", "b", *STORE))
        procs.append(b)
        router, rproc = start_server(
            router_args(tiny_llama_dir, url_r, "--decode-policy", "kv_aware"), command="router"
        )
        procs.append(rproc)
        wait_usable(router, 1)
        tail = [(13 * i) % 1000 + 3 for i in range(40)]
        out = complete(router, prefix + tail)
        assert out["usage"]["prompt_tokens"] == 200
        metrics = httpx.get(f"{router}/metrics", timeout=10).text
        assert "pdserve_router_predicted_prefix_hit_tokens_total 160.0" in metrics
        stats = engine_state(b_url)
        assert stats["kv_store_hit_tokens"] == 160  # and B did load it from the store
        assert stats["prefix_hit_tokens"] >= 160
    finally:
        for p in procs:
            kill_server(p)
