"""The cluster registry in Redis: who is alive, where, and how loaded (schema + codec).

The key names (`ClusterKeys`) and their layout are in pdserve/common/redis_keys.py.
A light module (msgspec, redis-py): nodes and the router both import it.
"""

from __future__ import annotations

import logging

import msgspec
from redis.asyncio import Redis

from pdserve.cluster.redis_client import LeanRedis
from pdserve.common.redis_keys import ClusterKeys

logger = logging.getLogger(__name__)

ROLES = ("colocated", "prefill", "decode")


class NodeRecord(msgspec.Struct, kw_only=True):
    """What a node tells the cluster about itself (`GET /v1/node` serves the same record)."""

    node_id: str
    role: str  # "colocated" | "prefill" | "decode"
    url: str  # HTTP base url of its OpenAI API
    model: str  # served model name (also the block-hash root key)
    block_size: int
    epoch: int  # boot epoch: changes whenever the node restarts
    kv_control: str = ""  # prefill: its KV control address (decode nodes connect to it)
    max_model_len: int = 0
    vocab_size: int = 0
    local_prefill_max_tokens: int = 0  # decode: a suffix this short is prefilled locally
    # load, as of `updated` (unix seconds)
    running: int = 0
    waiting: int = 0
    kv_used: int = 0
    kv_total: int = 0
    updated: float = 0.0
    # the shared KV store this node loads prefixes from ("": none); its blocks are in the
    # index set `{prefix}:kv:store:{kv_store}`, so they count as this node's hits too
    kv_store: str = ""

    @property
    def serves_clients(self) -> bool:
        """Decode and colocated nodes take client requests; prefill nodes take orders."""
        return self.role != "prefill"

    def to_redis(self) -> dict[str, str]:
        return {f: str(getattr(self, f)) for f in self.__struct_fields__}

    @classmethod
    def from_redis(cls, fields: dict[bytes, bytes]) -> NodeRecord:
        """Decode a Redis hash; raises ValueError if a field is missing or malformed."""
        raw = {k.decode(): v.decode() for k, v in fields.items()}
        try:
            rec = msgspec.convert(raw, cls, strict=False)
        except msgspec.ValidationError as e:
            raise ValueError(f"bad node record: {e}") from None
        if rec.role not in ROLES:
            raise ValueError(f"bad node record: role {rec.role!r}")
        return rec


async def read_nodes(redis: Redis, keys: ClusterKeys) -> list[NodeRecord]:
    """Every live node's record: SMEMBERS of the ids, then one pipeline of HGETALLs.

    Ids whose record expired are removed from the id set (a live node re-adds its own).
    Malformed records are skipped. Raises RedisError/OSError if Redis is unreachable.
    """
    lean = isinstance(redis, LeanRedis)  # the router's: ~5x less CPU for 128 records
    ids = sorted(
        await (redis.execute("SMEMBERS", keys.nodes) if lean else redis.smembers(keys.nodes))
    )
    if not ids:
        return []
    if lean:
        replies = await redis.pipeline([("HGETALL", keys.node(i.decode())) for i in ids])
        hashes = [dict(zip(r[::2], r[1::2])) for r in replies]
    else:
        pipe = redis.pipeline(transaction=False)
        for node_id in ids:
            pipe.hgetall(keys.node(node_id.decode()))
        hashes = await pipe.execute()
    records, gone = [], []
    for node_id, fields in zip(ids, hashes):
        if not fields:
            gone.append(node_id)
            continue
        try:
            records.append(NodeRecord.from_redis(fields))
        except ValueError as e:
            logger.warning("ignoring node %s: %s", node_id.decode(errors="replace"), e)
    if gone:
        await (redis.execute("SREM", keys.nodes, *gone) if lean else redis.srem(keys.nodes, *gone))
    return records
