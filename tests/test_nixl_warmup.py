"""A new NIXL peer's connection warm-up (kv_transfer/nixl_warmup.py), on real NIXL pairs.

The peer runs in a child process (tests/test_nixl_transport.py's `Peer`); each test uses a
fresh, never-connected peer, as a prefill node meets a new decode node.
"""

from __future__ import annotations

import os
import signal
import time

import msgspec
import pytest
import torch

pytest.importorskip("nixl")

from pdserve.engine.sampling_params import SamplingParams  # noqa: E402
from pdserve.kv_transfer import messages as m  # noqa: E402
from pdserve.kv_transfer.base import NewOrder, RecvDone, RecvFailed  # noqa: E402
from pdserve.kv_transfer.kv_layout import storage_of  # noqa: E402
from pdserve.kv_transfer.nixl_connector import nixl_connector  # noqa: E402
from pdserve.kv_transfer.nixl_transport import NixlTransport, PeerMetadata, TransferState  # noqa: E402
from pdserve.kv_transfer.transfer_types import WarmupTimedOut  # noqa: E402
from tests.servers import free_port  # noqa: E402
from tests.test_nixl_transport import SENTINEL, SMALL, Cmd, Peer, _kv  # noqa: E402


def _drive(t: NixlTransport, limit_s: float) -> tuple[list[tuple[str, str | None]], float]:
    """Progress warm-ups as an engine loop does (every ms) until none is left."""
    t0 = time.monotonic()
    ended: list[tuple[str, str | None]] = []
    while t.num_warming and time.monotonic() - t0 < limit_s:
        ended += t.progress_warmups()
        time.sleep(1e-3)
    return ended, time.monotonic() - t0


def _span(t: torch.Tensor) -> tuple[int, int]:
    nbytes = t.untyped_storage().nbytes()
    return t.untyped_storage().data_ptr(), t.untyped_storage().data_ptr() + nbytes


@pytest.mark.parametrize("block_major", [False, True])
def test_scratch_region_never_aliases_the_kv_blocks(block_major):
    kv = _kv(SMALL, 0.0, block_major)
    with NixlTransport("local-scratch", kv, progress_thread=False) as t:
        md = msgspec.msgpack.decode(t.local_metadata(), type=PeerMetadata)
        lo, hi = _span(storage_of(kv))
        assert md.scratch_bytes == t.layout.block_bytes * 2 * t.layout.num_layers > 0
        s_lo, s_hi = md.scratch_addr, md.scratch_addr + md.scratch_bytes
        assert s_hi <= lo or s_lo >= hi, "the scratch region overlaps the KV tensor"


def test_warmup_connects_a_new_peer_and_the_first_write_lands_intact():
    peer = Peer("peer-warm", SMALL)
    try:
        torch.manual_seed(1)
        with NixlTransport("local-warm", _kv(SMALL), progress_thread=False) as t:
            name = t.add_peer(peer.metadata)
            assert t.num_warming == 1
            ended, _ = _drive(t, limit_s=60)
            assert ended == [(name, None)]
            assert t.num_warming == 0
            # The warm-up never touched a KV block of the peer, nor counts as a transfer.
            assert bool((peer.kv() == SENTINEL).all())
            assert t.stats.done == 0 and t.num_inflight == 0
            # The first real WRITE over the warmed connection: its bytes arrive intact.
            h = t.write_blocks(name, [3, 4, 9], [0, 1, 5], notif=b"first")
            assert t.wait(h, timeout_s=30) is TransferState.DONE
            t.release(h)
            reply = peer.request(Cmd("await_notif", timeout_s=30))
            assert b"first" in msgspec.msgpack.decode(reply)["notifs"]["local-warm"]
            got = peer.kv()
            for src, dst in ((3, 0), (4, 1), (9, 5)):
                assert torch.equal(got[:, :, dst], t._kv_cache[:, :, src])
            untouched = [b for b in range(SMALL[1]) if b not in (0, 1, 5)]
            assert bool((got[:, :, untouched] == SENTINEL).all())
            t.check_integrity()
    finally:
        peer.close()


def test_a_peer_that_dies_during_the_warmup_is_reported_within_its_deadline():
    victim = Peer("peer-dies", SMALL)
    os.kill(victim.proc.pid, signal.SIGSTOP)  # so the warm-up is still in flight when it dies
    try:
        with NixlTransport(
            "local-dies", _kv(SMALL), progress_thread=False, warmup_timeout_s=3.0
        ) as t:
            name = t.add_peer(victim.metadata, connect_s=0.0)
            victim.proc.kill()
            victim.proc.wait(timeout=10)
            ended, waited = _drive(t, limit_s=30)
            assert len(ended) == 1 and ended[0][0] == name and ended[0][1]
            assert waited < 3.0 + 15.0, waited  # failed (or timed out) by its deadline
            t.check_integrity()
    finally:
        if victim.proc.poll() is None:
            victim.proc.kill()


def test_a_silent_peer_warmup_is_waited_out_then_cancelled():
    """A peer that never answers (frozen: its wireup never completes) must not hang
    anything: the warm-up ends at its deadline, is cancelled, and close() returns."""
    silent = Peer("peer-silent", SMALL)
    os.kill(silent.proc.pid, signal.SIGSTOP)
    try:
        with NixlTransport(
            "local-silent", _kv(SMALL), progress_thread=False, warmup_timeout_s=1.0
        ) as t:
            t0 = time.monotonic()  # the warm-up's deadline starts inside add_peer
            name = t.add_peer(silent.metadata, connect_s=0.0)
            ended, _ = _drive(t, limit_s=30)
            waited = time.monotonic() - t0
            # It times out (UCX may, rarely, give up on the frozen peer first: also fine).
            assert len(ended) == 1 and ended[0][0] == name and ended[0][1], ended
            if isinstance(ended[0][1], WarmupTimedOut):  # not counted as a failed peer
                assert "did not finish in 1 s" in ended[0][1] and waited >= 1.0
            assert waited < 1.0 + 15.0, waited  # by its deadline, plus a loaded box's polls
            assert t.num_warming == 0
            t.check_integrity()
            t.remove_peer(name)
    finally:
        silent.proc.kill()
        silent.proc.wait(timeout=10)


# -- on the prefill side of the NIXL connector (real ZMQ control, real NIXL agents) ------


def _order(agent: str, rid: str) -> m.PrefillOrder:
    return m.PrefillOrder(
        request_id=rid,
        attempt=0,
        prompt_token_ids=list(range(1, 9)),  # 2 blocks of 4
        params=SamplingParams(max_tokens=1),
        decode_agent=agent,
        first_block=0,
        dst_block_ids=[5, 6],
        ttl_s=60.0,
    )


def _connector_kv(fill: float) -> torch.Tensor:
    return torch.full((2, 2, 16, 4, 2, 8), fill)  # layers, K/V, blocks, block, heads, dim


def _drive_sides(sides, seconds: float, until) -> list:
    events, end = [], time.monotonic() + seconds
    while time.monotonic() < end:
        for s in sides:
            events += s.poll()
        if until(events):
            break
        time.sleep(0.005)
    return events


def _pair(warmup_timeout_s: float):
    prefill = nixl_connector(
        node_id="p",
        role="prefill",
        control_address=f"tcp://127.0.0.1:{free_port()}",
        net_devices="lo",
        warmup_timeout_s=warmup_timeout_s,
    )
    prefill.register_kv_cache(_connector_kv(1.0))
    decode = nixl_connector(node_id="d", role="decode", net_devices="lo")
    decode.register_kv_cache(_connector_kv(0.0))
    return prefill, decode


def test_prefill_side_warms_a_new_decode_peer_up_and_its_blocks_land():
    prefill, decode = _pair(warmup_timeout_s=60.0)
    try:
        decode.request_prefill(_order(decode.local_name, "w1"), prefill.control_address)
        events = _drive_sides(
            [prefill, decode], 60, lambda ev: any(isinstance(e, NewOrder) for e in ev)
        )
        assert any(isinstance(e, NewOrder) for e in events)
        assert prefill.has_pending()  # the order, and the warm-up the hello started
        _drive_sides([prefill, decode], 60, lambda ev: prefill.data.num_warming == 0)
        assert prefill.data.num_warming == 0 and prefill.data.peers == [decode.local_name]
        prefill.finish(("w1", 0), [2, 3], 0, first_token=7, logprob=None)
        events = _drive_sides(
            [prefill, decode], 60, lambda ev: any(isinstance(e, RecvDone) for e in ev)
        )
        assert [e.first_token for e in events if isinstance(e, RecvDone)] == [7]
        dst = decode.data._kv_cache
        assert torch.all(dst[:, :, 5:7] == 1.0) and torch.all(dst[:, :, :5] == 0.0)
        assert torch.all(dst[:, :, 7:] == 0.0)  # nothing else of the KV was written
        prefill.check_integrity()
    finally:
        decode.close()
        prefill.close()


def test_prefill_side_keeps_a_peer_whose_warmup_only_timed_out():
    """The decode node's loop stalls past the warm-up deadline (its NIXL agent has no
    progress thread, so UCX's wireup with it cannot complete): the prefill node's warm-up
    is cancelled at its deadline, but a busy loop is not a dead peer: the peer stays, and
    once the decode loop runs again its orders' blocks land intact."""
    prefill, decode = _pair(warmup_timeout_s=1.0)
    try:
        decode.request_prefill(_order(decode.local_name, "s1"), prefill.control_address)
        # The decode side only flushes its control queue (the hello and the order go out)
        # and never progresses NIXL; the prefill side gets them, posts the warm-up and
        # waits it out.
        t0 = time.monotonic()
        events, end = [], t0 + 30
        while time.monotonic() < end:
            decode.control.tick(set())
            events += prefill.poll()
            if any(isinstance(e, NewOrder) for e in events) and prefill.data.num_warming == 0:
                break
            time.sleep(0.005)
        waited = time.monotonic() - t0
        assert any(isinstance(e, NewOrder) for e in events)
        assert prefill.data.num_warming == 0 and waited < 1.0 + 10.0
        assert prefill.data.peers == [decode.local_name]  # kept
        prefill.finish(("s1", 0), [2, 3], 0, first_token=7, logprob=None)
        events = _drive_sides(
            [prefill, decode], 60, lambda ev: any(isinstance(e, RecvDone) for e in ev)
        )
        assert [e.first_token for e in events if isinstance(e, RecvDone)] == [7]
        assert not any(isinstance(e, RecvFailed) for e in events)
        dst = decode.data._kv_cache
        assert torch.all(dst[:, :, 5:7] == 1.0) and torch.all(dst[:, :, :5] == 0.0)
        assert torch.all(dst[:, :, 7:] == 0.0)
        prefill.check_integrity()
    finally:
        decode.close()
        prefill.close()
