"""Pure-torch implementations of every kernel contract: the CPU path and the test oracle.

Paged KV cache layout, shared by every kernel and by the KV connectors:
    k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]
Each block's `[block_size, num_kv_heads, head_dim]` is contiguous; the stride between
blocks is free (a layer's view of a block-major cache steps over every other layer's
blocks, engine/kv_tensor.py), and K and V share it. A token's slot is
`block_id * block_size + offset`. Block tables are int32
[num_seqs, max_blocks_per_seq]; entries past a sequence's last block are padding and must
hold a valid block id (0 is used), they are masked out by the sequence's length.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def store_kv(
    key: torch.Tensor,  # [T, Hkv, D]
    value: torch.Tensor,  # [T, Hkv, D]
    k_cache: torch.Tensor,  # [N, bs, Hkv, D]
    v_cache: torch.Tensor,  # [N, bs, Hkv, D]
    slot_mapping: torch.Tensor,  # [T] int64; -1 = skip this token
) -> None:
    """Write each token's K and V into the paged cache at its slot, in place."""
    n, bs, hkv, d = k_cache.shape
    keep = slot_mapping >= 0
    if not bool(keep.all()):
        key, value, slot_mapping = key[keep], value[keep], slot_mapping[keep]
    if k_cache.is_contiguous() and v_cache.is_contiguous():
        k_cache.view(n * bs, hkv, d).index_copy_(0, slot_mapping, key)
        v_cache.view(n * bs, hkv, d).index_copy_(0, slot_mapping, value)
        return
    at = (slot_mapping // bs, slot_mapping % bs)  # strided blocks: (block, offset) pairs
    k_cache.index_put_(at, key)
    v_cache.index_put_(at, value)


def _gather_kv(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """[N, bs, Hkv, D] gathered through one block-table row -> [length, Hkv, D]."""
    bs = cache.shape[1]
    nblocks = (length + bs - 1) // bs
    return cache[block_table[:nblocks].long()].flatten(0, 1)[:length]


def paged_decode_attention(
    q: torch.Tensor,  # [B, H, D], one query token per sequence
    k_cache: torch.Tensor,  # [N, bs, Hkv, D]
    v_cache: torch.Tensor,  # [N, bs, Hkv, D]
    block_tables: torch.Tensor,  # [B, M] int32
    context_lens: torch.Tensor,  # [B] int32, tokens in cache including this step's token
    scale: float,
) -> torch.Tensor:  # [B, H, D]
    """Attention of each sequence's newest token over its whole paged context (GQA aware)."""
    b, h, d = q.shape
    bs, hkv = k_cache.shape[1], k_cache.shape[2]
    max_len = int(context_lens.max())
    nblocks = (max_len + bs - 1) // bs
    idx = block_tables[:, :nblocks].long()  # [B, nb]
    k = k_cache[idx].flatten(1, 2)[:, :max_len]  # [B, L, Hkv, D]
    v = v_cache[idx].flatten(1, 2)[:, :max_len]
    mask = torch.arange(max_len, device=q.device)[None, :] < context_lens[:, None].long()
    out = F.scaled_dot_product_attention(
        q.unsqueeze(2),  # [B, H, 1, D]
        k.transpose(1, 2),  # [B, Hkv, L, D]
        v.transpose(1, 2),
        attn_mask=mask[:, None, None, :],
        scale=scale,
        enable_gqa=h != hkv,
    )
    return out.squeeze(2)


def paged_prefill_attention(
    q: torch.Tensor,  # [T, H, D], the new tokens of every sequence, concatenated
    k_cache: torch.Tensor,  # [N, bs, Hkv, D]; the new tokens' K/V are already stored
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, M] int32
    query_start_loc: torch.Tensor,  # [B + 1] int32, offsets of each sequence's rows in q
    seq_lens: torch.Tensor,  # [B] int32, context length after this step (prefix + new)
    scale: float,
    new_kv: tuple[torch.Tensor, torch.Tensor] | None = None,  # this step's K/V [T, Hkv, D]
) -> torch.Tensor:  # [T, H, D]
    """Causal attention of variable-length query chunks over their paged context.

    Sequence i's queries are its last `q_len_i` tokens, at positions
    `seq_len_i - q_len_i ... seq_len_i - 1`; each attends to every cached token at or
    before its own position (the prefix cache and earlier chunks included).
    `new_kv` is this step's K/V (already stored): a backend may read a sequence without
    a cached prefix from it instead of the cache (pdserve.kernels.prefill_attention); this oracle
    reads the cache.
    """
    h, hkv = q.shape[1], k_cache.shape[2]
    out = torch.empty_like(q)
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    for i, seq_len in enumerate(lens):
        s, e = starts[i], starts[i + 1]
        q_len = e - s
        if q_len == 0:
            continue
        k = _gather_kv(k_cache, block_tables[i], seq_len).transpose(0, 1)  # [Hkv, L, D]
        v = _gather_kv(v_cache, block_tables[i], seq_len).transpose(0, 1)
        qi = q[s:e].transpose(0, 1)  # [H, q_len, D]
        if q_len == seq_len:
            o = F.scaled_dot_product_attention(
                qi, k, v, is_causal=True, scale=scale, enable_gqa=h != hkv
            )
        else:
            qpos = torch.arange(seq_len - q_len, seq_len, device=q.device)
            mask = torch.arange(seq_len, device=q.device)[None, :] <= qpos[:, None]
            o = F.scaled_dot_product_attention(
                qi, k, v, attn_mask=mask, scale=scale, enable_gqa=h != hkv
            )
        out[s:e] = o.transpose(0, 1)
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """y = weight * x / rms(x), computed in fp32 and cast back (as Hugging Face Llama does)."""
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(dtype)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """residual' = x + residual; returns (rms_norm(residual'), residual')."""
    residual = x + residual
    return rms_norm(residual, weight, eps), residual


def rotary_embedding(
    positions: torch.Tensor,  # [T] int64
    q: torch.Tensor,  # [T, H, D], rotated in place
    k: torch.Tensor,  # [T, Hkv, D], rotated in place
    cos_sin_cache: torch.Tensor,  # [max_pos, D] fp32: cos in [:, :D/2], sin in [:, D/2:]
) -> None:
    """Llama/NeoX rotary embedding: x*cos + rotate_half(x)*sin on the two halves of D."""
    half = cos_sin_cache.shape[1] // 2
    cs = cos_sin_cache[positions]
    cos = cs[:, None, :half].to(q.dtype)
    sin = cs[:, None, half:].to(q.dtype)
    for x in (q, k):
        x1, x2 = x[..., :half], x[..., half:]
        o1 = x1 * cos - x2 * sin
        o2 = x2 * cos + x1 * sin
        x[..., :half] = o1
        x[..., half:] = o2


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """[T, 2I] (gate | up) -> silu(gate) * up, [T, I]."""
    i = x.shape[-1] // 2
    return F.silu(x[..., :i]) * x[..., i:]


# Decode-row fusions (kernels/ops.py): an op set may decline any input (None), and the
# model then runs the unfused ops above. The reference declines every input.
FUSES_MLP_ACTIVATION = False  # the MLP runs silu_and_mul on the gate_up GEMM's output


def gate_up_silu(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | None:
    """silu_and_mul(F.linear(x, weight)) in one call, or None (not taken)."""
    return None


def norm_linear(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    silu: bool,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(Residual add +) RMSNorm, then the projection after it, in one call, or None."""
    return None
