"""Validation of a prefill order from a peer: nothing a decode node sends can crash us.

A prefill node checks each `PrefillOrder` here before its engine sees it; an order that
fails is rejected (`PrefillRejected` naming the reason), never executed. Token ids and
sampling parameters are checked by the engine's own request validation afterwards.
"""

from __future__ import annotations

from pdserve.kv_transfer.messages import PrefillOrder

MAX_ORDER_TTL_S = 3600.0  # an order may not ask for a longer deadline than this
MAX_ATTEMPT = 2**62


def order_problem(order: PrefillOrder, *, block_size: int, peer_num_blocks: int) -> str | None:
    """Why `order` cannot be taken (None if it can).

    `block_size` is ours (the layouts were checked compatible at `PeerHello`);
    `peer_num_blocks` is the decode node's pool size, bounding its block ids.
    """
    if not order.request_id or len(order.request_id) > 256:
        return "request_id must be 1-256 characters"
    if not 0 <= order.attempt <= MAX_ATTEMPT:
        return f"attempt {order.attempt} out of range"
    n_prompt = len(order.prompt_token_ids)
    if n_prompt == 0:
        return "empty prompt"
    n_blocks = -(-n_prompt // block_size)
    if not 0 <= order.first_block < n_blocks:
        return f"first_block {order.first_block} outside the prompt's {n_blocks} blocks"
    dst = order.dst_block_ids
    if len(dst) != n_blocks - order.first_block:
        return (
            f"{len(dst)} destination blocks for prompt blocks "
            f"{order.first_block}..{n_blocks} ({n_blocks - order.first_block} needed)"
        )
    bad = next((b for b in dst if not 0 <= b < peer_num_blocks), None)
    if bad is not None:
        return f"destination block {bad} outside the decode node's [0, {peer_num_blocks})"
    if len(set(dst)) != len(dst):
        return "duplicate destination block ids"
    if not 0 < order.ttl_s <= MAX_ORDER_TTL_S:  # NaN fails too
        return f"ttl_s {order.ttl_s} outside (0, {MAX_ORDER_TTL_S:g}] s"
    return None
