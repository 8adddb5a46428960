"""Chained block hashes: the identity of a block of KV, shared by every engine and the router.

    root        = blake2b("pdserve-root-v2" || model name || block size
                          [|| weights digest] [|| cache salt])
    hash(block) = blake2b(hash(previous block), or root for the first || its int32 token ids)

Stable across processes and runs (never Python's `hash()`), so nodes and the router agree
on the hash of the same tokens. The root is keyed by the model name, the block size and
the digest of the model's weights (pdserve/common/weights_digest.py): blocks of two models,
two checkpoints under one name, or two block sizes never share a hash; nor do the blocks of
requests with different `cache_salt`s (a tenant's prefix hits are visible only to requests
with its salt; no salt is the shared, unsalted root). A leaf module (stdlib
only): the router imports it without pulling in the engine or torch.
"""

from __future__ import annotations

import hashlib
from array import array

HASH_BYTES = 16
_ROOT_TAG = b"pdserve-root-v2"


def root_hash(model: str, block_size: int, salt: str = "", weights: str = "") -> bytes:
    """The parent of a prompt's first block for this model, block size, cache salt and
    weights digest ("": unknown, as in tests with a stand-in model runner)."""
    h = hashlib.blake2b(digest_size=HASH_BYTES)
    h.update(_ROOT_TAG)
    h.update(model.encode())
    h.update(b"\x00")
    h.update(block_size.to_bytes(4, "little"))
    if weights:
        h.update(b"weights\x00")
        h.update(weights.encode())
    if salt:
        h.update(b"salt\x00")
        h.update(salt.encode())
    return h.digest()


def hash_block_tokens(parent: bytes, token_ids: list[int] | tuple[int, ...]) -> bytes:
    """Hash of one full block, chained from its parent (the root for the first block)."""
    h = hashlib.blake2b(parent, digest_size=HASH_BYTES)
    h.update(array("i", token_ids).tobytes())
    return h.digest()


def hash_prompt_blocks(token_ids: list[int], block_size: int, root: bytes) -> list[bytes]:
    """Hashes of every full block of `token_ids`, chained from `root`.

    The same bytes as `hash_block_tokens` block by block, but the prompt is packed into
    int32s once and each block is one blake2b call (half the time: the router hashes every
    prompt on its decision path)."""
    n = len(token_ids) // block_size
    if n <= 0:
        return []
    data = array("i", token_ids[: n * block_size]).tobytes()
    step = 4 * block_size
    blake2b = hashlib.blake2b
    hashes: list[bytes] = []
    parent = root
    for off in range(0, n * step, step):
        parent = blake2b(parent + data[off : off + step], digest_size=HASH_BYTES).digest()
        hashes.append(parent)
    return hashes
