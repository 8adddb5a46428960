"""The router's view of the cluster: every node it knows, how to reach it, whether to use it.

A node comes from the static lists (`--prefill`/`--decode`, probed over HTTP) or from the
Redis registry; it is keyed by its HTTP url. It gets new work only when it is *usable*:
its record is known, it is healthy (its last probe answered, or the registry lists it),
its circuit breaker allows it, and it serves the router's model. Each node has ONE shared
connection pool for requests (`NodePool`, router/node_http.py) and one
`aiohttp.ClientSession` for health probes, created when the node is first seen (inside the
event loop). Idle connections are dropped after 4 s, before a node's HTTP server
(uvicorn: 5 s) closes them: a request sent on a connection the node is closing would fail
and count against the node.
"""

from __future__ import annotations

import logging
import math
import ssl
import time
from dataclasses import dataclass, field

import aiohttp

from pdserve.api.cluster_secret import NODE_KEY_HEADER, node_key
from pdserve.cluster.registry import NodeRecord
from pdserve.router.breaker import CircuitBreaker
from pdserve.router.config import RouterConfig
from pdserve.router.node_http import NodePool

logger = logging.getLogger(__name__)

_KEEPALIVE_S = 4.0  # idle node connections kept this long (uvicorn closes them at 5 s)


@dataclass(eq=False)
class NodeState:
    url: str
    client: aiohttp.ClientSession  # health probes
    breaker: CircuitBreaker
    http: NodePool | None = None  # requests (set for every node the view creates)
    static_role: str | None = None  # "prefill" | "decode" for a static node
    record: NodeRecord | None = None
    healthy: bool = False  # last probe answered (static nodes; registry nodes while Redis is down)
    in_registry: bool = False
    last_error: str | None = None
    # what this router has sent and not yet seen finish
    inflight: int = 0
    inflight_blocks: int = 0  # decode: prompt blocks of requests in flight
    prefill_blocks: int = 0  # prefill: prompt blocks whose first token has not arrived
    selections: dict[str, int] = field(default_factory=dict)
    # the engine's progress in /v1/node probes: steps seen, and when they last advanced
    engine_steps: int | None = None
    steps_advanced_at: float = 0.0
    stuck: bool = False  # busy with no progress for `engine_stuck_after_s`: no new requests

    @property
    def role(self) -> str | None:
        return self.record.role if self.record else self.static_role

    @property
    def alive(self) -> bool:
        return self.healthy or self.in_registry

    def usable(self, model: str) -> bool:
        return (
            self.record is not None
            and self.alive
            and not self.stuck
            and self.breaker.allows()
            and self.record.model == model
        )

    def observe_engine(self, steps: int, busy: bool, now: float, stuck_after_s: float) -> bool:
        """Take a probe's engine progress; True if `stuck` changed. Stuck: busy, and its
        step count has not moved for `stuck_after_s` (0: never); unstuck when it moves."""
        if steps != self.engine_steps:
            self.engine_steps, self.steps_advanced_at = steps, now
        stuck = busy and stuck_after_s > 0 and now - self.steps_advanced_at > stuck_after_s
        changed, self.stuck = stuck != self.stuck, stuck
        return changed

    def summary(self) -> dict:
        r = self.record
        return {
            "url": self.url,
            "node_id": r.node_id if r else None,
            "role": self.role,
            "model": r.model if r else None,
            "epoch": r.epoch if r else None,
            "block_size": r.block_size if r else None,
            "kv_control": r.kv_control if r else None,
            "load": {
                "running": r.running if r else None,
                "waiting": r.waiting if r else None,
                "kv_used": r.kv_used if r else None,
                "kv_total": r.kv_total if r else None,
                "router_inflight": self.inflight,
            },
            "remote_prefill_share": remote_prefill_share(r),
            "source": "static" if self.static_role else "registry",
            "in_registry": self.in_registry,
            "healthy": self.healthy,
            "breaker": self.breaker.state,
            "engine_stuck": self.stuck,
            "last_error": self.last_error,
            "record_age_s": round(time.time() - r.updated, 3) if r and r.updated else None,
        }


def remote_prefill_share(r: NodeRecord | None) -> float | None:
    """The share of a node's requests whose prompt a prefill node computed (None: no
    record or no request yet)."""
    total = r.prefills_remote + r.prefills_local if r else 0
    return round(r.prefills_remote / total, 4) if r and total else None


class ClusterView:
    """Every node the router knows. The usable lists are cached (the decision path asks for
    them on every request) and rebuilt after anything that changes them: a registry read, a
    probe, a breaker changing state, or the end of an open breaker's cooldown."""

    def __init__(self, config: RouterConfig):
        self.config = config
        self.nodes: dict[str, NodeState] = {}
        self._usable: tuple[list[NodeState], list[NodeState]] | None = None
        self._usable_until = math.inf  # when an open breaker turns half-open
        self.invalidate()
        # One TLS context for every node client (building one costs ~0.1 s of CPU).
        self._ssl = ssl.create_default_context()
        for url in config.prefill_urls:
            self._add(url, "prefill")
        for url in config.decode_urls:
            self._add(url, "decode")

    def _add(self, url: str, static_role: str | None = None) -> NodeState:
        url = url.rstrip("/")
        node = self.nodes.get(url)
        if node is None:
            cfg = self.config
            node = NodeState(
                url=url,
                client=aiohttp.ClientSession(
                    connector=aiohttp.TCPConnector(
                        limit=0, keepalive_timeout=_KEEPALIVE_S, ssl=self._ssl
                    ),
                    # deadlines: to connect, and between two reads (a stream may be long)
                    timeout=aiohttp.ClientTimeout(
                        total=None,
                        sock_connect=cfg.connect_timeout_s,
                        sock_read=cfg.request_timeout_s,
                    ),
                    headers=node_headers(cfg),
                    auto_decompress=False,
                ),
                http=NodePool(
                    url,
                    node_headers(cfg),
                    self._ssl,
                    cfg.connect_timeout_s,
                    cfg.request_timeout_s,
                    _KEEPALIVE_S,
                ),
                breaker=CircuitBreaker(cfg.breaker_failures, cfg.breaker_cooldown_s),
                static_role=static_role,
            )
            node.breaker.on_change = self.invalidate
            self.nodes[url] = node
            self.invalidate()
        elif static_role:
            node.static_role = static_role
        return node

    def invalidate(self) -> None:
        self._usable = None
        self._limits: tuple[int, int] | None | bool = False  # False: not computed

    def usable(self, serves_clients: bool) -> list[NodeState]:
        """Usable decode-capable nodes (decode, colocated), or usable prefill nodes, in url
        order (a cached list: do not modify it)."""
        now = time.monotonic()
        if self._usable is None or now >= self._usable_until:
            model = self.config.api_name
            ok = sorted((n for n in self.nodes.values() if n.usable(model)), key=lambda n: n.url)
            self._usable = (
                [n for n in ok if not n.record.serves_clients],
                [n for n in ok if n.record.serves_clients],
            )
            ends = [b.open_until for b in (n.breaker for n in self.nodes.values())
                    if b.open_until is not None and b.open_until > now]  # fmt: skip
            self._usable_until = min(ends, default=math.inf)
        return self._usable[serves_clients]

    def limits(self) -> tuple[int, int] | None:
        """(max_model_len, vocab_size) the serving nodes of this model last reported (the
        smallest), kept while nodes come and go, so bad prompts fail without a node.
        Cached like the usable lists (records change only with registry reads and probes)."""
        if self._limits is False:
            self._limits = self._compute_limits()
        return self._limits

    def _compute_limits(self) -> tuple[int, int] | None:
        recs = [
            n.record
            for n in self.nodes.values()
            if n.record and n.record.serves_clients and n.record.model == self.config.api_name
        ]
        if not recs:
            return None
        return min(r.max_model_len for r in recs), min(r.vocab_size for r in recs)

    def apply_registry(self, records: list[NodeRecord]) -> list[NodeState]:
        """Replace the registry part of the view with these live records; returns the nodes
        that just left it, for the caller to probe at once (a Redis that restarted empty
        lists no node until their next heartbeats, and live nodes must keep serving)."""
        seen = set()
        for rec in records:
            node = self._add(rec.url)
            if node.record is None or node.record.epoch != rec.epoch:
                logger.info(
                    "node %s (%s, epoch %d) at %s", rec.node_id, rec.role, rec.epoch, rec.url
                )
            node.record = rec
            node.in_registry = True
            seen.add(node.url)
        left = [n for n in self.nodes.values() if n.in_registry and n.url not in seen]
        for node in left:
            logger.warning("node %s left the registry: probing it", node.url)
            node.in_registry = False
        self.invalidate()
        return left

    def apply_probe(self, node: NodeState, record: NodeRecord | None, error: str | None) -> None:
        if record is not None:
            if not node.healthy:
                logger.info("node %s is healthy (%s)", node.url, record.role)
            node.record, node.healthy, node.last_error = record, True, None
        else:
            if node.healthy:
                logger.warning("node %s failed its health probe: %s", node.url, error)
            node.healthy, node.last_error = False, error
        self.invalidate()

    async def aclose(self) -> None:
        for node in self.nodes.values():
            node.http.close()
            await node.client.close()


def node_headers(cfg: RouterConfig) -> dict[str, str]:
    """Headers on every request to a node: its HTTP key when the cluster has a secret."""
    return {NODE_KEY_HEADER: node_key(cfg.cluster_secret)} if cfg.cluster_secret else {}
