"""EngineCore/LLM on a tiny random Llama: greedy output equals Hugging Face token for token."""

import random

import pytest
import torch

from pdserve.common.errors import ConfigError, InvalidRequestError
from pdserve.engine import LLM, SamplingParams
from tests.hf_reference import hf_greedy, load_hf

pytestmark = pytest.mark.isa  # scripts/avx2_view.sh runs it as an AVX2-only CPU

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


@pytest.fixture(scope="module")
def hf_model(tiny_llama_dir):
    return load_hf(tiny_llama_dir)


def random_prompts(n: int, lengths: list[int], seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 1024) for _ in range(lengths[i % len(lengths)])] for i in range(n)]


def check_against_hf(llm: LLM, hf_model, prompts, params=GREEDY):
    outs = llm.generate(prompts, params)
    for p, o in zip(prompts, outs):
        assert o.token_ids == hf_greedy(hf_model, p, params.max_tokens), f"prompt len {len(p)}"
        assert o.finish_reason == "length"
    llm.engine.check_integrity()
    assert llm.engine.stats().kv_blocks_used == 0
    return outs


def test_single_prompt(tiny_llama_dir, hf_model):
    llm = LLM(tiny_llama_dir, block_size=4, num_blocks=64)
    check_against_hf(llm, hf_model, random_prompts(1, [7]))


def test_batch_of_very_different_lengths(tiny_llama_dir, hf_model):
    llm = LLM(tiny_llama_dir, block_size=4, num_blocks=256)
    prompts = random_prompts(9, [1, 3, 4, 5, 17, 64, 130, 2, 33], seed=1)
    check_against_hf(llm, hf_model, prompts)


def test_chunked_prefill(tiny_llama_dir, hf_model):
    # A 7-token budget cuts every long prompt into chunks that end mid-block.
    llm = LLM(tiny_llama_dir, block_size=4, num_blocks=256, max_num_batched_tokens=7)
    prompts = random_prompts(4, [50, 23, 9, 31], seed=2)
    check_against_hf(llm, hf_model, prompts)


def test_prefix_cache_reuse(tiny_llama_dir, hf_model):
    llm = LLM(tiny_llama_dir, block_size=4, num_blocks=128)
    shared = random_prompts(1, [40], seed=3)[0]
    a, b = shared + [5, 6, 7], shared + [8, 9]
    (out_a,) = check_against_hf(llm, hf_model, [a])
    assert out_a.num_cached_tokens == 0
    (out_b,) = check_against_hf(llm, hf_model, [b])
    assert out_b.num_cached_tokens == 40  # the 10 full shared blocks
    assert llm.engine.stats().prefix_hit_tokens == 40
    # The whole prompt submitted again: everything but the last token's block is reused.
    (out_a2,) = check_against_hf(llm, hf_model, [a])
    assert out_a2.num_cached_tokens == 40


def _count_rows(llm: LLM, layer: int) -> list[int]:
    """Rows entering `layer`'s o_proj + MLP, one entry per call (per step)."""
    mod = llm.engine.runner.model.model.layers[layer]
    seen, inner = [], mod.after_attention

    def after_attention(o, residual, gemv=True):
        seen.append(o.shape[0])
        return inner(o, residual, gemv)

    mod.after_attention = after_attention
    return seen


def test_last_layer_runs_only_the_rows_that_sample(tiny_llama_dir, hf_model):
    """A step with prompt tokens computes the last layer's o_proj, MLP and final norm only
    for the rows that sample (engine/models/llama.py `out_rows`); its K/V for every row.
    The tokens stay Hugging Face's, whole prompts and chunked ones."""
    llm = LLM(tiny_llama_dir, block_size=4, num_blocks=256)
    first, last = _count_rows(llm, 0), _count_rows(llm, -1)
    prompts = random_prompts(3, [5, 17, 33], seed=11)
    check_against_hf(llm, hf_model, prompts)
    # the prompt step: 55 rows, 3 sample (decode steps run the fused native forward)
    assert first == [55] and last == [3]
    # chunks of 7 tokens: a step whose chunks all end mid-prompt skips the last layer's
    # o_proj and MLP; the later steps' K/V (written by every layer) are still right
    llm = LLM(tiny_llama_dir, block_size=4, num_blocks=256, max_num_batched_tokens=7)
    first, last = _count_rows(llm, 0), _count_rows(llm, -1)
    check_against_hf(llm, hf_model, random_prompts(1, [20], seed=12))
    assert first == [7, 7, 6] and last == [1]  # 2 chunks without a sampling row
    # prompt logprobs need every prompt row's hidden state: no pruning there
    llm = LLM(tiny_llama_dir, block_size=4, num_blocks=256)
    last = _count_rows(llm, -1)
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, prompt_logprobs=1)
    (out,) = llm.generate([prompts[1]], params)
    assert last == [17] and len(out.prompt_logprobs) == 16
    assert out.token_ids == hf_greedy(hf_model, prompts[1], 2)


@pytest.mark.parametrize("length", [41, 43, 47])  # 1, 3 and 7 tokens after the cached blocks
def test_same_request_twice_same_logprobs(tiny_llama_dir, length):
    """A prompt computed whole, then again with all but its last few tokens from the prefix
    cache: the same tokens and bit-equal logprobs (the few rows left run the same kernels
    a whole prompt does: prepacked GEMMs, not the decode GEMV; the native prefill attention
    with the cached context)."""
    llm = LLM(tiny_llama_dir, block_size=8, num_blocks=128)
    prompt = random_prompts(1, [length], seed=7)[0]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=True)
    (first,) = llm.generate([prompt], params)
    (again,) = llm.generate([prompt], params)
    assert first.num_cached_tokens == 0 and again.num_cached_tokens == length // 8 * 8
    assert again.token_ids == first.token_ids
    assert again.logprobs == first.logprobs


def test_same_request_twice_same_logprobs_wide_mlp(tmp_path):
    """As above, one token after the cached blocks, with an MLP as wide as SmolLM2's
    (K = 1536 into the down projection): oneDNN's one-row kernel sums in another order
    there, so the lone row must not reach it alone (engine/models/cpu_linear.py)."""
    from tests.conftest import make_tiny_llama

    path = make_tiny_llama(str(tmp_path / "m"), seed=5, intermediate_size=1536)
    llm = LLM(path, block_size=8, num_blocks=128)
    prompt = random_prompts(1, [41], seed=7)[0]
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, logprobs=True)
    (first,) = llm.generate([prompt], params)
    (again,) = llm.generate([prompt], params)
    assert again.num_cached_tokens == 40
    assert again.token_ids == first.token_ids and again.logprobs == first.logprobs


def test_preemption_by_recompute(tiny_llama_dir, hf_model):
    # 12 blocks x 4 tokens cannot hold 4 sequences of ~30 tokens: preemption must happen.
    llm = LLM(tiny_llama_dir, block_size=4, num_blocks=12, enable_prefix_caching=False)
    prompts = random_prompts(4, [14, 10, 12, 9], seed=4)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    check_against_hf(llm, hf_model, prompts, params)
    assert llm.engine.stats().num_preemptions > 0


def test_preemption_with_prefix_cache(tiny_llama_dir, hf_model):
    llm = LLM(tiny_llama_dir, block_size=4, num_blocks=14, max_num_batched_tokens=16)
    prompts = random_prompts(5, [13, 21, 6, 17, 9], seed=5)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    check_against_hf(llm, hf_model, prompts, params)
    assert llm.engine.stats().num_preemptions > 0


def test_seeded_sampling_is_reproducible(tiny_llama_dir):
    llm = LLM(tiny_llama_dir, block_size=4, num_blocks=128)
    p = random_prompts(1, [8], seed=6)[0]
    sp = SamplingParams(
        temperature=1.0, top_p=0.9, top_k=50, seed=1234, max_tokens=12, ignore_eos=True
    )
    alone = llm.generate([p], sp)[0].token_ids
    # Same seed inside a different batch gives the same tokens.
    others = [SamplingParams(temperature=1.0, seed=i, max_tokens=5) for i in range(3)]
    batched = llm.generate([p] + random_prompts(3, [5, 9, 2]), [sp] + others)[0].token_ids
    assert alone == batched
    other_seed = llm.generate(
        [p], SamplingParams(temperature=1.0, seed=99, max_tokens=12, ignore_eos=True)
    )
    assert other_seed[0].token_ids != alone
    llm.engine.check_integrity()


def test_top_k_1_equals_greedy_and_logprobs(tiny_llama_dir, hf_model):
    llm = LLM(tiny_llama_dir, block_size=4, num_blocks=64)
    p = random_prompts(1, [6], seed=7)[0]
    out = llm.generate(
        [p], SamplingParams(temperature=0.7, top_k=1, max_tokens=8, ignore_eos=True, logprobs=True)
    )[0]
    assert out.token_ids == hf_greedy(hf_model, p, 8)
    assert len(out.logprobs) == 8 and all(lp <= 0 for lp in out.logprobs)
    # logprob of the greedy token matches HF's log-softmax at the first position
    with torch.no_grad():
        logits = hf_model(torch.tensor([p])).logits[0, -1]
    assert out.logprobs[0] == pytest.approx(
        torch.log_softmax(logits, -1)[out.token_ids[0]].item(), abs=1e-4
    )


def test_stop_token_ids_and_max_tokens(tiny_llama_dir, hf_model):
    llm = LLM(tiny_llama_dir, block_size=4, num_blocks=64)
    p = random_prompts(1, [6], seed=8)[0]
    ref = hf_greedy(hf_model, p, 10)
    out = llm.generate(
        [p], SamplingParams(temperature=0, max_tokens=10, stop_token_ids=[ref[3]], ignore_eos=True)
    )[0]
    assert out.token_ids == ref[: ref.index(ref[3]) + 1] and out.finish_reason == "stop"


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"temperature": -0.5}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"top_k": 0}, "top_k"),
    ],
)
def test_bad_sampling_params(kwargs, match):
    with pytest.raises(InvalidRequestError, match=match):
        SamplingParams(**kwargs)


def test_bad_prompts(tiny_llama_dir):
    llm = LLM(tiny_llama_dir, block_size=4, num_blocks=64, max_model_len=32)
    with pytest.raises(InvalidRequestError, match="empty"):
        llm.generate([[]], GREEDY)
    with pytest.raises(InvalidRequestError, match="context"):
        llm.generate([list(range(3, 40))], GREEDY)
    with pytest.raises(InvalidRequestError, match="outside the vocabulary"):
        llm.generate([[5, 1024]], GREEDY)
    with pytest.raises(InvalidRequestError, match="outside the vocabulary"):
        llm.generate([[-1, 5]], GREEDY)
    llm.engine.check_integrity()


def test_config_errors_name_the_field(tiny_llama_dir):
    with pytest.raises(ConfigError, match="model.dtype"):
        LLM(tiny_llama_dir, dtype="float8")
    with pytest.raises(ConfigError, match="cache.block_size"):
        LLM(tiny_llama_dir, block_size=6)
    with pytest.raises(ConfigError, match="scheduler.max_num_seqs"):
        LLM(tiny_llama_dir, max_num_seqs=0)
    with pytest.raises(ConfigError, match="model.max_model_len"):
        LLM(tiny_llama_dir, max_model_len=100_000)
    with pytest.raises(ConfigError, match="model.prompt_gemm"):
        LLM(tiny_llama_dir, prompt_gemm="fast")


def test_sequence_capped_by_context(tiny_llama_dir):
    llm = LLM(tiny_llama_dir, block_size=4, num_blocks=64, max_model_len=16)
    out = llm.generate(
        [list(range(3, 13))], SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)
    )[0]
    assert len(out.token_ids) == 6 and out.finish_reason == "length"


def test_bf16_close_to_fp32(tiny_llama_dir, hf_model):
    llm = LLM(tiny_llama_dir, block_size=4, num_blocks=64, dtype="bfloat16")
    assert llm.engine.runner.kv_cache.dtype == torch.bfloat16
    prompts = random_prompts(2, [9, 20], seed=9)
    outs = llm.generate(prompts, GREEDY)
    for p, o in zip(prompts, outs):
        with torch.no_grad():
            top5 = hf_model(torch.tensor([p])).logits[0, -1].topk(5).indices.tolist()
        assert o.token_ids[0] in top5  # bf16 rounding may reorder near-ties, not more
        assert len(o.token_ids) == GREEDY.max_tokens
    llm.engine.check_integrity()
