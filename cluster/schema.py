"""The cluster config file (YAML) as pydantic models: what `pdserve launch` reads.

One file describes a whole cluster: the model every node serves, Redis (embedded or an
external URL), the router, and the prefill and decode node groups. Unknown keys are errors
(`extra="forbid"`), so a typo never passes silently.

The sections are made of the components' settings (pdserve/config/): a YAML key is the
field's name, and the same field is a `pdserve serve` flag and an engine setting. Field
descriptions are the reference documentation (docs/configuration.md is generated from them
by cluster/docs.py).

Checks that span fields (port clashes, a prefill group without a connector) live in
cluster/checks.py; cluster/config_file.py maps every error to its line in the YAML file.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from pdserve.config.engine import (
    CacheSettings,
    ComputeSettings,
    KVFormatSettings,
    ModelSettings,
    SchedulerSettings,
)
from pdserve.config.fields import Settings as Section
from pdserve.config.kv import KVBackendSettings, StoreSettings, TransferSettings
from pdserve.config.node import HTTPSettings, RegistrySettings
from pdserve.config.router import RouterSettings

# Sections that are one component's settings as they are.
ConnectorSection = TransferSettings
KVBackendSection = KVBackendSettings
KVStoreSection = StoreSettings


class ModelSection(KVFormatSettings, ModelSettings):
    """What every node serves; the settings prefill and decode nodes must agree on."""

    name: str = Field(
        min_length=1,
        description="built-in name, HF directory or .gguf file (required)",
    )


class RedisSection(Section):
    """Where the cluster's shared state lives. `redis: embedded` and `redis: URL` are
    shorthands for `redis: {url: ...}`."""

    url: str = Field(
        "embedded",
        description="`embedded` (the launcher starts a local redis-server, persistence "
        "off, on loopback) or `redis://host:port[/db]` of an existing server",
    )
    host: str = Field("127.0.0.1", description="embedded: address redis-server binds")
    port: int | None = Field(
        None, ge=1, le=65535, description="embedded: port (default: a free one)"
    )

    @field_validator("url")
    @classmethod
    def _url(cls, v: str) -> str:
        if v != "embedded" and not v.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError(f"must be 'embedded' or a redis:// URL, got {v!r}")
        return v

    @property
    def embedded(self) -> bool:
        return self.url == "embedded"


class RouterSection(RouterSettings):
    """The cluster's front door (`pdserve router`): the only endpoint clients use."""

    enabled: bool = Field(True, description="start a router (false: nodes only)")


class RaySection(Section):
    """Where the Ray launcher places each node of the group (ignored by the local launcher)."""

    num_cpus: float = Field(1.0, ge=0, description="Ray CPUs one node reserves")
    num_gpus: float = Field(0.0, ge=0, description="Ray GPUs one node reserves")
    resources: dict[str, float] = Field(
        default_factory=dict, description="custom Ray resources (labels) one node needs"
    )


PortSpec = int | list[int]


class NodeGroup(SchedulerSettings, CacheSettings, ComputeSettings, HTTPSettings):
    """`count` identical nodes of one role; node `i` uses `port + i` (or `port[i]`)."""

    count: int = Field(1, ge=0, description="number of nodes")
    host: str | list[str] = Field(
        "127.0.0.1",
        description="address the nodes bind, or one per node; `auto`: the IP of the Ray node "
        "the node is placed on (ray launcher)",
    )
    port: PortSpec = Field(description="HTTP port of the first node, or one per node (required)")
    kv_port: PortSpec | None = Field(
        None, description="prefill: KV control (ZMQ) port of the first node, or one per node"
    )
    device: str | list[str] = Field("cpu", description="`cpu`, `cuda:N`, or one per node")
    connector: ConnectorSection | None = Field(
        None, description="KV connector (required for prefill, and for decode with prefill nodes)"
    )
    kv_backends: list[KVBackendSection] | None = Field(
        None,
        description="the node's KV backends in order, replacing `connector.kind` and "
        "`kv_store.backend` (its `transfer` backend must be of `connector.kind`; chunk size "
        "and timeouts still come from `kv_store`); unset: derived from those two",
    )
    ray: RaySection = Field(default_factory=RaySection, description="Ray placement")


class RestartSection(Section):
    """What the launcher does when a process exits on its own."""

    enabled: bool = Field(True, description="restart a crashed node, router or Redis")
    max_restarts: int = Field(5, ge=0, description="restarts per process before giving up")
    backoff_s: float = Field(1.0, ge=0, description="wait before the first restart")
    backoff_max_s: float = Field(30.0, ge=0, description="the wait doubles up to this")
    reset_after_s: float = Field(
        120.0, gt=0, description="healthy this long: the restart count starts over"
    )


class LauncherSection(RegistrySettings):
    """How `pdserve launch` runs the processes."""

    kind: Literal["local", "ray"] = Field("local", description="`local` or `ray`")
    ray_address: str = Field(
        "auto", description="ray: cluster address (`auto`: the local Ray cluster)"
    )
    run_dir: str = Field("runs", description="per-run directories (logs, cluster.json) go here")
    startup_timeout_s: float = Field(
        600.0, gt=0, description="a process not healthy by then fails the launch"
    )
    drain_timeout_s: float = Field(
        30.0,
        ge=0,
        description="on stop: each process answers new requests with a 503 and gives "
        "in-flight requests this long (router first, then nodes); SIGKILL 10 s after it",
    )
    log_level: Literal["debug", "info", "warning", "error"] = Field(
        "info", description="log level of every process"
    )
    restart: RestartSection = Field(default_factory=RestartSection, description="restarts")


class ClusterConfig(Section):
    """The whole cluster."""

    cluster: str = Field(
        "pdserve",
        min_length=1,
        pattern=r"^[A-Za-z0-9_.-]+$",
        description="cluster name: the Redis key prefix and the run directory's prefix",
    )
    model: ModelSection = Field(description="the model (required)")
    redis: RedisSection = Field(default_factory=RedisSection, description="cluster state")
    router: RouterSection = Field(default_factory=RouterSection, description="front door")
    prefill: NodeGroup | None = Field(None, description="prefill node group")
    decode: NodeGroup = Field(description="decode node group (required)")
    kv_store: KVStoreSection = Field(
        default_factory=KVStoreSection, description="shared prefix store (off by default)"
    )
    launcher: LauncherSection = Field(default_factory=LauncherSection, description="launcher")
    secret_file: str | None = Field(
        None,
        description="file holding the cluster secret (16+ bytes): nodes then encrypt "
        "(CurveZMQ) and authenticate (HMAC) the KV control channel, seal KV-done "
        "notifications and answer HTTP only from the router (docs/operations.md)",
    )
    insecure_open_network: bool = Field(
        False,
        description="INSECURE: allow the router, nodes or embedded Redis to bind beyond "
        "loopback without `secret_file` (anyone who reaches a port can then read prompts, "
        "write Redis and add nodes); without it such a config is refused",
    )

    @field_validator("redis", mode="before")
    @classmethod
    def _redis_shorthand(cls, v: object) -> object:
        return {"url": v} if isinstance(v, str) else v
