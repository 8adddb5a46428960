"""Build the engine's PD role (decode: import KV; prefill: export KV) and its KV store."""

from __future__ import annotations

from engine.config import EngineConfig
from engine.kv_role import KVRole
from engine.kv_store import KVStore
from kv_transfer.base import create_connector


def build_kv_role(config: EngineConfig) -> KVRole | None:
    """None for a colocated node; else the role with its connector (not yet attached)."""
    cfg = config.kv_transfer
    if cfg.role == "colocated":
        return None
    extra: dict = {"net_devices": cfg.net_devices}
    if cfg.connector == "lmcache":  # PD through the shared store of `kv_store`
        from kv_transfer.lmcache_connector import LMCacheSettings

        st = config.kv_store
        extra = {
            "lmcache": LMCacheSettings(
                remote_url=st.remote_url,
                namespace=st.namespace or config.model.model,
                chunk_size=st.chunk_size,
                local_cpu_bytes=st.local_cpu_bytes,
            )
        }
    connector = create_connector(
        cfg.connector,
        node_id=cfg.node_id,
        role=cfg.role,
        control_address=cfg.control_address,
        abort_grace_s=cfg.abort_grace_s,
        peer_timeout_s=cfg.peer_timeout_s,
        cluster_secret=cfg.cluster_secret,
        **extra,
    )
    if cfg.role == "prefill":
        from prefill.role import PrefillRole

        return PrefillRole(connector)
    from decode.role import DecodeRole

    return DecodeRole(
        connector,
        transfer_timeout_s=cfg.transfer_timeout_s,
        prefill_locally_on_failure=cfg.on_prefill_failure == "local",
        prefill_nodes=cfg.prefill_nodes,
    )


def store_index_id(config: EngineConfig) -> str:
    """Names the prefix store's index set in the cluster's KV index ("": no store): nodes
    that share chunks (same namespace and dtype) share it."""
    st = config.kv_store
    if st.backend is None:
        return ""
    return f"{st.namespace or config.model.model}|{config.model.dtype_name}"


def build_kv_store(config: EngineConfig) -> KVStore | None:
    """The prefix store from `config.kv_store` (None when off); LMCache is built lazily."""
    cfg = config.kv_store
    if cfg.backend is None:
        return None
    from kv_transfer.prefix_store import PrefixStore, redis_health_check

    # Chunks are shared by every node that names the model the same way.
    namespace = cfg.namespace or config.model.model

    def backend(kv_cache):
        from kv_transfer.lmcache_store import LMCacheKVStore

        return LMCacheKVStore(
            kv_cache,
            namespace=namespace,
            chunk_size=cfg.chunk_size,
            local_cpu_bytes=cfg.local_cpu_bytes,
            remote_url=cfg.remote_url,
        )

    return PrefixStore(
        backend,
        load_timeout_s=cfg.load_timeout_s,
        save_timeout_s=cfg.save_timeout_s,
        retry_after_s=cfg.retry_after_s,
        health_check=redis_health_check(cfg.remote_url) if cfg.remote_url else None,
    )
