"""The pool of paged KV blocks: free queue, reference counts and the prefix cache.

A block is *free* when its ref count is 0; it sits in the free queue (oldest-freed
first). A free block may still be *cached*: it keeps its hash and contents until it is
handed out again, which evicts it from the cache (LRU, since the queue is in free order).
A cache hit on a free block takes it out of the queue. A hash hit is confirmed by
comparing token ids: different tokens with the same hash never share a block.

Invariants (`check_integrity`): every block is either in the free queue with ref 0, or
out of it with ref > 0; free + used == total; every cache entry points at a block that
carries that hash.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np


class BlockPoolError(RuntimeError):
    pass


@dataclass(eq=False)
class KVBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: bytes | None = None
    token_ids: tuple[int, ...] | None = None  # the block's tokens, to confirm hash hits

    def __repr__(self) -> str:
        return f"KVBlock({self.block_id}, ref={self.ref_cnt}, cached={self.block_hash is not None})"


@dataclass
class CacheEvents:
    """Block hashes that entered or left this pool's prefix cache (for the KV index)."""

    stored: list[bytes] = field(default_factory=list)
    evicted: list[bytes] = field(default_factory=list)
    store_saved: list[bytes] = field(default_factory=list)  # now in the shared KV store


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True):
        if num_blocks < 1:
            raise BlockPoolError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, KVBlock] = OrderedDict((b.block_id, b) for b in self.blocks)
        self._cached: dict[bytes, KVBlock] = {}
        self._events = CacheEvents()
        self.record_events = False

    # -- queries ---------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def get_cached_block(self, block_hash: bytes, token_ids: list[int]) -> KVBlock | None:
        """The block holding exactly these tokens under this hash, or None."""
        block = self._cached.get(block_hash)
        if block is None or block.token_ids != tuple(token_ids):
            return None
        return block

    # -- mutations -------------------------------------------------------------------
    def get_new_blocks(self, n: int) -> list[KVBlock]:
        """Take n blocks off the front of the free queue (evicting their cache entries)."""
        if n > len(self._free):
            raise BlockPoolError(f"asked for {n} blocks, only {len(self._free)} free")
        out = []
        for _ in range(n):
            _, block = self._free.popitem(last=False)
            self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def get_new_blocks_in_runs(self, n: int, after: int | None = None) -> list[KVBlock]:
        """Like `get_new_blocks`, but as few runs of consecutive block ids as possible.

        For blocks a KV transfer moves: a run is one descriptor per layer and K/V, so a
        request held in a few runs on both nodes transfers like one contiguous WRITE.
        Free blocks without prefix-cache content are used first while there are enough
        (cached ones only when needed); the run continuing block `after` (the request's
        last block) comes first, then the longest runs. Costs O(free blocks): use it for
        the blocks that cross the wire, not for every decode step.
        """
        if n > len(self._free):
            raise BlockPoolError(f"asked for {n} blocks, only {len(self._free)} free")
        if n == 0:
            return []
        ids = np.fromiter(self._free, dtype=np.int64, count=len(self._free))
        cached = np.fromiter(
            (b.block_id for b in self._cached.values() if b.ref_cnt == 0), dtype=np.int64
        )
        if cached.size and ids.size - cached.size >= n:
            ids = np.setdiff1d(ids, cached, assume_unique=True)  # sorted
        else:
            ids.sort()
        starts = np.concatenate(([0], np.flatnonzero(np.diff(ids) != 1) + 1))
        lengths = np.diff(np.concatenate((starts, [ids.size])))
        order = np.argsort(-lengths, kind="stable")  # longest first, then lowest id
        if after is not None:
            i = int(np.searchsorted(ids, after + 1))
            if i < ids.size and ids[i] == after + 1:
                run = int(np.searchsorted(starts, i, side="right")) - 1
                starts[run], lengths[run] = i, lengths[run] - (i - starts[run])
                order = np.concatenate(([run], order[order != run]))
        out: list[KVBlock] = []
        for r in order:
            first, take = int(starts[r]), min(int(lengths[r]), n - len(out))
            for block_id in ids[first : first + take].tolist():
                block = self._free.pop(block_id)
                self._evict(block)
                block.ref_cnt = 1
                out.append(block)
            if len(out) == n:
                break
        return out

    def touch(self, blocks: list[KVBlock]) -> None:
        """Take a reference on (possibly free, cached) blocks, e.g. on a prefix hit."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self._free[block.block_id]
            block.ref_cnt += 1

    def free_blocks(self, blocks: list[KVBlock]) -> None:
        """Drop one reference on each block; blocks reaching 0 join the free queue's tail.

        Pass a request's blocks tail-first so its last blocks are evicted first.
        """
        for block in blocks:
            if block.ref_cnt <= 0:
                raise BlockPoolError(f"double free of block {block.block_id}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free[block.block_id] = block

    def cache_full_block(self, block: KVBlock, block_hash: bytes, token_ids: list[int]) -> None:
        """Register a full block under its hash (no-op if caching is off or already cached)."""
        if not self.enable_caching or block.block_hash is not None:
            return
        if block_hash in self._cached:
            return  # another block already holds these tokens; keep the first
        block.block_hash = block_hash
        block.token_ids = tuple(token_ids)
        self._cached[block_hash] = block
        if self.record_events:
            self._events.stored.append(block_hash)

    def reset_prefix_cache(self) -> None:
        """Forget every cached block (only blocks nobody holds keep no hash)."""
        for block in list(self._cached.values()):
            self._evict(block)

    def cached_hashes(self) -> list[bytes]:
        """Every hash in the prefix cache now (a snapshot for rebuilding the KV index)."""
        return list(self._cached)

    def note_store_saved(self, block_hashes: list[bytes]) -> None:
        """Blocks the shared KV store (engine/kv_store.py) now holds, for its index set."""
        if self.record_events:
            self._events.store_saved += block_hashes

    def take_events(self) -> CacheEvents:
        events, self._events = self._events, CacheEvents()
        return events

    def _evict(self, block: KVBlock) -> None:
        if block.block_hash is None:
            return
        if self._cached.get(block.block_hash) is block:
            del self._cached[block.block_hash]
            if self.record_events:
                self._events.evicted.append(block.block_hash)
        block.block_hash = None
        block.token_ids = None

    # -- invariants ------------------------------------------------------------------
    def check_integrity(self) -> None:
        """Raise BlockPoolError if any pool invariant is broken."""
        free_ids = set(self._free)
        if len(free_ids) != len(self._free):
            raise BlockPoolError("free queue holds a block twice")
        used = 0
        for block in self.blocks:
            if block.ref_cnt < 0:
                raise BlockPoolError(f"block {block.block_id} has ref {block.ref_cnt}")
            in_free = block.block_id in free_ids
            if in_free != (block.ref_cnt == 0):
                raise BlockPoolError(
                    f"block {block.block_id}: ref {block.ref_cnt} but in_free_queue={in_free}"
                )
            used += block.ref_cnt > 0
        if used + len(free_ids) != self.num_blocks:
            raise BlockPoolError(f"free {len(free_ids)} + used {used} != {self.num_blocks}")
        for h, block in self._cached.items():
            if block.block_hash != h:
                raise BlockPoolError(f"cache entry for block {block.block_id} has a stale hash")
