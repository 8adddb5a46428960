"""How KV moves between nodes (the transfer connector) and the shared prefix store."""

from __future__ import annotations

from typing import Literal

from pydantic import ByteSize, field_validator

from pdserve.config.fields import Settings, setting


def _redis_or_cluster(v: str) -> str:
    if v != "cluster" and not v.startswith("redis://"):
        raise ValueError(f"must be 'cluster' or a redis:// URL, got {v!r}")
    return v


class TransferSettings(Settings):
    """How KV blocks move from prefill to decode nodes."""

    FLAG_PREFIX = "kv-"

    kind: Literal["nixl", "lmcache"] = setting(
        "nixl",
        "KV connector: `nixl` (point to point) or `lmcache` (through the `kv_store.url` Redis)",
        flag="--kv-connector",
    )
    transfer_timeout_s: float = setting(
        60.0, "deadline for a prompt's KV", gt=0, aliases=("--kv-transfer-timeout",)
    )
    abort_grace_s: float = setting(
        2.0,
        "after a deadline or abort, wait before reusing blocks",
        ge=0,
        aliases=("--kv-abort-grace",),
    )
    peer_timeout_s: float = setting(
        5.0,
        "decode: a prefill node silent this long is dead (its requests fail over)",
        gt=0,
        aliases=("--kv-peer-timeout",),
    )
    engine_stall_s: float = setting(
        30.0,
        "decode: a prefill node whose engine holds work but took no step this long is "
        "stuck (its requests fail over; no new orders until it steps again); keep it above "
        "the longest prefill step",
        gt=0,
    )
    checksums: bool = setting(
        True,
        "decode: ask prefill nodes for an xxh3_64 checksum of every KV block they send and "
        "verify the landed blocks before decoding (a mismatch fails the transfer over); the "
        "KV store keeps one per block and verifies it on load (a mismatch is a miss)",
    )
    fallback_warn_share: float = setting(
        0.2,
        "decode: log a warning when more than this share of the last 100 requests that "
        "named a prefill node were prefilled here after their transfer failed",
        ge=0,
        le=1,
    )
    net_devices: str = setting(
        "auto",
        "network devices the NIXL/UCX data plane listens on (UCX_NET_DEVICES, e.g. `lo`, "
        "`eth0`, `mlx5_0:1`); `auto`: the interface holding the node's `host` address (`lo` "
        "for loopback), all for a wildcard bind",
    )


class StoreSettings(Settings):
    """A shared, persistent KV store (LMCache): every node saves finished prompt chunks to
    it and loads the longest stored prefix before computing (kv_transfer/prefix_store.py)."""

    FLAG_PREFIX = "kv-store-"

    backend: Literal["lmcache"] | None = setting(None, "`lmcache`; unset: off", flag="--kv-store")
    url: str = setting(
        "cluster", "`cluster` (the cluster's Redis) or `redis://host:port` of another one"
    )
    chunk_size: int = setting(256, "tokens per chunk (a multiple of block_size)", ge=1)
    local_cpu_bytes: ByteSize = setting(
        ByteSize(1 << 30),
        "each node's local CPU tier of the store (at least 1 MiB)",
        aliases=("--kv-store-local-bytes",),
        ge=1 << 20,
    )
    load_timeout_s: float = setting(
        10.0, "a slower load: compute locally", gt=0, aliases=("--kv-store-load-timeout",)
    )
    save_timeout_s: float = setting(
        30.0, "a save not visible by then fails", gt=0, aliases=("--kv-store-save-timeout",)
    )
    retry_after_s: float = setting(
        10.0, "after a failure, skip the store", ge=0, aliases=("--kv-store-retry-after",)
    )

    _url = field_validator("url")(_redis_or_cluster)


class KVBackendSettings(Settings):
    """One backend of a node's composed KV connector (kv_transfer/multi_connector.py)."""

    kind: Literal["nixl", "lmcache"] = setting(help="`nixl` or `lmcache`")
    roles: list[Literal["transfer", "load", "save"]] = setting(
        help="`transfer`: a PD request's KV between its nodes (one backend at most); "
        "`load`: asked for stored prefixes, in list order, the first that has one serves it; "
        "`save`: gets every prompt the node computes (lmcache only for load/save)",
        min_length=1,
    )
    url: str = setting("cluster", "lmcache: `cluster` (the cluster's Redis) or `redis://host:port`")

    _url = field_validator("url")(_redis_or_cluster)

    def spec(self) -> str:
        """As `pdserve serve --kv-backend` takes it."""
        roles = f"{self.kind}:{','.join(self.roles)}"
        return roles if self.kind == "nixl" else f"{roles}:{self.url}"
