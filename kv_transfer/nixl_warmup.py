"""Connection warm-up: a 1-block WRITE between scratch regions, posted when a peer is added.

Contract
--------
* The first WRITE to a new NIXL peer waits for UCX to finish wiring the connection up
  (tens of ms on one host against a never-connected target; a network round trip or more
  across hosts). `PeerWarmups.start(peer, md)` posts one small WRITE to the peer at once,
  so the wireup runs while the first request is still computing; `progress()`, called on
  every loop turn, drives it and reports how it ended. Nothing ever waits for it: real
  WRITEs posted meanwhile go out as usual (they share the connection being set up).
* Every transport owns a dedicated scratch region of one block (`layout.block_bytes`) on
  its KV tensor's device, allocated and registered separately from the KV tensor: a
  warm-up reads only our scratch and writes only the peer's scratch (announced in its
  `PeerMetadata`), never a KV block. Peers that announce no scratch are not warmed up.
* Every warm-up ends within `timeout_s`: DONE (the connection is up), FAILED (NIXL said
  so: the peer died or is unreachable) or timed out (cancelled). `progress()` returns
  `(peer, None)` for a DONE one and `(peer, reason)` for the others, a timeout's reason
  being a `WarmupTimedOut`; the owner decides what they mean (a prefill node drops a
  FAILED peer and keeps a timed-out one: its loop was busy, not gone;
  kv_transfer/prefill_side.py).
* Warm-ups have their own request table: they count in neither the transport's stats
  nor its `num_inflight`. `cancel(peer)` ends a peer's warm-up silently; `close()` all.
* Not thread-safe: the transport's owner thread drives it.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import numpy as np
import torch
from nixl._api import nixl_agent

from pdserve.kv_transfer.kv_layout import KVLayout
from pdserve.kv_transfer.nixl_requests import NIXL_ERRORS, RequestTable
from pdserve.kv_transfer.transfer_types import (
    PeerMetadata,
    TransferHandle,
    TransferState,
    TransferStats,
    WarmupTimedOut,
)

logger = logging.getLogger(__name__)

# Every warm-up ends by then. Generous: on a loaded CPU box a healthy wireup can take
# hundreds of ms; a peer that is not up by then is treated as unreachable.
WARMUP_TIMEOUT_S = 10.0
MAX_ROUNDS = 8  # warm-up WRITEs per peer at most (see `progress`)


@dataclass
class _Warmup:
    local: np.ndarray  # descriptors of our scratch region
    remote: np.ndarray  # of the peer's
    remote_mem: str
    started: float
    handle: TransferHandle | None = None
    rounds: int = 0
    inline: bool = False  # the last WRITE completed as it was posted


class PeerWarmups:
    def __init__(
        self, agent: nixl_agent, name: str, layout: KVLayout, device: torch.device, timeout_s: float
    ) -> None:
        self._agent = agent
        self.name = name
        self.timeout_s = timeout_s
        self._mem_type = layout.mem_type
        # One block of every layer's K and V, in its own allocation (never a view of the KV
        # tensor), zero-filled; written as one descriptor per (layer, kv) like a real WRITE.
        self._piece = layout.block_bytes
        n = layout.block_bytes * 2 * layout.num_layers
        self.scratch = torch.zeros(n, dtype=torch.uint8, device=device)
        self._reg = agent.register_memory(self.scratch)
        self._dev = layout.device_id
        self._table = RequestTable(name)
        self._pending: dict[str, _Warmup] = {}

    @property
    def scratch_addr(self) -> int:
        return self.scratch.data_ptr()

    @property
    def scratch_bytes(self) -> int:
        return self.scratch.numel()

    @property
    def peers(self) -> list[str]:
        """Peers whose warm-up is still in flight."""
        return list(self._pending)

    def start(self, peer: str, md: PeerMetadata) -> bool:
        """Post the warm-up WRITE to `peer`; False if it announced no scratch region."""
        self.cancel(peer)
        nbytes = min(self.scratch_bytes, md.scratch_bytes)
        if nbytes <= 0 or md.scratch_addr == 0:
            return False
        piece = min(self._piece, nbytes)
        offsets = np.arange(0, nbytes - piece + 1, piece, dtype=np.uint64)
        w = _Warmup(
            _descs(self.scratch_addr + offsets, piece, self._dev),
            _descs(md.scratch_addr + offsets, piece, md.layout.device_id),
            md.layout.mem_type,
            time.perf_counter(),
        )
        self._pending[peer] = w
        self._post(peer, w)
        return True

    def _post(self, peer: str, w: _Warmup) -> None:
        stats = TransferStats(bytes=int(w.local[:, 1].sum()), descriptors=len(w.local))
        w.handle, rec = self._table.open(peer, stats)
        w.rounds += 1
        try:
            rec.xfer = self._agent.initialize_xfer(
                "WRITE",
                self._agent.get_xfer_descs(w.local, self._mem_type),
                self._agent.get_xfer_descs(w.remote, w.remote_mem),
                peer,
                b"",
            )
            status = self._agent.transfer(rec.xfer)
        except NIXL_ERRORS as e:
            logger.warning(
                "nixl transport %s: warm-up to %s failed to post: %s", self.name, peer, e
            )
            status = "ERR"
        w.inline = status == "DONE"
        self._settle(w.handle, rec, status)

    def progress(self) -> list[tuple[str, str | None]]:
        """Drive the warm-ups in flight; `(peer, None)` for each that completed,
        `(peer, reason)` for each that failed or ran out of time (cancelled)."""
        ended: list[tuple[str, str | None]] = []
        now = time.perf_counter()
        for peer, w in list(self._pending.items()):
            handle = w.handle
            rec = self._table.record(handle)
            if handle.state is TransferState.PENDING:
                try:
                    status = self._agent.check_xfer_state(rec.xfer)
                except NIXL_ERRORS as e:
                    logger.warning("nixl transport %s: warm-up to %s: %s", self.name, peer, e)
                    status = "ERR"
                self._settle(handle, rec, status)
            if handle.state is TransferState.DONE:
                self._table.release(handle)
                # A WRITE completing does not mean UCX finished wiring the connection up
                # (it may have gone over a lane set up first); once it is, a WRITE
                # between processes on a host completes as it is posted. Repost until
                # one does, or `MAX_ROUNDS` did (across hosts none completes inline).
                if not w.inline and w.rounds < MAX_ROUNDS and now < w.started + self.timeout_s:
                    self._post(peer, w)
                    continue
                ms = (now - w.started) * 1e3
                logger.info(
                    "nixl transport %s: connection to %s up (%.1f ms, %d warm-up WRITEs)",
                    self.name, peer, ms, w.rounds,
                )  # fmt: skip
                ended.append((peer, None))
                del self._pending[peer]
                continue
            if handle.state is TransferState.FAILED:
                ended.append((peer, "the connection warm-up WRITE failed"))
            elif now >= w.started + self.timeout_s:
                reason = f"the connection warm-up did not finish in {self.timeout_s:g} s"
                ended.append((peer, WarmupTimedOut(reason)))
            else:
                continue
            logger.warning("nixl transport %s: peer %s: %s", self.name, peer, ended[-1][1])
            del self._pending[peer]
            self._table.release(handle)  # cancels one still in flight
        return ended

    def _settle(self, handle: TransferHandle, rec, status: str) -> None:
        if status == "DONE":
            self._table.finish(handle, rec, TransferState.DONE)
        elif status == "ERR":
            self._table.finish(handle, rec, TransferState.FAILED)

    def cancel(self, peer: str) -> None:
        """End `peer`'s warm-up, if any, without reporting it."""
        w = self._pending.pop(peer, None)
        if w is not None and w.handle is not None and not w.handle.released:
            self._table.release(w.handle)

    def check_integrity(self) -> None:
        self._table.check_integrity()

    def close(self) -> None:
        for peer in list(self._pending):
            self.cancel(peer)
        self._table.release_parked()
        self._agent.deregister_memory(self._reg)
        self._reg = None
        self._agent = None  # no reference left to keep a destroyed transport's agent alive


def _descs(addrs: np.ndarray, length: int, dev: int) -> np.ndarray:
    out = np.empty((addrs.size, 3), dtype=np.uint64)
    out[:, 0], out[:, 1], out[:, 2] = addrs, length, dev
    return out
