"""Save after a load another backend served (real engine, real LMCache, two real
redis-servers): the backend that lacks the loaded prefix stores the whole prompt, so its
save becomes visible (no save timeout with the prompt's blocks pinned) and it can serve
the prompt to a node that loads from it alone."""

import time

import pytest

from cluster.embedded_redis import EmbeddedRedis
from engine.config import (
    CacheConfig,
    EngineConfig,
    KVBackendConfig,
    KVStoreConfig,
    ModelConfig,
    SchedulerConfig,
)
from engine.core import EngineCore
from engine.sampling_params import SamplingParams
from node.roles import build_kv

pytest.importorskip("lmcache")

BS, CHUNK = 4, 16
PROMPT = list(range(7, 7 + 40))
PARAMS = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)


def core_with(model_dir, urls: list[str]) -> EngineCore:
    backends = tuple(
        KVBackendConfig("lmcache", ("load", "save"), remote_url=u, name=f"s{i}")
        for i, u in enumerate(urls)
    )
    cfg = EngineConfig(
        model=ModelConfig(model_dir),
        cache=CacheConfig(block_size=BS, num_blocks=64),
        scheduler=SchedulerConfig(max_num_batched_tokens=64),
        # a save that never becomes visible fails at 4 s, well inside the 60 s below
        kv_store=KVStoreConfig(
            chunk_size=CHUNK, local_cpu_bytes=16 << 20, retry_after_s=0, save_timeout_s=4
        ),
        kv_backends=backends,
        num_threads=1,
    )
    _, store = build_kv(cfg)
    return EngineCore(cfg, None, kv_store=store)


def run(core: EngineCore, rid: str, prompt: list[int]) -> None:
    core.add_request(rid, prompt, PARAMS)
    t0 = time.monotonic()
    while core.has_unfinished:
        assert time.monotonic() - t0 < 60, "engine still busy"
        core.step()
        time.sleep(0.005)


def test_save_after_another_backends_load_stores_the_whole_prompt(tiny_llama_dir):
    with EmbeddedRedis() as a, EmbeddedRedis() as b:
        prime = core_with(tiny_llama_dir, [b.url])  # B holds the prompt's first 2 chunks
        try:
            run(prime, "p", PROMPT[:33])
        finally:
            prime.kv_store.shutdown()
        both = core_with(tiny_llama_dir, [a.url, b.url])
        try:
            run(both, "q", PROMPT)  # A misses, B serves 32 tokens, then saved to both
            st = both.kv_store.backend_stats()
            assert st["s0"]["served_tokens"] == 0
            assert st["s1"]["served_tokens"] == 32
            assert st["s0"]["kv_store_save_failures"] == 0
            assert st["s0"]["kv_store_saves"] == 1
            assert both.kv.num_free_blocks == 64  # the save's pin released
        finally:
            both.kv_store.shutdown()
        only_a = core_with(tiny_llama_dir, [a.url])  # a fresh node: A alone has it all
        try:
            run(only_a, "r", PROMPT)
            assert only_a.kv_store.backend_stats()["s0"]["served_tokens"] == len(PROMPT)
        finally:
            only_a.kv_store.shutdown()
