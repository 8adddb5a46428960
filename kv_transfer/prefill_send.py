"""One attempt's send on the prefill side: its state, its posted WRITEs, and whether one
may still be moving.

A WRITE is posted only while the decode node's lease on the connection runs
(`PrefillSide._may_post`), but a WRITE posted in time may still be moving when the lease
ends: a slow link, a long engine step before NIXL was progressed again, or a prefill
process stopped and resumed. The decode node releases a fenced connection's blocks after
its last lease plus `abort_grace_s`, whatever the two hosts' clocks read (and drops its
incoming data-plane connections before that, for what the network still holds:
kv_transfer/decode_side.py), so once the lease has lapsed (this host's monotonic clock)
with a WRITE of the connection still PENDING, the prefill side stops every WRITE in flight
(`DataPlane.stop_writes`) before anything progresses a transfer further. Releasing the
handle would not do: NIXL frees the request while UCX goes on sending its data until the
whole WRITE has landed (measured over real NIXL between two hosts,
tests/multihost/test_cancel.py). A stopped WRITE may still land what the network already
carries, so each stopped attempt's end message (which lets the decode node release at
once) waits `grace_s` after the stop.

The record also keeps the checksums of every block sent so far when the order asked for
them (engine/kv_checksum.py; the done carries them).
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from pdserve.engine.kv_checksum import block_checksums
from pdserve.kv_transfer import messages as m
from pdserve.kv_transfer.transfer_types import TransferHandle, TransferState


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
    quiet_until: float = float("-inf")  # ENDING: no end message before (stopped WRITEs)
    epoch: int = -1  # the decode agent's epoch (PeerHello) of the last WRITE posted
    unsettled: bool = False  # a WRITE ended FAILED (stopped or failed): its data may move
    checksums: list[int] = field(default_factory=list)  # of the blocks sent, in order

    @property
    def pending(self) -> bool:
        """A WRITE of this attempt may still be moving (not known to have ended)."""
        return any(h.state is TransferState.PENDING for h in self.handles)

    def hash_sent(self, kv_cache, src: list[int]) -> None:
        """Hash the blocks about to be sent (their step is done) if the order asked."""
        if self.order.checksums:
            self.checksums += block_checksums(kv_cache, src)
