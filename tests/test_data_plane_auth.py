"""Who may make a node's NIXL data plane act: only holders of the cluster secret.

Real NIXL agents (UCX on loopback) and real ZMQ control sockets, with a cluster secret:

* a stranger (no secret, or a wrong one) that sends its real NIXL agent metadata and an
  order to a prefill node (it gets no CurveZMQ connection; and a frame that got through
  would still fail the MAC) never gets that metadata loaded (so the prefill node never
  WRITEs to it) nor the order seen by the engine; a decode node with the secret does,
  and its blocks arrive intact with a sealed `PrefillDone`;
* a decode node ignores a `PrefillDone` data-plane notification that is not sealed with
  the secret, even one from an agent that knows its metadata and the order's nonce (what
  a sniffer of the unencrypted control channel could learn).
"""

from __future__ import annotations

import time

import pytest
import torch

from pdserve.engine.sampling_params import SamplingParams
from pdserve.kv_transfer import messages as m
from pdserve.kv_transfer.base import NewOrder, RecvDone, RecvFailed, Released
from pdserve.kv_transfer.frame_auth import FrameAuth
from pdserve.kv_transfer.nixl_connector import nixl_connector
from tests.servers import free_port

pytest.importorskip("nixl")

SECRET = b"data-plane-test-secret-0123456789"
BLOCK = 4


def kv(fill: float) -> torch.Tensor:
    return torch.full((2, 2, 16, BLOCK, 2, 8), fill)  # layers, K/V, blocks, block, heads, dim


def order(agent: str, rid: str = "r1") -> m.PrefillOrder:
    return m.PrefillOrder(
        request_id=rid,
        attempt=0,
        prompt_token_ids=list(range(1, 9)),  # 2 blocks
        params=SamplingParams(max_tokens=1),
        decode_agent=agent,
        first_block=0,
        dst_block_ids=[5, 6],
        ttl_s=60.0,
    )


@pytest.fixture
def prefill():
    side = nixl_connector(
        node_id="p",
        role="prefill",
        control_address=f"tcp://127.0.0.1:{free_port()}",
        cluster_secret=SECRET,
        net_devices="lo",
    )
    side.register_kv_cache(kv(1.0))
    yield side
    side.close()


def decode_side(secret: bytes | None):
    side = nixl_connector(node_id="d", role="decode", cluster_secret=secret, net_devices="lo")
    side.register_kv_cache(kv(0.0))
    return side


def drive(sides, seconds: float, until=None) -> list:
    """Poll every side for up to `seconds` (or until `until(events)`); all events seen."""
    events, end = [], time.monotonic() + seconds
    while time.monotonic() < end:
        for s in sides:
            events += s.poll()
        if until is not None and until(events):
            break
        time.sleep(0.01)
    return events


@pytest.mark.parametrize("stranger_secret", [None, b"another secret, 16+ bytes long"])
def test_stranger_metadata_is_never_loaded(prefill, stranger_secret):
    stranger = decode_side(stranger_secret)  # a real NIXL agent with real metadata
    try:
        stranger.request_prefill(order(stranger.local_name), prefill.control_address)
        events = drive([prefill, stranger], 3.0)
        assert not any(isinstance(e, NewOrder) for e in events)
        assert prefill.data.peers == []  # its metadata was never loaded
    finally:
        stranger.close()

    legit = decode_side(SECRET)
    try:
        legit.request_prefill(order(legit.local_name), prefill.control_address)
        events = drive([prefill, legit], 60.0, lambda ev: any(isinstance(e, NewOrder) for e in ev))
        assert [e.key for e in events if isinstance(e, NewOrder)] == [("r1", 0)]
        assert prefill.data.peers == [legit.local_name]
        # the prefill side pushes its blocks 2, 3 into the ordered blocks 5, 6
        prefill.finish(("r1", 0), [2, 3], 0, first_token=7, logprob=None)
        events = drive([prefill, legit], 60.0, lambda ev: any(isinstance(e, RecvDone) for e in ev))
        done = [e for e in events if isinstance(e, RecvDone)]
        assert len(done) == 1 and done[0].first_token == 7 and done[0].num_blocks == 2
        dst = legit.data._kv_cache
        assert torch.all(dst[:, :, 5:7] == 1.0) and torch.all(dst[:, :, :5] == 0.0)
    finally:
        legit.close()


def test_unsealed_prefill_done_is_ignored(prefill):
    decode = decode_side(SECRET)
    sniffer = decode_side(None)  # an agent that learned decode's metadata and the nonce
    try:
        decode.request_prefill(order(decode.local_name, "r2"), prefill.control_address)
        events = drive([prefill, decode], 60.0, lambda ev: any(isinstance(e, NewOrder) for e in ev))
        assert any(isinstance(e, NewOrder) for e in events)
        nonce = decode._attempts[("r2", 0)].order.nonce
        sniffer.data.add_peer(decode.data.local_metadata())
        forged = m.PrefillDone(
            request_id="r2", attempt=0, first_token=1, logprob=None, num_blocks=2, nonce=nonce
        )
        wrong = FrameAuth(b"another secret, 16+ bytes long")
        for payload in (m.encode(forged), wrong.seal(m.encode(forged))):
            sniffer.data.send_notif(decode.local_name, payload)
        events = drive([decode, sniffer], 3.0)
        assert not any(isinstance(e, RecvDone) for e in events)
        assert ("r2", 0) in decode._attempts  # still waiting for the real prefill node
        # the real one, sealed, is accepted
        prefill.finish(("r2", 0), [2, 3], 0, first_token=9, logprob=None)
        events = drive([prefill, decode], 60.0, lambda ev: any(isinstance(e, RecvDone) for e in ev))
        assert [e.first_token for e in events if isinstance(e, RecvDone)] == [9]
    finally:
        sniffer.close()
        decode.close()


def test_nixl_metadata_side_channel_is_off(prefill):
    """NIXL can listen for metadata on its own socket (`enable_listen_thread`); pdserve
    never turns it on: metadata arrives only inside sealed control frames."""
    assert prefill.data._agent_config.enable_listen is False


@pytest.mark.parametrize("first_token", [2**40, -1])
def test_out_of_vocabulary_first_token_fails_the_attempt_over(prefill, first_token, caplog):
    """Issue 29 item 2: a prefill node holding the secret (a broken or hostile one) that
    pushes every block and a sealed `PrefillDone` whose `first_token` lies outside the
    vocabulary: the attempt fails (the request fails over) and its blocks are released,
    with a count and a log line naming the peer; the token never reaches the engine."""
    decode = decode_side(SECRET)
    decode.vocab_size = 1000
    try:
        decode.request_prefill(order(decode.local_name, "r3"), prefill.control_address)
        events = drive([prefill, decode], 60.0, lambda ev: any(isinstance(e, NewOrder) for e in ev))
        assert any(isinstance(e, NewOrder) for e in events)
        prefill.finish(("r3", 0), [2, 3], 0, first_token=first_token, logprob=None)
        events = drive([prefill, decode], 60.0, lambda ev: any(isinstance(e, Released) for e in ev))
        assert not any(isinstance(e, RecvDone) for e in events)
        (failed,) = [e for e in events if isinstance(e, RecvFailed)]
        assert f"first token {first_token} outside the vocabulary [0, 1000)" in failed.reason
        assert [e.key for e in events if isinstance(e, Released)] == [("r3", 0)]
        assert decode.num_bad_dones == 1 and ("r3", 0) not in decode._attempts
        assert f"bad done from prefill node {prefill.control_address}" in caplog.text
    finally:
        decode.close()
