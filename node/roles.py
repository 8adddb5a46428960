"""Build the engine's PD role (decode: import KV; prefill: export KV) from its config."""

from __future__ import annotations

from engine.config import KVTransferConfig
from engine.kv_role import KVRole
from kv_transfer.base import create_connector


def build_kv_role(cfg: KVTransferConfig) -> KVRole | None:
    """None for a colocated node; else the role with its connector (not yet attached)."""
    if cfg.role == "colocated":
        return None
    connector = create_connector(
        cfg.connector,
        node_id=cfg.node_id,
        role=cfg.role,
        control_address=cfg.control_address,
        abort_grace_s=cfg.abort_grace_s,
        peer_timeout_s=cfg.peer_timeout_s,
        cluster_secret=cfg.cluster_secret,
        net_devices=cfg.net_devices,
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
