"""Chained block hashes, shared by the engine's prefix cache, the KV index and the router.

hash(block i) = blake2b(hash(block i-1) || token ids of block i as little-endian int32).
Stable across processes and runs (never Python's `hash()`), so two nodes and the router
agree on the hash of the same tokens.
"""

from __future__ import annotations

import hashlib
from array import array

HASH_BYTES = 16
_ROOT = b"pdserve-root-v1"


def hash_block_tokens(parent: bytes | None, token_ids: list[int] | tuple[int, ...]) -> bytes:
    h = hashlib.blake2b(digest_size=HASH_BYTES)
    h.update(parent if parent is not None else _ROOT)
    h.update(array("i", token_ids).tobytes())
    return h.digest()


def hash_prompt_blocks(token_ids: list[int], block_size: int) -> list[bytes]:
    """Hashes of every full block of `token_ids`, chained from the root."""
    hashes: list[bytes] = []
    parent = None
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block_tokens(parent, token_ids[start : start + block_size])
        hashes.append(parent)
    return hashes
