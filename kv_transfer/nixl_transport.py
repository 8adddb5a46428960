"""Low-level NIXL transport: WRITE paged KV blocks from this node's KV tensor into a peer's.

Contract
--------
* One `NixlTransport` per node process owns one NIXL agent and registers the node's whole
  KV tensor (`pdserve.kv_transfer.kv_layout` describes its shape) once: DRAM for a CPU tensor,
  VRAM for a CUDA tensor. The tensor must outlive the transport and must not be resized.
* Peers are introduced out of band: `local_metadata()` gives msgpack bytes (NIXL agent
  metadata + `KVLayout`, no pickle) that the other side passes to `add_peer()`. Only the
  side that *initiates* WRITEs needs the other's metadata; the target needs nothing, and
  receives notifications from any initiator that knows it.
* `write_blocks(peer, src, dst, notif)` WRITEs local block `src[i]` into the peer's block
  `dst[i]` for every layer in `layers` (default all) and both K and V. Pairs consecutive
  on both sides are merged, so each (layer, kv, run) is at most ONE NIXL descriptor: a
  contiguous request costs `2 * len(layers)` descriptors whatever its length (fewer when
  runs span whole planes and so also touch across planes on both sides). With block-major
  KV caches on both sides (`kv_layout.alloc_block_major`) a run is ONE descriptor over
  every layer, so even fully scattered blocks cost one descriptor each.
* Posting may do the copy: between processes on one host UCX WRITEs through CMA
  (process_vm_writev), which completes inside `write_blocks` (the handle is DONE on
  return). Across hosts (TCP, RDMA) the data moves after `write_blocks` returns. Callers
  that must not block (the engine loop) post from a worker thread or in per-layer pieces.
* Progress: with `progress_thread=True` (default) NIXL progresses UCX in its own thread,
  which busy-polls about one core per agent. With False, incoming connections and
  notifications are only handled while the owner calls `poll`/`wait`/`get_notifs`, so a
  target must call `get_notifs()` regularly (an engine loop does, once per step). It returns at once with a
  `TransferHandle`; the data moves in the background.
* `notif`, if given, is delivered to the peer (`get_notifs()` there, keyed by our agent
  name) only after all of this transfer's data has landed in the peer's memory: NIXL sends
  it on the same endpoint after the transfer's puts complete. A notif is therefore the
  target's signal that the blocks are readable. `send_notif` sends one with no data.
* `poll(h)` / `wait(h, timeout_s)` report `PENDING`, `DONE` or `FAILED`. `wait` returns
  `PENDING` when the timeout expires; it never hangs. Every handle must be `release()`d
  exactly once; `check_integrity()` raises if a handle was dropped without release
  (`kv_transfer/nixl_requests.py` keeps that table and the totals).
* Not thread-safe: one thread drives a transport.

Failure modes
-------------
* Caller bugs raise `ValueError` before anything is posted: unknown peer, src/dst length
  mismatch, empty or duplicate dst ids, ids outside either side's `num_blocks`, layers out
  of range, a peer whose layout differs in shape or dtype (raised by `add_peer`).
* Peer death (process killed, node lost) never raises from `write_blocks`, `poll` or `wait`:
  the handle ends `FAILED` once UCX notices (a killed local peer: milliseconds; a silent
  network peer: UCX keepalive time). Callers bound the wait with `wait(..., timeout_s)`
  and treat `PENDING` at the deadline as failure. Data in the destination blocks of a
  FAILED or released-while-PENDING transfer is undefined.
* `release()` of a PENDING handle frees its NIXL request (if NIXL refuses, the request is
  parked and released again on `close()`), but does not stop the data: UCX goes on
  sending it. `stop_writes()` stops every WRITE in flight by rebuilding the agent.
* A rebuild UCX refuses (no usable device: the host's link is down) leaves the transport
  down (`is_down`), not raising: `write_blocks` gives FAILED handles, `send_notif` and
  `local_metadata` raise `RuntimeError`, `add_peer` keeps the peer for later; the rebuild
  is tried again, after a backoff, from `progress_warmups`/`get_notifs`/`write_blocks`.
* `send_notif` to a dead peer raises `RuntimeError` if NIXL reports it, else is lost.
"""

from __future__ import annotations

import logging
import time

import msgspec
import numpy as np
import torch
from nixl._api import nixl_agent, nixl_agent_config

from pdserve.engine.kv_tensor import KVRanks
from pdserve.kv_transfer.kv_layout import KVLayout, check_ranks, coalesce, storage_of
from pdserve.kv_transfer.nixl_requests import NIXL_ERRORS, RequestTable
from pdserve.kv_transfer.nixl_warmup import WARMUP_TIMEOUT_S, PeerWarmups
from pdserve.kv_transfer.tp_staging import StagingPool, write_descs
from pdserve.kv_transfer.transfer_types import (
    PeerMetadata,
    TransferHandle,
    TransferState,
    TransferStats,
    TransportStats,
)

logger = logging.getLogger(__name__)

# How long `add_peer` progresses a new connection, so that the first WRITE to a new peer
# does not pay the connection setup itself (docs/benchmarks-history.md, "The first WRITE
# to a new peer").
CONNECT_S = 0.005
# After `stop_writes`, a rebuild UCX refuses (no usable device while the host's link is
# down) is tried again after 0.5 s, then twice as long each time, at most every 5 s.
REOPEN_FIRST_S = 0.5
REOPEN_MAX_S = 5.0


class NixlTransport:
    """A NIXL agent with this node's KV tensor registered; see the module docstring."""

    def __init__(
        self,
        name: str,
        kv_cache: torch.Tensor,
        backends: tuple[str, ...] = ("UCX",),
        backend_params: dict[str, str] | None = None,
        progress_thread: bool = True,
        warmup_timeout_s: float = WARMUP_TIMEOUT_S,
    ) -> None:
        """`backend_params` go to every backend, e.g. {"ucx_error_handling_mode": "peer"}.

        `progress_thread=True` lets NIXL progress UCX in its own thread, which busy-polls
        (about one core per agent). With False, nothing moves on this side unless the owner
        calls `poll`/`wait`/`get_notifs` regularly (the engine loop does, once per step).
        `warmup_timeout_s` bounds each new peer's connection warm-up (`add_peer`).
        """
        self.name = name
        self.ranks = KVLayout.of_ranks(kv_cache)  # a tensor-parallel node: one per rank
        self.layout = self.ranks[0]
        self._kv_cache = kv_cache  # keep the registered memory alive
        if not isinstance(kv_cache, KVRanks):  # one device: one rank holding every head
            kv_cache = KVRanks((kv_cache,), (0,), kv_cache.shape[4])
        self._kv_ranks = kv_cache
        # No NIXL listen thread: peers' metadata arrives only inside sealed control frames
        # (kv_transfer/prefill_side.py), never on a socket of NIXL's own.
        self._agent_config = nixl_agent_config(
            enable_prog_thread=progress_thread, enable_listen_thread=False, backends=[]
        )
        self._backends = (tuple(backends), dict(backend_params or {}), warmup_timeout_s)
        self._agent: nixl_agent | None = None  # None: down (`stop_writes` could not rebuild)
        self._open_agent()
        self._reopen_at, self._reopen_backoff_s = 0.0, REOPEN_FIRST_S
        self._lost_peers: list[tuple[str, str]] = []  # not loaded again by a rebuild
        self._codec = msgspec.msgpack.Encoder()
        self._peers: dict[str, PeerMetadata] = {}
        self._requests = RequestTable(name, self._free_staged)
        self.staged_writes = 0  # WRITEs from staging buffers, in all
        self.agent_restarts = 0  # `stop_writes` or `fence_incoming` rebuilt the agent
        self.incoming_fences = 0  # `fence_incoming` calls
        self._notifs: dict[str, list[bytes]] = {}  # received while connecting, not yet read
        self._closed = False
        logger.info(
            "nixl transport %s: %s %s %.1f MiB registered (%d blocks x %d B per layer-kv)",
            name,
            "block-major" if self.layout.block_major else "layer-major",
            self.layout.mem_type,
            self.layout.total_bytes / 2**20,
            self.layout.num_blocks,
            self.layout.block_bytes,
        )

    def _open_agent(self) -> None:
        """The NIXL agent under this transport's name, its backends, the KV tensor
        registered, the warm-up scratch and a staging pool on it. Raises a NIXL error if
        UCX cannot start (no usable device: the host's link is down) and keeps nothing."""
        backends, params, warmup_timeout_s = self._backends
        caches = self._kv_ranks.caches
        agent = nixl_agent(self.name, self._agent_config)
        for backend in backends:
            agent.create_backend(backend, dict(params))
        self._reg = [agent.register_memory(storage_of(c)) for c in caches]
        self._warmups = PeerWarmups(
            agent, self.name, self.layout, caches[0].device, warmup_timeout_s
        )
        self._staging = StagingPool(agent.register_memory, agent.deregister_memory)
        self._agent = agent

    def _close_agent(self) -> None:
        """Destroy the agent: its UCX worker, and with it every connection and everything
        it still had to send. Every PENDING handle ends FAILED (the handles stay)."""
        self._requests.cancel_all()
        if self._agent is None:  # down (a rebuild failed): nothing left to destroy
            return
        for peer in list(self._peers):
            try:
                self._agent.remove_remote_agent(peer)
            except NIXL_ERRORS as e:
                logger.warning("nixl transport %s: removing peer %s: %s", self.name, peer, e)
        self._requests.release_parked()
        self._requests.drop_parked()  # NIXL refused twice: the worker goes anyway
        self._warmups.close()
        self._staging.close()
        for reg in self._reg:
            self._agent.deregister_memory(reg)
        # Destroy the agent (its UCX workers and threads) here, on the owner's thread, not
        # whenever the interpreter's teardown gets to it beside other native destructors:
        # the warm-ups and the staging pool let go of it on close, so this is the last
        # reference, also when the rebuild that follows fails (its WRITEs must stop then).
        self._reg = None
        self._agent = None

    def stop_writes(self) -> int:
        """Stop every WRITE in flight, to every peer, so that nothing more of them moves
        but what the network already carries; returns how many were PENDING (they end
        FAILED). Releasing a PENDING request does not do this: NIXL frees the request, but
        UCX goes on sending its data (over TCP, until the whole WRITE has landed: a 32 MiB
        WRITE released after 1 s on an 8 Mbit/s tbf link went on landing for the 10 s watched,
        tests/multihost/test_cancel.py), and removing the peer does not stop it either.
        Only the UCX worker's end does, so the agent is rebuilt under the same name: the
        KV tensor registered again, every peer added again and warmed up (their metadata
        is unchanged; a target needs none of ours, so peers see only a new connection)."""
        self._check_open()
        if self._agent is None:  # down: nothing is in flight
            return 0
        pending = self._requests.num_pending
        self._rebuild(f"to stop {pending} WRITE(s) in flight")
        return pending

    def fence_incoming(self) -> None:
        """Drop every connection into our memory (`DataPlane.fence_incoming`): the agent
        is rebuilt, so its UCX worker's sockets close and the kernel discards what they
        had not read; a segment a peer's kernel retransmits later (an orphaned socket's
        data after a partition heals: tests/multihost/test_cancel.py) meets no socket and
        is reset. The rebuilt worker has a new address: `local_metadata()` changes."""
        self._check_open()
        if self._agent is not None:  # down: no connection is left to drop
            self._rebuild("to drop every incoming connection")
        self.incoming_fences += 1

    def _rebuild(self, why: str) -> None:
        self._close_agent()
        self.agent_restarts += 1
        logger.warning("nixl transport %s: agent destroyed %s", self.name, why)
        self._reopen_backoff_s = REOPEN_FIRST_S
        self._reopen()

    def _reopen(self) -> bool:
        """Build the agent again after `stop_writes`, with every peer; False if UCX cannot
        start yet (the transport stays down: WRITEs fail at once, notifications wait) and
        the next try is due after a backoff (`_agent_up`)."""
        self._reopen_at = time.monotonic() + self._reopen_backoff_s
        self._reopen_backoff_s = min(2 * self._reopen_backoff_s, REOPEN_MAX_S)
        try:
            self._open_agent()
        except NIXL_ERRORS as e:
            self._agent, self._reg = None, None
            logger.warning(
                "nixl transport %s: agent not rebuilt (%s); down, next try in %.1f s",
                self.name, e, self._reopen_at - time.monotonic(),
            )  # fmt: skip
            return False
        for name, md in list(self._peers.items()):
            try:
                loaded = self._agent.add_remote_agent(md.agent_metadata)
            except NIXL_ERRORS as e:
                loaded = f"({e})"
            loaded = loaded.decode() if isinstance(loaded, bytes) else loaded
            if loaded != name:  # it loaded nothing, or under another name: it is not a peer
                logger.warning(
                    "nixl transport %s: peer %s not loaded again: %s", self.name, name, loaded
                )
                del self._peers[name]
                self._lost_peers.append((name, f"its metadata did not load again: {loaded}"))
                continue
            self._warmups.start(name, md)
        logger.warning("nixl transport %s: agent rebuilt, %d peer(s)", self.name, len(self._peers))
        return True

    def _agent_up(self) -> bool:
        """Whether the agent is up; when it is down and its next try is due, tries."""
        if self._agent is not None:
            return True
        return time.monotonic() >= self._reopen_at and self._reopen()

    @property
    def is_down(self) -> bool:
        """The agent is down: destroyed by `stop_writes` and not yet built again."""
        return self._agent is None and not self._closed

    # ---- peers -------------------------------------------------------------------------

    def local_metadata(self) -> bytes:
        self._check_open()
        if not self._agent_up():
            raise RuntimeError(f"nixl transport {self.name} is down (agent not rebuilt yet)")
        w = self._warmups
        md = PeerMetadata(
            self.name, self._agent.get_agent_metadata(), self.layout, w.scratch_addr,
            w.scratch_bytes, tuple(self.ranks) if len(self.ranks) > 1 else (),
        )  # fmt: skip
        return self._codec.encode(md)

    def add_peer(self, metadata: bytes, connect_s: float = CONNECT_S, warm_up: bool = True) -> str:
        """Load a peer's `local_metadata()`; returns its name. Same bytes twice: no-op.

        `connect_s` > 0: set up UCX's connection to the peer now (`make_connection`) and
        progress it for that long. A failure is logged: the first WRITE then connects.
        `warm_up`: also post a 1-block WRITE between the two sides' scratch regions
        (kv_transfer/nixl_warmup.py), which the owner drives with `progress_warmups()` on
        every loop turn, so the wireup completes before the first real WRITE needs it
        (`connect_s` alone does not finish it: without a progress thread UCX moves only
        while we poll)."""
        self._check_open()
        md = msgspec.msgpack.decode(metadata, type=PeerMetadata)
        if md.agent_name == self.name:
            raise ValueError(f"peer has our own agent name {self.name!r}")
        check_ranks(self.layout, md.rank_layouts)
        known = self._peers.get(md.agent_name)
        if known == md:
            return md.agent_name
        if known is not None:  # the peer restarted under the same name
            self.remove_peer(md.agent_name)
        if not self._agent_up():  # loaded (and its name checked) when the agent is back
            self._peers[md.agent_name] = md
            return md.agent_name
        name = self._agent.add_remote_agent(md.agent_metadata)
        if isinstance(name, bytes):
            name = name.decode()
        if name != md.agent_name:
            raise ValueError(f"metadata names agent {name!r}, envelope says {md.agent_name!r}")
        self._peers[name] = md
        logger.info("nixl transport %s: added peer %s", self.name, name)
        if connect_s > 0:
            self._connect(name, connect_s)
        if warm_up:
            self._warmups.start(name, md)
        return name

    def _connect(self, peer: str, budget_s: float) -> None:
        try:
            self._agent.make_connection(peer)
        except NIXL_ERRORS as e:
            logger.warning("nixl transport %s: connecting to %s: %s", self.name, peer, e)
            return
        deadline = time.perf_counter() + budget_s
        while time.perf_counter() < deadline:  # progress: the peer's answers get handled
            self._stash_notifs()
            time.sleep(2e-4)

    def remove_peer(self, peer: str) -> None:
        """Forget `peer`; its PENDING transfers are cancelled and end FAILED."""
        self._check_open()
        if peer not in self._peers:
            return
        self._warmups.cancel(peer)
        self._requests.fail_pending(peer)
        del self._peers[peer]
        if self._agent is None:
            return
        try:
            self._agent.remove_remote_agent(peer)
        except NIXL_ERRORS as e:
            logger.warning("nixl transport %s: removing peer %s: %s", self.name, peer, e)

    @property
    def peers(self) -> list[str]:
        return list(self._peers)

    def peer_layout(self, peer: str) -> KVLayout:
        """The KV layout `peer` announced (raises KeyError for an unknown peer)."""
        return self._peers[peer].layout

    # ---- transfers ---------------------------------------------------------------------

    def write_blocks(
        self,
        peer: str,
        src_block_ids: list[int],
        dst_block_ids: list[int],
        notif: bytes | None = None,
        layers: range | None = None,
    ) -> TransferHandle:
        """WRITE local blocks `src[i]` into the peer's blocks `dst[i]`; see module docstring."""
        self._check_open()
        if peer not in self._peers:
            raise ValueError(f"unknown peer {peer!r}")
        remote = self._peers[peer].layout
        src = np.asarray(src_block_ids, dtype=np.int64).reshape(-1)
        dst = np.asarray(dst_block_ids, dtype=np.int64).reshape(-1)
        if src.size != dst.size:
            raise ValueError(f"{src.size} src block ids but {dst.size} dst block ids")
        if src.size == 0:
            raise ValueError("no blocks to write")
        if np.unique(dst).size != dst.size:
            raise ValueError("duplicate dst block ids")
        self.layout.check_block_ids(src, "src")
        remote.check_block_ids(dst, "dst")
        layers = range(self.layout.num_layers) if layers is None else layers
        self.layout.check_layers(layers)
        if not self._agent_up():  # nothing can move: the attempt fails now, not at its deadline
            handle, rec = self._requests.open(peer, TransferStats(bytes=0, descriptors=0))
            self._requests.finish(handle, rec, TransferState.FAILED)
            return handle

        local_descs, remote_descs, staged = write_descs(
            self._kv_ranks, self.ranks, self._peers[peer].rank_layouts, layers, src, dst,
            self._staging.take,
        )  # fmt: skip
        local_descs, remote_descs = coalesce(local_descs, remote_descs)
        stats = TransferStats(
            bytes=int(local_descs[:, 1].sum()), descriptors=int(local_descs.shape[0])
        )
        handle, rec = self._requests.open(peer, stats)
        if staged:  # staging buffers (kv_transfer/tp_staging.py): given back with the request
            rec.staged = staged
            self.staged_writes += 1
        try:
            rec.xfer = self._agent.initialize_xfer(
                "WRITE",
                self._agent.get_xfer_descs(local_descs, self.layout.mem_type),
                self._agent.get_xfer_descs(remote_descs, remote.mem_type),
                peer,
                notif or b"",
            )
            status = self._agent.transfer(rec.xfer)
        except NIXL_ERRORS as e:
            logger.warning("nixl transport %s: write to %s failed to post: %s", self.name, peer, e)
            status = "ERR"
        if status == "DONE":
            self._requests.finish(handle, rec, TransferState.DONE)
        elif status == "ERR":
            self._requests.finish(handle, rec, TransferState.FAILED)
        return handle

    def _free_staged(self, staged: list[int]) -> None:
        for key in staged:
            self._staging.give(key)

    @property
    def num_staged(self) -> int:
        """Staging buffers held by transfers whose requests are not freed yet."""
        return self._staging.num_busy

    def poll(self, handle: TransferHandle) -> TransferState:
        """Current state of `handle`; a dead peer shows as FAILED, never as an exception."""
        if handle.state is not TransferState.PENDING:
            return handle.state
        rec = self._requests.record(handle)
        try:
            status = self._agent.check_xfer_state(rec.xfer)
        except NIXL_ERRORS as e:
            logger.warning("nixl transport %s: transfer %d: %s", self.name, handle.id, e)
            status = "ERR"
        if status == "DONE":
            self._requests.finish(handle, rec, TransferState.DONE)
        elif status == "ERR":
            self._requests.finish(handle, rec, TransferState.FAILED)
        return handle.state

    def wait(self, handle: TransferHandle, timeout_s: float) -> TransferState:
        """Poll until DONE/FAILED or `timeout_s` passes (then PENDING). Never hangs."""
        deadline = time.perf_counter() + timeout_s
        delay = 1e-5
        while (state := self.poll(handle)) is TransferState.PENDING:
            if time.perf_counter() >= deadline:
                return state
            time.sleep(delay)
            delay = min(delay * 2, 1e-3)
        return state

    def release(self, handle: TransferHandle) -> None:
        """Free the handle's NIXL request; a PENDING transfer is cancelled (ends FAILED)."""
        self._requests.release(handle)

    # ---- notifications -----------------------------------------------------------------

    def get_notifs(self) -> dict[str, list[bytes]]:
        """Notifications received since the last call, keyed by the sender's agent name."""
        self._check_open()
        self._stash_notifs()
        notifs, self._notifs = self._notifs, {}
        return notifs

    def _stash_notifs(self) -> None:
        if not self._agent_up():
            return
        for agent, msgs in self._agent.get_new_notifs().items():
            self._notifs.setdefault(agent, []).extend(msgs)

    def progress_warmups(self) -> list[tuple[str, str | None]]:
        """Drive connection warm-ups (see `add_peer`); `(peer, None)` for each that
        completed, `(peer, reason)` for each that failed or timed out (the peer stays
        added: the caller decides). Also handles incoming notifications (kept for
        `get_notifs`). While the agent is down (`stop_writes`), also tries to rebuild it
        when due; a peer the rebuild could not load again is reported failed here."""
        up = self._agent_up()
        lost, self._lost_peers = self._lost_peers, []
        if not up or not self._warmups.peers:
            return lost
        self._stash_notifs()
        return lost + self._warmups.progress()

    @property
    def num_warming(self) -> int:
        return len(self._warmups.peers)

    def send_notif(self, peer: str, msg: bytes) -> None:
        """Send `msg` to `peer` with no data; ordered after our completed transfers to it."""
        self._check_open()
        if peer not in self._peers:
            raise ValueError(f"unknown peer {peer!r}")
        if not self._agent_up():
            raise RuntimeError(f"notification to {peer!r} failed: the agent is down")
        try:
            self._agent.send_notif(peer, msg)
        except NIXL_ERRORS as e:
            raise RuntimeError(f"notification to {peer!r} failed: {e}") from e

    # ---- bookkeeping -------------------------------------------------------------------

    @property
    def stats(self) -> TransportStats:
        return self._requests.stats

    @property
    def registered_memory(self) -> str:
        """The memory type NIXL registered the KV tensor as: "DRAM_SEG" or "VRAM_SEG"."""
        if not self._agent_up():
            raise RuntimeError(f"nixl transport {self.name} is down (agent not rebuilt yet)")
        return self._reg[0].getType().name

    @property
    def num_inflight(self) -> int:
        """Handles posted and not yet released (any state)."""
        return self._requests.num_inflight

    def check_integrity(self) -> None:
        """Raise RuntimeError if a handle leaked (dropped unreleased) or counts disagree."""
        self._requests.check_integrity()
        self._warmups.check_integrity()

    def close(self) -> None:
        """Cancel what is in flight, drop peers, deregister memory. Idempotent."""
        if self._closed:
            return
        self._close_agent()
        self._peers.clear()
        self._closed = True
        logger.info("nixl transport %s closed: %s", self.name, self._requests.totals)

    def __enter__(self) -> NixlTransport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- internals ---------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"nixl transport {self.name} is closed")
