"""Prometheus metrics of the router, in a registry owned by its app (no module globals)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_DECISION_BUCKETS = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 0.1, 1.0)

_GAP_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class RouterMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter(
            "pdserve_router_requests", "Requests answered, by route and HTTP status",
            ["route", "status"], registry=r,
        )  # fmt: skip
        self.decision = Histogram(
            "pdserve_router_decision_seconds",
            "Time to choose the nodes of one request (KV index lookup included)",
            buckets=_DECISION_BUCKETS, registry=r,
        )  # fmt: skip
        self.selections = Counter(
            "pdserve_router_selections", "Nodes chosen, by node url and role",
            ["node", "role"], registry=r,
        )  # fmt: skip
        self.prefills = Counter(
            "pdserve_router_prefills",
            "Requests by where their prompt is prefilled: local (decode/colocated) or remote",
            ["where"], registry=r,
        )  # fmt: skip
        self.predicted_hit_tokens = Counter(
            "pdserve_router_predicted_prefix_hit_tokens",
            "Prompt tokens the KV index said the chosen node holds", registry=r,
        )  # fmt: skip
        self.actual_hit_tokens = Counter(
            "pdserve_router_actual_prefix_hit_tokens",
            "Prompt tokens the decode node reported as cached (usage.cached_tokens)", registry=r,
        )  # fmt: skip
        self.retries = Counter(
            "pdserve_router_retries", "Attempts retried on another node, by reason",
            ["reason"], registry=r,
        )  # fmt: skip
        self.migrations = Counter(
            "pdserve_router_migrations",
            "Streams moved to another decode node mid-stream, by where the continuation's "
            "KV came from (prefill_node, prefix_cache, local)", ["path"], registry=r,
        )  # fmt: skip
        self.migration_gap = Histogram(
            "pdserve_router_migration_gap_seconds",
            "Client-seen gap across a migration (last bytes before to first bytes after)",
            ["path"], buckets=_GAP_BUCKETS, registry=r,
        )  # fmt: skip
        self.usable_nodes = Gauge(
            "pdserve_router_usable_nodes", "Nodes that may get new work, by role",
            ["role"], registry=r,
        )  # fmt: skip
        self.redis_up = Gauge(
            "pdserve_router_redis_up", "1 when the registry is reachable", registry=r
        )

        self._children: dict[tuple, object] = {}

    def child(self, metric, *values: str):
        """`metric.labels(*values)`, cached (labels() costs more than the increment)."""
        key = (metric, values)
        c = self._children.get(key)
        if c is None:
            c = self._children[key] = metric.labels(*values)
        return c

    def render(self) -> bytes:
        return generate_latest(self.registry)
