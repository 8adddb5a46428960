"""The router's settings: how it picks nodes, retries, limits clients and serves HTTP."""

from __future__ import annotations

from typing import Literal

from pydantic import ValidationInfo, field_validator

from pdserve.config.engine import DEFAULT_MODEL
from pdserve.config.fields import Settings, setting
from pdserve.config.limits import RequestCostSettings

POLICIES = ("round_robin", "least_loaded", "kv_aware")
Policy = Literal["round_robin", "least_loaded", "kv_aware"]


class RouterSettings(RequestCostSettings):
    """The cluster's front door (`pdserve router`): the only endpoint clients use."""

    host: str = setting("127.0.0.1", "address the router binds")
    port: int = setting(8000, "the router's HTTP port", ge=1, le=65535)
    prefill_policy: Policy = setting("kv_aware", "how a prefill node is picked")
    decode_policy: Policy = setting("kv_aware", "how a decode node is picked")
    api_key: str | None = setting(
        None,
        "clients must send `Authorization: Bearer KEY` (`pdserve router` takes it from "
        "$PDSERVE_API_KEY when not given, which keeps it out of the process list)",
    )
    overlap_weight: float = setting(
        1.0, "kv_aware: weight of the blocks a node would have to compute", ge=0
    )
    kv_temperature: float = setting(
        0.0,
        "kv_aware: sample nodes by softmax(-cost / T), T in KV blocks (0: always the cheapest)",
        ge=0,
        allow_inf_nan=False,
    )
    max_retries: int = setting(1, "extra attempts on another node while nothing was streamed", ge=0)
    max_migrations: int = setting(
        2,
        "times one stream may move to another decode node after its first token, when its "
        "node fails (0: never; the client then gets an error event)",
        ge=0,
    )
    migrate_buffered: bool = setting(
        True,
        "serve non-streamed requests from the decode node as streams, so that they migrate "
        "like streams when their node fails (false: retried from the start, max_retries)",
    )
    migrate_silent_after_s: float = setting(
        3.0,
        "a stream silent this long on a decode node out of service (failed health probe, "
        "open breaker, stuck engine) is cut and moves to another decode node",
        gt=0,
        allow_inf_nan=False,
    )
    health_interval_s: float = setting(1.0, "how often nodes are probed", gt=0)
    request_timeout_s: float = setting(600.0, "whole request deadline", gt=0)
    breaker_failures: int = setting(
        3, "consecutive failures that open a node's circuit breaker", ge=1
    )
    engine_stuck_after_s: float = setting(
        30.0,
        "a decode node whose engine holds work and makes no progress this long (its /v1/node "
        "step count) gets no new requests until it does (0: never)",
        ge=0,
    )
    breaker_cooldown_s: float = setting(
        5.0, "first open period of a breaker (doubles while failures go on)", gt=0
    )
    body_timeout_s: float = setting(
        30.0, "a request body not received in full by then gets HTTP 408", gt=0
    )
    max_concurrent_per_key: int = setting(
        0,
        "generation requests in flight per API key (else per client address); more get a "
        "429 (0: no limit)",
        ge=0,
    )
    prompt_tokens_per_minute_per_key: int = setting(
        0,
        "prompt tokens per minute per API key (else per client address), a token bucket; "
        "over it: 429 `rate_limit_exceeded` with Retry-After (0: no limit)",
        ge=0,
    )
    max_prompt_tokens_per_request: int = setting(
        0,
        "prompt tokens one request may have; more: 429 `request_too_large` (0: only the "
        "context length limits it)",
        ge=0,
    )
    node_hosts: list[str] = setting(
        [],
        "with a cluster secret too, a registry record is taken only if its url and KV "
        "control address are on these hosts or the static nodes' (neither given: any host)",
        metavar="HOST",
    )
    cache_salt_per_client: bool = setting(
        False,
        "key every request's prefix-cache salt by its client (API key, else address) too: "
        "one client's cached prompts are invisible to every other (cached_tokens, routing)",
    )
    ssl_certfile: str | None = setting(
        None, "serve HTTPS with this certificate (PEM; needs `ssl_keyfile`)"
    )
    ssl_keyfile: str | None = setting(
        None, "the certificate's private key (PEM)", validate_default=True
    )

    @field_validator("ssl_keyfile")
    @classmethod
    def _ssl_pair(cls, v: str | None, info: ValidationInfo) -> str | None:
        if (info.data.get("ssl_certfile") is None) != (v is None):
            raise ValueError("give both ssl_certfile and ssl_keyfile, or neither")
        return v


class RouterProcessSettings(Settings):
    """`pdserve router` only: what the launcher derives from the rest of the cluster config
    (the model, the nodes, Redis) rather than reads from the `router` section."""

    name: str = setting(
        DEFAULT_MODEL,
        "tokenizer and chat template: built-in name, HF dir, .gguf (YAML: `model.name`)",
        flag="--model",
    )
    served_name: str | None = setting(
        None,
        "name in the API (default: --model; YAML: `model.served_name`)",
        flag="--served-model-name",
    )
    redis_url: str | None = setting(None, "cluster registry, e.g. redis://127.0.0.1:6379")
    cluster: str = setting("pdserve", "Redis key prefix of the cluster")
    prefill: list[str] = setting([], "static prefill node (repeatable)", metavar="URL")
    decode: list[str] = setting([], "static decode or colocated node (repeatable)", metavar="URL")
    cluster_secret_file: str | None = setting(
        None,
        "file with the cluster secret (or env PDSERVE_CLUSTER_SECRET): sent to nodes as "
        "their HTTP key",
    )
    drain_timeout_s: float = setting(
        5.0,
        "on SIGTERM: stop accepting, give in-flight requests this long, then exit",
        ge=0,
    )
