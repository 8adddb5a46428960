"""Checksums of the KV store's chunks: written beside each chunk on save, checked on load.

LMCache's chunk format has no room for our metadata, so each chunk's checksums live
beside it: under `<chunk key>kvsum` in the same Redis (a node without a remote tier keeps
them in a bounded dict, beside its local CPU tier). The value is one xxh3_64 per block of
the chunk as it sits in our paged cache (engine/kv_checksum.py; a prompt's partly filled
last block hashes only its filled rows), msgpack-encoded, written with SET NX: the first
writer's bytes are the chunk's, as LMCache keeps the first copy of a key too.

On load, every block filled from the store (from the first block not already present up
to what the retrieve reported) is hashed and compared; the load is cut at the first
block that differs, so the request computes from there (a miss, counted in
`kv_store_checksum_mismatches`, with a warning). A chunk without checksums (saved by a
node with checksums off, or before they existed) is accepted unverified, as before.
"""

from __future__ import annotations

import logging
from collections import OrderedDict

import msgspec
import torch

from pdserve.engine.kv_checksum import block_checksums

logger = logging.getLogger(__name__)

MAX_LOCAL_CHUNKS = 65_536  # without Redis: chunks whose checksums are remembered


class StoreChecksums:
    def __init__(self, kv_cache: torch.Tensor, block_size: int, remote_url: str | None):
        self.kv = kv_cache
        self.bs = block_size
        self.mismatches = 0
        self._local: OrderedDict[str, bytes] = OrderedDict()
        self._redis = None
        if remote_url is not None:
            import redis

            self._redis = redis.Redis.from_url(remote_url, socket_timeout=10.0)

    def _blocks(self, start: int, end: int, slots: list[int]) -> tuple[list[int], list[int]]:
        """The blocks holding tokens [start, end) (block-aligned start), with their rows."""
        bs = self.bs
        firsts = range(start, end, bs)
        return [slots[t] // bs for t in firsts], [min(bs, end - t) for t in firsts]

    def save(self, chunks: list[tuple[int, int, str]], slots: list[int]) -> None:
        """Record the checksums of `chunks` ((start, end, key), as stored) from `slots`."""
        values = {}
        for start, end, key in chunks:
            ids, rows = self._blocks(start, end, slots)
            values[key + "kvsum"] = msgspec.msgpack.encode(block_checksums(self.kv, ids, rows))
        if self._redis is not None:
            pipe = self._redis.pipeline(transaction=False)
            for k, v in values.items():
                pipe.set(k, v, nx=True)
            pipe.execute()
            return
        for k, v in values.items():
            self._local.setdefault(k, v)
            self._local.move_to_end(k)
        while len(self._local) > MAX_LOCAL_CHUNKS:
            self._local.popitem(last=False)

    def verified(
        self, chunks: list[tuple[int, int, str]], slots: list[int], present: int, filled: int
    ) -> int:
        """How much of the loaded prefix [0, `filled`) to keep: `filled`, or the first token
        of the first block in [`present`, `filled`) whose contents differ from its chunk's
        checksums (`present`: block-aligned, already in the cache, not loaded)."""
        todo = [(s, e, k) for s, e, k in chunks if e > present and s < filled]
        if not todo:
            return filled
        keys = [k + "kvsum" for _, _, k in todo]
        if self._redis is not None:
            raw = self._redis.mget(keys)
        else:
            raw = [self._local.get(k) for k in keys]
        for (start, end, key), value in zip(todo, raw):
            if value is None:
                continue  # saved without checksums: accepted unverified
            expected = msgspec.msgpack.decode(value, type=list[int])
            lo, hi = max(start, present), min(end, filled)
            ids, rows = self._blocks(lo, hi, slots)
            first = (lo - start) // self.bs
            for i, got in enumerate(block_checksums(self.kv, ids, rows)):
                j = first + i
                if j >= len(expected) or rows[i] != min(self.bs, end - lo - i * self.bs):
                    return lo + i * self.bs  # a chunk shorter than recorded: stop here
                if got != expected[j]:
                    self.mismatches += 1
                    logger.warning(
                        "KV store chunk %s: block %d of the chunk fails its checksum; the "
                        "load stops at token %d (the rest is computed)", key, j, lo + i * self.bs
                    )  # fmt: skip
                    return lo + i * self.bs
        return filled

    def close(self) -> None:
        if self._redis is not None:
            self._redis.close()
