"""The NIXL KV connector: prefill WRITEs paged blocks straight into the decode node's blocks.

Assembled from three parts: the ZMQ control channel (`pdserve.kv_transfer.control_channel`:
sockets, bounded non-blocking sends, peer liveness), the NIXL data plane
(`pdserve.kv_transfer.nixl_transport`), and the side's protocol logic (`pdserve.kv_transfer.decode_side`
or `pdserve.kv_transfer.prefill_side`, each an explicit state machine). The prefill node binds
a ROUTER at its control address; each decode node connects a DEALER and introduces itself
once with its NIXL metadata (`PeerHello`), so afterwards only block ids travel per
request. Blocks are pushed as chunks finish; the request's last WRITE is posted only
after every earlier one is DONE and carries `PrefillDone` as its notification, so the
decode node hears "done" only once all blocks have landed. See `pdserve.kv_transfer.base`.
"""

from __future__ import annotations

import os
import uuid

import torch

from pdserve.kv_transfer.control_channel import DecodeControl, PrefillControl
from pdserve.kv_transfer.decode_side import DecodeSide
from pdserve.kv_transfer.frame_auth import FrameAuth
from pdserve.kv_transfer.prefill_side import PrefillSide


def _nixl_factory(node_id: str, net_devices: str | None, warmup_timeout_s: float | None = None):
    def build(kv_cache: torch.Tensor):
        from pdserve.kv_transfer.nixl_transport import NixlTransport

        if net_devices:  # UCX reads it when the agent starts: listen only on these
            os.environ["UCX_NET_DEVICES"] = net_devices
        name = f"{node_id}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        # The engine loop polls every step, so no NIXL progress thread busy-spinning a core.
        kw = {} if warmup_timeout_s is None else {"warmup_timeout_s": warmup_timeout_s}
        return NixlTransport(name, kv_cache, progress_thread=False, **kw)

    return build


def nixl_connector(
    *,
    node_id: str,
    role: str,
    control_address: str | None = None,
    abort_grace_s: float = 2.0,
    peer_timeout_s: float = 5.0,
    engine_stall_s: float = 30.0,
    heartbeat_s: float = 1.0,
    cluster_secret: bytes | None = None,
    net_devices: str | None = None,
    warmup_timeout_s: float | None = None,
) -> DecodeSide | PrefillSide:
    """The decode or prefill side of the NIXL connector for one node. With
    `cluster_secret`, control frames are sealed and checked (kv_transfer/frame_auth.py),
    the control channel is encrypted (CurveZMQ) and `PrefillDone` notifications are sealed;
    `net_devices` (UCX_NET_DEVICES) keeps the data plane's listeners on those devices;
    `engine_stall_s`: a prefill peer whose engine holds work but took no step this long
    is stuck (`DecodeControl.stuck`); `warmup_timeout_s` bounds a new decode peer's connection warm-up (default
    `nixl_warmup.WARMUP_TIMEOUT_S`; a peer that misses it is dropped and refused)."""
    if role == "decode":
        return DecodeSide(
            lambda hello: DecodeControl(
                hello,
                heartbeat_s=heartbeat_s,
                peer_timeout_s=peer_timeout_s,
                stall_s=engine_stall_s,
                auth=FrameAuth(cluster_secret),
            ),
            _nixl_factory(node_id, net_devices),
            abort_grace_s=abort_grace_s,
        )
    if role == "prefill":
        if not control_address:
            raise ValueError("a prefill node needs a control address (kv control)")
        # Give up on in-flight WRITEs half a grace past the order's own deadline.
        return PrefillSide(
            PrefillControl(control_address, auth=FrameAuth(cluster_secret)),
            _nixl_factory(node_id, net_devices, warmup_timeout_s),
            grace_s=abort_grace_s / 2,
        )
    raise ValueError(f"NIXL connector role must be 'prefill' or 'decode', got {role!r}")
