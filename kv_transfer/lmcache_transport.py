"""The LMCache data plane of the PD transport: token-keyed store/retrieve jobs on a worker.

Where NIXL WRITEs blocks into a peer's cache, this data plane goes through the shared
store (LMCache's local CPU tier plus its Redis remote backend, `LMCacheKVStore`): the
prefill node `store`s a prompt's chunks and waits until Redis holds every one of them;
the decode node `retrieve`s them by token ids into its own blocks. Each is a job on one
worker thread that owns the LMCache engine (every LMCache call blocks on Redis); the
engine thread posts jobs and polls their `TransferHandle`s, never waiting.

A job has a deadline (the order's, on the shared wall clock): a store not visible by
then, or a job that raises (Redis unreachable: a PING precedes each job), ends FAILED. A
handle released while its job still runs stays counted in flight (`num_inflight`) until
the job ends, so the connector keeps the blocks it touches out of circulation until then.

Peers exchange `PeerMetadata` (no NIXL bytes) only to check that their KV shapes and
dtypes match: chunks stored by one node are loaded bit for bit into the other's blocks.
The storage order may differ (a block-major prefill node, a layer-major decode node):
chunks are the same bytes from either (`pdserve.kv_transfer.kv_slots`).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec
import torch

from pdserve.kv_transfer.kv_layout import KVLayout
from pdserve.kv_transfer.transfer_types import (
    PeerMetadata,
    TransferHandle,
    TransferState,
    TransferStats,
)

logger = logging.getLogger(__name__)


@dataclass
class _Job:
    kind: str  # "store" | "retrieve"
    token_ids: list[int]
    slots: list[int]
    skip_tokens: int  # tokens [0, skip) are not stored / left untouched
    deadline: float  # time.monotonic()
    handle: TransferHandle
    present: int = 0  # retrieve: leading tokens present after the job
    error: str | None = None
    ended: threading.Event = field(default_factory=threading.Event)


class LMCacheDataPlane:
    """One node's LMCache store, run on a worker thread, behind handles like NIXL's."""

    def __init__(
        self,
        name: str,
        kv_cache: torch.Tensor,
        backend_factory: Callable[[torch.Tensor], object],
        health_check: Callable[[], None] | None = None,
        startup_timeout_s: float = 60.0,
    ):
        """`backend_factory(kv_cache)` builds the `LMCacheKVStore` (on the worker thread);
        `health_check()` raises when the store's Redis is unreachable."""
        self.name = name
        self.layout = KVLayout.from_tensor(kv_cache)
        self._health_check = health_check
        self._peers: dict[str, KVLayout] = {}
        self._jobs: dict[int, _Job] = {}  # handle id -> job not yet ended or not released
        self._queue: queue.Queue[_Job | None] = queue.Queue()
        self._ids = iter(range(1, 1 << 62))
        self._backend = None
        self._started = threading.Event()
        self._closed = False
        self._thread = threading.Thread(
            target=self._work, args=(backend_factory, kv_cache), name="lmcache-pd", daemon=True
        )
        self._thread.start()
        if not self._started.wait(startup_timeout_s):
            logger.warning("LMCache data plane not up after %g s", startup_timeout_s)
        self._token_bytes = self.layout.block_bytes * 2 * self.layout.num_layers
        self._token_bytes //= self.layout.block_size

    # -- peers ---------------------------------------------------------------------------
    def local_metadata(self) -> bytes:
        return msgspec.msgpack.encode(PeerMetadata(self.name, b"", self.layout))

    def add_peer(self, metadata: bytes) -> str:
        md = msgspec.msgpack.decode(metadata, type=PeerMetadata)
        self.layout.check_compatible(md.layout, same_storage=False)  # chunks: either layout
        self._peers[md.agent_name] = md.layout
        return md.agent_name

    @property
    def peers(self) -> list[str]:
        return list(self._peers)

    def remove_peer(self, peer: str) -> None:
        self._peers.pop(peer, None)

    def progress_warmups(self) -> list[tuple[str, str | None]]:
        return []  # no connection to warm up

    @property
    def num_warming(self) -> int:
        return 0

    def peer_layout(self, peer: str) -> KVLayout:
        return self._peers[peer]

    # -- jobs (engine thread) ------------------------------------------------------------
    def store(self, token_ids, slots, skip_tokens: int, deadline: float) -> TransferHandle:
        """Store tokens [skip_tokens, n) from `slots`; DONE once Redis holds every chunk."""
        return self._post("store", token_ids, slots, skip_tokens, deadline)

    def retrieve(self, token_ids, slots, skip_tokens: int, deadline: float) -> TransferHandle:
        """Load stored chunks into `slots` (tokens [0, skip_tokens) untouched); DONE with
        `present(handle)` the leading tokens now in the cache."""
        return self._post("retrieve", token_ids, slots, skip_tokens, deadline)

    def _post(self, kind, token_ids, slots, skip, deadline: float) -> TransferHandle:
        """`deadline`: time.monotonic() by which the job gives up."""
        if self._closed:
            raise RuntimeError("the LMCache data plane is closed")
        nbytes = (len(token_ids) - skip) * self._token_bytes
        handle = TransferHandle(next(self._ids), kind, TransferStats(nbytes, 1))
        job = _Job(kind, list(token_ids), list(slots), skip, deadline, handle)
        self._jobs[handle.id] = job
        self._queue.put(job)
        return handle

    def poll(self, handle: TransferHandle) -> TransferState:
        job = self._jobs.get(handle.id)
        if job is not None and handle.state is TransferState.PENDING and job.ended.is_set():
            handle.state = TransferState.FAILED if job.error else TransferState.DONE
            if job.error:
                logger.warning("LMCache %s failed: %s", job.kind, job.error)
            if handle.released:
                del self._jobs[handle.id]
        return handle.state

    def present(self, handle: TransferHandle) -> int:
        job = self._jobs.get(handle.id)
        return job.present if job is not None else 0

    def release(self, handle: TransferHandle) -> None:
        """Forget the handle; a job still running stays in flight until it ends."""
        handle.released = True
        job = self._jobs.get(handle.id)
        if job is not None and job.ended.is_set():
            del self._jobs[handle.id]

    def stop_writes(self) -> int:
        """Nothing to stop: a job writes the store, never a peer's blocks (the decode node
        retrieves into its own), and ends by its deadline; its handle stays as it is."""
        return 0

    def fence_incoming(self) -> None:
        """Nothing to drop: no peer writes our blocks (the decode node retrieves into its
        own, and a retrieve ends by its deadline)."""

    @property
    def num_inflight(self) -> int:
        """Handles not released, plus released ones whose job still runs (it may still
        touch its blocks)."""
        for job in [j for j in self._jobs.values() if j.handle.released]:
            if job.ended.is_set():
                del self._jobs[job.handle.id]
        return len(self._jobs)

    def get_notifs(self) -> dict[str, list[bytes]]:
        return {}  # "done" travels over the control channel, after the store is visible

    def check_integrity(self) -> None:
        for hid, job in self._jobs.items():
            if job.handle.id != hid:
                raise RuntimeError(f"LMCache job table corrupt at handle {hid}")

    def close(self, timeout_s: float = 3.0) -> None:
        if self._closed:
            return
        self._closed = True
        self._queue.put(None)
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            logger.warning("LMCache data plane worker still busy after %.1f s", timeout_s)

    # -- worker thread -------------------------------------------------------------------
    def _work(self, factory, kv_cache: torch.Tensor) -> None:
        try:
            self._backend = factory(kv_cache)
        except Exception as e:  # LMCache missing or misconfigured: every job fails
            logger.error("LMCache data plane unavailable: %r", e)
        self._started.set()
        while (job := self._queue.get()) is not None:
            try:
                self._run(job)
            except Exception as e:
                job.error = repr(e)
            job.ended.set()
        if self._backend is not None:
            self._backend.close()

    def _run(self, job: _Job) -> None:
        if job.handle.released and job.kind == "retrieve":
            job.error = "released before it started"
            return
        if time.monotonic() > job.deadline:
            job.error = "deadline passed before it started"
            return
        if self._backend is None:
            raise RuntimeError("the LMCache backend did not start")
        if self._health_check is not None:
            self._health_check()
        b = self._backend
        if job.kind == "store":
            b.store(job.token_ids, job.slots, job.skip_tokens)
            if not b.wait_visible(job.token_ids, job.deadline):
                job.error = "chunks not visible in the store before the deadline"
            return
        job.present = b.retrieve(job.token_ids, job.slots, job.skip_tokens)
