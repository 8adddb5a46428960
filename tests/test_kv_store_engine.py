"""The LMCache prefix store inside the engine (real LMCache, real redis-server, in process).

Each EngineCore here is a separate "node": its own paged cache and its own LMCache local
tier; what one node saved reaches another only through Redis. Greedy outputs are checked
against Hugging Face.
"""

import random
import time

import msgspec
import pytest

from pdserve.engine.config import CacheConfig, EngineConfig, KVStoreConfig, ModelConfig
from pdserve.engine.core import EngineCore
from pdserve.engine.sampling_params import SamplingParams
from pdserve.node.roles import build_kv_store
from tests.hf_reference import hf_greedy, load_hf

pytest.importorskip("lmcache")

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
BS, CHUNK = 4, 16


@pytest.fixture(scope="module")
def hf_model(tiny_llama_dir):
    return load_hf(tiny_llama_dir)


def make_node(model_dir, url, **store_kw) -> EngineCore:
    cfg = EngineConfig(
        model=ModelConfig(model_dir),
        cache=CacheConfig(block_size=BS, num_blocks=128),
        kv_store=KVStoreConfig(
            backend="lmcache",
            remote_url=url,
            chunk_size=CHUNK,
            local_cpu_bytes=64 << 20,
            **store_kw,
        ),
        num_threads=1,
    )
    return EngineCore(cfg, kv_store=build_kv_store(cfg))


def run(core: EngineCore, prompt: list[int], rid: str, max_s: float = 60.0):
    core.add_request(rid, prompt, GREEDY)
    return run_added(core, max_s)


def run_added(core: EngineCore, max_s: float = 60.0):
    tokens, cached, deadline = [], None, time.monotonic() + max_s
    while core.has_unfinished:  # also drains the store's save jobs (pins released)
        assert time.monotonic() < deadline, "engine did not finish"
        for o in core.step():
            tokens += o.new_token_ids
            cached = o.num_cached_tokens
    core.check_integrity()
    assert core.stats().kv_blocks_used == 0
    return tokens, cached


def prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 1024) for _ in range(n)]


def test_node_b_reuses_node_a_prefix(tiny_llama_dir, hf_model, redis_server):
    a = make_node(tiny_llama_dir, redis_server.url)
    b = make_node(tiny_llama_dir, redis_server.url)
    try:
        p = prompt(50, seed=1)
        out_a, cached_a = run(a, p, "a")
        assert cached_a == 0
        assert a.stats().kv_store_saves == 1
        # B has never seen the prompt: 3 whole chunks (48 tokens) come from Redis; the
        # last block (47 + 1 token left to compute) is recomputed.
        q = p[:48] + prompt(7, seed=2)  # same prefix, another tail
        out_b, cached_b = run(b, q, "b")
        s = b.stats()
        assert s.kv_store_hit_tokens == 48 and cached_b == 48
        assert s.kv_store_loads == 1 and s.kv_store_load_failures == 0
        assert s.kv_store_checksum_mismatches == 0  # every loaded block verified
        assert s.prefill_paths == {"store_hit": 1}
        assert out_a == hf_greedy(hf_model, p, GREEDY.max_tokens)
        assert out_b == hf_greedy(hf_model, q, GREEDY.max_tokens)
    finally:
        a.kv_store.shutdown()
        b.kv_store.shutdown()


def test_a_corrupted_store_chunk_is_caught_on_load(tiny_llama_dir, hf_model, redis_server):
    """Issue 30: each chunk's block checksums are saved beside it (kv_transfer/
    store_sums.py); bytes flipped in the stored chunks in Redis are caught when node B
    loads them: a miss, counted, computed locally, and the answer is still exact."""
    import redis

    a = make_node(tiny_llama_dir, redis_server.url)
    b = make_node(tiny_llama_dir, redis_server.url)
    try:
        p = prompt(50, seed=11)
        run(a, p, "a")
        r = redis.Redis.from_url(redis_server.url)
        chunks = list(r.scan_iter("*kv_bytes"))
        assert len(chunks) == 4 and len(list(r.scan_iter("*kvsum"))) == 4  # 3 whole + 2 tokens
        for key in chunks:
            value = bytearray(r.get(key))
            value[len(value) // 2] ^= 0xFF
            r.set(key, bytes(value))
        out_b, cached_b = run(b, p, "b")
        s = b.stats()
        assert s.kv_store_checksum_mismatches == 1 and s.kv_store_hit_tokens == 0
        assert cached_b == 0 and s.prefill_paths == {"local_policy": 1}
        assert out_b == hf_greedy(hf_model, p, GREEDY.max_tokens)
    finally:
        a.kv_store.shutdown()
        b.kv_store.shutdown()


def test_salted_prompts_share_the_store_only_with_their_salt(
    tiny_llama_dir, hf_model, redis_server
):
    """A salted request saves its chunks under keys keyed by its salt: another node finds
    them with the same salt only (another salt, or none, computes the whole prompt)."""
    a = make_node(tiny_llama_dir, redis_server.url)
    b = make_node(tiny_llama_dir, redis_server.url)
    try:
        p = prompt(50, seed=11)
        a.add_request("s1", p, msgspec.structs.replace(GREEDY, cache_salt="tenant-1"))
        ref = hf_greedy(hf_model, p, GREEDY.max_tokens)
        assert run_added(a) == (ref, 0) and a.stats().kv_store_saves == 1
        for rid, salt in (("s2", "tenant-2"), ("s3", "")):
            b.add_request(rid, p, msgspec.structs.replace(GREEDY, cache_salt=salt))
            assert run_added(b) == (ref, 0)  # nothing found in the store under its keys
        assert b.stats().kv_store_hit_tokens == 0
        b.add_request("s4", p, msgspec.structs.replace(GREEDY, cache_salt="tenant-1"))
        assert run_added(b) == (ref, 48)  # 3 whole chunks, from a's save through Redis
        assert b.stats().kv_store_hit_tokens == 48
    finally:
        a.kv_store.shutdown()
        b.kv_store.shutdown()


def test_prefix_survives_node_restart(tiny_llama_dir, hf_model, redis_server):
    p = prompt(40, seed=3)
    a = make_node(tiny_llama_dir, redis_server.url)
    out1, _ = run(a, p, "r1")
    t = time.monotonic()
    a.kv_store.shutdown()
    assert time.monotonic() - t < 5.0  # bounded even with the Redis backend
    del a
    a2 = make_node(tiny_llama_dir, redis_server.url)  # a fresh node: empty cache and tier
    try:
        out2, cached = run(a2, p, "r2")
        assert out2 == out1 == hf_greedy(hf_model, p, GREEDY.max_tokens)
        assert cached == 36 and a2.stats().kv_store_hit_tokens == 36  # 9 of 10 blocks
    finally:
        a2.kv_store.shutdown()


def test_store_through_a_redis_that_wants_a_password(tiny_llama_dir, hf_model):
    """A cluster with a secret runs Redis with a password (issue 28): the LMCache store
    saves and loads through it with the password in its URL (as node/cli.py passes it
    from the environment), and a node without the password is refused and computes
    locally instead of reading anything."""
    from pdserve.cluster.embedded_redis import EmbeddedRedis
    from pdserve.common.redis_auth import with_password

    with EmbeddedRedis(password="s3cret-pw-for-lmcache") as server:
        url = with_password(server.url, server.password)
        a, b = make_node(tiny_llama_dir, url), make_node(tiny_llama_dir, url)
        stranger = make_node(tiny_llama_dir, server.url, retry_after_s=0.0)  # no password
        try:
            p = prompt(50, seed=7)
            out_a, _ = run(a, p, "a")
            out_b, cached_b = run(b, p, "b")
            assert cached_b == 48 and b.stats().kv_store_hit_tokens == 48
            out_s, cached_s = run(stranger, p, "s")
            assert cached_s == 0 and stranger.stats().kv_store_hit_tokens == 0
            want = hf_greedy(hf_model, p, GREEDY.max_tokens)
            assert out_a == out_b == out_s == want
        finally:
            for node in (a, b, stranger):
                node.kv_store.shutdown()


def test_redis_down_computes_locally(tiny_llama_dir, hf_model, redis_server, caplog):
    url = redis_server.url
    redis_server.stop()
    node = make_node(tiny_llama_dir, url, retry_after_s=0.0)
    try:
        p = prompt(30, seed=4)
        with caplog.at_level("WARNING", logger="pdserve.kv_transfer.prefix_store"):
            out, cached = run(node, p, "r", max_s=60.0)
        assert out == hf_greedy(hf_model, p, GREEDY.max_tokens)
        assert cached == 0
        s = node.stats()
        assert s.kv_store_load_failures == 1 and s.kv_store_saves == 0
        # the prompt's chunk, and the generated tokens' chunk (positions 16-32) where the
        # prompt's save had failed already when they filled it (one save in flight)
        assert 1 <= s.kv_store_save_failures <= 2
        assert "KV store load failed" in caplog.text and "request r" in caplog.text
    finally:
        node.kv_store.shutdown()


def test_load_deadline_waited_out(tiny_llama_dir, hf_model, hung_redis_url):
    """A store that does not answer: the request computes locally once the load deadline
    passes; the blocks the load might still write stay parked until the load has ended."""
    node = make_node(tiny_llama_dir, hung_redis_url, load_timeout_s=0.3, retry_after_s=60)
    try:
        p = prompt(30, seed=5)
        node.add_request("r", p, GREEDY)
        tokens, parked, deadline = [], None, time.monotonic() + 120
        while node.has_unfinished:
            assert time.monotonic() < deadline, "never settled"
            for o in node.step():
                tokens += o.new_token_ids
            s = node.stats()
            if parked is None and s.kv_store_load_failures:
                parked = s.kv_blocks_used  # right after the deadline: 8 parked (+ its new ones)
            if len(tokens) < GREEDY.max_tokens:
                continue
            time.sleep(0.01)  # output done; wait for the late load to end
        assert tokens == hf_greedy(hf_model, p, GREEDY.max_tokens)
        assert parked >= 8
        assert node.stats().kv_store_load_failures == 1
        node.check_integrity()
        assert node.stats().kv_blocks_used == 0
    finally:
        t = time.monotonic()
        node.kv_store.shutdown()
        assert time.monotonic() - t < 5.0


def test_store_round_trip_scattered_blocks_and_skip(redis_server):
    """Chunks written from one paged cache land bit-exact in scattered blocks of another
    (through Redis: the reader's own tier is empty); skipped tokens stay untouched."""
    import torch

    from pdserve.kv_transfer.kv_slots import runs as _runs
    from pdserve.kv_transfer.lmcache_store import LMCacheKVStore

    assert _runs(torch.tensor([-1, 0, 1, 7, 8])) == [(0, 1, -1), (1, 3, 0), (3, 5, 7)]
    shape = (2, 2, 32, BS, 2, 8)  # [layers, 2, blocks, block_size, heads, head_dim]
    src, dst = torch.randn(shape), torch.zeros(shape)
    kw = dict(
        namespace="t", chunk_size=CHUNK, local_cpu_bytes=16 << 20, remote_url=redis_server.url
    )
    a, b = LMCacheKVStore(src, **kw), LMCacheKVStore(dst, **kw)
    try:
        toks = prompt(45, seed=9)
        src_slots = list(range(4 * BS, 4 * BS + 45))
        dst_blocks = [30, 2, 17, 5, 9, 21, 11, 3, 26, 14, 7, 19]  # 12 blocks, scattered
        dst_slots = [blk * BS + i for blk in dst_blocks for i in range(BS)][:45]
        assert a.store(toks, src_slots) == 45
        assert a.wait_visible(toks, time.monotonic() + 30)
        assert b.lookup(toks) == 45
        assert b.retrieve(toks, dst_slots, skip_tokens=20) == 45
        fs, fd = src.view(2, 2, -1, 16), dst.view(2, 2, -1, 16)
        s_idx, d_idx = torch.tensor(src_slots), torch.tensor(dst_slots)
        assert torch.equal(fd[:, :, d_idx[20:]], fs[:, :, s_idx[20:]])
        assert not fd[:, :, d_idx[:20]].any()  # present locally: never overwritten
        assert b.retrieve(prompt(45, seed=10), dst_slots) == 0  # unknown prompt: a miss
    finally:
        a.close()
        b.close()
