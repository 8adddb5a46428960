"""Seeded sampling is a function of (seed, token position): a request resumed from its
prompt plus a generated prefix (what the router's migration sends) draws exactly the
tokens of the run it continues, for every choice seed of `n`, alone or in a batch."""

from __future__ import annotations

import pytest

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.request import position_seed
from tests.test_engine import random_prompts

N = 12


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return LLM(tiny_llama_dir, block_size=4, num_blocks=128)


def sampled(seed: int, max_tokens: int = N) -> SamplingParams:
    return SamplingParams(temperature=1.0, top_p=0.95, seed=seed, max_tokens=max_tokens,
                          ignore_eos=True)  # fmt: skip


def test_resumed_seeded_run_draws_the_same_tokens(llm):
    prompt = random_prompts(1, [9], seed=11)[0]
    for seed in (7, 8, -3):  # 8: choice 1 of n with seed 7 (the node's seed + i)
        full = llm.generate([prompt], sampled(seed))[0].token_ids
        assert len(full) == N
        for p in (1, 5, N - 1):
            rest = llm.generate([prompt + full[:p]], sampled(seed, N - p))[0].token_ids
            assert rest == full[p:], f"seed {seed}, resumed at {p}"
    # a resumed request batched with others (and a different batch shape) draws the same
    full = llm.generate([prompt], sampled(7))[0].token_ids
    others = random_prompts(3, [5, 13, 4], seed=12)
    outs = llm.generate([*others, prompt + full[:4]], [sampled(1)] * 3 + [sampled(7, N - 4)])
    assert outs[-1].token_ids == full[4:]
    llm.engine.check_integrity()


def test_seeds_differ_by_position_and_seed():
    seeds = {position_seed(s, p) for s in range(4) for p in range(4)}
    assert len(seeds) == 16  # s + 1 at p never replays s at p + 1
    assert all(0 <= x < 2**64 for x in seeds)
    # the unfailed stream is not the step-count stream: two seeds differ in their draws
    assert position_seed(7, 10) != position_seed(7, 11)
