"""The cluster config file (YAML) as pydantic models: what `pdserve launch` reads.

One file describes a whole cluster: the model every node serves, Redis (embedded or an
external URL), the router, and the prefill and decode node groups. Unknown keys are errors
(`extra="forbid"`), so a typo never passes silently. Field descriptions are the reference
documentation (docs/configuration.md is generated from them by cluster/docs.py).

Checks that span fields (port clashes, a prefill group without a connector) live in
cluster/config_file.py, which also maps every error to its line in the YAML file.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ByteSize, ConfigDict, Field, field_validator, model_validator

POLICIES = Literal["round_robin", "least_loaded", "kv_aware"]


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelSection(Section):
    """What every node serves; the settings prefill and decode nodes must agree on."""

    name: str = Field(
        min_length=1, description="built-in name, HF directory or .gguf file (required)"
    )
    served_name: str | None = Field(None, description="model name in the API (default: `name`)")
    dtype: Literal["float32", "bfloat16", "float16"] | None = Field(
        None,
        description="weights and KV cache dtype (default: bfloat16 on CUDA, float32 on "
        "CPU); float32 is token-exact vs HF",
    )
    block_size: int = Field(16, ge=1, description="tokens per KV block (a power of two)")
    kv_layout: Literal["layer_major", "block_major"] = Field(
        "layer_major",
        description="storage order of the paged KV cache: `layer_major` ([L, 2, N, ...]) or "
        "`block_major` ([N, L, 2, ...]: a block's every layer in one range, one NIXL "
        "descriptor per block run)",
    )
    enforce_eager: bool | None = Field(
        None,
        description="true: run the model step as plain torch (the reference); false: "
        "decode steps compiled whole with torch.compile, one graph per batch bucket up to "
        "`scheduler.max_num_seqs` (CPU; compiled code cached on disk under the pdserve "
        "cache dir); null: eager (measured as fast or faster, docs/benchmarks.md)",
    )
    batched_decode: bool = Field(
        True,
        description="CPU fp32/bf16: decode steps of 9-256 rows as one native call on a copy of "
        "the projection and lm_head weights packed for it (~2x the weights' memory; false: "
        "oneDNN's GEMMs, op by op)",
    )
    max_model_len: int | None = Field(
        None, ge=2, description="longest sequence, prompt + output (default: the model's)"
    )

    @field_validator("block_size")
    @classmethod
    def _power_of_two(cls, v: int) -> int:
        if v & (v - 1):
            raise ValueError(f"must be a power of two, got {v}")
        return v


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


class RouterSection(Section):
    """The cluster's front door (`pdserve router`): the only endpoint clients use."""

    enabled: bool = Field(True, description="start a router (false: nodes only)")
    host: str = Field("127.0.0.1", description="address the router binds")
    port: int = Field(8000, ge=1, le=65535, description="the router's HTTP port")
    prefill_policy: POLICIES = Field("kv_aware", description="how a prefill node is picked")
    decode_policy: POLICIES = Field("kv_aware", description="how a decode node is picked")
    api_key: str | None = Field(None, description="clients must send `Authorization: Bearer KEY`")
    overlap_weight: float = Field(
        1.0, ge=0, description="kv_aware: weight of the blocks a node would have to compute"
    )
    kv_temperature: float = Field(
        0.0,
        ge=0,
        allow_inf_nan=False,
        description="kv_aware: sample nodes by softmax(-cost / T), T in KV blocks "
        "(0: always the cheapest)",
    )
    max_retries: int = Field(
        1, ge=0, description="extra attempts on another node while nothing was streamed"
    )
    health_interval_s: float = Field(1.0, gt=0, description="how often nodes are probed")
    request_timeout_s: float = Field(600.0, gt=0, description="whole request deadline")
    breaker_failures: int = Field(
        3, ge=1, description="consecutive failures that open a node's circuit breaker"
    )
    breaker_cooldown_s: float = Field(
        5.0, gt=0, description="first open period of a breaker (doubles while failures go on)"
    )
    body_timeout_s: float = Field(
        30.0, gt=0, description="a request body not received in full by then gets HTTP 408"
    )
    max_concurrent_per_key: int = Field(
        0,
        ge=0,
        description="generation requests in flight per API key (else per client "
        "address); more get a 429 (0: no limit)",
    )
    prompt_tokens_per_minute_per_key: int = Field(
        0,
        ge=0,
        description="prompt tokens per minute per API key (else per client address), a "
        "token bucket; over it: 429 `rate_limit_exceeded` with Retry-After (0: no limit)",
    )
    max_prompt_tokens_per_request: int = Field(
        0,
        ge=0,
        description="prompt tokens one request may have; more: 429 `request_too_large` "
        "(0: only the context length limits it)",
    )
    ssl_certfile: str | None = Field(
        None, description="serve HTTPS with this certificate (PEM; needs `ssl_keyfile`)"
    )
    ssl_keyfile: str | None = Field(None, description="the certificate's private key (PEM)")

    @model_validator(mode="after")
    def _ssl_pair(self) -> RouterSection:
        if (self.ssl_certfile is None) != (self.ssl_keyfile is None):
            raise ValueError("give both ssl_certfile and ssl_keyfile, or neither")
        return self


class ConnectorSection(Section):
    """How KV blocks move from prefill to decode nodes."""

    kind: Literal["nixl", "lmcache"] = Field(
        "nixl",
        description="KV connector: `nixl` (point to point) or `lmcache` (through the "
        "`kv_store.url` Redis)",
    )
    transfer_timeout_s: float = Field(60.0, gt=0, description="deadline for a prompt's KV")
    abort_grace_s: float = Field(
        2.0, ge=0, description="after a deadline or abort, wait before reusing blocks"
    )
    peer_timeout_s: float = Field(
        5.0,
        gt=0,
        description="decode: a prefill node silent this long is dead (its requests fail over)",
    )
    net_devices: str = Field(
        "auto",
        description="network devices the NIXL/UCX data plane listens on (UCX_NET_DEVICES, "
        "e.g. `lo`, `eth0`, `mlx5_0:1`); `auto`: `lo` when the node binds loopback, else all",
    )


class KVBackendSection(Section):
    """One backend of a node's composed KV connector (kv_transfer/multi_connector.py)."""

    kind: Literal["nixl", "lmcache"] = Field(description="`nixl` or `lmcache`")
    roles: list[Literal["transfer", "load", "save"]] = Field(
        min_length=1,
        description="`transfer`: a PD request's KV between its nodes (one backend at most); "
        "`load`: asked for stored prefixes, in list order, the first that has one serves it; "
        "`save`: gets every prompt the node computes (lmcache only for load/save)",
    )
    url: str = Field(
        "cluster",
        description="lmcache: `cluster` (the cluster's Redis) or `redis://host:port`",
    )

    @field_validator("url")
    @classmethod
    def _url(cls, v: str) -> str:
        if v != "cluster" and not v.startswith("redis://"):
            raise ValueError(f"must be 'cluster' or a redis:// URL, got {v!r}")
        return v

    def spec(self) -> str:
        """As `pdserve serve --kv-backend` takes it."""
        roles = f"{self.kind}:{','.join(self.roles)}"
        return roles if self.kind == "nixl" else f"{roles}:{self.url}"


class KVStoreSection(Section):
    """A shared, persistent KV store (LMCache): every node saves finished prompt chunks to
    it and loads the longest stored prefix before computing (kv_transfer/prefix_store.py)."""

    backend: Literal["lmcache"] | None = Field(None, description="`lmcache`; unset: off")
    url: str = Field(
        "cluster",
        description="`cluster` (the cluster's Redis) or `redis://host:port` of another one",
    )
    chunk_size: int = Field(256, ge=1, description="tokens per chunk (a multiple of block_size)")
    local_cpu_bytes: ByteSize = Field(
        ByteSize(1 << 30), description="each node's local CPU tier of the store"
    )
    load_timeout_s: float = Field(10.0, gt=0, description="a slower load: compute locally")
    save_timeout_s: float = Field(30.0, gt=0, description="a save not visible by then fails")
    retry_after_s: float = Field(10.0, ge=0, description="after a failure, skip the store")

    @field_validator("url")
    @classmethod
    def _url(cls, v: str) -> str:
        if v != "cluster" and not v.startswith("redis://"):
            raise ValueError(f"must be 'cluster' or a redis:// URL, got {v!r}")
        return v


class RaySection(Section):
    """Where the Ray launcher places each node of the group (ignored by the local launcher)."""

    num_cpus: float = Field(1.0, ge=0, description="Ray CPUs one node reserves")
    num_gpus: float = Field(0.0, ge=0, description="Ray GPUs one node reserves")
    resources: dict[str, float] = Field(
        default_factory=dict, description="custom Ray resources (labels) one node needs"
    )


PortSpec = int | list[int]


class NodeGroup(Section):
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
    num_threads: int | None = Field(None, ge=1, description="engine torch threads per node")
    kv_cache_bytes: ByteSize = Field(
        ByteSize(1 << 30), description="paged KV cache size per node, e.g. `256MiB`"
    )
    num_blocks: int | None = Field(None, ge=1, description="KV blocks (overrides the bytes)")
    enable_prefix_caching: bool = Field(True, description="reuse identical prompt prefixes")
    kv_populate: bool = Field(
        True,
        description="CPU: fault the whole KV cache in at start (seconds per GiB in some VMs), "
        "so the first requests do not pay page faults; false: a faster start",
    )
    max_num_seqs: int = Field(64, ge=1, description="requests in the running batch")
    max_num_batched_tokens: int = Field(2048, ge=1, description="token budget of one step")
    local_prefill_max_tokens: int = Field(
        16, ge=0, description="decode: prefill an uncached suffix this short locally"
    )
    on_prefill_failure: Literal["local", "error"] = Field(
        "local", description="decode: when KV does not arrive, prefill locally or fail"
    )
    max_body_bytes: int = Field(4 << 20, ge=1, description="larger request bodies get HTTP 413")
    body_timeout_s: float = Field(
        30.0, gt=0, description="a request body not received in full by then gets HTTP 408"
    )
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


class LauncherSection(Section):
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
    heartbeat_s: float = Field(1.0, gt=0, description="nodes refresh their registry record")
    node_ttl_s: float = Field(5.0, gt=0, description="a silent node leaves the registry")
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

    @field_validator("redis", mode="before")
    @classmethod
    def _redis_shorthand(cls, v: object) -> object:
        return {"url": v} if isinstance(v, str) else v
