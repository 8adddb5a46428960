"""Sealed control frames (kv_transfer/frame_auth.py): a stranger, a tampered frame, a
replay and a stale frame are all refused; without a secret frames pass unchanged."""

from __future__ import annotations

import pytest

from pdserve.kv_transfer import messages as m
from pdserve.kv_transfer.frame_auth import FrameAuth, UnauthenticatedFrame

SECRET = b"0123456789abcdef-cluster"


class Clock:
    def __init__(self, t: float = 1000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


def test_round_trip_and_every_refusal():
    clock = Clock()
    sender, receiver = FrameAuth(SECRET, clock=clock), FrameAuth(SECRET, clock=clock)
    payload = m.encode(m.AbortPrefill(request_id="r1", attempt=0, ttl_s=60.0))
    frame = sender.seal(payload)
    assert frame != payload and receiver.open(frame) == payload
    with pytest.raises(UnauthenticatedFrame, match="replayed"):
        receiver.open(frame)  # the same frame again, inside the window
    with pytest.raises(UnauthenticatedFrame, match="bad MAC"):
        receiver.open(FrameAuth(b"another secret, 16+ bytes", clock=clock).seal(payload))
    tampered = bytearray(sender.seal(payload))
    tampered[-1] ^= 1
    with pytest.raises(UnauthenticatedFrame, match="bad MAC"):
        receiver.open(bytes(tampered))
    with pytest.raises(UnauthenticatedFrame, match="not a sealed frame|too short"):
        receiver.open(payload)  # an unsigned message
    with pytest.raises(UnauthenticatedFrame, match="too short"):
        receiver.open(b"")
    old = sender.seal(payload)
    clock.t += 31  # past the 30 s window: a stale replay
    with pytest.raises(UnauthenticatedFrame, match="stale"):
        receiver.open(old)
    assert receiver.open(sender.seal(payload)) == payload  # fresh frames still pass


def test_nonce_memory_is_bounded():
    clock = Clock()
    sender = FrameAuth(SECRET, clock=clock)
    receiver = FrameAuth(SECRET, clock=clock, max_nonces=8)
    for _ in range(20):
        receiver.open(sender.seal(b"x"))
    assert len(receiver._seen) <= 8
    clock.t += 60
    receiver.open(sender.seal(b"y"))
    assert len(receiver._seen) == 1  # nonces past the window are forgotten


def test_no_secret_passes_through_and_short_secret_is_refused():
    plain = FrameAuth(None)
    assert not plain.enabled and plain.seal(b"abc") == b"abc" and plain.open(b"abc") == b"abc"
    with pytest.raises(ValueError, match="16 bytes"):
        FrameAuth(b"short")
