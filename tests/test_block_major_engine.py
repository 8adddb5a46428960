"""The engine on a block-major KV cache (`model.kv_layout: block_major`): greedy output equals
Hugging Face token for token, as on the layer-major cache, with every CPU kernel set, in
single, batched, chunked, prefix-hit and preemption runs, eager and compiled."""

import pytest

from pdserve.common.errors import ConfigError
from pdserve.engine import LLM, SamplingParams
from pdserve.engine.config import CacheConfig, EngineConfig, KVStoreConfig, ModelConfig
from pdserve.engine.kv_tensor import BLOCK_MAJOR, layout_of
from pdserve.kernels.ops import CPU_ATTENTION_ENV
from tests.hf_reference import hf_greedy, load_hf
from tests.test_engine import random_prompts

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


@pytest.fixture(scope="module")
def hf_model(tiny_llama_dir):
    return load_hf(tiny_llama_dir)


def check(llm: LLM, hf_model, prompts) -> list:
    outs = llm.generate(prompts, GREEDY)
    for p, o in zip(prompts, outs):
        assert o.token_ids == hf_greedy(hf_model, p, GREEDY.max_tokens), f"prompt len {len(p)}"
    llm.engine.check_integrity()
    assert llm.engine.stats().kv_blocks_used == 0
    return outs


def block_major_llm(model_dir: str, **kw) -> LLM:
    llm = LLM(model_dir, block_size=4, kv_layout=BLOCK_MAJOR, **kw)
    cache = llm.engine.runner.kv_cache
    assert layout_of(cache) == BLOCK_MAJOR and not cache[0, 0].is_contiguous()
    return llm


@pytest.mark.parametrize("kernels", ["native", "reference"])
def test_block_major_greedy_equals_hf(kernels, tiny_llama_dir, hf_model, monkeypatch):
    monkeypatch.setenv(CPU_ATTENTION_ENV, kernels)
    # A 7-token budget chunks the long prompts mid-block; then a prefix-cache hit.
    llm = block_major_llm(tiny_llama_dir, num_blocks=256, max_num_batched_tokens=7)
    check(llm, hf_model, random_prompts(6, [1, 5, 17, 64, 33, 4], seed=1))
    shared = random_prompts(1, [40], seed=3)[0]
    check(llm, hf_model, [shared + [5, 6]])
    (hit,) = check(llm, hf_model, [shared + [8, 9, 10]])
    assert hit.num_cached_tokens == 40


def test_block_major_preemption(tiny_llama_dir, hf_model):
    llm = block_major_llm(tiny_llama_dir, num_blocks=14, max_num_batched_tokens=16)
    check(llm, hf_model, random_prompts(4, [20, 9, 14, 6], seed=4))


def test_block_major_compiled_step(tiny_llama_dir, hf_model):
    # max_num_seqs 4: three decode buckets (1, 2, 4) to compile
    llm = block_major_llm(tiny_llama_dir, num_blocks=128, enforce_eager=False, max_num_seqs=4)
    assert llm.engine.runner.model.compiled_decode is not None
    check(llm, hf_model, random_prompts(3, [7, 30, 2], seed=5))


def test_layout_config_errors_name_the_field_and_lmcache_is_accepted():
    with pytest.raises(ConfigError, match="cache.kv_layout"):
        CacheConfig(kv_layout="blocks")
    # LMCache reads and writes block-major caches too (kv_transfer/kv_slots.py)
    cfg = EngineConfig(
        model=ModelConfig(),
        cache=CacheConfig(kv_layout=BLOCK_MAJOR),
        kv_store=KVStoreConfig(backend="lmcache"),
    )
    assert cfg.cache.kv_layout == BLOCK_MAJOR
