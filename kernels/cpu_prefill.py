"""Prefill (extend) attention on CPU through torch's flash SDPA kernel, without gathering
fresh prompts' K/V back out of the paged cache.

Same contract as `kernels.reference.paged_prefill_attention`, plus `new_kv`: this step's
K/V rows (the ones just stored, same rows as `q`). The reference gathers every
sequence's context from the cache (`aten::index`) and calls SDPA on 3-D tensors, which
torch runs through its unfused math path (materialised scores, mask built with `tril`,
GQA heads repeated). Here:
  - a sequence with no cached prefix (`q_len == seq_len`: a fresh prompt, or the first
    chunk of one) attends over its own new K/V directly, read as strided views;
  - when every sequence is fresh and of one length (a batch of equal prompts) they go
    through one SDPA call, [B, H, L, D];
  - a sequence with a prefix (prefix-cache hit, later chunk) gathers its context from the
    cache as the reference does; its query rows are the last `q_len` of the context,
    with a bottom-right aligned causal mask;
  - every call is 4-D, which torch's CPU dispatcher sends to its flash kernel
    (`_scaled_dot_product_flash_attention_for_cpu`: tiled online softmax in fp32
    accumulators, GQA without repeating heads); 3-D inputs go to the math path.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.reference import _gather_kv


def _sdpa(q, k, v, scale, causal=False, mask=None):
    """q [B, Lq, H, D], k/v [B, Lk, Hkv, D] (any strides) -> [B, H, Lq, D]."""
    h, hkv = q.shape[2], k.shape[2]
    return F.scaled_dot_product_attention(
        q.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        attn_mask=mask,
        is_causal=causal,
        scale=scale,
        enable_gqa=h != hkv,
    )


def paged_prefill_attention(
    q: torch.Tensor,  # [T, H, D]
    k_cache: torch.Tensor,  # [N, bs, Hkv, D]; the new tokens' K/V are already stored
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, M] int32
    query_start_loc: torch.Tensor,  # [B + 1] int32
    seq_lens: torch.Tensor,  # [B] int32
    scale: float,
    new_kv: tuple[torch.Tensor, torch.Tensor] | None = None,  # this step's K/V, [T, Hkv, D]
) -> torch.Tensor:  # [T, H, D]
    """Causal attention of variable-length query chunks over their paged context."""
    t, h, d = q.shape
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    q_lens = [starts[i + 1] - starts[i] for i in range(len(lens))]
    fresh = [ql == sl for ql, sl in zip(q_lens, lens)]
    if new_kv is not None and lens and all(fresh) and len(set(q_lens)) == 1 and t:
        b, n = len(lens), q_lens[0]
        k, v = new_kv
        o = _sdpa(q.view(b, n, h, d), k.view(b, n, *k.shape[1:]),
                  v.view(b, n, *v.shape[1:]), scale, causal=True)  # fmt: skip
        return o.transpose(1, 2).reshape(t, h, d)
    out = torch.empty_like(q)
    for i, seq_len in enumerate(lens):
        s, e = starts[i], starts[i + 1]
        q_len = e - s
        if q_len == 0:
            continue
        qi = q[s:e].unsqueeze(0)
        if fresh[i] and new_kv is not None:
            k, v = new_kv[0][s:e].unsqueeze(0), new_kv[1][s:e].unsqueeze(0)
            o = _sdpa(qi, k, v, scale, causal=True)
        else:
            k = _gather_kv(k_cache, block_tables[i], seq_len).unsqueeze(0)
            v = _gather_kv(v_cache, block_tables[i], seq_len).unsqueeze(0)
            if q_len == seq_len:
                o = _sdpa(qi, k, v, scale, causal=True)
            else:
                qpos = torch.arange(seq_len - q_len, seq_len, device=q.device)
                mask = torch.arange(seq_len, device=q.device)[None, :] <= qpos[:, None]
                o = _sdpa(qi, k, v, scale, mask=mask)
        out[s:e] = o[0].transpose(0, 1)
    return out
