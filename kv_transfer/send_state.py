"""What the prefill side (`kv_transfer/prefill_side.py`) keeps per attempt it serves.

`SendState` is the attempt's place in the state machine drawn there; `_Send` its record:
the order, the decode node's connection, the WRITEs posted and deferred (no lease yet),
the final blocks with their `PrefillDone`, and the checksums of every block sent so far
when the order asked for them (engine/kv_checksum.py; the done carries them).
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from pdserve.kv_transfer import messages as m
from pdserve.kv_transfer.transfer_types import TransferHandle


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
    checksums: list[int] = field(default_factory=list)  # of the blocks sent, in order
