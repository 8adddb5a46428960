"""A debug audit of the one-owner rule for held blocks (`PDSERVE_KV_POISON=1`).

When a failed or cancelled attempt's blocks are released (`Released`: no WRITE of the
attempt can land any more), the audit fills those that became free (not a prefix-cache
block another request shares) with +inf, a value no forward pass
writes into KV. Until a block is handed out again it must keep that value: the audit
checks the free poisoned blocks before every step, and each poisoned block again at the
moment a request is given it (after scheduling, before the step writes it). A WRITE that
landed after the release shows as a violation (`kv_poison_violations` in the engine's
stats, and an error in the log naming the blocks). Off by default: it costs a scan of
the poisoned blocks per step.
"""

from __future__ import annotations

import logging
import os

import torch

logger = logging.getLogger(__name__)

ENV = "PDSERVE_KV_POISON"


def poison_enabled() -> bool:
    return os.environ.get(ENV, "0") == "1"


class PoisonAudit:
    def __init__(self, kv_cache: torch.Tensor):
        self.kv = kv_cache  # the logical view: [L, 2, N, bs, Hkv, D]
        self.blocks: set[int] = set()  # released, poisoned, not handed out since
        self.violations = 0

    def poison(self, block_ids: list[int]) -> None:
        if block_ids:
            self.kv[:, :, block_ids] = float("inf")
            self.blocks.update(block_ids)

    def _intact(self, block_ids: list[int]) -> list[bool]:
        view = self.kv[:, :, block_ids].transpose(0, 2).reshape(len(block_ids), -1)
        return torch.isinf(view).all(dim=1).tolist()

    def check(self, block_ids: list[int], when: str, forget: bool = True) -> None:
        """Check those of `block_ids` still poisoned; forget them (handed out) or, with
        `forget=False`, only those found written."""
        ids = [b for b in block_ids if b in self.blocks]
        if not ids:
            return
        bad = [b for b, ok in zip(ids, self._intact(ids)) if not ok]
        self.blocks.difference_update(ids if forget else bad)
        if bad:
            self.violations += len(bad)
            logger.error("KV poison: blocks %s were written after their release (%s)", bad, when)

    def scan(self) -> None:
        """Every poisoned block is free (handed-out ones were checked and forgotten)."""
        self.check(sorted(self.blocks), "while free", forget=False)
