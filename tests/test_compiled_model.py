"""The compiled model step (engine/compiled_model.py): token-for-token equal to Hugging Face
greedy, like the eager reference, and it never recompiles once warmed up."""

import pytest
import torch

from engine import LLM, SamplingParams
from engine.compiled_model import CompiledPieces, compiled_graph_count
from engine.config import ModelConfig
from engine.model_files import default_cache_dir
from tests.hf_reference import hf_greedy, load_hf
from tests.test_engine import random_prompts


@pytest.fixture(scope="module")
def compiled_llm(tiny_llama_dir):
    # A module-scoped engine: the compile (a few graphs, C++ builds) is paid once here,
    # or loaded from the on-disk cache (<pdserve cache dir>/compile) when warm.
    llm = LLM(tiny_llama_dir, block_size=4, num_blocks=512, enforce_eager=False)
    assert isinstance(llm.engine.runner.model.pieces, CompiledPieces)
    cache = default_cache_dir() / "compile"
    assert cache.is_dir() and any(cache.rglob("*.py")), "no compiled code cached on disk"
    return llm


def test_compiled_step_equals_hf_greedy(tiny_llama_dir, compiled_llm):
    llm = compiled_llm
    hf = load_hf(tiny_llama_dir)
    graphs = compiled_graph_count()
    # one lone decode row, a batch of very different lengths, and a chunked prompt
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    for prompts in (
        random_prompts(1, [7]),
        random_prompts(9, [1, 3, 4, 5, 17, 64, 130, 2, 33], seed=1),
    ):
        outs = llm.generate(prompts, params)
        for p, o in zip(prompts, outs):
            assert o.token_ids == hf_greedy(hf, p, 10), f"prompt len {len(p)}"
    llm.engine.check_integrity()
    assert compiled_graph_count() == graphs, "serving recompiled after warm-up"


def test_compiled_logits_match_eager(tiny_llama_dir, compiled_llm):
    llm = compiled_llm
    eager = LLM(tiny_llama_dir, block_size=4, num_blocks=512, enforce_eager=True)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=3)
    prompts = random_prompts(3, [5, 40, 12], seed=5)
    for a, b in zip(llm.generate(prompts, params), eager.generate(prompts, params)):
        assert a.token_ids == b.token_ids
        torch.testing.assert_close(
            torch.tensor(a.logprobs), torch.tensor(b.logprobs), rtol=1e-4, atol=1e-4
        )


def test_enforce_eager_default_is_eager():
    assert not ModelConfig().compiled  # measured as fast or faster (docs/benchmarks.md)
    assert ModelConfig(enforce_eager=False).compiled
    assert ModelConfig(dtype="bfloat16", enforce_eager=False).compiled
    assert not ModelConfig(enforce_eager=True).compiled
    assert not ModelConfig(device="cuda", enforce_eager=False).compiled  # CUDA: eager
