"""Chained block hashes: the identity of a block of KV, shared by every engine and the router.

    root        = blake2b("pdserve-root-v2" || model name || block size)
    hash(block) = blake2b(hash(previous block), or root for the first || its int32 token ids)

Stable across processes and runs (never Python's `hash()`), so nodes and the router agree
on the hash of the same tokens. The root is keyed by the model name and the block size:
blocks of two models, or of two block sizes, never share a hash. A leaf module (stdlib
only): the router imports it without pulling in the engine or torch.
"""

from __future__ import annotations

import hashlib
from array import array

HASH_BYTES = 16
_ROOT_TAG = b"pdserve-root-v2"


def root_hash(model: str, block_size: int) -> bytes:
    """The parent of a prompt's first block for this model and block size."""
    h = hashlib.blake2b(digest_size=HASH_BYTES)
    h.update(_ROOT_TAG)
    h.update(model.encode())
    h.update(b"\x00")
    h.update(block_size.to_bytes(4, "little"))
    return h.digest()


def hash_block_tokens(parent: bytes, token_ids: list[int] | tuple[int, ...]) -> bytes:
    """Hash of one full block, chained from its parent (the root for the first block)."""
    h = hashlib.blake2b(parent, digest_size=HASH_BYTES)
    h.update(array("i", token_ids).tobytes())
    return h.digest()


def hash_prompt_blocks(token_ids: list[int], block_size: int, root: bytes) -> list[bytes]:
    """Hashes of every full block of `token_ids`, chained from `root`."""
    hashes: list[bytes] = []
    parent = root
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block_tokens(parent, token_ids[start : start + block_size])
        hashes.append(parent)
    return hashes
