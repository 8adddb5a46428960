"""The PD control channel over ZMQ: sockets, bounded non-blocking sends, peer liveness.

Reusable by any connector whose data moves elsewhere (NIXL, LMCache): it carries the
typed messages of `pdserve.kv_transfer.messages` and knows nothing about blocks.

Decode side (`DecodeControl`): one DEALER per prefill node, created on first use, at most
`max_peers` at once; a peer with nothing outstanding is closed after `idle_close_s`.
`send` never blocks: a frame ZMQ cannot take now (no connection yet, high-water mark)
waits in the peer's own queue of at most `max_queued` frames, flushed by `tick`; when that
queue is full, or the address cannot be connected, `send` returns False and the caller
fails over. `withdraw` takes a queued frame back: such a frame was never sent, so the
peer never saw it. Liveness: while the caller says a peer is busy (`tick(busy)`), a
`Heartbeat` goes out every `heartbeat_s`; a peer that has not answered anything for
`peer_timeout_s` since an unanswered heartbeat is dead (`alive()` is False); it keeps
getting heartbeats and is alive again as soon as it answers one.

Prefill side (`PrefillControl`): one ROUTER, owned by a pump thread
(kv_transfer/control_pump.py) that checks each frame's seal and answers heartbeats at
once, even while the engine thread is inside a long step (so a decode node sees this node
alive exactly while its process runs); `recv` hands over every other message, or a
`MalformedMessage`, with the sender's identity. `reply` never blocks: ZMQ drops what it
cannot deliver, and the decode node's deadlines cover it. With a `link` given (the
simulator), there is no thread: `recv` screens frames and answers heartbeats itself.

With a cluster secret (`auth`), every frame is sealed (kv_transfer/frame_auth.py) and the
connection is encrypted with CurveZMQ: the prefill node's key pair is derived from the
secret (`curve_server_keys`), so only holders of the secret can connect at all.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import zmq
from zmq.utils import z85

from pdserve.kv_transfer import messages as m
from pdserve.kv_transfer.control_pump import ControlPump
from pdserve.kv_transfer.frame_auth import FrameAuth, UnauthenticatedFrame

logger = logging.getLogger(__name__)


class ZmqDealerLink:
    """A decode node's connection to one prefill node: a DEALER that never blocks.
    `server_key`: the prefill nodes' CURVE public key (encrypts the connection)."""

    def __init__(self, ctx: zmq.Context, node: str, server_key: bytes | None = None):
        self.socket = ctx.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.IMMEDIATE, 1)  # queue in DecodeControl until connected
        if server_key is not None:
            public, secret = zmq.curve_keypair()  # any client key: the frames' MAC decides
            self.socket.curve_serverkey = server_key
            self.socket.curve_publickey, self.socket.curve_secretkey = public, secret
        try:
            self.socket.connect(node)
        except zmq.ZMQError as e:
            self.socket.close(linger=0)
            raise ConnectionError(str(e)) from e

    def send(self, frame: bytes) -> bool:
        """False when ZMQ cannot take the frame now (no connection, high-water mark)."""
        try:
            self.socket.send(frame, zmq.NOBLOCK)
            return True
        except zmq.Again:
            return False

    def recv(self) -> bytes | None:
        return self.socket.recv() if self.socket.poll(0) else None

    def close(self) -> None:
        self.socket.close(linger=0)


def curve_server_keys(auth: FrameAuth) -> tuple[bytes, bytes] | None:
    """The prefill nodes' CURVE key pair (public, secret; Z85), derived from the cluster
    secret: with a secret, ZMQ encrypts the control channel (CurveZMQ), and a client that
    does not know the public key (so not the secret) cannot even complete a handshake."""
    seed = auth.derive(b"zmq curve server")
    if seed is None:
        return None
    secret = z85.encode(seed)
    return zmq.curve_public(secret), secret


@dataclass
class _Peer:
    link: ZmqDealerLink
    last_used: float
    queue: deque[tuple[bytes, tuple[str, int] | None]] = field(default_factory=deque)
    ping_sent_at: float | None = None  # an unanswered heartbeat went out then
    last_ping: float = float("-inf")
    dead: bool = False


class DecodeControl:
    def __init__(
        self,
        hello: Callable[[], m.PeerHello],
        *,
        heartbeat_s: float = 1.0,
        peer_timeout_s: float = 5.0,
        idle_close_s: float = 60.0,
        max_peers: int = 64,
        max_queued: int = 1024,
        clock: Callable[[], float] = time.monotonic,
        connect: Callable[[str], ZmqDealerLink] | None = None,
        auth: FrameAuth | None = None,
    ):
        """`connect(node)` opens a link (default: a ZMQ DEALER; the simulator passes an
        in-memory one) and raises ConnectionError if it cannot. `auth` seals and checks
        every frame (a cluster secret); frames that fail the check are dropped."""
        self.auth = auth or FrameAuth(None)
        self.rejected_frames = 0
        self._ctx = zmq.Context() if connect is None else None
        server_key = curve_server_keys(self.auth)
        self._connect_link = connect or (
            lambda node: ZmqDealerLink(self._ctx, node, server_key and server_key[0])
        )
        self._hello = hello
        self.heartbeat_s = heartbeat_s
        self.peer_timeout_s = peer_timeout_s
        self.idle_close_s = idle_close_s
        self.max_peers = max_peers
        self.max_queued = max_queued
        self.clock = clock
        self._peers: dict[str, _Peer] = {}
        self._seq = 0

    # -- sending -------------------------------------------------------------------------
    def send(self, node: str, msg: m.ToPrefill, key: tuple[str, int] | None = None) -> bool:
        """Send or queue `msg`; False when `node` is unreachable or its queue is full."""
        peer = self._peers.get(node) or self._connect(node)
        if peer is None:
            return False
        peer.last_used = self.clock()
        if peer.queue or not self._try_send(peer, self._frame(msg)):
            if len(peer.queue) >= self.max_queued:
                logger.warning("control queue to %s is full; refusing a message", node)
                return False
            peer.queue.append((self._frame(msg), key))
        return True

    def withdraw(self, node: str, key: tuple[str, int]) -> bool:
        """Drop the queued (never sent) frames of `key`; True if there were any."""
        peer = self._peers.get(node)
        if peer is None:
            return False
        before = len(peer.queue)
        peer.queue = deque(x for x in peer.queue if x[1] != key)
        return len(peer.queue) != before

    def _frame(self, msg: m.ToPrefill) -> bytes:
        return self.auth.seal(m.encode(msg))

    def _try_send(self, peer: _Peer, frame: bytes) -> bool:
        return peer.link.send(frame)

    def _connect(self, node: str) -> _Peer | None:
        if len(self._peers) >= self.max_peers and not self._close_one_idle():
            logger.warning("already %d prefill peers; not connecting to %s", self.max_peers, node)
            return None
        try:
            link = self._connect_link(node)
        except ConnectionError as e:
            logger.warning("cannot connect to prefill node %s: %s", node, e)
            return None
        peer = _Peer(link, self.clock())
        self._peers[node] = peer
        peer.queue.append((self._frame(self._hello()), None))
        self._flush(peer)
        return peer

    def _flush(self, peer: _Peer) -> None:
        while peer.queue and self._try_send(peer, peer.queue[0][0]):
            peer.queue.popleft()

    # -- receiving, liveness -------------------------------------------------------------
    def recv(self) -> list[tuple[str, m.ToDecode | m.MalformedMessage]]:
        out: list[tuple[str, m.ToDecode | m.MalformedMessage]] = []
        for node, peer in self._peers.items():
            while (raw := peer.link.recv()) is not None:
                try:  # MAC only: an answer may wait here through a long engine step
                    # (past the freshness window); a CurveZMQ session admits no replays
                    raw = self.auth.open(raw, fresh=False)
                except UnauthenticatedFrame as e:
                    self.rejected_frames += 1
                    logger.warning("dropping a control frame from %s: %s", node, e)
                    continue
                peer.ping_sent_at, peer.dead = None, False  # any message proves it alive
                try:
                    msg = m.decode_to_decode(raw)
                except m.MalformedMessage as e:
                    logger.warning("malformed control message from %s: %s", node, e)
                    out.append((node, e))
                    continue
                if not isinstance(msg, m.HeartbeatAck):
                    out.append((node, msg))
        return out

    def tick(self, busy: set[str]) -> None:
        """Flush queues, heartbeat busy (and dead) peers, mark silent ones dead, close
        connections with nothing outstanding for `idle_close_s`."""
        now = self.clock()
        for node, peer in list(self._peers.items()):
            self._flush(peer)
            if node in busy:
                peer.last_used = now
            elif not peer.queue and now - peer.last_used > self.idle_close_s:
                self._close(node)
                continue
            elif not peer.dead:
                peer.ping_sent_at = None  # nothing outstanding: no answer expected
                continue
            # busy, or dead: heartbeat until it answers (a dead peer may come back)
            if now - peer.last_ping >= self.heartbeat_s:
                self._seq += 1
                peer.last_ping = now
                if peer.ping_sent_at is None:
                    peer.ping_sent_at = now
                if not peer.queue:  # never queued: a peer that cannot take it is silent
                    self._try_send(peer, self._frame(m.Heartbeat(seq=self._seq)))
            if peer.ping_sent_at is not None and not peer.dead:
                if now - peer.ping_sent_at > self.peer_timeout_s:
                    logger.warning("prefill node %s missed heartbeats: dead", node)
                    peer.dead = True

    def alive(self, node: str) -> bool:
        peer = self._peers.get(node)
        return peer is None or not peer.dead

    def _close_one_idle(self) -> bool:
        idle = [(p.last_used, n) for n, p in self._peers.items() if not p.queue]
        if not idle:
            return False
        self._close(min(idle)[1])
        return True

    def _close(self, node: str) -> None:
        self._peers.pop(node).link.close()
        logger.info("closed the control connection to %s", node)

    @property
    def num_peers(self) -> int:
        return len(self._peers)

    def sockets(self) -> list[zmq.Socket]:
        return [p.link.socket for p in self._peers.values() if p.link.socket is not None]

    def close(self) -> None:
        for node in list(self._peers):
            self._close(node)
        if self._ctx is not None:
            self._ctx.term()


class PrefillControl:
    def __init__(
        self, address: str, link: ControlPump | None = None, auth: FrameAuth | None = None
    ):
        """`link`: a bound socket with `recv`/`send`/`socket`/`address`/`close` whose
        frames `recv` screens (the simulator's); default: a `ControlPump` that binds a ZMQ
        ROUTER at `address` and screens frames in its own thread. `auth`: frames not
        sealed with the cluster secret, or replayed, are dropped unanswered."""
        self.auth = auth or FrameAuth(None)
        self.rejected_frames = 0
        self._ctx = zmq.Context() if link is None else None
        self._link = link or ControlPump(
            self._ctx, address, self._screen, curve_server_keys(self.auth)
        )
        self.address = self._link.address
        logger.info("prefill control channel on %s", self.address)

    def _screen(self, ident: bytes, raw: bytes, send: Callable[[bytes, bytes], None]):
        """The opened payload of an authentic frame for the engine, or None: a refused
        frame is dropped, a `Heartbeat` is answered here through `send`."""
        try:
            raw = self.auth.open(raw)
        except UnauthenticatedFrame as e:
            self.rejected_frames += 1
            logger.warning("dropping a control frame: %s", e)
            return None
        try:
            msg = m.decode_to_prefill(raw)
        except m.MalformedMessage:
            return raw  # the engine thread decodes it again and answers the sender
        if isinstance(msg, m.Heartbeat):
            send(ident, self.auth.seal(m.encode(m.HeartbeatAck(seq=msg.seq))))
            return None
        return raw

    def recv(self) -> list[tuple[bytes, m.ToPrefill | m.MalformedMessage]]:
        out: list[tuple[bytes, m.ToPrefill | m.MalformedMessage]] = []
        screened = getattr(self._link, "screened", False)
        while (frames := self._link.recv()) is not None:
            if len(frames) != 2:
                logger.warning("dropping a control message of %d frames", len(frames))
                continue
            ident, raw = frames
            if not screened:
                raw = self._screen(ident, raw, self._link.send)
                if raw is None:
                    continue
            try:
                msg = m.decode_to_prefill(raw)
            except m.MalformedMessage as e:
                logger.warning("malformed control message: %s", e)
                out.append((ident, e))
                continue
            out.append((ident, msg))
        return out

    def reply(self, ident: bytes, msg: m.ToDecode) -> None:
        self._link.send(ident, self.auth.seal(m.encode(msg)))

    def sockets(self) -> list[zmq.Socket]:
        return [self._link.socket] if self._link.socket is not None else []

    def close(self) -> None:
        self._link.close()
        if self._ctx is not None:
            self._ctx.term()
