"""From a `ClusterConfig` to concrete processes: one `NodeSpec` per node, the `pdserve serve`
settings of each node, and the `pdserve router` command line.

`node_settings()` reads a node's settings from its sections (pdserve/config/node.py
`NODE_SECTIONS`: which component lives where in the YAML), keyed by the `pdserve serve`
flag dests generated from the same fields; `pdserve serve --config FILE --node NAME` (how
the launchers start every node) runs on them. Nodes are named `prefill-0..N-1` and `decode-0..N-1`.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import Any

from pdserve.cluster.schema import ClusterConfig, NodeGroup
from pdserve.config.fields import flag_of, to_dests
from pdserve.config.node import NODE_SECTIONS, ServeSettings
from pdserve.config.router import RouterProcessSettings, RouterSettings

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


def section_of(cfg: ClusterConfig, path: str, role: str) -> Any:
    """The section at `path` (e.g. `{role}.connector`) of `cfg`; None when it is unset."""
    obj: Any = cfg
    for key in path.format(role=role).split("."):
        obj = getattr(obj, key) if obj is not None else None
    return obj


def node_settings(
    cfg: ClusterConfig,
    node: NodeSpec,
    redis_url: str | None = None,
    prefill_nodes: list[NodeSpec] | None = None,
) -> dict[str, Any]:
    """The node's settings, keyed by `pdserve serve` option dest (e.g. `kv_cache_bytes`):
    each component's fields from its section (pdserve/config/node.py NODE_SECTIONS), then
    what is the node's own (address, role, peers).

    `redis_url`: the cluster's Redis (the embedded server's URL is only known at launch).
    `prefill_nodes`: the decode node's static prefill list (default: the config's).
    """
    settings: dict[str, Any] = {}
    for cls, path in NODE_SECTIONS:
        section = section_of(cfg, path, node.role)
        if section is not None:  # a group without a connector: the flags' defaults
            settings.update(to_dests(cls, section))
    if redis_url is None and not cfg.redis.embedded:
        redis_url = cfg.redis.url
    if node.role == "decode":
        peers = group_nodes(cfg, "prefill") if prefill_nodes is None else prefill_nodes
    own = ServeSettings(
        role=node.role,
        node_id=node.name,
        kv_control=node.control_address,
        prefill_node=[p.control_address for p in peers] if node.role == "decode" else [],
        redis_url=redis_url,  # None: embedded, known only once launched
        cluster=cfg.cluster,
        advertise_url=node.url,
        cluster_secret_file=cfg.secret_file,
        kv_backend=[b.spec() for b in node.group.kv_backends or []],
    )
    settings.update(to_dests(ServeSettings, own))
    settings.update(host=node.host, port=node.port, device=node.device)  # this node's pick
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
    r, m = cfg.router, cfg.model
    argv = [sys.executable, "-m", "pdserve", "router", "--log-level", log_level]
    proc = RouterProcessSettings(
        name=m.name,
        served_name=m.served_name,
        redis_url=redis_url,
        cluster=cfg.cluster,
        cluster_secret_file=cfg.secret_file,
        drain_timeout_s=cfg.launcher.drain_timeout_s,
    )
    for cls, section in ((RouterSettings, r), (RouterProcessSettings, proc)):
        for name in cls.model_fields:
            value = getattr(section, name)
            if value is None or name in ("api_key", "prefill", "decode"):
                continue  # the API key goes by environment
            flag = flag_of(cls, name)
            if isinstance(value, bool):  # --x / --no-x
                argv.append(flag if value else f"--no-{flag[2:]}")
            elif isinstance(value, list):  # repeatable
                argv += [a for v in value for a in (flag, str(v))]
            else:
                argv += [flag, str(value)]
    for node in nodes:
        argv += [f"--{node.role}", node.url]
    return argv


def router_env(cfg: ClusterConfig) -> dict[str, str]:
    """The router's environment: the API key travels here, not on its command line."""
    env = dict(os.environ)
    if cfg.router.api_key:
        env["PDSERVE_API_KEY"] = cfg.router.api_key  # router/cli.py API_KEY_ENV
    return env
