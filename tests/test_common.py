"""The shared floor's small contracts: the token-id check and the Redis key layout."""

from __future__ import annotations

import pytest

from pdserve.common.errors import InvalidRequestError
from pdserve.common.redis_keys import ClusterKeys
from pdserve.common.request_cost import CostLimits, CostMeter
from pdserve.common.sampling_rules import check_token_ids


def test_check_token_ids_names_the_field_and_the_first_bad_id():
    check_token_ids([0, 5, 9], 10, "prompt")
    for ids, bad in (([1, 10, 11], 10), ([3, -1], -1)):
        with pytest.raises(
            InvalidRequestError, match=rf"token id {bad} is outside .*\[0, 10\)"
        ) as e:
            check_token_ids(ids, 10, "logit_bias")
        assert e.value.param == "logit_bias"


def test_check_token_ids_is_skipped_without_a_vocabulary():
    check_token_ids([10**9], None, "prompt")  # the router before any node reported one


def test_redis_key_layout():
    """The layout nodes, routers and tools of different versions share: never change it
    without a migration."""
    k = ClusterKeys()
    assert k.nodes == "pdserve:nodes"
    assert k.node("n1") == "pdserve:node:n1"
    assert k.kv("n1", 7) == "pdserve:kv:n1:7"
    assert k.kv_store("s") == "pdserve:kv:store:s"
    assert k.launcher == "pdserve:launcher"
    assert (k.node_pattern, k.kv_pattern) == ("pdserve:node:*", "pdserve:kv:*")
    assert ClusterKeys("c2").node("x") == "c2:node:x"
    with pytest.raises(ValueError, match="without whitespace"):
        ClusterKeys("a b")


def test_cost_meter_charges_every_sequence_and_names_each_limit():
    """Issue 29 item 1: sequences (prompts x n), prompt tokens x n, and logprob entries
    (echoed prompt tokens and max_tokens, x (logprobs + 1), per sequence)."""
    limits = CostLimits(8, 1000, 5000)
    with pytest.raises(InvalidRequestError, match="max_sequences_per_request=8"):
        CostMeter(limits, num_prompts=3, n=3, alternatives=None, echo=False, max_tokens=1)
    m = CostMeter(limits, num_prompts=2, n=4, alternatives=None, echo=False, max_tokens=1)
    m.add_prompt(125)  # x n=4: 500
    with pytest.raises(InvalidRequestError, match="max_sequence_tokens_per_request=1000"):
        m.add_prompt(126)  # 504 more
    m = CostMeter(limits, num_prompts=1, n=2, alternatives=4, echo=True, max_tokens=100)
    assert m.entries == 2 * 100 * 5
    with pytest.raises(InvalidRequestError, match="max_logprob_entries_per_request=5000"):
        m.add_prompt(401)  # 2 x 401 x 5 more
    with pytest.raises(InvalidRequestError, match="max_logprob_entries_per_request"):
        CostMeter(limits, num_prompts=1, n=1, alternatives=20, echo=False, max_tokens=300)
