"""The shared floor's small contracts: the token-id check and the Redis key layout."""

from __future__ import annotations

import pytest

from pdserve.common.errors import InvalidRequestError
from pdserve.common.redis_keys import ClusterKeys
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
