"""The decode node's check of what a prefill node returns in `PrefillDone`: the first
token in the vocabulary, and logprobs whose counts, tokens and values answer its own
order exactly."""

from __future__ import annotations

import math

import msgspec
import pytest

from pdserve.engine.outputs import TokenLogprobs
from pdserve.engine.sampling_params import SamplingParams
from pdserve.kv_transfer import messages as m
from pdserve.kv_transfer.done_check import done_problem

PROMPT = [5, 6, 7, 8]
VOCAB = 200


def order(**params) -> m.PrefillOrder:
    return m.PrefillOrder(
        request_id="r", attempt=1, prompt_token_ids=PROMPT,
        params=SamplingParams(max_tokens=1, **params), decode_agent="d", first_block=0,
        dst_block_ids=[0], ttl_s=60.0,
    )  # fmt: skip


def done(**kw) -> m.PrefillDone:
    return m.PrefillDone(request_id="r", attempt=1, first_token=9, num_blocks=1, **kw)


def plp(k: int) -> list[TokenLogprobs]:
    return [TokenLogprobs([t, *range(100, 100 + k)], [-1.0] * (k + 1)) for t in PROMPT[1:]]


def test_what_was_asked_passes_and_survives_the_wire():
    o = order(logprobs=True, top_logprobs=2, prompt_logprobs=2)
    d = done(logprob=-0.5, top=TokenLogprobs([9, 1, 2], [-0.5, -1.0, -2.0]), prompt_logprobs=plp(2))
    assert done_problem(o, m.decode_to_decode(m.encode(d)), VOCAB) is None
    assert done_problem(order(), done(logprob=None), VOCAB) is None


@pytest.mark.parametrize(
    "params, kw, problem",
    [
        ({}, {"prompt_logprobs": plp(0)}, "not asked"),
        ({}, {"top": TokenLogprobs([9], [-1.0])}, "not asked"),
        ({"logprobs": True, "top_logprobs": 2}, {"logprob": -1.0}, "none returned"),
        ({"logprobs": True, "top_logprobs": 1}, {"logprob": -1.0, "top": TokenLogprobs([9, 1, 2], [-1.0] * 3)}, "expected"),
        ({"logprobs": True, "top_logprobs": 1}, {"logprob": -1.0, "top": TokenLogprobs([3, 1], [-1.0] * 2)}, "not 9"),
        ({"logprobs": True, "top_logprobs": 1}, {"logprob": -0.1, "top": TokenLogprobs([9, 1], [-1.0] * 2)}, "differs"),
        ({"prompt_logprobs": 0}, {}, "none prompt logprobs"),
        ({"prompt_logprobs": 0}, {"prompt_logprobs": plp(0)[:2]}, "2 prompt logprobs"),
        ({"prompt_logprobs": 0}, {"prompt_logprobs": plp(0) * 1000}, "3000 prompt logprobs"),
        ({"prompt_logprobs": 1}, {"prompt_logprobs": plp(0)}, "expected"),
        ({"prompt_logprobs": 0}, {"prompt_logprobs": plp(0)[::-1]}, "not 6"),
        ({"prompt_logprobs": 0}, {"prompt_logprobs": [TokenLogprobs([t], [math.nan]) for t in PROMPT[1:]]}, "log-probability"),
        ({"prompt_logprobs": 0}, {"prompt_logprobs": [TokenLogprobs([t], [3.0]) for t in PROMPT[1:]]}, "log-probability"),
        ({"prompt_logprobs": 1}, {"prompt_logprobs": [TokenLogprobs([t, -4], [-1.0, -2.0]) for t in PROMPT[1:]]}, "outside the vocabulary"),
        ({"logprobs": True, "top_logprobs": 1}, {"logprob": -1.0, "top": TokenLogprobs([9, 200], [-1.0] * 2)}, "outside the vocabulary"),
        ({}, {"first_token": 2**40}, "first token 1099511627776 outside the vocabulary"),
        ({}, {"first_token": -1}, "first token -1 outside"),
        ({}, {"first_token": 200}, "first token 200 outside"),
        ({}, {"logprob": math.inf}, "not a log-probability"),
        ({}, {"logprob": 5.0}, "not a log-probability"),
    ],
)  # fmt: skip
def test_anything_else_is_a_problem(params, kw, problem):
    kw.setdefault("logprob", None)
    d = msgspec.structs.replace(done(logprob=None), **kw)
    assert problem in (done_problem(order(**params), d, VOCAB) or "")


def test_block_checksums_answer_the_order_exactly():
    """Asked: one unsigned 64-bit checksum per written block; not asked: none."""
    asked = msgspec.structs.replace(order(), checksums=True)
    assert done_problem(asked, m.decode_to_decode(m.encode(done(logprob=None, checksums=[2**64 - 1]))), VOCAB) is None  # fmt: skip
    for sums, problem in [
        (None, "no block checksums"),
        ([1, 2], "2 block checksums for 1 blocks"),
        ([-1], "64-bit"),
        ([2**64], "64-bit"),
    ]:
        assert problem in done_problem(asked, done(logprob=None, checksums=sums), VOCAB)
    assert "not asked" in done_problem(order(), done(logprob=None, checksums=[1]), VOCAB)
