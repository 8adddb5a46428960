"""A node's membership in the cluster: its registry record, heartbeat and KV index writer.

With `--redis-url`, the node writes its `NodeRecord` (cluster/registry.py) every
`heartbeat_s` with a TTL of `node_ttl_s`, so a node that dies leaves the registry by itself,
and mirrors its prefix cache into the KV index (cluster/kv_index.py). All of this runs as
tasks on the HTTP process's event loop: the engine only attaches cache events to the
output batches it sends anyway. Redis being down costs nothing but log lines: the node
keeps serving, and re-registers and rebuilds its index once Redis answers again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from redis.asyncio import Redis
from redis.exceptions import RedisError

from pdserve.cluster.kv_index import KVIndexPublisher
from pdserve.cluster.registry import NodeRecord, RecordCheck, host_of, read_nodes
from pdserve.common.redis_auth import redact
from pdserve.common.redis_keys import ClusterKeys
from pdserve.common.task_stop import cancel_and_wait
from pdserve.engine.config import EngineConfig
from pdserve.engine.messages import OutputBatch
from pdserve.node.roles import store_index_id

LEAVE_TIMEOUT_S = 3.0  # a stopping node waits this long at most to leave the registry

if TYPE_CHECKING:  # the CLI imports this module for ClusterOptions: keep it light
    from pdserve.engine.async_llm import AsyncLLM

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ClusterOptions:
    """How a node joins a cluster (`pdserve serve --redis-url ... --cluster ...`)."""

    advertise_url: str  # this node's HTTP url as others reach it
    redis_url: str | None = None
    cluster: str = "pdserve"
    heartbeat_s: float = 1.0
    node_ttl_s: float = 5.0

    def __post_init__(self) -> None:
        if not self.advertise_url.startswith(("http://", "https://")):
            raise ValueError(f"advertise_url {self.advertise_url!r} must be an http(s) url")
        if self.heartbeat_s <= 0:
            raise ValueError(f"heartbeat_s must be > 0, got {self.heartbeat_s}")
        if self.node_ttl_s <= self.heartbeat_s:
            raise ValueError(
                f"node_ttl_s ({self.node_ttl_s}) must exceed heartbeat_s ({self.heartbeat_s})"
            )
        ClusterKeys(self.cluster)  # validates the name


class ClusterAgent:
    """Builds this node's record; registers it and publishes KV events when Redis is set."""

    def __init__(
        self,
        config: EngineConfig,
        llm: AsyncLLM,
        options: ClusterOptions,
        registry_prefills: set[str] | None = None,
    ):
        self.config = config
        # decode role: control addresses of this model's live prefill nodes, updated in
        # place every heartbeat (the node's PrefillNodes source reads this set)
        self.registry_prefills = registry_prefills if registry_prefills is not None else set()
        self.llm = llm
        self.options = options
        self.epoch = time.time_ns()
        self.keys = ClusterKeys(options.cluster)
        self.store_id = store_index_id(config)  # "": no shared KV store
        self.redis: Redis | None = None
        self.publisher: KVIndexPublisher | None = None
        self._tasks: list[asyncio.Task] = []
        self._registered = False
        self._stopped = False
        # signs this node's record; only signed prefill records on the configured prefill
        # nodes' hosts (any host when none is configured) become peers
        self.secret = config.kv_transfer.cluster_secret
        hosts = {host_of(a) for a in config.kv_transfer.prefill_nodes}
        self.check = RecordCheck(self.secret, hosts or None)

    @property
    def node_id(self) -> str:
        return self.config.kv_transfer.node_id

    def record(self) -> NodeRecord:
        cfg, info, stats = self.config, self.llm.info, self.llm.client.latest_stats
        rec = NodeRecord(
            node_id=self.node_id,
            role=cfg.kv_transfer.role,
            url=self.options.advertise_url,
            model=cfg.model.api_name,
            block_size=cfg.cache.block_size,
            epoch=self.epoch,
            kv_control=cfg.kv_transfer.control_address or "",
            max_model_len=info.max_model_len if info else 0,
            vocab_size=info.vocab_size if info else 0,
            local_prefill_max_tokens=cfg.scheduler.local_prefill_max_tokens,
            kv_total=info.num_blocks if info else 0,
            updated=time.time(),
            kv_store=self.store_id,
            weights=info.weights_digest if info else "",
        )
        if stats is not None:
            rec.running, rec.waiting = stats.num_running, stats.num_waiting
            rec.kv_used = stats.kv_blocks_used
            rec.prefills_remote = stats.prefill_paths.get("remote", 0)
            rec.prefills_local = sum(stats.prefill_paths.values()) - rec.prefills_remote
        return rec

    def on_batch(self, batch: OutputBatch) -> None:
        if self.publisher is not None:
            self.publisher.add(batch.kv_stored, batch.kv_evicted)
            if batch.kv_store_saved:
                self.publisher.add_store_saved(batch.kv_store_saved)

    async def start(self) -> None:
        if self.options.redis_url is None:
            return
        self.redis = Redis.from_url(
            self.options.redis_url, socket_timeout=2.0, socket_connect_timeout=2.0
        )
        self.publisher = KVIndexPublisher(
            self.redis,
            self.keys.kv(self.node_id, self.epoch),
            self.options.node_ttl_s,
            self.llm.client.get_cached_hashes,
            store_key=self.keys.kv_store(self.store_id) if self.store_id else None,
        )
        self._tasks = [
            asyncio.create_task(self._heartbeat(), name="registry-heartbeat"),
            asyncio.create_task(self.publisher.run(), name="kv-index-publisher"),
        ]
        logger.info(
            "node %s (epoch %d) registering in %s under %r",
            self.node_id,
            self.epoch,
            redact(self.options.redis_url),
            self.options.cluster,
        )

    async def stop(self, timeout_s: float = LEAVE_TIMEOUT_S) -> None:
        """Stop heartbeats and leave the registry (again: a no-op), within `timeout_s`:
        past it the node goes on stopping and its record expires by its TTL instead (a
        Redis, or a client library, that does not answer never holds the node up)."""
        if self._stopped:
            return
        self._stopped = True
        leave = asyncio.create_task(self._leave(), name="registry-leave")
        done, _ = await asyncio.wait({leave}, timeout=timeout_s)
        if not done:  # left running: it ends with the process
            logger.warning(
                "leaving the registry took over %g s; going on without (the record expires "
                "in %g s)",
                timeout_s,
                self.options.node_ttl_s,
            )
        elif leave.exception() is not None:  # never the caller's: it stops all the same
            logger.warning("leaving the registry failed (%r); going on", leave.exception())

    async def _leave(self) -> None:
        if self.publisher is not None:
            self.publisher.stopped = True
        await cancel_and_wait(self._tasks, 1.0)  # a leftover stops at its flag
        if self.redis is not None:
            with contextlib.suppress(RedisError, OSError):
                # Leave at once rather than after the TTL (a clean shutdown).
                await self.redis.delete(
                    self.keys.node(self.node_id), self.keys.kv(self.node_id, self.epoch)
                )
            await self.redis.aclose()

    async def _heartbeat(self) -> None:
        opts = self.options
        ttl_ms = int(opts.node_ttl_s * 1000)
        while not self._stopped:  # also checked: a cancel may be swallowed (task_stop.py)
            try:
                pipe = self.redis.pipeline(transaction=False)
                pipe.hset(self.keys.node(self.node_id), mapping=self.record().to_redis(self.secret))
                pipe.pexpire(self.keys.node(self.node_id), ttl_ms)
                pipe.sadd(self.keys.nodes, self.node_id)
                pipe.pexpire(self.publisher.key, ttl_ms)
                *_, kv_alive = await pipe.execute()
                if not kv_alive and not self.publisher.need_rebuild:
                    logger.warning("KV index set vanished from Redis; rebuilding it")
                    self.publisher.need_rebuild = True
                if not self._registered:
                    logger.info("node %s registered", self.node_id)
                self._registered = True
                if self.config.kv_transfer.role == "decode":
                    await self._refresh_prefills()
            except (RedisError, OSError) as e:
                if self._registered:
                    logger.warning("registry heartbeat failed (%s); retrying", e)
                self._registered = False
                self.publisher.need_rebuild = True
            await asyncio.sleep(opts.heartbeat_s)

    async def _refresh_prefills(self) -> None:
        """Allow exactly the live prefill nodes of this model (kept as is if Redis fails)."""
        live = {
            r.kv_control
            for r in await read_nodes(self.redis, self.keys, self.check)
            if r.role == "prefill" and r.model == self.config.model.api_name and r.kv_control
        }
        if live != self.registry_prefills:
            logger.info("prefill nodes in the registry: %s", sorted(live) or "none")
            self.registry_prefills.clear()
            self.registry_prefills.update(live)
