"""A client never chooses where a decode node connects (node/prefill_nodes.py)."""

import pytest

from pdserve.common.errors import InvalidRequestError
from pdserve.node.prefill_nodes import PARAM, PrefillNodes

A, B = "tcp://127.0.0.1:7001", "tcp://127.0.0.1:7002"


@pytest.mark.parametrize("asked", ["tcp://nohost:1", "ipc:///tmp/x", "tcp://10.0.0.1:7001", ""])
def test_unlisted_prefill_node_is_refused(asked):
    nodes = PrefillNodes.configured([A, B], "decode")
    with pytest.raises(InvalidRequestError) as e:
        nodes.choose(asked)
    assert e.value.param == PARAM


def test_listed_node_is_honoured_and_default_rotates():
    nodes = PrefillNodes.configured([B, A], "decode")
    assert nodes.choose(B) == B
    assert [nodes.choose(None) for _ in range(4)] == [A, B, A, B]


def test_source_is_consulted_per_request():
    live = {A}
    nodes = PrefillNodes(lambda: live, "decode")  # e.g. a cluster registry's view
    assert nodes.choose(A) == A
    live.discard(A)
    live.add(B)
    with pytest.raises(InvalidRequestError):
        nodes.choose(A)
    assert nodes.choose(None) == B


def test_other_roles_take_no_prefill_node():
    nodes = PrefillNodes.configured([], "colocated")
    assert nodes.choose(None) is None
    with pytest.raises(InvalidRequestError):
        nodes.choose(A)
