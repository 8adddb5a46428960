"""Build the node's KV backends from its config: one `MultiConnector`
(kv_transfer/multi_connector.py) holding the PD transfer connector (wrapped here in the
engine's PD role: decode imports KV, prefill exports it) and the prefix-store backends."""

from __future__ import annotations

import logging

from pdserve.engine.config import EngineConfig, KVBackendConfig
from pdserve.engine.kv_role import KVRole
from pdserve.engine.kv_store import KVStore
from pdserve.kv_transfer.base import DecodeConnector, PrefillConnector
from pdserve.kv_transfer.connectors import create_connector
from pdserve.kv_transfer.multi_connector import MultiConnector, StoreBackend

logger = logging.getLogger(__name__)


def build_kv(config: EngineConfig) -> tuple[KVRole | None, KVStore | None]:
    """The engine's PD role (None: colocated) and prefix store (None: none), both from
    the node's one MultiConnector."""
    multi = build_kv_connector(config)
    logger.info("KV backends: %s", multi.describe())
    role = _role(config, multi.transfer) if multi.transfer is not None else None
    return role, (multi if multi.has_store else None)


def build_kv_role(config: EngineConfig) -> KVRole | None:
    """Just the PD role (no prefix store), e.g. for a test or a GPU check."""
    multi = build_kv_connector(config, stores=False)
    return _role(config, multi.transfer) if multi.transfer is not None else None


def build_kv_store(config: EngineConfig) -> KVStore | None:
    """Just the prefix store (no transfer connector)."""
    multi = build_kv_connector(config, transfer=False)
    return multi if multi.has_store else None


def build_kv_connector(
    config: EngineConfig, *, transfer: bool = True, stores: bool = True
) -> MultiConnector:
    """Every backend of `config.backends` in order (LMCache is built lazily, on attach)."""
    store_list: list[StoreBackend] = []
    conn, conn_name = None, None
    for b in config.backends:
        if "transfer" in b.roles and transfer:
            conn, conn_name = _transfer_connector(config, b), b.name
        if stores and ("load" in b.roles or "save" in b.roles):
            assert b.name is not None  # config.backends names every backend
            store_list.append(
                StoreBackend(b.name, _prefix_store(config, b), "load" in b.roles, "save" in b.roles)
            )
    return MultiConnector(store_list, conn, conn_name)


def _transfer_connector(
    config: EngineConfig, b: KVBackendConfig
) -> DecodeConnector | PrefillConnector:
    cfg = config.kv_transfer
    extra: dict = {"net_devices": cfg.net_devices}
    if b.kind == "lmcache":  # PD through a shared store
        from pdserve.kv_transfer.lmcache_connector import LMCacheSettings

        st = config.kv_store
        url = b.remote_url or st.remote_url
        assert url is not None  # EngineConfig checks it
        extra = {
            "lmcache": LMCacheSettings(
                remote_url=url,
                namespace=store_namespace(config),
                chunk_size=st.chunk_size,
                local_cpu_bytes=st.local_cpu_bytes,
            )
        }
    return create_connector(
        b.kind,
        node_id=cfg.node_id,
        role=cfg.role,
        control_address=cfg.control_address,
        abort_grace_s=cfg.abort_grace_s,
        peer_timeout_s=cfg.peer_timeout_s,
        engine_stall_s=cfg.engine_stall_s,
        cluster_secret=cfg.cluster_secret,
        **extra,
    )


def _role(config: EngineConfig, connector: DecodeConnector | PrefillConnector) -> KVRole:
    cfg = config.kv_transfer
    if cfg.role == "prefill":
        from pdserve.prefill.role import PrefillRole

        return PrefillRole(connector)  # type: ignore[arg-type]
    from pdserve.decode.role import DecodeRole

    return DecodeRole(
        connector,  # type: ignore[arg-type]
        transfer_timeout_s=cfg.transfer_timeout_s,
        prefill_locally_on_failure=cfg.on_prefill_failure == "local",
        prefill_nodes=cfg.prefill_nodes,
        checksums=cfg.checksums,
        fallback_warn_share=cfg.fallback_warn_share,
    )


def store_namespace(config: EngineConfig) -> str:
    """LMCache's chunk-key namespace: the configured one (default: the model's name) and
    the digest of the weights (pdserve/common/weights_digest.py), so nodes share chunks
    only when they run the same checkpoint, whatever it is called."""
    from pdserve.common.model_files import resolve_model
    from pdserve.common.weights_digest import weights_digest

    digest = weights_digest(resolve_model(config.model.name))
    return f"{config.kv_store.namespace or config.model.name}|{digest}"


def store_index_id(config: EngineConfig) -> str:
    """Names the prefix store's index set in the cluster's KV index ("": no store): nodes
    that share chunks (same namespace and dtype) share it."""
    if not config.has_prefix_store:
        return ""
    return f"{config.kv_store.namespace or config.model.name}|{config.model.dtype_name}"


def _prefix_store(config: EngineConfig, b: KVBackendConfig) -> KVStore:
    """One LMCache prefix store (its own worker thread and local tier) for backend `b`."""
    from pdserve.kv_transfer.prefix_store import PrefixStore, redis_health_check

    cfg = config.kv_store
    url = b.remote_url or cfg.remote_url
    namespace = store_namespace(config)

    def backend(kv_cache):
        from pdserve.kv_transfer.lmcache_store import LMCacheKVStore

        return LMCacheKVStore(
            kv_cache,
            namespace=namespace,
            chunk_size=cfg.chunk_size,
            local_cpu_bytes=cfg.local_cpu_bytes,
            remote_url=url,
            checksums=config.kv_transfer.checksums,
        )

    return PrefixStore(
        backend,
        load_timeout_s=cfg.load_timeout_s,
        save_timeout_s=cfg.save_timeout_s,
        retry_after_s=cfg.retry_after_s,
        health_check=redis_health_check(url) if url else None,
    )
