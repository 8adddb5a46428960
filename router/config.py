"""Router configuration: one frozen dataclass, checked in `__post_init__` (errors name the field)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from pdserve.config.fields import ConfigError as RouterConfigError
from pdserve.config.router import POLICIES

__all__ = ["RouterConfig", "RouterConfigError"]


@dataclass(frozen=True)
class RouterConfig:
    model: str = "smollm2-135m-instruct"  # tokenizer + chat template: built-in, HF dir, .gguf
    served_model_name: str | None = None  # the name clients and nodes use (default: model)
    host: str = "127.0.0.1"
    port: int = 8000
    redis_url: str | None = None
    cluster: str = "pdserve"
    prefill_urls: tuple[str, ...] = ()  # static nodes (work without Redis)
    decode_urls: tuple[str, ...] = ()
    prefill_policy: str = "kv_aware"
    decode_policy: str = "kv_aware"
    api_key: str | None = None
    # kv_aware cost: overlap_weight x blocks to compute + load in blocks (router/policies.py)
    overlap_weight: float = 1.0
    # kv_aware: sample nodes by softmax(-cost / T), T in KV blocks; 0: always the cheapest
    kv_temperature: float = 0.0
    health_interval_s: float = 1.0  # node probes (GET /v1/node)
    registry_interval_s: float = 0.5  # registry re-reads
    connect_timeout_s: float = 2.0
    request_timeout_s: float = 600.0  # whole request, first byte to last
    max_retries: int = 1  # extra attempts on another node when nothing was streamed yet
    breaker_failures: int = 3  # consecutive failures that open a node's circuit
    breaker_cooldown_s: float = 5.0  # first open period (doubles while failures go on)
    max_body_bytes: int = 4 << 20
    body_timeout_s: float = 30.0  # a request body not in full by then: 408
    max_concurrent_per_key: int = 0  # generation requests in flight per client; 0: no limit
    prompt_tokens_per_minute_per_key: int = 0  # router/token_budget.py; 0: no limit
    max_prompt_tokens_per_request: int = 0  # per client request; 0: only the context length
    ssl_certfile: str | None = None  # serve HTTPS with this certificate (PEM) ...
    ssl_keyfile: str | None = None  # ... and this private key
    # sent to nodes as their HTTP key (api/cluster_secret.py); None: nodes are open
    cluster_secret: bytes | None = field(default=None, repr=False)

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model

    def __post_init__(self) -> None:
        for name in ("prefill_policy", "decode_policy"):
            if getattr(self, name) not in POLICIES:
                raise RouterConfigError(
                    name, f"must be one of {POLICIES}, got {getattr(self, name)!r}"
                )
        for url in self.prefill_urls + self.decode_urls:
            if not url.startswith(("http://", "https://")):
                field = "prefill" if url in self.prefill_urls else "decode"
                raise RouterConfigError(field, f"{url!r} must be an http(s):// url")
        if not self.redis_url and not self.decode_urls:
            raise RouterConfigError(
                "decode", "give --decode URL (static nodes) or --redis-url (registry)"
            )
        if self.redis_url and not self.redis_url.startswith(("redis://", "rediss://", "unix://")):
            raise RouterConfigError("redis_url", f"{self.redis_url!r} is not a redis:// url")
        if not 0 <= self.port < 65536:
            raise RouterConfigError("port", f"must be in [0, 65535], got {self.port}")
        if self.max_retries < 0:
            raise RouterConfigError("max_retries", f"must be >= 0, got {self.max_retries}")
        if self.breaker_failures < 1:
            raise RouterConfigError(
                "breaker_failures", f"must be >= 1, got {self.breaker_failures}"
            )
        for name in (
            "health_interval_s",
            "registry_interval_s",
            "connect_timeout_s",
            "request_timeout_s",
            "breaker_cooldown_s",
            "body_timeout_s",
        ):
            if not getattr(self, name) > 0:
                raise RouterConfigError(name, f"must be > 0, got {getattr(self, name)}")
        for name in (
            "max_concurrent_per_key",
            "prompt_tokens_per_minute_per_key",
            "max_prompt_tokens_per_request",
        ):
            if getattr(self, name) < 0:
                raise RouterConfigError(name, f"must be >= 0, got {getattr(self, name)}")
        if (self.ssl_certfile is None) != (self.ssl_keyfile is None):
            raise RouterConfigError("ssl_keyfile", "give both ssl_certfile and ssl_keyfile")
        for name in ("ssl_certfile", "ssl_keyfile"):
            path = getattr(self, name)
            if path is not None and not os.path.isfile(path):
                raise RouterConfigError(name, f"{path!r} is not a readable file")
        if not self.overlap_weight >= 0:
            raise RouterConfigError("overlap_weight", f"must be >= 0, got {self.overlap_weight}")
        if not 0 <= self.kv_temperature < float("inf"):
            raise RouterConfigError(
                "kv_temperature", f"must be a finite number >= 0, got {self.kv_temperature}"
            )
