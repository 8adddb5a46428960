"""Keeps the `ClusterView` current: registry reads from Redis, health probes over HTTP.

- Registry (with `--redis-url`): every `registry_interval_s`, one SMEMBERS of the node ids
  and one pipeline of HGETALLs. A node whose record expired (TTL) leaves the view's
  registry part at once. When Redis does not answer, the router keeps its last view,
  marks `redis_ok` false (routing becomes load-only) and probes every node over HTTP
  until Redis answers again, then rebuilds the view from the registry.
- Probes: `GET /v1/node` (the node's record, with its load) every `health_interval_s`,
  for static nodes always, for registry nodes while Redis is down or their circuit is
  open (a successful probe then closes it), and for every decode-capable node while
  `engine_stuck_after_s` is set: the probe carries the engine's progress (`engine:
  {steps, busy}`), and a node whose engine is busy without progress that long gets no
  new requests until its steps advance again (a dead engine answers 503: unhealthy).
"""

from __future__ import annotations

import asyncio
import logging
import time

import aiohttp
import msgspec
from redis.asyncio import Redis
from redis.exceptions import RedisError

from pdserve.cluster.redis_client import LeanRedis, connect, lean_client
from pdserve.cluster.registry import NodeRecord, RecordCheck, host_of, read_nodes
from pdserve.common.redis_keys import ClusterKeys
from pdserve.common.task_stop import cancel_and_wait
from pdserve.router.config import RouterConfig
from pdserve.router.nodes import ClusterView, NodeState

logger = logging.getLogger(__name__)

_PROBE_TIMEOUT = aiohttp.ClientTimeout(total=2.0)


class _Engine(msgspec.Struct):
    steps: int = 0
    busy: bool = False


class _Progress(msgspec.Struct):
    """The engine part of a /v1/node answer (absent from older nodes)."""

    engine: _Engine | None = None


class Membership:
    def __init__(self, config: RouterConfig, view: ClusterView):
        self.config = config
        self.view = view
        self.keys = ClusterKeys(config.cluster)
        self.redis: Redis | None = None
        # the KV index lookup's client (request path); None: it uses `redis`
        self.lookup_redis: LeanRedis | None = None
        self.redis_ok = False
        self._tasks: list[asyncio.Task] = []
        self._decoder = msgspec.json.Decoder(NodeRecord)
        self._progress = msgspec.json.Decoder(_Progress)
        # registry records: signed with the cluster secret, on the static nodes' hosts
        hosts = {host_of(u) for u in config.prefill_urls + config.decode_urls}
        hosts |= set(config.node_hosts)
        self.check = RecordCheck(config.cluster_secret, hosts or None)

    async def start(self) -> None:
        if self.config.redis_url:
            self.redis = connect(
                self.config.redis_url, socket_timeout=1.0, socket_connect_timeout=1.0
            )
            self.lookup_redis = lean_client(self.config.redis_url, timeout_s=1.0)
            await self.refresh_registry()
            self._tasks.append(asyncio.create_task(self._registry_loop(), name="registry"))
        await self.probe_all()
        self._tasks.append(asyncio.create_task(self._probe_loop(), name="probes"))

    async def stop(self) -> None:
        await cancel_and_wait(self._tasks, 2.0)  # redis-py may swallow a cancel (task_stop.py)
        if self.redis is not None:
            await self.redis.aclose()
        if self.lookup_redis is not None:
            await self.lookup_redis.aclose()

    # -- registry ------------------------------------------------------------------------
    async def refresh_registry(self) -> None:
        try:
            records = await read_nodes(self.lookup_redis or self.redis, self.keys, self.check)
        except (RedisError, OSError) as e:
            if self.redis_ok:
                logger.warning("Redis unreachable (%s): serving from the last view", e)
            self.redis_ok = False
            return
        if not self.redis_ok:
            logger.info("Redis reachable: %d nodes in the registry", len(records))
        self.redis_ok = True
        left = self.view.apply_registry(records)
        await asyncio.gather(*(self.probe(n) for n in left))  # dead ones fail it at once

    async def _registry_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.registry_interval_s)
            await self.refresh_registry()

    # -- probes --------------------------------------------------------------------------
    def _needs_probe(self, node: NodeState) -> bool:
        return (
            node.static_role is not None
            or not self.redis_ok
            or node.breaker.state != "closed"
            or not node.in_registry
            and node.healthy
            or self.config.engine_stuck_after_s > 0
            and node.role != "prefill"
        )

    async def probe_all(self) -> None:
        nodes = [n for n in self.view.nodes.values() if self._needs_probe(n)]
        await asyncio.gather(*(self.probe(n) for n in nodes))

    async def probe(self, node: NodeState) -> None:
        try:
            async with node.client.get(node.url + "/v1/node", timeout=_PROBE_TIMEOUT) as resp:
                if resp.status != 200:
                    raise ValueError(f"/v1/node answered {resp.status}")
                raw = await resp.read()
                record, progress = self._decoder.decode(raw), self._progress.decode(raw)
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, msgspec.DecodeError) as e:
            self.view.apply_probe(node, None, f"{type(e).__name__}: {e}")
            return
        if node.breaker.state == "half_open":
            node.breaker.record_success()
        engine = progress.engine
        if engine is not None and node.observe_engine(
            engine.steps, engine.busy, time.monotonic(), self.config.engine_stuck_after_s
        ):
            if node.stuck:
                logger.warning(
                    "node %s: its engine has made no progress for %g s while busy: "
                    "no new requests until it does", node.url, self.config.engine_stuck_after_s,
                )  # fmt: skip
            else:
                logger.info("node %s: its engine makes progress again", node.url)
        if node.in_registry and node.record is not None:
            # a registry node keeps its signed record: the probe answers liveness only
            record = node.record
        self.view.apply_probe(node, record, None)

    async def _probe_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.health_interval_s)
            await self.probe_all()
