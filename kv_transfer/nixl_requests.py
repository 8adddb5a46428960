"""The table of NIXL transfer requests one `NixlTransport` posted, and their accounting.

Contract
--------
* `open(peer)` creates a `TransferHandle` (a fresh id) and its record; the transport then
  attaches the NIXL request (`rec.xfer`) it posts. Every handle ends in exactly one
  `finish(..., DONE|FAILED)` (or stays PENDING until released) and is `release()`d exactly
  once by its owner.
* A finished-FAILED request is cancelled and freed at once. A release NIXL refuses is
  parked and retried by `release_parked()`.
* `check_integrity()` raises if a handle was dropped without release (the table holds
  only weak references to handles) or if posted != released + in flight.
* Not thread-safe: the transport's owner thread drives it.
"""

from __future__ import annotations

import logging
import time
import weakref
from dataclasses import dataclass

import msgspec
from nixl import _bindings as nixl_bindings
from nixl._api import nixl_xfer_handle

from pdserve.kv_transfer.transfer_types import (
    TransferHandle,
    TransferState,
    TransferStats,
    TransportStats,
)

logger = logging.getLogger(__name__)

NIXL_ERRORS: tuple[type[Exception], ...] = tuple(
    getattr(nixl_bindings, n)
    for n in dir(nixl_bindings)
    if n.startswith("nixl") and n.endswith("Error")
)


@dataclass
class InFlight:
    xfer: nixl_xfer_handle | None  # None once finished with an error or cancelled
    ref: weakref.ref[TransferHandle]
    peer: str
    t0: float
    staged: object = None  # what the request reads (kv_transfer/tp_staging.py): freed with it


class RequestTable:
    """Posted transfers by handle id, their totals, and the requests NIXL would not free."""

    def __init__(self, owner: str, free_staged=lambda staged: None) -> None:
        self.owner = owner  # the agent name, for log lines
        self._inflight: dict[int, InFlight] = {}
        # releases NIXL refused, with what their requests read; retried on close
        self._parked: list[tuple[nixl_xfer_handle, object]] = []
        self._free_staged = free_staged  # called once NIXL no longer reads it
        self._next_id = 0
        self._released = 0
        self.totals = TransportStats()

    def open(self, peer: str, stats: TransferStats) -> tuple[TransferHandle, InFlight]:
        handle = TransferHandle(self._next_id, peer, stats)
        self._next_id += 1
        rec = InFlight(None, weakref.ref(handle), peer, time.perf_counter())
        self._inflight[handle.id] = rec
        return handle, rec

    def record(self, handle: TransferHandle) -> InFlight:
        rec = self._inflight.get(handle.id)
        if rec is None or rec.ref() is not handle:
            raise ValueError(f"{handle!r} is released or not from this transport")
        return rec

    def finish(self, handle: TransferHandle, rec: InFlight, state: TransferState) -> None:
        handle.state = state
        if state is TransferState.DONE:
            handle.stats.seconds = time.perf_counter() - rec.t0
            self.totals.done += 1
            self.totals.bytes += handle.stats.bytes
            self.totals.descriptors += handle.stats.descriptors
            self.totals.seconds += handle.stats.seconds
            return
        self.totals.failed += 1
        self._release(rec)  # cancel (if still running) and free the request

    def release(self, handle: TransferHandle) -> None:
        """Free the handle's NIXL request; a PENDING transfer is cancelled (ends FAILED)."""
        rec = self.record(handle)
        if handle.state is TransferState.PENDING:
            self.finish(handle, rec, TransferState.FAILED)
        else:
            self._release(rec)
        del self._inflight[handle.id]
        handle.released = True
        self._released += 1

    def fail_pending(self, peer: str | None = None) -> None:
        """End FAILED every PENDING transfer (to `peer`, or to anyone)."""
        for rec in self._inflight.values():
            handle = rec.ref()
            if (peer is None or rec.peer == peer) and handle is not None:
                if handle.state is TransferState.PENDING:
                    self.finish(handle, rec, TransferState.FAILED)

    def cancel_all(self) -> None:
        """Cancel what is pending and free every in-flight NIXL request (handles stay)."""
        self.fail_pending()
        for rec in self._inflight.values():
            self._release(rec)

    def drop_parked(self) -> None:
        """Forget the releases NIXL refused (their agent is being destroyed)."""
        for _xfer, staged in self._parked:
            if staged is not None:
                self._free_staged(staged)
        self._parked = []

    @property
    def num_pending(self) -> int:
        return sum(
            1 for r in self._inflight.values()
            if (h := r.ref()) is not None and h.state is TransferState.PENDING
        )  # fmt: skip

    def release_parked(self) -> None:
        """Retry the releases NIXL refused before."""
        parked, self._parked = self._parked, []
        for xfer, staged in parked:
            self._release_xfer(xfer, staged)

    @property
    def stats(self) -> TransportStats:
        return msgspec.structs.replace(self.totals)

    @property
    def num_inflight(self) -> int:
        return len(self._inflight)

    def check_integrity(self) -> None:
        """Raise RuntimeError if a handle leaked (dropped unreleased) or counts disagree."""
        leaked = [i for i, rec in self._inflight.items() if rec.ref() is None]
        if leaked:
            raise RuntimeError(f"transfer handles dropped without release: {leaked}")
        if self._next_id != self._released + len(self._inflight):
            raise RuntimeError(
                f"{self._next_id} posted != {self._released} released + "
                f"{len(self._inflight)} in flight"
            )
        t = self.totals
        if t.done + t.failed > self._next_id:
            raise RuntimeError(f"{t.done} done + {t.failed} failed > {self._next_id} posted")

    def _release(self, rec: InFlight) -> None:
        xfer, staged, rec.xfer, rec.staged = rec.xfer, rec.staged, None, None
        if xfer is not None:
            self._release_xfer(xfer, staged)
        elif staged is not None:  # never posted
            self._free_staged(staged)

    def _release_xfer(self, xfer: nixl_xfer_handle, staged: object = None) -> None:
        try:
            xfer.release()
        except NIXL_ERRORS as e:
            logger.warning("nixl transport %s: NIXL kept a request (%s); parked", self.owner, e)
            self._parked.append((xfer, staged))
            return
        if staged is not None:
            self._free_staged(staged)
