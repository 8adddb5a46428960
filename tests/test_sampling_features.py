"""Penalties, logit_bias, min_tokens and logprobs of the offline engine against transformers,
with the real SmolLM2 (fp32): greedy with each penalty equals `generate` with the matching
logits processor; prompt logprobs equal transformers' log-softmax within 1e-4.
"""

from __future__ import annotations

import pytest
import torch
from transformers import LogitsProcessor, LogitsProcessorList

from pdserve.engine import LLM, SamplingParams
from tests.hf_reference import load_hf

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m-instruct"
PROMPT = "A list of fruits: apple, apple, apple,"
N = 16


@pytest.fixture(scope="module")
def llm():
    return LLM(MODEL, kv_cache_bytes=64 << 20, num_threads=1)


@pytest.fixture(scope="module")
def hf(llm):
    return load_hf(llm.engine.model_dir)


@pytest.fixture(scope="module")
def prompt_ids(llm) -> list[int]:
    return llm.tokenizer.encode(PROMPT, add_special_tokens=False)


class OpenAIPenalties(LogitsProcessor):
    """Reference for OpenAI's frequency/presence penalties (over generated tokens only)."""

    def __init__(self, prompt_len: int, frequency: float, presence: float):
        self.prompt_len, self.frequency, self.presence = prompt_len, frequency, presence

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        for b in range(scores.shape[0]):
            counts = torch.bincount(input_ids[b, self.prompt_len :], minlength=scores.shape[1])
            counts = counts[: scores.shape[1]].to(scores.dtype)
            scores[b] -= counts * self.frequency + (counts > 0).to(scores.dtype) * self.presence
        return scores


def hf_generate(hf, ids: list[int], max_new: int, **kwargs) -> list[int]:
    x = torch.tensor([ids])
    kwargs.setdefault("eos_token_id", None)
    if kwargs["eos_token_id"] is None:
        kwargs.setdefault("min_new_tokens", max_new)
    with torch.no_grad():
        out = hf.generate(
            x, attention_mask=torch.ones_like(x), max_new_tokens=max_new, do_sample=False,
            pad_token_id=0, **kwargs,
        )  # fmt: skip
    return out[0, len(ids) :].tolist()


def greedy(llm, ids, **kw) -> list[int]:
    params = SamplingParams(temperature=0, max_tokens=N, ignore_eos=True, **kw)
    return llm.generate([ids], params)[0].token_ids


def test_plain_greedy_repeats_so_penalties_matter(llm, hf, prompt_ids):
    plain = greedy(llm, prompt_ids)
    assert plain == hf_generate(hf, prompt_ids, N)
    # each penalty below changes this output (otherwise the comparisons prove little)
    assert plain != greedy(llm, prompt_ids, repetition_penalty=1.5)
    assert plain != greedy(llm, prompt_ids, frequency_penalty=1.5)
    assert plain != greedy(llm, prompt_ids, presence_penalty=2.0)


@pytest.mark.parametrize("penalty", [1.5, 0.7])
def test_repetition_penalty_equals_transformers(llm, hf, prompt_ids, penalty):
    ours = greedy(llm, prompt_ids, repetition_penalty=penalty)
    assert ours == hf_generate(hf, prompt_ids, N, repetition_penalty=penalty)


@pytest.mark.parametrize("freq,pres", [(1.5, 0.0), (0.0, 2.0), (0.6, 0.9), (-0.5, 0.0)])
def test_frequency_presence_penalties_equal_reference(llm, hf, prompt_ids, freq, pres):
    ours = greedy(llm, prompt_ids, frequency_penalty=freq, presence_penalty=pres)
    proc = LogitsProcessorList([OpenAIPenalties(len(prompt_ids), freq, pres)])
    assert ours == hf_generate(hf, prompt_ids, N, logits_processor=proc)


def test_logit_bias_equals_sequence_bias(llm, hf, prompt_ids):
    plain = greedy(llm, prompt_ids)
    bias = {plain[0]: -5.0, plain[1]: -3.0, 1000: 4.0}
    ours = greedy(llm, prompt_ids, logit_bias=bias)
    assert ours != plain
    ref = hf_generate(hf, prompt_ids, N, sequence_bias={(t,): b for t, b in bias.items()})
    assert ours == ref


def test_logit_bias_100_forces_a_token(llm, prompt_ids):
    tok = llm.tokenizer.encode(" banana", add_special_tokens=False)[0]
    for params in (
        SamplingParams(temperature=0, max_tokens=5, logit_bias={tok: 100.0}),
        SamplingParams(temperature=1.0, seed=3, max_tokens=5, logit_bias={tok: 100.0}),
    ):
        assert llm.generate([prompt_ids], params)[0].token_ids == [tok] * 5


def test_min_tokens_equals_min_new_tokens(llm, hf):
    chat = [{"role": "user", "content": "What is 2+2? Answer with a number only."}]
    ids = llm.tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    ids = llm.tokenizer.encode(ids, add_special_tokens=False)
    eos = sorted(llm.engine.eos_token_ids)
    short = llm.generate([ids], SamplingParams(temperature=0, max_tokens=30))[0]
    assert short.finish_reason == "stop" and len(short.token_ids) < 10
    params = SamplingParams(temperature=0, max_tokens=30, min_tokens=15)
    out = llm.generate([ids], params)[0]
    assert len(out.token_ids) >= 15
    ref = hf_generate(hf, ids, 30, eos_token_id=eos, min_new_tokens=15)
    assert out.token_ids == ref[: len(out.token_ids)] and len(ref) == len(out.token_ids)


def test_stop_token_ids(llm, prompt_ids):
    plain = greedy(llm, prompt_ids)
    params = SamplingParams(temperature=0, max_tokens=N, stop_token_ids=[plain[3]])
    out = llm.generate([prompt_ids], params)[0]
    assert out.token_ids == plain[: plain.index(plain[3]) + 1]
    assert out.finish_reason == "stop"


def test_prompt_logprobs_equal_transformers_log_softmax(llm, hf, prompt_ids):
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=5)
    out = llm.generate([prompt_ids], params)[0]
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([prompt_ids])).logits[0].float(), dim=-1)
    assert len(out.prompt_logprobs) == len(prompt_ids) - 1
    for j, entry in enumerate(out.prompt_logprobs):
        assert entry.token_ids[0] == prompt_ids[j + 1]
        assert abs(entry.logprobs[0] - ref[j, prompt_ids[j + 1]].item()) < 1e-4
        top = ref[j].topk(5)
        assert entry.token_ids[1:] == top.indices.tolist()
        assert max(abs(a - b) for a, b in zip(entry.logprobs[1:], top.values.tolist())) < 1e-4


def test_prompt_logprobs_chunked_and_beside_a_cached_prefix(llm, hf, prompt_ids):
    chunked = LLM(MODEL, kv_cache_bytes=64 << 20, num_threads=1, max_num_batched_tokens=5)
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    llm.generate([prompt_ids], SamplingParams(temperature=0, max_tokens=1))  # cache it
    whole = llm.generate([prompt_ids], params)[0]
    cut = chunked.generate([prompt_ids], params)[0]
    assert [e.token_ids for e in cut.prompt_logprobs] == [[t] for t in prompt_ids[1:]]
    diffs = [
        abs(a.logprobs[0] - b.logprobs[0])
        for a, b in zip(whole.prompt_logprobs, cut.prompt_logprobs)
    ]
    assert len(whole.prompt_logprobs) == len(prompt_ids) - 1 and max(diffs) < 1e-4
    llm.engine.check_integrity()


def test_sampled_logprobs_and_top_logprobs_equal_transformers(llm, hf, prompt_ids):
    params = SamplingParams(
        temperature=0, max_tokens=6, ignore_eos=True, logprobs=True, top_logprobs=20
    )
    out = llm.generate([prompt_ids], params)[0]
    with torch.no_grad():
        full = torch.tensor([prompt_ids + out.token_ids[:-1]])
        ref = torch.log_softmax(hf(full).logits[0, len(prompt_ids) - 1 :].float(), dim=-1)
    for j, (tok, lp, top) in enumerate(zip(out.token_ids, out.logprobs, out.top_logprobs)):
        assert abs(lp - ref[j, tok].item()) < 1e-4
        want = ref[j].topk(20)
        assert top.token_ids[0] == tok and top.token_ids[1:] == want.indices.tolist()
        assert max(abs(a - b) for a, b in zip(top.logprobs[1:], want.values.tolist())) < 1e-4
