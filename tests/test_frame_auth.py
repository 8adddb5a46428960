"""Sealed control frames (kv_transfer/frame_auth.py): a stranger, a tampered frame and a
replay are all refused, whatever the hosts' clocks say; without a secret frames pass
unchanged."""

from __future__ import annotations

import time

import pytest

from pdserve.kv_transfer import messages as m
from pdserve.kv_transfer.frame_auth import FrameAuth, UnauthenticatedFrame

SECRET = b"0123456789abcdef-cluster"


def test_round_trip_and_every_refusal():
    sender, receiver = FrameAuth(SECRET), FrameAuth(SECRET)
    payload = m.encode(m.AbortPrefill(request_id="r1", attempt=0, ttl_s=60.0))
    frame = sender.seal(payload)
    assert frame != payload and receiver.open(frame) == payload
    with pytest.raises(UnauthenticatedFrame, match="replayed"):
        receiver.open(frame)  # the same frame again
    with pytest.raises(UnauthenticatedFrame, match="bad MAC"):
        receiver.open(FrameAuth(b"another secret, 16+ bytes").seal(payload))
    tampered = bytearray(sender.seal(payload))
    tampered[-1] ^= 1
    with pytest.raises(UnauthenticatedFrame, match="bad MAC"):
        receiver.open(bytes(tampered))
    with pytest.raises(UnauthenticatedFrame, match="not a sealed frame|too short"):
        receiver.open(payload)  # an unsigned message
    with pytest.raises(UnauthenticatedFrame, match="too short"):
        receiver.open(b"")
    assert receiver.open(sender.seal(payload)) == payload  # fresh frames still pass


def test_out_of_order_inside_the_window_passes_once_and_far_behind_is_refused():
    sender, receiver = FrameAuth(SECRET, window=8), FrameAuth(SECRET, window=8)
    frames = [sender.seal(b"%d" % i) for i in range(30)]
    receiver.open(frames[0])
    receiver.open(frames[5])
    assert receiver.open(frames[3]) == b"3"  # late but inside the window: taken once
    with pytest.raises(UnauthenticatedFrame, match="already seen"):
        receiver.open(frames[3])
    for f in frames[6:30]:
        receiver.open(f)
    with pytest.raises(UnauthenticatedFrame, match="behind the window"):
        receiver.open(frames[4])  # never seen, but 25 frames behind: a replay of an old one
    assert len(receiver._sessions[sender.session].seen) <= 2 * 8


def test_no_wall_clock_is_compared(monkeypatch):
    """A frame sealed on a host whose wall clock is a day off (or the receiver's) passes:
    the seal carries no timestamp at all."""
    sender = FrameAuth(SECRET)
    frame = sender.seal(b"order")
    real = time.time
    monkeypatch.setattr(time, "time", lambda: real() + 86400.0)
    assert FrameAuth(SECRET).open(frame) == b"order"
    assert FrameAuth(SECRET).open(FrameAuth(SECRET).seal(b"x")) == b"x"


def test_session_table_is_bounded():
    receiver = FrameAuth(SECRET, max_sessions=8)
    for _ in range(20):
        receiver.open(FrameAuth(SECRET).seal(b"x"))
    assert len(receiver._sessions) == 8


def test_no_secret_passes_through_and_short_secret_is_refused():
    plain = FrameAuth(None)
    assert not plain.enabled and plain.seal(b"abc") == b"abc" and plain.open(b"abc") == b"abc"
    with pytest.raises(ValueError, match="16 bytes"):
        FrameAuth(b"short")
