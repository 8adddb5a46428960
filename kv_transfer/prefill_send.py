"""One attempt's send on the prefill side: its state, its posted WRITEs, and cancelling
them when the connection's lease lapses.

A WRITE is posted only while the decode node's lease on the connection runs
(`PrefillSide._may_post`), but a WRITE posted in time may still be moving when the lease
ends: a slow link, a long engine step before NIXL was progressed again, or a prefill
process stopped and resumed. The decode node counts on nothing of a fenced connection
landing later than its last lease plus `abort_grace_s`, whatever the two hosts' clocks
read, so once the lease has lapsed (this host's monotonic clock) every WRITE of the
connection still PENDING is cancelled: its NIXL request is released
(`DataPlane.release`), before anything progresses the transfer further, rather than left
to finish into blocks the decode node may have given to another request. A cancelled
WRITE may still land what the network already carries, so the attempt's end message
(which lets the decode node release at once) waits `grace_s` after the cancel.

The record also keeps the checksums of every block sent so far when the order asked for
them (engine/kv_checksum.py; the done carries them).
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from pdserve.engine.kv_checksum import block_checksums
from pdserve.kv_transfer import messages as m
from pdserve.kv_transfer.transfer_types import DataPlane, TransferHandle, TransferState


class SendState(enum.Enum):
    COMPUTING = "computing"
    FINISHING = "finishing"
    ENDING = "ending"


@dataclass
class _Send:
    order: m.PrefillOrder
    ident: bytes
    state: SendState = SendState.COMPUTING
    handles: list[TransferHandle] = field(default_factory=list)
    blocks_sent: int = 0
    final: tuple[list[int], list[int], m.PrefillDone] | None = None
    final_posted: bool = False
    reply: m.ToDecode | None = None  # what the decode node hears when ENDING completes
    started: float = field(default_factory=time.perf_counter)
    deadline: float = float("inf")  # this clock: no WRITE is posted after it
    deferred: list[tuple[list[int], list[int]]] = field(default_factory=list)  # no lease yet
    quiet_until: float = float("-inf")  # ENDING: no end message before (cancelled WRITEs)
    checksums: list[int] = field(default_factory=list)  # of the blocks sent, in order

    def cancel_pending(self, data: DataPlane) -> int:
        """Release (cancel) every WRITE not known to have ended, without polling it first
        (a poll would progress it); the number cancelled."""
        pending = [h for h in self.handles if h.state is TransferState.PENDING]
        for h in pending:
            data.release(h)
        self.handles = [h for h in self.handles if not h.released]
        return len(pending)

    def hash_sent(self, kv_cache, src: list[int]) -> None:
        """Hash the blocks about to be sent (their step is done) if the order asked."""
        if self.order.checksums:
            self.checksums += block_checksums(kv_cache, src)
