"""Per-request view of the block pool: prefix lookup, slot allocation for a step, free."""

from __future__ import annotations

from collections.abc import Collection

from pdserve.engine.block_pool import BlockPool, BlockPoolError, KVBlock
from pdserve.engine.request import Request

HoldKey = tuple[str, int]  # (request id, transfer attempt)


class KVCacheManager:
    """Owns which blocks each request holds.

    Contract: `get_computed_blocks` is a pure lookup (takes no references);
    `allocate_slots` either takes every block the step needs or nothing (returns None);
    `free` releases everything a request holds. A request's blocks cover its first
    `num_computed_tokens + num_new_tokens` tokens after a successful allocation.

    Holds: blocks a KV transfer may still touch after their request ended (a late WRITE
    into them, an export still reading them) move to `holds`, keyed by (request id,
    attempt), and leave circulation until `release_hold`. Exactly one party releases a
    hold: the KV role that claimed it, once it can prove no transfer touches the blocks.
    `check_integrity(claimed)` raises unless every hold is claimed and every claim held.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True):
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, enable_caching)
        self.req_blocks: dict[str, list[KVBlock]] = {}
        self.holds: dict[HoldKey, list[KVBlock]] = {}
        self._num_cached: dict[str, int] = {}  # leading blocks already registered in cache
        self.prefix_queries = 0  # tokens looked up
        self.prefix_hits = 0  # tokens found

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def usage(self) -> float:
        return self.pool.num_used_blocks / self.pool.num_blocks

    def get_computed_blocks(self, request: Request) -> tuple[list[KVBlock], int]:
        """Longest cached prefix of the request's tokens: (blocks, number of tokens).

        At least one token is always left to compute, so the last position's logits exist.
        """
        if not self.enable_caching:
            return [], 0
        max_blocks = (request.num_tokens - 1) // self.block_size
        bs = self.block_size
        hits: list[KVBlock] = []
        for i, h in enumerate(request.block_hashes[:max_blocks]):
            block = self.pool.get_cached_block(h, request.all_token_ids[i * bs : (i + 1) * bs])
            if block is None:
                break
            hits.append(block)
        self.prefix_queries += request.num_tokens
        self.prefix_hits += len(hits) * bs
        return hits, len(hits) * bs

    def blocks_needed(
        self, request: Request, num_new_tokens: int, num_computed_blocks: int = 0
    ) -> int:
        total = -(-(request.num_computed_tokens + num_new_tokens) // self.block_size)
        held = len(self.req_blocks.get(request.request_id, ())) + num_computed_blocks
        return max(0, total - held)

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        computed_blocks: list[KVBlock] | None = None,
        cache: bool = True,
    ) -> list[KVBlock] | None:
        """Blocks for the next `num_new_tokens` tokens, or None if the pool cannot hold them.

        `computed_blocks` (from `get_computed_blocks`, first scheduling only) are taken
        as the request's leading blocks; `request.num_computed_tokens` must already count them.
        `cache=False` keeps the new blocks out of the prefix cache (their KV comes from
        elsewhere later: call `cache_blocks` once it has landed). Blocks a KV transfer
        moves (`cache=False` on a decode node, a prefill node's `kv_export` requests) are
        taken in runs of consecutive ids, so the transfer needs few descriptors.
        """
        computed_blocks = computed_blocks or []
        need = self.blocks_needed(request, num_new_tokens, len(computed_blocks))
        # Free cached blocks we are about to reuse do not count as allocatable.
        reusable_free = sum(1 for b in computed_blocks if b.ref_cnt == 0)
        if need > self.pool.num_free_blocks - reusable_free:
            return None
        blocks = self.req_blocks.setdefault(request.request_id, [])
        if computed_blocks:
            self.pool.touch(computed_blocks)
            blocks.extend(computed_blocks)
            self._num_cached[request.request_id] = len(computed_blocks)
        if request.kv_export or not cache:  # PD: these blocks cross the wire, keep them in runs
            after = blocks[-1].block_id if blocks else None
            new_blocks = self.pool.get_new_blocks_in_runs(need, after)
        else:
            new_blocks = self.pool.get_new_blocks(need)
        blocks.extend(new_blocks)
        if cache:
            self.cache_blocks(request, request.num_computed_tokens + num_new_tokens)
        return new_blocks

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        """Register the request's blocks that are full once `num_tokens` are computed."""
        if not self.enable_caching:
            return
        rid = request.request_id
        blocks = self.req_blocks[rid]
        start = self._num_cached.get(rid, 0)
        end = min(num_tokens // self.block_size, len(request.block_hashes))
        bs = self.block_size
        for i in range(start, end):
            tokens = request.all_token_ids[i * bs : (i + 1) * bs]
            self.pool.cache_full_block(blocks[i], request.block_hashes[i], tokens)
        self._num_cached[rid] = max(start, end)

    def free(self, request: Request) -> None:
        self.release(request.request_id)

    def hold(self, request: Request) -> HoldKey:
        """Move a request's blocks into a hold under (request id, attempt); see the class doc."""
        key = (request.request_id, request.attempt)
        if key in self.holds:
            raise BlockPoolError(f"hold {key} exists already")
        self.holds[key] = self.req_blocks.pop(request.request_id, [])
        self._num_cached.pop(request.request_id, None)
        return key

    def release_hold(self, key: HoldKey) -> None:
        """Free the blocks of hold `key` (only its owner may, once no transfer touches them)."""
        blocks = self.holds.pop(key, None)
        if blocks is None:
            raise BlockPoolError(f"no hold {key}")
        self.pool.free_blocks(list(reversed(blocks)))

    def pin(self, request_id: str, num_blocks: int, owner: str) -> list[int]:
        """Take an extra reference on the request's first `num_blocks` blocks for `owner`
        (e.g. a store job still reading them); `release(owner)` drops it. Returns their ids."""
        blocks = self.req_blocks[request_id][:num_blocks]
        self.pool.touch(blocks)
        self.req_blocks.setdefault(owner, []).extend(blocks)
        return [b.block_id for b in blocks]

    def park(self, request_id: str, owner: str) -> None:
        """Move all of a request's blocks to `owner` (a job may still write them)."""
        self.req_blocks.setdefault(owner, []).extend(self.req_blocks.pop(request_id, []))
        self._num_cached.pop(request_id, None)

    def release(self, owner: str) -> None:
        """Free every block request `owner` holds."""
        blocks = self.req_blocks.pop(owner, [])
        self._num_cached.pop(owner, None)
        self.pool.free_blocks(list(reversed(blocks)))

    def hold_block_ids(self, key: HoldKey) -> list[int]:
        return [b.block_id for b in self.holds.get(key, ())]

    @property
    def num_held_blocks(self) -> int:
        return sum(len(v) for v in self.holds.values())

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_blocks.get(request_id, ())]

    def check_integrity(self, claimed: Collection[HoldKey] = ()) -> None:
        """Pool invariants, block refs == blocks owned, and every hold claimed exactly."""
        self.pool.check_integrity()
        held = sum(len(v) for v in self.req_blocks.values()) + self.num_held_blocks
        refs = sum(b.ref_cnt for b in self.pool.blocks)
        if held != refs:
            raise BlockPoolError(f"requests and holds own {held} block refs, pool counts {refs}")
        claimed = set(claimed)
        if unclaimed := set(self.holds) - claimed:
            raise BlockPoolError(f"holds no live transfer claims: {sorted(unclaimed)[:8]}")
        if missing := claimed - set(self.holds):
            raise BlockPoolError(f"transfers claim holds that do not exist: {sorted(missing)[:8]}")
