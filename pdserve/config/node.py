"""A node's HTTP front, its place in the cluster registry, and per-process plumbing."""

from __future__ import annotations

from typing import Literal

from pdserve.config.engine import (
    CacheSettings,
    ComputeSettings,
    KVFormatSettings,
    ModelSettings,
    SchedulerSettings,
)
from pdserve.config.fields import Settings, setting
from pdserve.config.kv import StoreSettings, TransferSettings
from pdserve.config.limits import RequestCostSettings

LOG_LEVELS = Literal["debug", "info", "warning", "error"]


class HTTPSettings(RequestCostSettings):
    """A node's HTTP server."""

    host: str = setting("127.0.0.1", "address the node binds")
    port: int = setting(8100, "HTTP port", ge=1, le=65535)
    max_body_bytes: int = setting(4 << 20, "larger request bodies get HTTP 413", ge=1)
    body_timeout_s: float = setting(
        30.0, "a request body not received in full by then gets HTTP 408", gt=0
    )
    grammar_deadline_s: float = setting(
        10.0,
        "a client's JSON schema compiles in a worker process killed past this (HTTP 400); "
        "engine/grammar_check.py",
        gt=0,
    )
    grammar_workers: int = setting(
        2, "worker processes compiling client schemas, started on the first", ge=1
    )


class RegistrySettings(Settings):
    """How a node keeps its record in the cluster registry, and how it stops."""

    heartbeat_s: float = setting(1.0, "nodes refresh their registry record", gt=0)
    node_ttl_s: float = setting(5.0, "a silent node leaves the registry", gt=0)
    drain_timeout_s: float = setting(
        5.0,
        "on stop: answer new requests with a 503 and give in-flight requests this long, then exit",
        ge=0,
    )


class ServeSettings(Settings):
    """`pdserve serve` only: what the launcher derives per node (role, addresses, the
    cluster's Redis) rather than reads from a YAML key."""

    role: Literal["colocated", "prefill", "decode"] = setting(
        "colocated", "this node's part in prefill/decode disaggregation"
    )
    node_id: str | None = setting(None, "name of this node (default: role-port)")
    kv_control: str | None = setting(
        None, "prefill role: ZMQ address its control channel binds, e.g. tcp://127.0.0.1:7100"
    )
    prefill_node: list[str] = setting(
        [], "decode role: control address of a prefill node (repeatable; round-robin)"
    )
    redis_url: str | None = setting(
        None,
        "register in this Redis (TTL heartbeat) and publish KV block events, e.g. "
        "redis://127.0.0.1:6379 (in a cluster: its `redis`)",
    )
    cluster: str = setting("pdserve", "Redis key prefix of the cluster (YAML: `cluster`)")
    advertise_url: str | None = setting(None, "this node's HTTP url (default http://HOST:PORT)")
    cluster_secret_file: str | None = setting(
        None,
        "file with the cluster secret (or env PDSERVE_CLUSTER_SECRET): authenticated KV "
        "control frames, HTTP only from the router (api/cluster_secret.py; YAML: `secret_file`)",
    )
    kv_store_namespace: str | None = setting(None, "default: the --model value")
    kv_backend: list[str] = setting(
        [],
        "a KV backend, in order (repeatable; replaces --kv-connector/--kv-store): KIND nixl "
        "or lmcache, ROLES from transfer,load,save, URL redis://... or `cluster`; e.g. "
        "--kv-backend nixl:transfer --kv-backend lmcache:load,save:cluster (YAML: the group's "
        "`kv_backends`)",
        metavar="KIND:ROLES[:URL]",
    )
    engine_address: str | None = setting(
        None,
        "base ZMQ address of the engine channels, ipc:///path/name (tcp:// is refused: the "
        "channels are unauthenticated); default: IPC sockets in a fresh temporary directory",
    )


# The components a node reads, each with the cluster config section it lives in (`{role}`:
# the node's group, `prefill` or `decode`). `pdserve serve` has a flag for every field of
# these and of `ServeSettings`; the launcher hands a node its sections' values under them.
NODE_SECTIONS: tuple[tuple[type[Settings], str], ...] = (
    (ModelSettings, "model"),
    (KVFormatSettings, "model"),
    (ComputeSettings, "{role}"),
    (CacheSettings, "{role}"),
    (SchedulerSettings, "{role}"),
    (HTTPSettings, "{role}"),
    (TransferSettings, "{role}.connector"),
    (StoreSettings, "kv_store"),
    (RegistrySettings, "launcher"),
)
