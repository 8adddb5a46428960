"""The simulated world: one clock, one seeded RNG, an in-memory control network and an
in-memory data plane (WRITEs that copy block bytes when they land).

Faults are all drawn from the world's RNG, so a seed reproduces a run exactly:
control messages are delayed (hence reordered) and dropped; WRITEs are delayed, fail
(scribbling garbage into their destination), and may still land after their sender died.
Each host reads its own clock (`World.host_clock`): an offset and a rate error of its
own, so nothing may compare two hosts' readings.
"""

from __future__ import annotations

import heapq
import itertools
import random
from dataclasses import dataclass

import msgspec
import torch

from pdserve.kv_transfer.kv_layout import KVLayout
from pdserve.kv_transfer.transfer_types import (
    PeerMetadata,
    TransferHandle,
    TransferState,
    TransferStats,
)


@dataclass
class Faults:
    ctl_delay: float = 0.02  # max control message delay (s)
    ctl_drop: float = 0.0  # probability a control message is lost
    write_delay: float = 0.05  # max WRITE latency (s)
    write_floor: float = 0.0  # min WRITE latency (s): a slow link
    write_fail: float = 0.0  # probability a WRITE fails
    notif_delay: float = 0.01
    step_time: float = 0.0  # max time a prefill step's model execution takes (s)
    # how long after its sender stopped (or died) a WRITE may still land: what the kernel's
    # buffers hold, at the link's rate, or a partition's length (tests/multihost/test_cancel.py)
    drain_s: float = 0.1


class Inbox:
    """Messages that become readable at their delivery time (delays reorder them)."""

    def __init__(self, world: World):
        self.world = world
        self._heap: list[tuple[float, int, object]] = []

    def put(self, payload: object, delay: float) -> None:
        heapq.heappush(self._heap, (self.world.now + delay, next(self.world.seq), payload))

    def pop_ready(self) -> object | None:
        if self._heap and self._heap[0][0] <= self.world.now:
            return heapq.heappop(self._heap)[2]
        return None

    def __len__(self) -> int:
        return len(self._heap)


class World:
    def __init__(self, seed: int, faults: Faults | None = None):
        self.rng = random.Random(seed)
        self.faults = faults or Faults()
        self.now = 1000.0
        self.seq = itertools.count()
        self.routers: dict[str, SimRouterLink] = {}  # control address -> prefill link
        self.planes: dict[str, SimData] = {}  # agent name -> data plane
        self.writes: list[SimWrite] = []  # posted, not yet landed or failed
        self.on_post = None  # callback(write) when a WRITE is posted (tags its attempt)
        self.on_land = None  # callback(write) just before a WRITE's bytes land
        self.landed = 0
        self.failed = 0
        self.incoming_fences = 0  # `SimData.fence_incoming` calls

    def clock(self) -> float:
        return self.now

    def host_clock(self, offset: float, rate: float):
        """A host's monotonic clock: `offset + rate * (true time)`."""
        return lambda: offset + rate * self.now

    def delay(self, hi: float) -> float:
        return self.rng.uniform(0.0, hi)

    def advance(self, dt: float) -> None:
        self.now += dt
        for w in [w for w in self.writes if w.at <= self.now]:
            self.writes.remove(w)
            w.complete()


# -- control network ------------------------------------------------------------------------


class SimDealerLink:
    """Decode -> one prefill node. Refuses sends while the node is unreachable (like a
    ZMQ DEALER with IMMEDIATE before it connects); a killed node swallows them. Each
    link has an identity of its own (a new connection, as a new ZMQ DEALER); a closed
    one gets nothing more."""

    socket = None
    _ids = itertools.count()

    def __init__(self, world: World, node: str, name: bytes):
        if node not in world.routers:
            raise ConnectionError(f"no route to {node}")
        ident = name + b"#%d" % next(SimDealerLink._ids)
        self.world, self.router, self.ident = world, world.routers[node], ident
        self.inbox = Inbox(world)
        self.router.dealers[ident] = self

    def send(self, frame: bytes) -> bool:
        r, f = self.router, self.world.faults
        if r.unreachable_until > self.world.now:
            return False
        if not r.dead and self.world.rng.random() >= f.ctl_drop:
            r.inbox.put((self.ident, frame), self.world.delay(f.ctl_delay))
        return True

    def recv(self) -> bytes | None:
        return self.inbox.pop_ready()

    def close(self) -> None:
        self.router.dealers.pop(self.ident, None)


class SimRouterLink:
    socket = None

    def __init__(self, world: World, address: str):
        self.world, self.address = world, address
        self.inbox = Inbox(world)
        self.dealers: dict[bytes, SimDealerLink] = {}
        self.dead = False
        self.unreachable_until = 0.0
        world.routers[address] = self

    def recv(self) -> list[bytes] | None:
        got = self.inbox.pop_ready()
        return None if got is None else list(got)

    def send(self, ident: bytes, frame: bytes) -> None:
        f = self.world.faults
        dealer = self.dealers.get(ident)
        if dealer is not None and not self.dead and self.world.rng.random() >= f.ctl_drop:
            dealer.inbox.put(frame, self.world.delay(f.ctl_delay))

    def close(self) -> None:
        pass


class SimPump:
    """The control pump thread's stand-in (kv_transfer/control_pump.py): `pump()` screens
    what reached the node (heartbeats answered, grants taken) and queues the rest, stamped
    with the host's clock, for the engine; the cluster pumps every live node each tick,
    also while its engine hangs."""

    screened = True
    socket = None

    def __init__(self, router: SimRouterLink, clock):
        self.router, self.address, self.clock = router, router.address, clock
        self.screen = None  # PrefillControl._screen, set once the control exists
        self._ready: list[list[bytes]] = []

    def pump(self) -> None:
        while (got := self.router.recv()) is not None:
            ident, raw = got
            payload = self.screen(ident, raw, self.router.send)
            if payload is not None:
                self._ready.append([ident, payload, repr(self.clock()).encode()])

    def recv(self) -> list[bytes] | None:
        return self._ready.pop(0) if self._ready else None

    def send(self, ident: bytes, frame: bytes) -> None:
        self.router.send(ident, frame)

    def close(self) -> None:
        pass


# -- data plane -------------------------------------------------------------------------------


@dataclass
class SimWrite:
    plane: SimData
    peer: SimData
    src: list[int]
    dst: list[int]
    notif: bytes | None
    handle: TransferHandle
    at: float  # when it lands (or fails)
    fails: bool
    key: tuple[str, int] | None = None  # the decode attempt it writes for (set by harness)
    cancelled: bool = False
    held: bool = False  # its sender is not running: only its own release moves it

    def let_go(self) -> None:
        """The sender's handle is done with (FAILED if it was PENDING); the data may
        still land, without its notification, on a handle nobody reads."""
        if self.handle.state is TransferState.PENDING:
            self.handle.state = TransferState.FAILED
        self.notif = None
        self.handle = TransferHandle(-1, self.handle.peer, self.handle.stats)

    def complete(self) -> None:
        if self.cancelled:
            return
        world = self.plane.world
        if self.fails:
            for d in self.dst[: 1 + len(self.dst) // 2]:  # a failed WRITE leaves garbage
                self.peer.kv[:, :, d] = -7.0
            self.handle.state = TransferState.FAILED
            world.failed += 1
            return
        if world.on_land is not None:
            world.on_land(self)
        self.peer.kv[:, :, self.dst] = self.plane.kv[:, :, self.src]
        self.handle.state = TransferState.DONE
        self.handle.stats.seconds = 0.0
        world.landed += 1
        if self.notif is not None:
            self.peer.notifs.put(
                (self.plane.name, self.notif), world.delay(world.faults.notif_delay)
            )


class SimData:
    """A node's data plane; the same contract as `NixlTransport` (see `DataPlane`)."""

    def __init__(self, world: World, name: str, kv: torch.Tensor):
        self.world, self.name, self.kv = world, name, kv
        self.layout = KVLayout.from_tensor(kv)
        self._peers: dict[str, KVLayout] = {}
        self._peer_md: dict[str, bytes] = {}  # the agent instance each peer's metadata names
        self.instance = 0  # as NIXL's agent: a new one (new address) at each fence_incoming
        self.notifs = Inbox(world)
        self._inflight: dict[int, SimWrite | None] = {}
        self._ids = itertools.count()
        world.planes[name] = self

    def local_metadata(self) -> bytes:
        return msgspec.msgpack.encode(PeerMetadata(self.name, self._address(), self.layout))

    def _address(self) -> bytes:
        return f"sim:{self.instance}".encode()

    def add_peer(self, metadata: bytes) -> str:
        md = msgspec.msgpack.decode(metadata, type=PeerMetadata)
        self.layout.check_compatible(md.layout)
        if md.agent_name not in self.world.planes:
            raise ValueError(f"unknown agent {md.agent_name!r}")
        self._peers[md.agent_name] = md.layout
        self._peer_md[md.agent_name] = md.agent_metadata
        return md.agent_name

    @property
    def peers(self) -> list[str]:
        return list(self._peers)

    def remove_peer(self, peer: str) -> None:
        """As NIXL: pending WRITEs to `peer` end FAILED, but their data goes on moving."""
        self._peers.pop(peer, None)
        self._peer_md.pop(peer, None)
        for w in self._inflight.values():
            if w is not None and w.handle.peer == peer and w.handle.state is TransferState.PENDING:
                w.let_go()

    def progress_warmups(self) -> list[tuple[str, str | None]]:
        return []  # no connection to warm up

    @property
    def num_warming(self) -> int:
        return 0

    def peer_layout(self, peer: str) -> KVLayout:
        return self._peers[peer]

    def write_blocks(self, peer, src_block_ids, dst_block_ids, notif=None) -> TransferHandle:
        if peer not in self._peers:
            raise ValueError(f"unknown peer {peer!r}")
        src, dst = list(src_block_ids), list(dst_block_ids)
        if not src or len(src) != len(dst) or len(set(dst)) != len(dst):
            raise ValueError("bad block lists")
        for ids, n in ((src, self.layout.num_blocks), (dst, self._peers[peer].num_blocks)):
            if any(not 0 <= b < n for b in ids):
                raise ValueError("block id out of range")
        f = self.world.faults
        h = TransferHandle(next(self._ids), peer, TransferStats(bytes=len(src), descriptors=1))
        if self._peer_md[peer] != self.world.planes[peer]._address():
            # metadata of an agent the peer has since dropped (fence_incoming): as UCX's
            # refused connection, the WRITE fails at once and nothing of it moves
            h.state = TransferState.FAILED
            self._inflight[h.id] = None
            return h
        fails = self.world.rng.random() < f.write_fail
        w = SimWrite(self, self.world.planes[peer], src, dst, notif, h, 0.0, fails)
        w.at = self.world.now + f.write_floor + self.world.delay(f.write_delay)
        self._inflight[h.id] = w
        self.world.writes.append(w)
        if self.world.on_post is not None:
            self.world.on_post(w)
        return h

    def poll(self, handle: TransferHandle) -> TransferState:
        return handle.state

    def release(self, handle: TransferHandle) -> None:
        """As NIXL: the request is freed, but a PENDING WRITE goes on moving (its data lands
        when it would have, without its notification) until `stop_writes`."""
        w = self._inflight.pop(handle.id)
        if handle.state is TransferState.PENDING:
            w.let_go()
        handle.released = True

    def stop_writes(self) -> int:
        """Every WRITE of this plane still moving (released or not) stops: data already on
        the wire may still land shortly (not a held WRITE's: what the wire had landed
        while its sender was held), the rest never does. Pending handles end FAILED."""
        stopped = 0
        for w in [w for w in self.world.writes if w.plane is self]:
            if w.handle.id >= 0 and w.handle.state is TransferState.PENDING:
                w.handle.state = TransferState.FAILED
                stopped += 1
            if not w.held and self.world.rng.random() < 0.5:
                w.at = min(w.at, self.world.now + self.world.faults.drain_s)
                w.let_go()
            else:
                w.cancelled = True
                self.world.writes.remove(w)
        return stopped

    def fence_incoming(self) -> None:
        """As NIXL's rebuilt agent: every WRITE into this plane still moving never lands
        (its sender's PENDING handle ends FAILED), wherever it was held or delayed."""
        for w in [w for w in self.world.writes if w.peer is self]:
            if w.handle.id >= 0 and w.handle.state is TransferState.PENDING:
                w.handle.state = TransferState.FAILED
            w.cancelled = True
            self.world.writes.remove(w)
        self.instance += 1
        self.world.incoming_fences += 1

    def get_notifs(self) -> dict[str, list[bytes]]:
        out: dict[str, list[bytes]] = {}
        while (got := self.notifs.pop_ready()) is not None:
            out.setdefault(got[0], []).append(got[1])
        return out

    def send_notif(self, peer: str, msg: bytes) -> None:
        self.world.planes[peer].notifs.put((self.name, msg), self.world.delay(0.01))

    @property
    def num_inflight(self) -> int:
        return len(self._inflight)

    def check_integrity(self) -> None:
        pass

    def close(self) -> None:
        pass
