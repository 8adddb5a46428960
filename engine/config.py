"""Engine configuration: frozen dataclasses, validated in __post_init__ (errors name the field).

A field the settings (pdserve/config/) also have has their name, takes their default and is
checked by them (`check`); the rest (the device, the node's id and peers, resolved URLs) is
the engine's own."""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace

from pdserve.common.errors import ConfigError
from pdserve.config.engine import (
    DEFAULT_MODEL,
    CacheSettings,
    KVFormatSettings,
    ModelSettings,
    SchedulerSettings,
)
from pdserve.config.fields import check, default
from pdserve.config.kv import StoreSettings, TransferSettings


@dataclass(frozen=True)
class ModelConfig:
    name: str = DEFAULT_MODEL  # built-in name, HF directory or .gguf path (YAML: model.name)
    dtype: str | None = None  # None: bfloat16 on CUDA, float32 on CPU
    device: str = "cpu"
    kernel_backend: str | None = None  # "torch" | "triton"; None picks by device
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    seed: int = 0
    # CPU fp32/bf16: projections' weights prepacked for oneDNN (engine/models/cpu_linear.py)
    cpu_onednn: bool = True
    # CPU: freed tensors' memory stays in the heap (engine/cpu_heap.py), not unmapped and
    # faulted in again by the next step
    cpu_keep_freed_memory: bool = True
    # CPU fp32/bf16: decode steps of 9-256 rows as one native call on weights packed for it
    # (engine/models/fused_decode.py; one more copy of the projections and lm_head)
    batched_decode: bool = default(ModelSettings, "batched_decode")
    # CPU: the plain projection weights kept where the packed copies could replace them
    # (engine/models/fused_decode.py, `FusedDecode.release_plain`)
    keep_plain_weights: bool = default(ModelSettings, "keep_plain_weights")
    # CPU: steps with prompt tokens on oneDNN's copy or the batched forward's panel copy
    # (engine/models/fused_decode.py, `FusedDecode.serve_prompt_steps`)
    prompt_gemm: str = default(ModelSettings, "prompt_gemm")
    # The model's name in the API, the registry and the block-hash root (default: `name`).
    served_name: str | None = None
    # True: plain torch (the reference). False: the decode step compiled
    # (engine/compiled_model.py; CPU only, CUDA runs eager). None: eager, which is as fast
    # or faster on CPU (docs/benchmarks.md) and compiles nothing per process.
    enforce_eager: bool | None = None
    compile_cache_dir: str | None = None  # None: <pdserve cache dir>/compile

    @property
    def compiled(self) -> bool:
        """Whether the step runs compiled (see `enforce_eager`)."""
        if not self.device.startswith("cpu"):
            return False
        if self.enforce_eager is None:  # eager by default: see `enforce_eager`
            return False
        return not self.enforce_eager

    @property
    def api_name(self) -> str:
        """The name clients, the registry and the block-hash root know the model by."""
        return self.served_name or self.name

    @property
    def dtype_name(self) -> str:
        """The dtype in use: the configured one, else bf16 on CUDA and fp32 on CPU."""
        if self.dtype is not None:
            return self.dtype
        return "bfloat16" if self.device.startswith("cuda") else "float32"

    @property
    def torch_dtype(self):
        import torch

        return getattr(torch, self.dtype_name)

    def __post_init__(self) -> None:
        check("model", self, ModelSettings, skip=("name",))
        if not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ConfigError("model.device", f"must be 'cpu' or 'cuda[:N]', got {self.device!r}")
        if self.kernel_backend not in (None, "torch", "triton"):
            raise ConfigError(
                "model.kernel_backend", f"must be 'torch' or 'triton', got {self.kernel_backend!r}"
            )


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = default(KVFormatSettings, "block_size")
    kv_cache_bytes: int = default(CacheSettings, "kv_cache_bytes")  # the paged KV tensor
    num_blocks: int | None = None  # overrides the byte budget when set
    enable_prefix_caching: bool = default(CacheSettings, "enable_prefix_caching")
    # Report blocks entering/leaving the prefix cache with each output batch (KV index).
    kv_events: bool = False
    kv_layout: str = default(KVFormatSettings, "kv_layout")  # layer_major | block_major
    # CPU: fault the KV cache in on a thread from the start, lowest blocks first
    # (kernels/fault_in.py), not block by block on the request path;
    # `PDSERVE_KV_POPULATE=0` turns it off process-wide.
    kv_populate: bool = default(CacheSettings, "kv_populate")

    def __post_init__(self) -> None:
        check("cache", self, KVFormatSettings, CacheSettings)


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_batched_tokens: int = default(SchedulerSettings, "max_num_batched_tokens")
    max_num_seqs: int = default(SchedulerSettings, "max_num_seqs")
    enable_chunked_prefill: bool = True
    # PD (decode role): a request whose uncached prompt suffix is at most this many tokens
    # is prefilled here instead of on its prefill node (conditional disaggregation).
    local_prefill_max_tokens: int = default(SchedulerSettings, "local_prefill_max_tokens")

    def __post_init__(self) -> None:
        check("scheduler", self, SchedulerSettings)


ROLES = ("colocated", "prefill", "decode")
CONNECTORS = ("nixl", "lmcache")  # kv_transfer/nixl_connector.py, kv_transfer/lmcache_connector.py


@dataclass(frozen=True)
class KVTransferConfig:
    """Which PD role this node plays and how its KV moves (see kv_transfer/ and docs/)."""

    role: str = "colocated"
    connector: str = "nixl"
    node_id: str = "node"
    # prefill: the ZMQ address its control channel binds (decode nodes connect to it)
    control_address: str | None = None
    # decode: control addresses of the prefill nodes requests are sent to by default
    prefill_nodes: tuple[str, ...] = ()
    transfer_timeout_s: float = default(TransferSettings, "transfer_timeout_s")
    abort_grace_s: float = default(TransferSettings, "abort_grace_s")
    peer_timeout_s: float = default(TransferSettings, "peer_timeout_s")
    engine_stall_s: float = default(TransferSettings, "engine_stall_s")
    checksums: bool = default(TransferSettings, "checksums")
    fallback_warn_share: float = default(TransferSettings, "fallback_warn_share")
    on_prefill_failure: str = default(SchedulerSettings, "on_prefill_failure")
    # seals every control frame (kv_transfer/frame_auth.py); None: unauthenticated
    cluster_secret: bytes | None = field(default=None, repr=False)
    net_devices: str | None = None  # UCX_NET_DEVICES of the data plane; None: all devices

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ConfigError("kv_transfer.role", f"must be one of {ROLES}, got {self.role!r}")
        if self.connector not in CONNECTORS:
            raise ConfigError(
                "kv_transfer.connector", f"must be one of {CONNECTORS}, got {self.connector!r}"
            )
        if self.role == "prefill" and not self.control_address:
            raise ConfigError("kv_transfer.control_address", "a prefill node needs one")
        for addr in ((self.control_address,) if self.control_address else ()) + self.prefill_nodes:
            if not addr.startswith(("tcp://", "ipc://")):
                raise ConfigError(
                    "kv_transfer.prefill_nodes"
                    if addr in self.prefill_nodes
                    else "kv_transfer.control_address",
                    f"{addr!r} must start with tcp:// or ipc://",
                )
        check("kv_transfer", self, TransferSettings, SchedulerSettings, skip=("net_devices",))


@dataclass(frozen=True)
class KVStoreConfig:
    """A shared, persistent KV store this node loads prompt prefixes from and saves them to
    (kv_transfer/prefix_store.py; docs/configuration.md). Off unless `backend` is set."""

    backend: str | None = None  # "lmcache"
    remote_url: str | None = None  # redis://host:port shared by the nodes; None: local only
    chunk_size: int = default(StoreSettings, "chunk_size")
    local_cpu_bytes: int = default(StoreSettings, "local_cpu_bytes")
    namespace: str | None = None  # key prefix; None: derived from the model name
    load_timeout_s: float = default(StoreSettings, "load_timeout_s")
    save_timeout_s: float = default(StoreSettings, "save_timeout_s")
    retry_after_s: float = default(StoreSettings, "retry_after_s")

    def __post_init__(self) -> None:
        if self.backend not in (None, "lmcache"):
            raise ConfigError(
                "kv_store.backend", f"must be 'lmcache' or unset, got {self.backend!r}"
            )
        if self.remote_url is not None and not self.remote_url.startswith("redis://"):
            raise ConfigError(
                "kv_store.remote_url", f"must start with redis://, got {self.remote_url!r}"
            )
        check("kv_store", self, StoreSettings)


BACKEND_KINDS = ("nixl", "lmcache")
BACKEND_ROLES = ("transfer", "load", "save")


@dataclass(frozen=True)
class KVBackendConfig:
    """One backend of the node's composed KV connector (kv_transfer/multi_connector.py).

    Roles: `transfer` moves a PD request's KV between its prefill and decode node (at
    most one backend; `nixl` or `lmcache`); `load` is asked, in list order, for a prompt's
    stored prefix (the first that has it serves the load); `save` receives every prompt
    this node computes (all of them). `load`/`save` are LMCache only."""

    kind: str
    roles: tuple[str, ...]
    remote_url: str | None = None  # lmcache: its Redis; None: kv_store.remote_url
    name: str | None = None  # in logs and metrics; None: "<kind>-<position>"

    def check(self, where: str) -> None:
        if self.kind not in BACKEND_KINDS:
            raise ConfigError(f"{where}.kind", f"must be one of {BACKEND_KINDS}, got {self.kind!r}")
        bad = [r for r in self.roles if r not in BACKEND_ROLES]
        if not self.roles or bad or len(set(self.roles)) != len(self.roles):
            raise ConfigError(
                f"{where}.roles",
                f"a non-empty list of distinct roles from {BACKEND_ROLES}, got {list(self.roles)}",
            )
        if self.kind == "nixl" and self.roles != ("transfer",):
            raise ConfigError(f"{where}.roles", "nixl moves a request's blocks: only 'transfer'")
        if self.remote_url is not None and not self.remote_url.startswith("redis://"):
            raise ConfigError(
                f"{where}.remote_url", f"must start with redis://, got {self.remote_url!r}"
            )


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    kv_transfer: KVTransferConfig = field(default_factory=KVTransferConfig)
    kv_store: KVStoreConfig = field(default_factory=KVStoreConfig)
    # The node's KV backends in order (kv_transfer/multi_connector.py). Empty: derived from
    # kv_transfer.connector (the transfer of a PD node) and kv_store.backend (load + save).
    kv_backends: tuple[KVBackendConfig, ...] = ()
    num_threads: int | None = None  # torch threads; None: one per core
    # ranks of this node's tensor-parallel group (engine/tp_runner.py); 1: one device
    tensor_parallel_size: int = 1

    def __post_init__(self) -> None:
        if self.num_threads is not None and self.num_threads < 1:
            raise ConfigError("num_threads", f"must be >= 1, got {self.num_threads}")
        if self.tensor_parallel_size < 1:
            raise ConfigError(
                "tensor_parallel_size", f"must be >= 1, got {self.tensor_parallel_size}"
            )
        self._check_backends()
        transfer = next((b for b in self.backends if "transfer" in b.roles), None)
        pd_lmcache = transfer is not None and transfer.kind == "lmcache"
        if pd_lmcache and (transfer.remote_url or self.kv_store.remote_url) is None:
            raise ConfigError(
                "kv_store.remote_url",
                "kv_transfer.connector 'lmcache' moves KV through this shared Redis: set it",
            )
        lmcache = self.has_prefix_store or pd_lmcache
        if lmcache and self.kv_store.chunk_size % self.cache.block_size:
            raise ConfigError(
                "kv_store.chunk_size",
                f"{self.kv_store.chunk_size} is not a multiple of cache.block_size "
                f"{self.cache.block_size}",
            )

    def _check_backends(self) -> None:
        if not self.kv_backends:
            return
        if self.kv_store.backend is not None:
            raise ConfigError(
                "kv_backends", "name the prefix store in kv_backends or kv_store.backend, not both"
            )
        transfers = 0
        for i, b in enumerate(self.kv_backends):
            b.check(f"kv_backends[{i}]")
            transfers += "transfer" in b.roles
        if transfers > 1:
            raise ConfigError("kv_backends", "at most one backend may have the role 'transfer'")
        pd = self.kv_transfer.role != "colocated"
        if pd != (transfers == 1):
            raise ConfigError(
                "kv_backends",
                f"a {self.kv_transfer.role} node needs exactly one 'transfer' backend"
                if pd
                else "a colocated node has no 'transfer' backend",
            )
        names = [b.name for b in self.backends]
        if len(set(names)) != len(names):
            raise ConfigError("kv_backends", f"backend names must differ, got {names}")

    @property
    def backends(self) -> tuple[KVBackendConfig, ...]:
        """The node's KV backends in order, named (explicit, or derived from the shorthand)."""
        given = self.kv_backends
        if not given:
            given = ()
            if self.kv_transfer.role != "colocated":
                given += (KVBackendConfig(self.kv_transfer.connector, ("transfer",)),)
            if self.kv_store.backend is not None:
                given += (KVBackendConfig(self.kv_store.backend, ("load", "save")),)
        return tuple(b if b.name else replace(b, name=f"{b.kind}-{i}") for i, b in enumerate(given))

    @property
    def transfer_kind(self) -> str | None:
        """The kind of the PD transfer backend (None on a colocated node)."""
        return next((b.kind for b in self.backends if "transfer" in b.roles), None)

    @property
    def has_prefix_store(self) -> bool:
        return any("load" in b.roles or "save" in b.roles for b in self.backends)

    @property
    def threads(self) -> int:
        return self.num_threads or len(os.sched_getaffinity(0))
