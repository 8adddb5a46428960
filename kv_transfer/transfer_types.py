"""Plain data the NIXL transport hands out: states, per-transfer stats, peer metadata, handles.

`PeerMetadata` is the only one that crosses a process boundary (msgpack, via
`NixlTransport.local_metadata`); the rest live in the process that posted the transfer.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

import msgspec

from pdserve.kv_transfer.kv_layout import KVLayout

if TYPE_CHECKING:
    import torch


class WarmupTimedOut(str):
    """A connection warm-up's reason when it only ran out of time (the peer's side did not
    progress in time, e.g. its engine loop was in a long step): not a failure of the peer.
    The connection then finishes with the peer's first transfer, as without a warm-up."""


class TransferState(enum.Enum):
    PENDING = "pending"
    DONE = "done"
    FAILED = "failed"


class TransferStats(msgspec.Struct):
    """What one transfer moved; `seconds` (post to observed completion) is set when DONE."""

    bytes: int
    descriptors: int
    seconds: float | None = None


class TransportStats(msgspec.Struct):
    """Totals over finished transfers of one transport."""

    done: int = 0
    failed: int = 0
    bytes: int = 0
    descriptors: int = 0
    seconds: float = 0.0


class PeerMetadata(msgspec.Struct, frozen=True):
    """What `local_metadata()` encodes: enough for a peer to WRITE into our blocks."""

    agent_name: str
    agent_metadata: bytes
    layout: KVLayout
    # A registered region apart from the KV blocks that a new peer's connection warm-up
    # WRITEs into (kv_transfer/nixl_warmup.py); 0 = none.
    scratch_addr: int = 0
    scratch_bytes: int = 0
    # Every rank's layout of a tensor-parallel node (`layout` is rank 0's); () for one device.
    ranks: tuple[KVLayout, ...] = ()

    @property
    def rank_layouts(self) -> list[KVLayout]:
        return list(self.ranks) or [self.layout]


class TransferHandle:
    """One posted WRITE. Read `state` and `stats`; pass it back to poll/wait/release."""

    __slots__ = ("id", "peer", "state", "stats", "released", "__weakref__")

    def __init__(self, id: int, peer: str, stats: TransferStats) -> None:
        self.id = id
        self.peer = peer
        self.state = TransferState.PENDING
        self.stats = stats
        self.released = False

    def __repr__(self) -> str:
        return f"TransferHandle(id={self.id}, peer={self.peer!r}, state={self.state.name})"


class DataPlane(Protocol):
    """What a connector side needs from its data transport (`NixlTransport`, or the
    simulator's in-memory one); see `pdserve.kv_transfer.nixl_transport` for the semantics."""

    name: str
    layout: KVLayout

    def local_metadata(self) -> bytes: ...

    def add_peer(self, metadata: bytes) -> str: ...

    def remove_peer(self, peer: str) -> None: ...

    @property
    def peers(self) -> list[str]: ...

    def peer_layout(self, peer: str) -> KVLayout: ...

    def write_blocks(
        self,
        peer: str,
        src_block_ids: list[int],
        dst_block_ids: list[int],
        notif: bytes | None = None,
    ) -> TransferHandle: ...

    def poll(self, handle: TransferHandle) -> TransferState: ...

    def release(self, handle: TransferHandle) -> None:
        """Free the handle (a PENDING one ends FAILED); its data may go on moving."""
        ...

    def stop_writes(self) -> int:
        """Stop every WRITE in flight, to every peer: nothing more of them lands but what
        the network already carries; returns how many were PENDING (they end FAILED).
        Never raises for a plane that cannot start again at once (NIXL: the host's link
        is down): the plane stays down, its WRITEs fail as they are posted, and it is
        built again on a later call once it can be."""
        ...

    def fence_incoming(self) -> None:
        """Drop every connection into this plane's memory, so that nothing a peer posted
        lands in it afterwards: not what the network or a kernel's socket buffer still
        carries, not what a peer's kernel retransmits once a partition heals (NIXL: the
        agent is rebuilt under the same name; its metadata changes, so peers need a new
        hello). Peers' WRITEs in flight end FAILED on their side. Never raises for a plane
        that cannot start again at once (it stays down, as after `stop_writes`)."""
        ...

    def get_notifs(self) -> dict[str, list[bytes]]: ...

    def send_notif(self, peer: str, msg: bytes) -> None: ...

    @property
    def num_inflight(self) -> int: ...

    def check_integrity(self) -> None: ...

    def close(self) -> None: ...

    def progress_warmups(self) -> list[tuple[str, str | None]]:
        """Drive new peers' connection warm-ups; `(peer, None)` for each that completed,
        `(peer, reason)` for each that failed or timed out (a timeout's reason is a
        `WarmupTimedOut`; kv_transfer/nixl_warmup.py)."""
        ...

    @property
    def num_warming(self) -> int:
        """Warm-ups still in flight."""
        ...


class DataPlaneOwner:
    """A connector side whose data plane is built when the engine registers its KV cache:
    `data_factory(kv_cache)` makes it; until then `_data` raises."""

    _data_factory: Callable[[torch.Tensor], DataPlane]
    data: DataPlane | None = None
    kv_cache: torch.Tensor | None = None  # what the data plane moves (checksums read it)

    def register_kv_cache(self, kv_cache: torch.Tensor) -> None:
        self.kv_cache = kv_cache
        self.data = self._data_factory(kv_cache)

    @property
    def _data(self) -> DataPlane:
        if self.data is None:
            raise RuntimeError("register_kv_cache() must be called first")
        return self.data

    @property
    def local_name(self) -> str:
        return self._data.name
