"""Save after a load another backend served (real engine, real LMCache, two real
redis-servers): the backend that lacks the loaded prefix stores the whole prompt, so its
save becomes visible (no save timeout with the prompt's blocks pinned) and it can serve
the prompt to a node that loads from it alone; that holds too when the load brought the
whole prompt, and the backend that served it answers its save at once."""

import pytest

from pdserve.cluster.embedded_redis import EmbeddedRedis
from pdserve.engine.core import EngineCore
from tests.store_engine import NUM_BLOCKS, run, store_core

pytest.importorskip("lmcache")

PROMPT = list(range(7, 7 + 40))


def core_with(model_dir: str, urls: list[str]) -> EngineCore:
    # a save that never becomes visible fails at 4 s, well inside run's 60 s
    return store_core(model_dir, [(u, ("load", "save")) for u in urls], save_timeout_s=4)


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
            assert both.kv.num_free_blocks == NUM_BLOCKS  # the save's pin released
        finally:
            both.kv_store.shutdown()
        only_a = core_with(tiny_llama_dir, [a.url])  # a fresh node: A alone has it all
        try:
            run(only_a, "r", PROMPT)
            assert only_a.kv_store.backend_stats()["s0"]["served_tokens"] == len(PROMPT)
        finally:
            only_a.kv_store.shutdown()


def test_prompt_served_whole_by_one_backend_is_saved_to_the_other(tiny_llama_dir):
    with EmbeddedRedis() as a, EmbeddedRedis() as b:
        prime = core_with(tiny_llama_dir, [b.url])  # B holds the whole prompt
        try:
            run(prime, "p", PROMPT)
        finally:
            prime.kv_store.shutdown()
        both = core_with(tiny_llama_dir, [b.url, a.url])  # B first: it serves it all
        try:
            run(both, "q", PROMPT)
            st = both.kv_store.backend_stats()
            assert st["s0"]["served_tokens"] == len(PROMPT)
            for name in ("s0", "s1"):  # B holds it all already, A stores it all
                assert st[name]["kv_store_save_failures"] == 0, name
                assert st[name]["kv_store_saves"] == 1, name
            assert both.kv.num_free_blocks == NUM_BLOCKS  # the save's pin released
        finally:
            both.kv_store.shutdown()
        only_a = core_with(tiny_llama_dir, [a.url])  # a fresh node: A alone has it all
        try:
            run(only_a, "r", PROMPT)
            assert only_a.kv_store.backend_stats()["s0"]["served_tokens"] == len(PROMPT)
        finally:
            only_a.kv_store.shutdown()
