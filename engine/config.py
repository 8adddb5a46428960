"""Engine configuration: frozen dataclasses, validated in __post_init__ (errors name the field)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from engine.errors import ConfigError

DTYPES = ("float32", "bfloat16", "float16")


@dataclass(frozen=True)
class ModelConfig:
    model: str = "smollm2-135m-instruct"  # built-in name, HF directory or .gguf path
    dtype: str = "float32"
    device: str = "cpu"
    kernel_backend: str | None = None  # "torch" | "triton"; None picks by device
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    seed: int = 0

    @property
    def torch_dtype(self):
        import torch

        return getattr(torch, self.dtype)

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ConfigError("model.dtype", f"must be one of {DTYPES}, got {self.dtype!r}")
        if not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ConfigError("model.device", f"must be 'cpu' or 'cuda[:N]', got {self.device!r}")
        if self.kernel_backend not in (None, "torch", "triton"):
            raise ConfigError(
                "model.kernel_backend", f"must be 'torch' or 'triton', got {self.kernel_backend!r}"
            )
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ConfigError("model.max_model_len", f"must be >= 2, got {self.max_model_len}")


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    kv_cache_bytes: int = 1 << 30  # budget for the paged KV tensor
    num_blocks: int | None = None  # overrides the byte budget when set
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ConfigError("cache.block_size", f"must be a power of two, got {self.block_size}")
        if self.kv_cache_bytes < 1:
            raise ConfigError("cache.kv_cache_bytes", f"must be > 0, got {self.kv_cache_bytes}")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ConfigError("cache.num_blocks", f"must be >= 1, got {self.num_blocks}")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_batched_tokens: int = 2048  # token budget of one step
    max_num_seqs: int = 64
    enable_chunked_prefill: bool = True
    # PD (decode role): a request whose uncached prompt suffix is at most this many tokens
    # is prefilled here instead of on its prefill node (conditional disaggregation).
    local_prefill_max_tokens: int = 16

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens < 1:
            raise ConfigError(
                "scheduler.max_num_batched_tokens",
                f"must be >= 1, got {self.max_num_batched_tokens}",
            )
        if self.max_num_seqs < 1:
            raise ConfigError("scheduler.max_num_seqs", f"must be >= 1, got {self.max_num_seqs}")
        if self.local_prefill_max_tokens < 0:
            raise ConfigError(
                "scheduler.local_prefill_max_tokens",
                f"must be >= 0, got {self.local_prefill_max_tokens}",
            )


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    num_threads: int | None = None  # torch threads; None: one per core

    def __post_init__(self) -> None:
        if self.num_threads is not None and self.num_threads < 1:
            raise ConfigError("num_threads", f"must be >= 1, got {self.num_threads}")

    @property
    def threads(self) -> int:
        return self.num_threads or len(os.sched_getaffinity(0))
