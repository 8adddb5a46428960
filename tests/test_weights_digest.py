"""KV is keyed by the weights, not the model's name (real engine, real LMCache, a real
redis-server): a checkpoint replaced in place under the same path and name never loads
the KV the old weights saved to the shared store, and answers as its own weights do (HF
reference); a node with the same weights still loads it. The digest is computed once and
cached beside the model, and computed again when a file changes."""

import json

import pytest

from pdserve.common.weights_digest import CACHE_NAME, weights_digest
from tests.conftest import make_tiny_llama
from tests.hf_reference import hf_greedy, load_hf
from tests.store_engine import PARAMS, run, store_core

pytest.importorskip("lmcache")

PROMPT = [(13 * i + 5) % 1000 for i in range(40)]


def served(model_dir: str, url: str, rid: str) -> tuple[list[int], int | None, int]:
    core = store_core(model_dir, [(url, ("load", "save"))])
    try:
        tokens, cached = run(core, rid, PROMPT)
        return tokens, cached, core.kv_store.backend_stats()["s0"]["served_tokens"]
    finally:
        core.kv_store.shutdown()


def test_a_checkpoint_replaced_in_place_never_loads_the_old_ones_kv(tmp_path, redis_server):
    model = str(tmp_path / "model")
    make_tiny_llama(model, seed=0)
    old = weights_digest(model)
    cache = json.loads((tmp_path / "model" / CACHE_NAME).read_text())
    assert cache["digest"] == old and "config.json" in cache["files"]
    _, cached, _ = served(model, redis_server.url, "old")  # saved under the old weights
    assert cached == 0
    make_tiny_llama(model, seed=1)  # same path, same name, other weights
    assert weights_digest(model) != old
    tokens, cached, from_store = served(model, redis_server.url, "new")
    assert (cached, from_store) == (0, 0)  # nothing of the old weights' KV
    assert tokens == hf_greedy(load_hf(model), PROMPT, PARAMS.max_tokens)
    _, cached, from_store = served(model, redis_server.url, "again")  # same weights: hits
    assert (cached, from_store) == (36, 40)  # the whole prompt but its last block
