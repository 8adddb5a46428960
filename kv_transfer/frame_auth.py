"""Authenticated control frames: an HMAC with the cluster secret, a sender session and a counter.

With a cluster secret configured, every control frame between nodes is sealed as

    MAGIC (4) | session (16) | counter (8, uint64) | HMAC-SHA256 (32) | payload

where the HMAC covers magic, session, counter and payload. The session is drawn at random
when the sealing `FrameAuth` is made (once per process side) and the counter rises by one
per sealed frame. `open()` refuses (raises `UnauthenticatedFrame`) a frame that is too
short, has another magic, a wrong MAC (a stranger without the secret, or a tampered frame),
or repeats a (session, counter) already accepted: a frame is taken once if its counter is
above the highest seen from its session or within the `window` below it (frames sealed on
several threads may arrive a little out of order) and not yet seen; one further behind is
refused as replayed. No timestamp is compared with this host's clock: two hosts' wall
clocks never meet (issue 27), and old frames cannot be replayed into a new connection
anyway, since the control channel is a CurveZMQ session with its own ephemeral keys. The
table of sessions is bounded (least recently used out). Refused frames are dropped
unanswered: a stranger learns nothing, and the node keeps serving. Without a secret
(`secret=None`) frames pass through unchanged, as before (fine on loopback, where only
this host's users reach the port).
"""

from __future__ import annotations

import hashlib
import hmac
import itertools
import os
import struct
import threading
from collections import OrderedDict

MAGIC = b"PDA2"
_HEAD = struct.Struct("!4s16sQ")
_MAC_LEN = 32
MIN_SECRET_BYTES = 16


class _Session:
    __slots__ = ("top", "seen")

    def __init__(self, counter: int):
        self.top = counter
        self.seen = {counter}


class UnauthenticatedFrame(ValueError):
    """A control frame that is not sealed by a holder of the cluster secret (or replayed)."""


class FrameAuth:
    def __init__(self, secret: bytes | None, *, window: int = 4096, max_sessions: int = 1 << 14):
        if secret is not None and len(secret) < MIN_SECRET_BYTES:
            raise ValueError(f"the cluster secret must be at least {MIN_SECRET_BYTES} bytes")
        self._secret = secret
        self.window = window
        self.max_sessions = max_sessions
        self.session = os.urandom(16)
        self._counter = itertools.count(1)
        self._sessions: OrderedDict[bytes, _Session] = OrderedDict()
        self._lock = threading.Lock()  # open() may run on a pump thread and the loop

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
        head = _HEAD.pack(MAGIC, self.session, next(self._counter))
        mac = hmac.new(self._secret, head + payload, hashlib.sha256).digest()
        return head + mac + payload

    def open(self, frame: bytes, fresh: bool = True) -> bytes:
        """The payload of an authentic frame not accepted before; else raises
        `UnauthenticatedFrame`. `fresh=False` checks only the MAC (for messages whose own
        content makes a replay harmless, e.g. a `PrefillDone` naming an order's one-time
        nonce)."""
        if self._secret is None:
            return frame
        if len(frame) < _HEAD.size + _MAC_LEN:
            raise UnauthenticatedFrame("frame too short to be sealed")
        head, mac = frame[: _HEAD.size], frame[_HEAD.size : _HEAD.size + _MAC_LEN]
        payload = frame[_HEAD.size + _MAC_LEN :]
        magic, session, counter = _HEAD.unpack(head)
        if magic != MAGIC:
            raise UnauthenticatedFrame("not a sealed frame")
        want = hmac.new(self._secret, head + payload, hashlib.sha256).digest()
        if not hmac.compare_digest(mac, want):
            raise UnauthenticatedFrame("bad MAC (wrong cluster secret or tampered frame)")
        if fresh:
            with self._lock:
                self._admit(session, counter)
        return payload

    def _admit(self, session: bytes, counter: int) -> None:
        known = self._sessions.get(session)
        if known is None:
            self._sessions[session] = _Session(counter)
            if len(self._sessions) > self.max_sessions:
                self._sessions.popitem(last=False)
            return
        self._sessions.move_to_end(session)
        if counter <= known.top - self.window:
            raise UnauthenticatedFrame(f"replayed frame (counter {counter} behind the window)")
        if counter in known.seen:
            raise UnauthenticatedFrame("replayed frame (counter already seen)")
        known.seen.add(counter)
        if counter > known.top:
            known.top = counter
            if len(known.seen) > 2 * self.window:  # keep only the window's counters
                floor = known.top - self.window
                known.seen = {c for c in known.seen if c > floor}
