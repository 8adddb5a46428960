"""Authenticated control frames: an HMAC with the cluster secret, a timestamp and a nonce.

With a cluster secret configured, every control frame between nodes is sealed as

    MAGIC (4) | timestamp (8, float64 seconds) | nonce (16) | HMAC-SHA256 (32) | payload

where the HMAC covers magic, timestamp, nonce and payload. `open()` refuses (raises
`UnauthenticatedFrame`) a frame that is too short, has another magic, a wrong MAC (a
stranger without the secret, or a tampered frame), a timestamp further than `window_s`
from this host's clock (a stale replay; nodes need clocks within `window_s`), or a nonce
already seen within the window (a fresh replay). Refused frames are dropped unanswered:
a stranger learns nothing, and the node keeps serving. Without a secret (`secret=None`)
frames pass through unchanged, as before (fine on loopback, where only this host's users
reach the port).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import struct
import time
from collections import OrderedDict
from collections.abc import Callable

MAGIC = b"PDA1"
_HEAD = struct.Struct("!4sd16s")
_MAC_LEN = 32
MIN_SECRET_BYTES = 16


class UnauthenticatedFrame(ValueError):
    """A control frame that is not sealed by a holder of the cluster secret (or replayed)."""


class FrameAuth:
    def __init__(
        self,
        secret: bytes | None,
        *,
        window_s: float = 30.0,
        max_nonces: int = 1 << 16,
        clock: Callable[[], float] = time.time,
    ):
        if secret is not None and len(secret) < MIN_SECRET_BYTES:
            raise ValueError(f"the cluster secret must be at least {MIN_SECRET_BYTES} bytes")
        self._secret = secret
        self.window_s = window_s
        self.max_nonces = max_nonces
        self.clock = clock
        self._seen: OrderedDict[bytes, float] = OrderedDict()  # nonce -> timestamp

    @property
    def enabled(self) -> bool:
        return self._secret is not None

    def derive(self, label: bytes) -> bytes | None:
        """A 32-byte key for `label`, derived from the secret (None without one)."""
        if self._secret is None:
            return None
        return hmac.new(self._secret, b"pdserve key: " + label, hashlib.sha256).digest()

    def seal(self, payload: bytes) -> bytes:
        if self._secret is None:
            return payload
        head = _HEAD.pack(MAGIC, self.clock(), os.urandom(16))
        mac = hmac.new(self._secret, head + payload, hashlib.sha256).digest()
        return head + mac + payload

    def open(self, frame: bytes, fresh: bool = True) -> bytes:
        """The payload of an authentic, fresh frame; else raises `UnauthenticatedFrame`.
        `fresh=False` checks only the MAC (for messages whose own content makes a replay
        harmless, e.g. a `PrefillDone` naming an order's one-time nonce, or that arrive
        over a CurveZMQ session, and which may wait longer than the window before they
        are read)."""
        if self._secret is None:
            return frame
        if len(frame) < _HEAD.size + _MAC_LEN:
            raise UnauthenticatedFrame("frame too short to be sealed")
        head, mac = frame[: _HEAD.size], frame[_HEAD.size : _HEAD.size + _MAC_LEN]
        payload = frame[_HEAD.size + _MAC_LEN :]
        magic, ts, nonce = _HEAD.unpack(head)
        if magic != MAGIC:
            raise UnauthenticatedFrame("not a sealed frame")
        want = hmac.new(self._secret, head + payload, hashlib.sha256).digest()
        if not hmac.compare_digest(mac, want):
            raise UnauthenticatedFrame("bad MAC (wrong cluster secret or tampered frame)")
        if not fresh:
            return payload
        now = self.clock()
        if not abs(now - ts) <= self.window_s:  # also refuses NaN
            raise UnauthenticatedFrame(f"timestamp {now - ts:+.1f} s off (stale or replayed)")
        self._forget(now)
        if nonce in self._seen:
            raise UnauthenticatedFrame("replayed frame (nonce already seen)")
        self._seen[nonce] = ts
        if len(self._seen) > self.max_nonces:  # flood of fresh frames: keep the newest
            self._seen.popitem(last=False)
        return payload

    def _forget(self, now: float) -> None:
        # Nonces older than the window cannot be replayed anyway (the timestamp check).
        while self._seen:
            nonce, ts = next(iter(self._seen.items()))
            if now - ts <= self.window_s:
                break
            del self._seen[nonce]
