"""Hostile client values at the engine boundary: each is refused naming its field, and
anything that still fails while sampling one request fails that request alone."""

import math

import pytest
import torch

from pdserve.common.errors import InvalidRequestError
from pdserve.engine import LLM, SamplingParams
from pdserve.engine.request import Request
from pdserve.engine.sampler import sample
from tests.hf_reference import hf_greedy, load_hf

HOSTILE = [
    ("temperature", math.nan),
    ("temperature", math.inf),
    ("temperature", -0.5),
    ("temperature", 1e9),
    ("top_p", math.nan),
    ("top_p", 0.0),
    ("top_p", math.inf),
    ("min_p", math.nan),
    ("min_p", -math.inf),
    ("min_p", 1.5),
    ("top_k", 0),
    ("top_k", 2**63),
    ("top_k", 10**30),
    ("seed", 2**64),
    ("seed", -(2**63) - 1),
    ("max_tokens", 0),
    ("max_tokens", 2**63),
    ("stop_token_ids", [-1]),
    ("stop_token_ids", [2**40]),
    ("stop", [""]),
    ("stop", ["x"] * 65),
]


@pytest.mark.parametrize(("field", "value"), HOSTILE, ids=[f"{f}={v!r}"[:40] for f, v in HOSTILE])
def test_hostile_sampling_value_names_its_field(field, value):
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(**{field: value})
    assert e.value.param == field


def test_wire_extremes_are_accepted():
    p = SamplingParams(seed=-(2**63), top_k=2**31 - 1, max_tokens=2**31 - 1, temperature=0)
    assert p.torch_seed == 2**63 and p.greedy
    SamplingParams(seed=2**63 - 1)


def test_tiny_temperature_is_greedy_and_samples_without_nan():
    assert SamplingParams(temperature=1e-30).greedy
    logits = torch.tensor([[0.0, 50.0, -3.0, 49.9]])
    p = SamplingParams(temperature=1e-4)  # above the greedy cut, far below 1
    sampled, errors = sample(logits, [Request("r", [1], p, block_size=4)])
    assert errors == {} and sampled[0].token == 1


def test_one_bad_row_fails_alone():
    logits = torch.randn(3, 16)
    logits[1, 4] = math.nan
    params = [SamplingParams(temperature=1.0, seed=1) for _ in range(3)]
    reqs = [Request(f"r{i}", [1], p, block_size=4) for i, p in enumerate(params)]
    sampled, errors = sample(logits, reqs)
    assert set(errors) == {1} and "not finite" in errors[1]
    assert set(sampled) == {0, 2} and all(0 <= sampled[i].token < 16 for i in (0, 2))


def test_engine_survives_a_request_whose_sampling_fails(tiny_llama_dir):
    llm = LLM(tiny_llama_dir, block_size=4, num_blocks=64)
    hf = load_hf(tiny_llama_dir)
    core = llm.engine
    bad = SamplingParams(temperature=1.0, max_tokens=4)
    bad.temperature = math.nan  # what validation would refuse: reaches the sampler anyway
    good = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    core.add_request("bad", [5, 6, 7, 8, 9], bad)
    core.add_request("good", [5, 6, 7, 8, 10], good)
    outs: dict[str, list] = {}
    while core.has_unfinished:
        for o in core.step():
            outs.setdefault(o.request_id, []).append(o)
    assert outs["bad"][-1].finish_reason == "error" and "not finite" in outs["bad"][-1].error
    assert [t for o in outs["good"] for t in o.new_token_ids] == hf_greedy(hf, [5, 6, 7, 8, 10], 6)
    core.check_integrity()
    assert core.kv.pool.num_used_blocks == 0
    # and the engine keeps serving
    (out,) = llm.generate([[3, 4, 5]], good)
    assert out.token_ids == hf_greedy(hf, [3, 4, 5], 6)
