"""The composed KV connector (kv_transfer/multi_connector.py), built by the node's wiring
(node/roles.build_kv) from `kv_backends`: NIXL for the request's transfer, two LMCache
stores on two real redis-servers for prefix reuse (in process, real NIXL, real LMCache).

The prefill node saves to both stores; a decode node loads from the first store that has
the prompt's prefix, then orders only the rest over NIXL. With the first store's Redis
killed, loads fall back to the second (a metric and a log line); with both killed, the
prefill node computes the whole prompt. The same composition on block-major caches. Greedy
output equals Hugging Face throughout.
"""

import logging
import random
import time

import pytest
import redis

from pdserve.cluster.embedded_redis import EmbeddedRedis
from pdserve.common.errors import ConfigError
from pdserve.engine.config import (
    CacheConfig,
    EngineConfig,
    KVBackendConfig,
    KVStoreConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
)
from pdserve.engine.core import EngineCore
from pdserve.engine.sampling_params import SamplingParams
from pdserve.node.roles import build_kv
from tests.hf_reference import hf_greedy, load_hf

pytest.importorskip("nixl")
pytest.importorskip("lmcache")

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
BS, CHUNK = 4, 16


def node(
    model_dir, role: str, urls: list[str], store_roles: tuple[str, ...], layout="layer_major"
) -> EngineCore:
    backends = (KVBackendConfig("nixl", ("transfer",)),) + tuple(
        KVBackendConfig("lmcache", store_roles, remote_url=u, name=f"store-{i}")
        for i, u in enumerate(urls)
    )
    cfg = EngineConfig(
        model=ModelConfig(model_dir),
        cache=CacheConfig(block_size=BS, num_blocks=256, kv_layout=layout),
        scheduler=SchedulerConfig(max_num_batched_tokens=32, local_prefill_max_tokens=4),
        kv_transfer=KVTransferConfig(
            role=role,
            node_id=f"{role}-{random.randrange(1 << 30)}",
            control_address="tcp://127.0.0.1:*" if role == "prefill" else None,
        ),  # fmt: skip
        kv_store=KVStoreConfig(
            chunk_size=CHUNK, local_cpu_bytes=64 << 20, load_timeout_s=20, retry_after_s=0
        ),
        kv_backends=backends,
        num_threads=1,
    )
    kv_role, store = build_kv(cfg)
    return EngineCore(cfg, kv_role, kv_store=store)


def run(decode: EngineCore, prefill: EngineCore, rid: str, prompt, max_s=120.0):
    addr = prefill.kv_role.connector.control_address
    decode.add_request(rid, prompt, GREEDY, remote_prefill=addr)
    out, deadline = [], time.monotonic() + max_s
    while decode.has_unfinished or prefill.has_unfinished:
        assert time.monotonic() < deadline, "PD pair did not finish"
        for o in decode.step():
            out += o.new_token_ids
        prefill.step()
    for core in (decode, prefill):
        core.check_integrity()
        assert core.kv.pool.num_used_blocks == 0
    return out


@pytest.fixture
def two_redis():
    with EmbeddedRedis() as a, EmbeddedRedis() as b:
        yield a, b


def test_load_from_first_store_that_has_it_save_to_all_fall_back_when_redis_dies(
    tiny_llama_dir, two_redis, caplog
):
    hf = load_hf(tiny_llama_dir)
    ra, rb = two_redis
    urls = [ra.url, rb.url]
    prefill = node(tiny_llama_dir, "prefill", urls, ("save",))
    cores = [prefill]

    def decode_node():
        core = node(tiny_llama_dir, "decode", urls, ("load",))
        cores.append(core)
        return core

    try:
        rng = random.Random(3)
        shared = [rng.randrange(3, 1024) for _ in range(48)]

        def prompt():
            return shared + [rng.randrange(3, 1024) for _ in range(rng.randrange(20, 30))]

        # 1. A fresh prefill: over NIXL, then saved to EVERY save backend.
        p1 = prompt()
        assert run(decode_node(), prefill, "r1", p1) == hf_greedy(hf, p1, 6)
        saved = prefill.kv_store.backend_stats()
        assert saved["store-0"]["kv_store_saves"] == saved["store-1"]["kv_store_saves"] == 1
        for server in two_redis:
            assert redis.Redis.from_url(server.url).dbsize() >= 3  # 3 whole chunks each

        # 2. Both stores hold the prefix: the FIRST serves it; NIXL brings only the rest.
        d2, p2 = decode_node(), prompt()
        assert run(d2, prefill, "r2", p2) == hf_greedy(hf, p2, 6)
        got = d2.kv_store.backend_stats()
        assert (got["store-0"]["served_tokens"], got["store-1"]["served_tokens"]) == (48, 0)
        s = d2.stats()
        assert s.kv_store_hit_tokens == 48 and s.pd_remote_prefills == 1
        assert s.kv_store_fallbacks == 0

        # 3. Only the second holds it: the first has nothing (no failure), the second serves.
        redis.Redis.from_url(ra.url).flushall()
        d3, p3 = decode_node(), prompt()
        assert run(d3, prefill, "r3", p3) == hf_greedy(hf, p3, 6)
        got = d3.kv_store.backend_stats()
        assert (got["store-0"]["served_tokens"], got["store-1"]["served_tokens"]) == (0, 48)
        assert d3.stats().kv_store_fallbacks == 0

        # 4. The first store's Redis is killed: its load fails fast, logged and counted,
        #    and the second serves; the prefill node's save to the dead one fails alone.
        ra.stop()
        d4, p4 = decode_node(), prompt()
        with caplog.at_level(logging.WARNING, logger="pdserve.kv_transfer.multi_connector"):
            t = time.monotonic()
            assert run(d4, prefill, "r4", p4) == hf_greedy(hf, p4, 6)
            took = time.monotonic() - t
        s = d4.stats()
        assert s.kv_store_fallbacks == 1 and s.kv_store_load_failures == 1
        assert s.kv_store_hit_tokens == 48
        assert d4.kv_store.backend_stats()["store-1"]["served_tokens"] == 48
        assert any(
            "request r4: KV load backend store-0 failed; trying store-1" in r.getMessage()
            for r in caplog.records
        )
        assert took < 60  # a dead Redis is refused at once (PING), never a hang

        # 5. Both Redis servers down: no store serves; the prefill node computes it all.
        rb.stop()
        d5, p5 = decode_node(), shared + [7, 8, 9, 10, 11]
        assert run(d5, prefill, "r5", p5) == hf_greedy(hf, p5, 6)
        s = d5.stats()
        assert s.kv_store_hit_tokens == 0 and s.kv_store_load_failures == 2
        assert s.pd_remote_prefills == 1 and d5.kv_role.bytes_received > 0
    finally:
        for core in cores:
            core.kv_role.shutdown()
            core.kv_store.shutdown()


def test_block_major_nodes_compose_nixl_and_lmcache(tiny_llama_dir, redis_server):
    """Block-major caches on both nodes: the store's chunks are read from and written into
    block-major blocks, NIXL WRITEs the rest as whole-block ranges; output equals HF."""
    hf = load_hf(tiny_llama_dir)
    urls = [redis_server.url]
    prefill = node(tiny_llama_dir, "prefill", urls, ("save",), layout="block_major")
    cores = [prefill]
    try:
        rng = random.Random(5)
        shared = [rng.randrange(3, 1024) for _ in range(48)]
        p1 = shared + [rng.randrange(3, 1024) for _ in range(21)]
        d1 = node(tiny_llama_dir, "decode", urls, ("load",), layout="block_major")
        cores.append(d1)
        assert run(d1, prefill, "r1", p1) == hf_greedy(hf, p1, 6)  # all over NIXL, saved
        assert prefill.kv_store.backend_stats()["store-0"]["kv_store_saves"] == 1
        d2 = node(tiny_llama_dir, "decode", urls, ("load",), layout="block_major")
        cores.append(d2)
        assert not d2.runner.kv_cache.is_contiguous()
        p2 = shared + [rng.randrange(3, 1024) for _ in range(26)]
        assert run(d2, prefill, "r2", p2) == hf_greedy(hf, p2, 6)
        s = d2.stats()
        assert s.kv_store_hit_tokens == 48 and s.pd_remote_prefills == 1  # NIXL: the rest
    finally:
        for core in cores:
            core.kv_role.shutdown()
            core.kv_store.shutdown()


def test_backends_config_errors_name_the_field():
    pd = KVTransferConfig(role="decode")
    nixl = KVBackendConfig("nixl", ("transfer",))
    cases = [
        ((KVBackendConfig("nixl", ("load",)),), "kv_backends[0].roles"),
        ((nixl, KVBackendConfig("lmcache", ("save", "save"))), "kv_backends[1].roles"),
        ((nixl, KVBackendConfig("redis", ("load",))), "kv_backends[1].kind"),
        ((nixl, nixl), "kv_backends"),  # two transfer backends
        ((KVBackendConfig("lmcache", ("load",)),), "kv_backends"),  # decode without transfer
        ((nixl, KVBackendConfig("lmcache", ("load",), remote_url="http://x")), "remote_url"),
    ]
    for backends, field in cases:
        with pytest.raises(ConfigError, match=field.replace("[", r"\[").replace("]", r"\]")):
            EngineConfig(kv_transfer=pd, kv_backends=backends)
    with pytest.raises(ConfigError, match="not both"):
        EngineConfig(
            kv_transfer=pd,
            kv_store=KVStoreConfig(backend="lmcache"),
            kv_backends=(nixl, KVBackendConfig("lmcache", ("load",))),
        )
    # The shorthand and the explicit list name the same backends.
    short = EngineConfig(kv_transfer=pd, kv_store=KVStoreConfig(backend="lmcache"))
    assert [(b.kind, b.roles, b.name) for b in short.backends] == [
        ("nixl", ("transfer",), "nixl-0"),
        ("lmcache", ("load", "save"), "lmcache-1"),
    ]
