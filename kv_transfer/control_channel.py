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
`peer_timeout_s` since an unanswered heartbeat is dead (`dead()`); it keeps getting
heartbeats and is alive again as soon as it answers one. A peer whose answers show its
engine holding work without taking a step for `stall_s` is stuck (`stuck()`), alive again
once its step counter moves; `alive()` is False while it is dead or stuck (no new orders).

Leases and fencing (all on this host's monotonic clock): each `HeartbeatAck` is answered
at once with a `LeaseGrant` (unless the peer is dead), letting that connection post
WRITEs for `lease_s` more. `fence(node)` closes the connection (a new one, under a new
ZMQ identity, replaces it) and returns when every lease it granted has run out; links
have numbered generations (`generation()`), and `closed_until(gen)` tells a caller
whether a generation's link is gone and since when nothing of it can be posted. Links
closed for another reason (idle, evicted) get the same bound.

Prefill side: `PrefillControl` (kv_transfer/prefill_control.py), re-exported here.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import zmq

from pdserve.kv_transfer import messages as m
from pdserve.kv_transfer.frame_auth import FrameAuth, UnauthenticatedFrame
from pdserve.kv_transfer.prefill_control import PrefillControl, curve_server_keys

__all__ = ["DecodeControl", "PrefillControl", "ZmqDealerLink", "curve_server_keys"]

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


# Clock rate bound: a duration of d on one host's monotonic clock is within d * (1 +- this)
# of real time (NTP slews at most 0.05 %; this leaves a wide margin).
MAX_RATE_ERROR = 0.01
LEASE_STRETCH = (1 + MAX_RATE_ERROR) / (1 - MAX_RATE_ERROR)
CLOSED_MEMORY_S = 3600.0  # how long a closed link's bound is remembered


@dataclass
class _Peer:
    link: ZmqDealerLink
    last_used: float
    gen: int
    queue: deque[tuple[bytes, tuple[str, int] | None]] = field(default_factory=deque)
    ping_sent_at: float | None = None  # an unanswered heartbeat went out then
    last_ping: float = float("-inf")
    dead: bool = False
    last_grant: float | None = None  # the last LeaseGrant on this link went out then
    steps: int = -1  # the peer engine's step counter, as last heard
    busy: bool = False
    progressed_at: float = 0.0  # when `steps` last moved (or the engine was idle)


class DecodeControl:
    def __init__(
        self,
        hello: Callable[[], m.PeerHello],
        *,
        heartbeat_s: float = 1.0,
        peer_timeout_s: float = 5.0,
        stall_s: float | None = None,
        lease_s: float | None = None,
        idle_close_s: float = 60.0,
        max_peers: int = 64,
        max_queued: int = 1024,
        clock: Callable[[], float] = time.monotonic,
        connect: Callable[[str], ZmqDealerLink] | None = None,
        auth: FrameAuth | None = None,
    ):
        """`connect(node)` opens a link (default: a ZMQ DEALER; the simulator passes an
        in-memory one) and raises ConnectionError if it cannot. `auth` seals and checks
        every frame (a cluster secret); frames that fail the check are dropped.
        `stall_s` (default `peer_timeout_s`; nodes pass `engine_stall_s`): a busy peer
        engine that took no step for this long is stuck (keep it above the longest step). `lease_s` (default `peer_timeout_s`): each grant's length."""
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
        self.stall_s = peer_timeout_s if stall_s is None else stall_s
        self.lease_s = peer_timeout_s if lease_s is None else lease_s
        self.idle_close_s = idle_close_s
        self.max_peers = max_peers
        self.max_queued = max_queued
        self.clock = clock
        self._peers: dict[str, _Peer] = {}
        self._closed: dict[int, float] = {}  # generation -> nothing of it lands after
        self._gens = 0
        self._seq = 0
        # a link lacks our current hello: opened while `hello` could not be made, or the
        # owner's data plane changed since (its owner then calls `hello_all`)
        self.hello_missing = False

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

    def _connect(self, node: str, like: _Peer | None = None) -> _Peer | None:
        if len(self._peers) >= self.max_peers and not self._close_one_idle():
            logger.warning("already %d prefill peers; not connecting to %s", self.max_peers, node)
            return None
        try:
            link = self._connect_link(node)
        except ConnectionError as e:
            logger.warning("cannot connect to prefill node %s: %s", node, e)
            return None
        self._gens += 1
        peer = _Peer(link, self.clock(), self._gens, progressed_at=self.clock())
        if like is not None:  # a replacement link: the peer's liveness carries over
            peer.dead, peer.ping_sent_at = like.dead, like.ping_sent_at
            peer.steps, peer.busy, peer.progressed_at = like.steps, like.busy, like.progressed_at
        self._peers[node] = peer
        try:
            peer.queue.append((self._frame(self._hello()), None))
        except RuntimeError as e:  # our data plane is down: the owner says hello later
            logger.warning("no hello for %s yet: %s", node, e)
            self.hello_missing = True
        self._flush(peer)
        return peer

    def hello_all(self, hello: m.PeerHello) -> None:
        """Introduce our data plane again on every open link (its metadata changed)."""
        self.hello_missing = False
        for node in list(self._peers):
            self.send(node, hello)

    def _flush(self, peer: _Peer) -> None:
        while peer.queue and self._try_send(peer, peer.queue[0][0]):
            peer.queue.popleft()

    # -- receiving, liveness -------------------------------------------------------------
    def recv(self) -> list[tuple[str, m.ToDecode | m.MalformedMessage]]:
        out: list[tuple[str, m.ToDecode | m.MalformedMessage]] = []
        for node, peer in list(self._peers.items()):
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
                if isinstance(msg, m.HeartbeatAck):
                    self._on_ack(peer, msg)
                else:
                    out.append((node, msg))
        return out

    def _on_ack(self, peer: _Peer, ack: m.HeartbeatAck) -> None:
        now = self.clock()
        if ack.steps != peer.steps or not ack.busy:
            peer.progressed_at = now
        peer.steps, peer.busy = ack.steps, ack.busy
        if self._try_send(peer, self._frame(m.LeaseGrant(at=ack.at, for_s=self.lease_s))):
            peer.last_grant = now

    def tick(self, busy: set[str]) -> None:
        """Flush queues, heartbeat busy (and dead) peers, mark silent ones dead, close
        connections with nothing outstanding for `idle_close_s`."""
        now = self.clock()
        for gen, until in list(self._closed.items()):
            if now > until + CLOSED_MEMORY_S:
                del self._closed[gen]
        for node, peer in list(self._peers.items()):
            self._flush(peer)
            if node in busy:
                peer.last_used = now
            else:  # nothing asked of it: its engine's progress is not ours to judge
                peer.busy, peer.progressed_at = False, now
                if not peer.queue and now - peer.last_used > self.idle_close_s:
                    self._close(node)
                    continue
            if node not in busy and not peer.dead:
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
        """Whether to order from `node`: not dead, and its engine not stuck."""
        return not self.dead(node) and not self.stuck(node)

    def dead(self, node: str) -> bool:
        peer = self._peers.get(node)
        return peer is not None and peer.dead

    def stuck(self, node: str) -> bool:
        peer = self._peers.get(node)
        if peer is None or not peer.busy:
            return False
        if self.clock() - peer.progressed_at <= self.stall_s:
            return False
        logger.warning("prefill node %s: engine stuck at step %d", node, peer.steps)
        return True

    # -- generations, fencing ------------------------------------------------------------
    def generation(self, node: str) -> int | None:
        peer = self._peers.get(node)
        return None if peer is None else peer.gen

    def closed_until(self, gen: int | None) -> float | None:
        """None while generation `gen`'s link is open; else the time (this clock) after
        which no WRITE posted under its leases is still being posted."""
        return self._closed.get(gen) if gen is not None else 0.0

    def fence(self, node: str) -> None:
        """Close `node`'s link so no lease of it is renewed; a new link replaces it."""
        peer = self._peers.get(node)
        if peer is None:
            return
        logger.warning("fencing the control connection to %s (generation %d)", node, peer.gen)
        self._close(node)
        self._connect(node, like=peer)

    def _close_one_idle(self) -> bool:
        idle = [(p.last_used, n) for n, p in self._peers.items() if not p.queue]
        if not idle:
            return False
        self._close(min(idle)[1])
        return True

    def _close(self, node: str) -> None:
        peer = self._peers.pop(node)
        peer.link.close()
        now = self.clock()
        grant = peer.last_grant
        self._closed[peer.gen] = now if grant is None else grant + self.lease_s * LEASE_STRETCH
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
