"""Checks of a cluster config that span fields: connectors, port lists, port clashes,
devices, the model. Each problem is `(key path, message)`; cluster/config_file.py turns
it into an error naming the field and its line.
"""

from __future__ import annotations

import re
import socket
from pathlib import Path
from typing import NamedTuple

from pdserve.cluster.nodes import cluster_nodes
from pdserve.cluster.schema import ClusterConfig, NodeGroup
from pdserve.common.cluster_secret import is_loopback

Problem = tuple[tuple[str | int, ...], str]
WILDCARD = ("0.0.0.0", "")


def _group_problems(cfg: ClusterConfig, role: str, group: NodeGroup) -> list[Problem]:
    problems: list[Problem] = []
    has_prefill = cfg.prefill is not None and cfg.prefill.count > 0
    needs_connector = role == "prefill" or has_prefill
    if needs_connector and group.connector is None and group.count > 0:
        why = "a prefill group" if role == "prefill" else "a decode group with prefill nodes"
        problems.append(((role, "connector"), f"{why} needs a KV connector, e.g. {{kind: nixl}}"))
    if role == "decode" and has_prefill and group.connector and cfg.prefill.connector:
        if group.connector.kind != cfg.prefill.connector.kind:
            problems.append(
                ((role, "connector", "kind"), "must match the prefill group's connector kind")
            )
    problems += _backend_problems(cfg, role, group)
    if group.tensor_parallel_size > 1 and group.count > 0:
        problems += _tp_problems(cfg, role, group, needs_connector)
    if role == "prefill" and group.kv_port is None and group.count > 0:
        problems.append(((role, "kv_port"), "prefill nodes need a KV control port"))
    for key in ("host", "port", "kv_port", "device"):
        value = getattr(group, key)
        if isinstance(value, list) and len(value) < group.count:
            problems.append(((role, key), f"lists {len(value)} values for {group.count} nodes"))
    for key in ("port", "kv_port"):
        value = getattr(group, key)
        ports = value if isinstance(value, list) else [] if value is None else [value]
        if isinstance(value, int) and group.count:
            ports = [value + group.count - 1]
        if any(not 1 <= p <= 65535 for p in ports):
            problems.append(((role, key), f"ports must be within 1..65535, got {value}"))
    devices = group.device if isinstance(group.device, list) else [group.device]
    for d in devices:
        if not re.fullmatch(r"cpu|cuda(:\d+)?", d):
            problems.append(((role, "device"), f"must be 'cpu' or 'cuda:N', got {d!r}"))
    hosts = group.host if isinstance(group.host, list) else [group.host]
    if "auto" in hosts and cfg.launcher.kind != "ray":
        problems.append(((role, "host"), "'auto' needs launcher.kind: ray"))
    return problems


def _tp_problems(cfg: ClusterConfig, role: str, group: NodeGroup, pd: bool) -> list[Problem]:
    """What a tensor-parallel group cannot run yet (engine/tp_runner.refuse_unsupported)."""
    key = (role, "tensor_parallel_size")
    if cfg.kv_store.backend is not None or any(
        "transfer" not in b.roles for b in group.kv_backends or []
    ):
        return [(key, "a node with tensor_parallel_size > 1 has no KV store (yet)")]
    if not pd:
        return []
    if group.connector is not None and group.connector.kind != "nixl":
        return [((role, "connector", "kind"), "a PD group with tensor_parallel_size > 1: nixl")]
    devices = group.device if isinstance(group.device, list) else [group.device]
    if any(d != "cpu" for d in devices):
        return [(key, "a PD group with tensor_parallel_size > 1 runs on cpu (for now)")]
    return []


def _backend_problems(cfg: ClusterConfig, role: str, group: NodeGroup) -> list[Problem]:
    if group.kv_backends is None:
        return []
    problems: list[Problem] = []
    if cfg.kv_store.backend is not None:
        problems.append(
            ((role, "kv_backends"), "name the prefix store here or in kv_store.backend, not both")
        )
    transfers = [i for i, b in enumerate(group.kv_backends) if "transfer" in b.roles]
    if len(transfers) > 1:
        problems.append(((role, "kv_backends"), "at most one backend may have role 'transfer'"))
    for i, b in enumerate(group.kv_backends):
        if b.kind == "nixl" and b.roles != ["transfer"]:
            problems.append(((role, "kv_backends", i, "roles"), "nixl: only 'transfer'"))
        if "transfer" in b.roles and group.connector and b.kind != group.connector.kind:
            problems.append(
                ((role, "kv_backends", i, "kind"), "must match this group's connector.kind")
            )
    return problems


class Endpoint(NamedTuple):
    host: str
    port: int
    path: tuple[str, ...]  # the config key that sets the port
    what: str


def endpoints(cfg: ClusterConfig) -> list[Endpoint]:
    """Every fixed port the cluster binds (router, embedded Redis, nodes' HTTP and KV)."""
    found: list[Endpoint] = []
    if cfg.router.enabled:
        found.append(Endpoint(cfg.router.host, cfg.router.port, ("router", "port"), "the router"))
    if cfg.redis.embedded and cfg.redis.port is not None:
        found.append(Endpoint(cfg.redis.host, cfg.redis.port, ("redis", "port"), "embedded Redis"))
    for node in cluster_nodes(cfg):
        found.append(Endpoint(node.host, node.port, (node.role, "port"), f"{node.name} HTTP"))
        if node.kv_port is not None:
            where = (node.role, "kv_port")
            found.append(Endpoint(node.host, node.kv_port, where, f"{node.name} KV control"))
    return found


def _port_clashes(cfg: ClusterConfig) -> list[Problem]:
    """Two endpoints of this cluster on one host and port (wildcard binds clash with all)."""
    found = endpoints(cfg)
    problems: list[Problem] = []
    for i, (host, port, path, what) in enumerate(found):
        for host2, port2, _, what2 in found[:i]:
            same_host = host == host2 or host in WILDCARD or host2 in WILDCARD
            if port == port2 and same_host:
                problems.append((path, f"port {port} clashes: {what} and {what2} both use it"))
                break
    return problems


def ports_in_use(cfg: ClusterConfig) -> list[Problem]:
    """Endpoints on this machine whose port another process already holds (launch time)."""
    problems: list[Problem] = []
    for host, port, path, what in endpoints(cfg):
        if host == "auto":
            continue  # placed by Ray
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind((host, port))
            except OSError as e:
                problems.append((path, f"{what}: cannot bind {host}:{port} ({e.strerror})"))
    return problems


def open_binds(cfg: ClusterConfig) -> list[tuple[str, str, str]]:
    """(host, section, what) of each process that binds beyond loopback."""
    binds = [(cfg.router.host, "router", "the router")] if cfg.router.enabled else []
    if cfg.redis.embedded:
        binds.append((cfg.redis.host, "redis", "embedded Redis"))
    binds += [(n.host, n.role, n.name) for n in cluster_nodes(cfg)]
    return [b for b in binds if not is_loopback(b[0])]


def open_without_secret(cfg: ClusterConfig) -> list[Problem]:
    """Endpoints beyond loopback in a cluster without a secret: each one a problem, unless
    `insecure_open_network` says so on purpose."""
    if cfg.secret_file or cfg.insecure_open_network:
        return []
    problems: dict[str, Problem] = {}
    for host, section, what in open_binds(cfg):
        if section not in problems:
            problems[section] = (
                (section, "host"),
                f"{what} binds {host or '0.0.0.0'}, beyond loopback, and the cluster has no "
                "secret_file: anyone who reaches it could read prompts, write Redis and add "
                "nodes. Set secret_file (or, knowingly, insecure_open_network: true)",
            )
    return list(problems.values())


def insecure_warning(cfg: ClusterConfig) -> str | None:
    """The loud line `config check` and `launch` print for an open cluster allowed on purpose."""
    binds = open_binds(cfg) if cfg.insecure_open_network and not cfg.secret_file else []
    if not binds:
        return None
    where = ", ".join(f"{what} on {host or '0.0.0.0'}" for host, _, what in binds)
    return (
        f"WARNING: insecure_open_network: {where} beyond loopback WITHOUT a cluster secret: "
        "anyone who reaches these ports can read prompts, write Redis and add nodes"
    )


def _model_problems(cfg: ClusterConfig) -> list[Problem]:
    from pdserve.common.model_files import BUILTIN_MODELS

    name = cfg.model.name
    if name in BUILTIN_MODELS or cfg.launcher.kind == "ray":
        return []  # on Ray the path is resolved on the node's own host
    path = Path(name).expanduser()
    if (path / "config.json").is_file() or (path.suffix == ".gguf" and path.is_file()):
        return []
    builtins = ", ".join(sorted(BUILTIN_MODELS))
    return [
        (
            ("model", "name"),
            f"{name!r} is no built-in model ({builtins}), HF directory or .gguf file",
        )
    ]


def cross_checks(cfg: ClusterConfig) -> list[Problem]:
    problems: list[Problem] = []
    if cfg.decode.count < 1:
        problems.append((("decode", "count"), "a cluster needs at least one decode node"))
    for role in ("prefill", "decode"):
        group = getattr(cfg, role)
        if group is not None:
            problems += _group_problems(cfg, role, group)
    if not problems:  # port lists are well-formed: compare the endpoints
        problems += _port_clashes(cfg) + open_without_secret(cfg)
    if cfg.launcher.node_ttl_s <= cfg.launcher.heartbeat_s:
        problems.append((("launcher", "node_ttl_s"), "must be > launcher.heartbeat_s"))
    restart = cfg.launcher.restart
    if restart.backoff_max_s < restart.backoff_s:
        problems.append((("launcher", "restart", "backoff_max_s"), "must be >= backoff_s"))
    return problems + _model_problems(cfg)
