"""Router configuration: one frozen dataclass, checked in `__post_init__` (errors name the field).

The fields of the router's settings (pdserve/config/router.py: the YAML `router` section, the
`pdserve router` flags) keep their names here, take their defaults from there and are
checked by that class; the rest (static nodes, Redis, intervals) is the router's own."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from pdserve.common.request_cost import CostLimits
from pdserve.config.engine import DEFAULT_MODEL
from pdserve.config.fields import ConfigError as RouterConfigError
from pdserve.config.fields import check, default
from pdserve.config.router import RouterSettings as S

__all__ = ["RouterConfig", "RouterConfigError"]


@dataclass(frozen=True)
class RouterConfig:
    name: str = DEFAULT_MODEL  # tokenizer + chat template: built-in, HF dir, .gguf
    served_name: str | None = None  # the name clients and nodes use (default: name)
    host: str = default(S, "host")
    port: int = default(S, "port")
    redis_url: str | None = None
    cluster: str = "pdserve"
    prefill_urls: tuple[str, ...] = ()  # static nodes (work without Redis)
    decode_urls: tuple[str, ...] = ()
    prefill_policy: str = default(S, "prefill_policy")
    decode_policy: str = default(S, "decode_policy")
    api_key: str | None = None
    # kv_aware cost: overlap_weight x blocks to compute + load in blocks (router/policies.py)
    overlap_weight: float = default(S, "overlap_weight")
    # kv_aware: sample nodes by softmax(-cost / T), T in KV blocks; 0: always the cheapest
    kv_temperature: float = default(S, "kv_temperature")
    health_interval_s: float = default(S, "health_interval_s")  # GET /v1/node
    registry_interval_s: float = 0.5  # registry re-reads
    connect_timeout_s: float = 2.0
    request_timeout_s: float = default(S, "request_timeout_s")
    max_retries: int = default(S, "max_retries")
    max_migrations: int = default(S, "max_migrations")
    migrate_buffered: bool = default(S, "migrate_buffered")
    migrate_silent_after_s: float = default(S, "migrate_silent_after_s")
    breaker_failures: int = default(S, "breaker_failures")
    breaker_cooldown_s: float = default(S, "breaker_cooldown_s")
    engine_stuck_after_s: float = default(S, "engine_stuck_after_s")
    max_body_bytes: int = 4 << 20
    body_timeout_s: float = default(S, "body_timeout_s")
    max_sequences_per_request: int = default(S, "max_sequences_per_request")
    max_sequence_tokens_per_request: int = default(S, "max_sequence_tokens_per_request")
    max_logprob_entries_per_request: int = default(S, "max_logprob_entries_per_request")
    max_concurrent_per_key: int = default(S, "max_concurrent_per_key")
    prompt_tokens_per_minute_per_key: int = default(S, "prompt_tokens_per_minute_per_key")
    max_prompt_tokens_per_request: int = default(S, "max_prompt_tokens_per_request")
    cache_salt_per_client: bool = default(S, "cache_salt_per_client")
    # registry records only on these or the static nodes' hosts
    node_hosts: list[str] = field(default_factory=list)
    ssl_certfile: str | None = None  # serve HTTPS with this certificate (PEM) ...
    ssl_keyfile: str | None = None  # ... and this private key
    # sent to nodes as their HTTP key (api/cluster_secret.py); None: nodes are open
    cluster_secret: bytes | None = field(default=None, repr=False)

    @property
    def cost_limits(self) -> CostLimits:
        return CostLimits.of(self)

    @property
    def api_name(self) -> str:
        """The name clients and nodes know the model by."""
        return self.served_name or self.name

    def __post_init__(self) -> None:
        check("", self, S)
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
        for name in ("registry_interval_s", "connect_timeout_s"):
            if not getattr(self, name) > 0:
                raise RouterConfigError(name, f"must be > 0, got {getattr(self, name)}")
        for name in ("ssl_certfile", "ssl_keyfile"):
            path = getattr(self, name)
            if path is not None and not os.path.isfile(path):
                raise RouterConfigError(name, f"{path!r} is not a readable file")
