"""The KV block index in Redis: which node's prefix cache holds which blocks.

One Redis set per node and boot epoch, `{prefix}:kv:{node_id}:{epoch}`, whose members are
the raw 16-byte block hashes (pdserve/common/block_hash.py) in that node's prefix cache, plus one
empty-string sentinel so that the set exists even when the cache is empty (a missing set
means Redis lost it: the node rebuilds it). The set carries the node's TTL, refreshed by
its heartbeat: a dead node's entries disappear with its record, and a restarted node
writes a new epoch's set while the old one ages out.

Writer (`KVIndexPublisher`, in the node's HTTP process, never on the engine loop): engine
output batches hand it the hashes that entered and left the prefix cache; a task flushes
them in one pipeline every `flush_interval_s`. If Redis fails, the buffer is dropped and
the set is rebuilt from a snapshot of the engine's cache once Redis answers again.
Reader (`PrefixHits`, in the router): one round trip (a server-side script over every
candidate's set) gives how many leading blocks of a prompt each node holds.

The shared KV store (LMCache prefix store) has a set too, `{prefix}:kv:store:{store_id}`:
every node saving to it adds the hashes of the full blocks of each prompt it saved. A node
that loads from that store (`NodeRecord.kv_store`) counts as holding the longer of its
own prefix and the store's, so a prompt whose prefix is in the store is cheap on any node.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Awaitable, Callable, Sequence

from redis.asyncio import Redis
from redis.exceptions import RedisError

from pdserve.cluster.redis_client import LeanRedis, Pending
from pdserve.cluster.registry import NodeRecord
from pdserve.common.redis_keys import ClusterKeys

logger = logging.getLogger(__name__)

SENTINEL = b""
# The store's chunks live until Redis evicts them; a block listed here but gone from the
# store costs a misjudged route, never a wrong answer (the node then computes it).
STORE_TTL_S = 24 * 3600
_CHUNK = 10_000  # members per SADD when rebuilding


class KVIndexPublisher:
    """Mirror one node's prefix cache into its index set.

    Within one engine batch every eviction of a hash precedes any store of the same hash
    (blocks are only evicted while being handed out, before the step caches new ones), so
    a batch is applied as SREM evicted, then SADD stored.
    """

    def __init__(
        self,
        redis: Redis,
        key: str,
        ttl_s: float,
        snapshot: Callable[[], Awaitable[list[bytes]]],
        flush_interval_s: float = 0.05,
        max_pending: int = 200_000,
        store_key: str | None = None,
    ):
        """`store_key`: the index set of the shared KV store this node saves to (shared by
        every node on that store; added to, never rebuilt, refreshed to `STORE_TTL_S`)."""
        self.redis = redis
        self.key = key
        self.store_key = store_key
        self._store_pending: list[bytes] = []
        self.ttl_ms = int(ttl_s * 1000)
        self.snapshot = snapshot
        self.flush_interval_s = flush_interval_s
        self.max_pending = max_pending
        self._pending: list[tuple[list[bytes], list[bytes]]] = []
        self._num_pending = 0
        self.need_rebuild = True  # first flush writes the sentinel and the current cache
        self.published = 0  # hashes written (stored + evicted), for tests and metrics
        self.stopped = False  # set by the node when it leaves: no write after that

    def add(self, stored: list[bytes], evicted: list[bytes]) -> None:
        """Queue one engine batch's events (called on the node's event loop, never blocks)."""
        if not stored and not evicted:
            return
        self._pending.append((evicted, stored))
        self._num_pending += len(stored) + len(evicted)
        if self._num_pending > self.max_pending:  # Redis is slow or gone: rebuild later
            self._drop_pending()
            self.need_rebuild = True

    def add_store_saved(self, hashes: list[bytes]) -> None:
        """Queue hashes of blocks the shared store now holds (flushed with the rest)."""
        if self.store_key is not None and len(self._store_pending) < self.max_pending:
            self._store_pending += hashes

    def _drop_pending(self) -> None:
        self._pending.clear()
        self._num_pending = 0

    async def run(self) -> None:
        """Flush until `stopped` is set or the task is cancelled."""
        while not self.stopped:
            await asyncio.sleep(self.flush_interval_s)
            try:
                await self.flush()
            except (RedisError, OSError) as e:
                if not self.need_rebuild:
                    logger.warning("KV index: Redis write failed (%s); will rebuild", e)
                self.need_rebuild = True
                self._drop_pending()

    async def flush(self) -> None:
        if self.need_rebuild:
            await self._rebuild()
        if self._store_pending:
            saved, self._store_pending = self._store_pending, []
            pipe = self.redis.pipeline(transaction=False)
            pipe.sadd(self.store_key, *saved)
            pipe.expire(self.store_key, STORE_TTL_S)
            await pipe.execute()
        if not self._pending:
            return
        batches, n = self._pending, self._num_pending
        self._pending, self._num_pending = [], 0
        pipe = self.redis.pipeline(transaction=False)
        for evicted, stored in batches:
            if evicted:
                pipe.srem(self.key, *evicted)
            if stored:
                pipe.sadd(self.key, *stored)
        pipe.pexpire(self.key, self.ttl_ms)
        await pipe.execute()
        self.published += n

    async def _rebuild(self) -> None:
        # Events that arrive while the snapshot is taken stay pending and are applied
        # after it: replaying in order any suffix of the history onto a state that already
        # reflects it gives the same final set.
        self._drop_pending()
        hashes = await self.snapshot()
        pipe = self.redis.pipeline(transaction=True)
        pipe.delete(self.key)
        pipe.sadd(self.key, SENTINEL)
        for i in range(0, len(hashes), _CHUNK):
            pipe.sadd(self.key, *hashes[i : i + _CHUNK])
        pipe.pexpire(self.key, self.ttl_ms)
        await pipe.execute()
        self.need_rebuild = False
        logger.info("KV index %s rebuilt with %d blocks", self.key, len(hashes))


# KEYS: index sets; ARGV: a prompt's hash chain. Per set, how many leading hashes it holds:
# one SISMEMBER of the first block (most nodes lack it), else a binary search for the last
# held block (~log2(blocks) SISMEMBERs; one SMISMEMBER of the whole chain cost the server ~3x
# more per holder). Exact because a prefix cache is prefix-closed: a block is cached only
# after its parent, and the block pool frees a request's blocks tail-first, so a parent is
# never evicted before its children (engine/block_pool.py).
_LEADING_HITS = """
local out = {}
local n = #ARGV
for k = 1, #KEYS do
  local key = KEYS[k]
  local lo = 0
  if redis.call('SISMEMBER', key, ARGV[1]) == 1 then
    lo = 1
    local hi = n
    while lo < hi do
      local mid = math.floor((lo + hi + 1) / 2)
      if redis.call('SISMEMBER', key, ARGV[mid]) == 1 then lo = mid else hi = mid - 1 end
    end
  end
  out[k] = lo
end
return out
"""


class PrefixHits:
    """Router-side reader: per node, how many leading blocks of a prompt it holds.

    One round trip per distinct chain (one per model and block size in the cluster, so
    usually one): a server-side script walks each node's set, so only one integer per node
    crosses the wire (EVALSHA; redis-py reloads the script after a Redis restart).
    """

    def __init__(self, redis: Redis | LeanRedis, keys: ClusterKeys):
        self.keys = keys
        self._lean = isinstance(redis, LeanRedis)
        if self._lean:
            self._script = redis.script(_LEADING_HITS)
        else:
            self._script = redis.register_script(_LEADING_HITS)

    async def __call__(
        self, nodes: Sequence[NodeRecord], chain_of: Callable[[NodeRecord], list[bytes]]
    ) -> dict[str, int]:
        """`chain_of(node)`: the prompt's chain under the node's model and block size.
        Raises RedisError/OSError if Redis is unreachable."""
        return await self.start(nodes, chain_of).result()

    def start(
        self, nodes: Sequence[NodeRecord], chain_of: Callable[[NodeRecord], list[bytes]]
    ) -> PendingHits:
        """The same lookup, its commands written now (with the lean client; redis-py's
        are sent when awaited): `await start(...).result()` later, or `.cancel()` it."""
        groups: dict[tuple[str, int], list[NodeRecord]] = {}
        for node in nodes:
            groups.setdefault((node.model, node.block_size), []).append(node)
        parts = []
        for members in groups.values():
            chain = chain_of(members[0])
            if not chain:
                continue
            keys = [self.keys.kv(n.node_id, n.epoch) for n in members]
            stores = sorted({n.kv_store for n in members if n.kv_store})
            keys += [self.keys.kv_store(s) for s in stores]
            if self._lean:
                reply = self._script.start(keys, chain)
            else:
                reply = Pending.later(functools.partial(self._script, keys=keys, args=chain))
            parts.append((members, stores, reply))
        return PendingHits(parts)


class PendingHits:
    """A `PrefixHits` lookup in flight."""

    def __init__(self, parts: list[tuple[list[NodeRecord], list[str], Pending]]):
        self._parts = parts

    async def result(self) -> dict[str, int]:
        """Node id -> leading blocks held. Raises RedisError/OSError if Redis failed."""
        hits: dict[str, int] = {}
        try:
            for members, stores, reply in self._parts:
                counts = [int(c) for c in await reply]
                in_store = dict(zip(stores, counts[len(members) :]))
                for n, c in zip(members, counts):  # a node can load what its store holds
                    hits[n.node_id] = max(c, in_store.get(n.kv_store, 0))
        finally:
            self.cancel()  # the rest, if one failed
        return hits

    def cancel(self) -> None:
        for _, _, reply in self._parts:
            reply.cancel()
