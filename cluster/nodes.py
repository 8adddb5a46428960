"""From a `ClusterConfig` to concrete processes: one `NodeSpec` per node, the `pdserve serve`
settings of each node, and the `pdserve router` command line.

`node_settings()` is the single mapping from YAML fields to a node's settings (keyed by the
`pdserve serve` option names), used both by `pdserve serve --config FILE --node NAME` and by
the launchers. Nodes are named `prefill-0..N-1` and `decode-0..N-1`.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import Any

from pdserve.cluster.schema import ClusterConfig, NodeGroup

ROLES = ("prefill", "decode")


@dataclass(frozen=True)
class NodeSpec:
    name: str  # prefill-0, decode-1, ...
    role: str  # "prefill" | "decode"
    index: int
    group: NodeGroup
    host: str
    port: int
    kv_port: int | None
    device: str

    @property
    def url(self) -> str:
        """Where others reach the node's HTTP API (loopback for a wildcard bind)."""
        host = "127.0.0.1" if self.host in ("0.0.0.0", "") else self.host
        return f"http://{host}:{self.port}"

    @property
    def control_address(self) -> str | None:
        return None if self.kv_port is None else f"tcp://{self.host}:{self.kv_port}"


def pick(value: int | str | list, index: int) -> Any:
    """`port: 8101` -> 8101 + index; `port: [8101, 8201]` -> the index-th entry."""
    if isinstance(value, list):
        return value[index]
    return value + index if isinstance(value, int) else value


def group_nodes(cfg: ClusterConfig, role: str, hosts: dict[str, str] | None = None):
    group: NodeGroup | None = getattr(cfg, role)
    if group is None:
        return []
    nodes = []
    for i in range(group.count):
        name = f"{role}-{i}"
        kv_port = pick(group.kv_port, i) if group.kv_port is not None else None
        host = (hosts or {}).get(name, pick(group.host, i))
        nodes.append(
            NodeSpec(
                name, role, i, group, host, pick(group.port, i), kv_port, pick(group.device, i)
            )
        )
    return nodes


def cluster_nodes(cfg: ClusterConfig, hosts: dict[str, str] | None = None) -> list[NodeSpec]:
    """Every node, prefill nodes first. `hosts` overrides where named nodes bind (Ray)."""
    return [n for role in ROLES for n in group_nodes(cfg, role, hosts)]


def find_node(cfg: ClusterConfig, name: str) -> NodeSpec:
    for node in cluster_nodes(cfg):
        if node.name == name:
            return node
    names = ", ".join(n.name for n in cluster_nodes(cfg)) or "none"
    raise KeyError(f"no node named {name!r} in this config (nodes: {names})")


def node_settings(
    cfg: ClusterConfig,
    node: NodeSpec,
    redis_url: str | None = None,
    prefill_nodes: list[NodeSpec] | None = None,
) -> dict[str, Any]:
    """The node's settings, keyed by `pdserve serve` option dest (e.g. `kv_cache_bytes`).

    `redis_url`: the cluster's Redis (the embedded server's URL is only known at launch).
    `prefill_nodes`: the decode node's static prefill list (default: the config's).
    """
    g, m = node.group, cfg.model
    settings: dict[str, Any] = {
        "model": m.name,
        "served_model_name": m.served_name,
        "dtype": m.dtype,
        "block_size": m.block_size,
        "kv_layout": m.kv_layout,
        "max_model_len": m.max_model_len,
        "enforce_eager": m.enforce_eager,
        "batched_decode": m.batched_decode,
        "host": node.host,
        "port": node.port,
        "device": node.device,
        "num_threads": g.num_threads,
        "kv_cache_bytes": int(g.kv_cache_bytes),
        "num_blocks": g.num_blocks,
        "no_prefix_caching": not g.enable_prefix_caching,
        "kv_populate": g.kv_populate,
        "max_num_seqs": g.max_num_seqs,
        "max_num_batched_tokens": g.max_num_batched_tokens,
        "local_prefill_max_tokens": g.local_prefill_max_tokens,
        "on_prefill_failure": g.on_prefill_failure,
        "max_body_bytes": g.max_body_bytes,
        "body_timeout_s": g.body_timeout_s,
        "role": node.role,
        "node_id": node.name,
        "kv_control": node.control_address,
        "prefill_node": [],
        "cluster": cfg.cluster,
        "advertise_url": node.url,
        "heartbeat_s": cfg.launcher.heartbeat_s,
        "node_ttl_s": cfg.launcher.node_ttl_s,
        "drain_timeout_s": cfg.launcher.drain_timeout_s,
        "cluster_secret_file": cfg.secret_file,
    }
    if g.connector is not None:
        settings["kv_connector"] = g.connector.kind
        settings["kv_transfer_timeout"] = g.connector.transfer_timeout_s
        settings["kv_abort_grace"] = g.connector.abort_grace_s
        settings["kv_peer_timeout"] = g.connector.peer_timeout_s
        settings["kv_net_devices"] = g.connector.net_devices
    if node.role == "decode":
        peers = group_nodes(cfg, "prefill") if prefill_nodes is None else prefill_nodes
        settings["prefill_node"] = [p.control_address for p in peers]
    if redis_url is None and not cfg.redis.embedded:
        redis_url = cfg.redis.url
    settings["redis_url"] = redis_url  # None: embedded, known only once launched
    st = cfg.kv_store
    uses_store = st.backend or (g.connector is not None and g.connector.kind == "lmcache")
    settings.update(
        kv_store=st.backend,
        kv_store_url=st.url if uses_store else None,  # "cluster": the node's --redis-url
        kv_store_chunk_size=st.chunk_size,
        kv_store_local_bytes=int(st.local_cpu_bytes),
        kv_store_namespace=None,
        kv_store_load_timeout=st.load_timeout_s,
        kv_store_save_timeout=st.save_timeout_s,
        kv_store_retry_after=st.retry_after_s,
    )
    settings["kv_backend"] = [b.spec() for b in g.kv_backends or []]
    return settings


def serve_argv(config_file: str, node: NodeSpec, overrides: list[str], **flags: Any) -> list[str]:
    """`python -m pdserve serve --config FILE --node NAME ...`: the node reads the same file."""
    argv = [sys.executable, "-m", "pdserve", "serve", "--config", config_file, "--node", node.name]
    for item in overrides:
        argv += ["--set", item]
    for dest, value in flags.items():
        if value is not None:
            argv += [f"--{dest.replace('_', '-')}", str(value)]
    return argv


def router_argv(
    cfg: ClusterConfig, redis_url: str | None, nodes: list[NodeSpec], log_level: str
) -> list[str]:
    """`python -m pdserve router ...` for the config's router section and these nodes."""
    r = cfg.router
    argv = [sys.executable, "-m", "pdserve", "router", "--host", r.host, "--port", str(r.port)]
    argv += ["--model", cfg.model.name, "--cluster", cfg.cluster, "--log-level", log_level]
    argv += ["--drain-timeout-s", str(cfg.launcher.drain_timeout_s)]
    if cfg.model.served_name:
        argv += ["--served-model-name", cfg.model.served_name]
    for key in ROUTER_OPTIONS:
        argv += [f"--{key.replace('_', '-')}", str(getattr(r, key))]
    if cfg.secret_file:
        argv += ["--cluster-secret-file", cfg.secret_file]
    if r.ssl_certfile:
        argv += ["--ssl-certfile", r.ssl_certfile]
    if r.ssl_keyfile:
        argv += ["--ssl-keyfile", r.ssl_keyfile]
    if redis_url:
        argv += ["--redis-url", redis_url]
    for node in nodes:
        argv += [f"--{node.role}", node.url]
    return argv


def router_env(cfg: ClusterConfig) -> dict[str, str]:
    """The router's environment: the API key travels here, not on its command line."""
    env = dict(os.environ)
    if cfg.router.api_key:
        env["PDSERVE_API_KEY"] = cfg.router.api_key  # router/cli.py API_KEY_ENV
    return env


# router section keys passed as `pdserve router --KEY VALUE`
ROUTER_OPTIONS = (
    "prefill_policy",
    "decode_policy",
    "overlap_weight",
    "kv_temperature",
    "max_retries",
    "health_interval_s",
    "request_timeout_s",
    "breaker_failures",
    "breaker_cooldown_s",
    "body_timeout_s",
    "max_concurrent_per_key",
    "prompt_tokens_per_minute_per_key",
    "max_prompt_tokens_per_request",
)
