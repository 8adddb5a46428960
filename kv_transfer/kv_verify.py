"""The decode node's check of landed KV blocks against their sender's checksums.

A prefill node that was asked (`PrefillOrder.checksums`) sends the xxh3_64 of every block
it wrote in its `PrefillDone` (engine/kv_checksum.py); once every block has landed (NIXL:
the done is the last WRITE's notification; LMCache: the retrieve finished), the decode
node hashes its own copies and compares, before the request joins a batch. A mismatch (a
torn or misdirected WRITE, memory corruption, a broken or lying peer) fails the attempt
like an incomplete transfer: the request fails over to another prefill node or is
prefilled here, never decoded from the bad blocks.

Test hook (`PDSERVE_KV_CORRUPT=1`, set only by tests): before the check, flip bytes of
the first landed block of every attempt, so a real corruption between the peer's hash
and ours is caught end to end. Off unless that variable says so.
"""

from __future__ import annotations

import logging
import os

import torch

from pdserve.engine.kv_checksum import block_checksums

logger = logging.getLogger(__name__)

CORRUPT_ENV = "PDSERVE_KV_CORRUPT"


def corrupt_enabled() -> bool:
    return os.environ.get(CORRUPT_ENV, "0") == "1"


def flip_bytes(kv_cache: torch.Tensor, block_id: int) -> None:
    """Invert the first 8 bytes of `block_id`'s K rows in layer 0 (the test hook; a
    tensor-parallel node's: in rank 0's cache)."""
    kv_cache = getattr(kv_cache, "caches", (kv_cache,))[0]
    raw = kv_cache[0, 0, block_id].view(torch.uint8).reshape(-1)
    raw[:8].bitwise_xor_(0xFF)


def mismatches(kv_cache: torch.Tensor, block_ids: list[int], expected: list[int]) -> list[int]:
    """The ids among `block_ids` whose contents do not hash to `expected` (same order)."""
    got = block_checksums(kv_cache, block_ids)
    return [b for b, g, e in zip(block_ids, got, expected) if g != e]
