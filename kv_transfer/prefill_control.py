"""The prefill node's end of the PD control channel: one ROUTER, leases, engine progress.

`PrefillControl` owns one ROUTER, pumped by its own thread (kv_transfer/control_pump.py)
that checks each frame's seal and handles heartbeats and lease grants at once, even while
the engine thread is inside a long step; `recv_timed` hands over every other message (or
a `MalformedMessage`) with the sender's identity and the time the pump received it (this
host's monotonic clock). `reply` never blocks: ZMQ drops what it cannot deliver, and the
decode node's deadlines cover it. With a `link` given (the simulator), there is no thread:
`recv_timed` screens frames itself.

What the pump answers for the engine:
* `Heartbeat` -> `HeartbeatAck` with this clock's reading (`at`) and the engine's progress
  (`steps`, `busy`: what `progress()` was last told), so a decode node tells a stuck
  engine from a busy one.
* `LeaseGrant(at, for_s)` -> this connection may post WRITEs until `min(at, now) + for_s`
  (`lease_until`). `at` is our own reading from the answered `HeartbeatAck`, so the lease
  starts before the decode node granted it: when the decode node stops granting (it fenced
  the connection), every lease ends within `for_s` (times the clocks' rate bound) of its
  last grant, whatever the two hosts' clocks read.
Per identity the pump remembers when it last heard from it (`last_heard`), so the engine
thread can forget identities whose connection went quiet (`forget`).

With a cluster secret (`auth`), every frame is sealed (kv_transfer/frame_auth.py) and the
connection is encrypted with CurveZMQ: the prefill node's key pair is derived from the
secret (`curve_server_keys`), so only holders of the secret can connect at all.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import zmq
from zmq.utils import z85

from pdserve.kv_transfer import messages as m
from pdserve.kv_transfer.control_pump import ControlPump
from pdserve.kv_transfer.frame_auth import FrameAuth, UnauthenticatedFrame

logger = logging.getLogger(__name__)

MAX_LEASE_S = 600.0  # a grant may not claim more than this


def curve_server_keys(auth: FrameAuth) -> tuple[bytes, bytes] | None:
    """The prefill nodes' CURVE key pair (public, secret; Z85), derived from the cluster
    secret: with a secret, ZMQ encrypts the control channel (CurveZMQ), and a client that
    does not know the public key (so not the secret) cannot even complete a handshake."""
    seed = auth.derive(b"zmq curve server")
    if seed is None:
        return None
    secret = z85.encode(seed)
    return zmq.curve_public(secret), secret


class PrefillControl:
    def __init__(
        self,
        address: str,
        link: ControlPump | None = None,
        auth: FrameAuth | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        """`link`: a bound socket with `recv`/`send`/`socket`/`address`/`close` whose
        frames `recv` screens (the simulator's); default: a `ControlPump` that binds a ZMQ
        ROUTER at `address` and screens frames in its own thread. `auth`: frames not
        sealed with the cluster secret, or replayed, are dropped unanswered. `clock`: this
        host's monotonic clock (leases, receipt times)."""
        self.auth = auth or FrameAuth(None)
        self.clock = clock
        self.rejected_frames = 0
        self.steps = 0  # the engine's progress, told by `progress()`
        self.busy = False
        self._leases: dict[bytes, float] = {}  # identity -> may post WRITEs until
        self.last_heard: dict[bytes, float] = {}  # identity -> last authentic frame
        self._ctx = zmq.Context() if link is None else None
        self._link = link or ControlPump(
            self._ctx, address, self._screen, curve_server_keys(self.auth), clock
        )
        self.address = self._link.address
        logger.info("prefill control channel on %s", self.address)

    def _screen(self, ident: bytes, raw: bytes, send: Callable[[bytes, bytes], None]):
        """The opened payload of an authentic frame for the engine, or None: a refused
        frame is dropped, a `Heartbeat` is answered and a `LeaseGrant` taken here."""
        try:
            raw = self.auth.open(raw)
        except UnauthenticatedFrame as e:
            self.rejected_frames += 1
            logger.warning("dropping a control frame: %s", e)
            return None
        now = self.clock()
        self.last_heard[ident] = now
        try:
            msg = m.decode_to_prefill(raw)
        except m.MalformedMessage:
            return raw  # the engine thread decodes it again and answers the sender
        if isinstance(msg, m.Heartbeat):
            ack = m.HeartbeatAck(seq=msg.seq, at=now, steps=self.steps, busy=self.busy)
            send(ident, self.auth.seal(m.encode(ack)))
            return None
        if isinstance(msg, m.LeaseGrant):
            if 0 < msg.for_s <= MAX_LEASE_S:  # `at` is ours: never later than now
                until = min(msg.at, now) + msg.for_s
                self._leases[ident] = max(self._leases.get(ident, until), until)
            return None
        return raw

    # -- the engine thread -----------------------------------------------------------------
    def progress(self, steps: int, busy: bool) -> None:
        """The engine loop's progress, carried by every `HeartbeatAck`."""
        self.steps, self.busy = steps, busy

    def lease_until(self, ident: bytes) -> float:
        """Until when (this clock) the connection `ident` may have WRITEs posted for it."""
        return self._leases.get(ident, float("-inf"))

    def forget(self, ident: bytes) -> None:
        self._leases.pop(ident, None)
        self.last_heard.pop(ident, None)

    def recv_timed(self) -> list[tuple[bytes, m.ToPrefill | m.MalformedMessage, float]]:
        """Messages for the engine: (sender, message, when this host received it)."""
        out: list[tuple[bytes, m.ToPrefill | m.MalformedMessage, float]] = []
        screened = getattr(self._link, "screened", False)
        while (frames := self._link.recv()) is not None:
            at = self.clock()
            if screened and len(frames) == 3:
                ident, raw, at = frames[0], frames[1], float(frames[2])
            elif len(frames) != 2:
                logger.warning("dropping a control message of %d frames", len(frames))
                continue
            else:
                ident, raw = frames
                if not screened:
                    raw = self._screen(ident, raw, self._link.send)
                    if raw is None:
                        continue
            try:
                msg = m.decode_to_prefill(raw)
            except m.MalformedMessage as e:
                logger.warning("malformed control message: %s", e)
                out.append((ident, e, at))
                continue
            out.append((ident, msg, at))
        return out

    def recv(self) -> list[tuple[bytes, m.ToPrefill | m.MalformedMessage]]:
        return [(ident, msg) for ident, msg, _ in self.recv_timed()]

    def reply(self, ident: bytes, msg: m.ToDecode) -> None:
        self._link.send(ident, self.auth.seal(m.encode(msg)))

    def sockets(self) -> list[zmq.Socket]:
        return [self._link.socket] if self._link.socket is not None else []

    def close(self) -> None:
        self._link.close()
        if self._ctx is not None:
            self._ctx.term()
