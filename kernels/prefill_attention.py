"""Prefill (extend) attention on CPU through torch's flash SDPA kernel, without gathering
fresh prompts' K/V back out of the paged cache.

Same contract as `pdserve.kernels.reference.paged_prefill_attention`, plus `new_kv`: this step's
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
Where it is built, every sequence goes to the native kernel
(kernels/csrc/prefill_attention.cpp: register-tiled fp32 arithmetic, causal tiles
skipped): fresh sequences (given `new_kv`) in one call over their new K/V, sequences with
a cached prefix in a second call over their context gathered from the cache, each query
row at its position in the context. A row's result depends only on its position and its
keys, so a prompt gets the same bits whether its prefix was cached or not (the same
request twice: the same logprobs). torch's flash kernel serves them where the kernel
cannot be built or for a dtype/stride it does not take (`PDSERVE_PREFILL_ATTENTION=sdpa`
forces it).
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from pdserve.kernels import native
from pdserve.kernels.reference import _gather_kv

PREFILL_ATTENTION_ENV = "PDSERVE_PREFILL_ATTENTION"  # "native" (default) or "sdpa"
_DTYPES = {torch.float32: 0, torch.bfloat16: 1}


def available() -> bool:
    """Whether the native kernel is built and loaded on this machine."""
    return native.load_library("prefill_attention") is not None


def _native(
    q,
    k,
    v,
    out,
    rows: list[tuple[int, int]],
    scale: float,
    kv_begins: list[int] | None = None,
    q_offsets: list[int] | None = None,
) -> bool:
    """Attention of the sequences whose query rows are `rows` (ranges of q/out), into
    `out`: sequence b's keys are k/v rows kv_begins[b] .. (default: its own rows), its
    first query row at position q_offsets[b] of that context (default 0: fresh).
    False (nothing written) when the native kernel does not take these tensors."""
    if os.environ.get(PREFILL_ATTENTION_ENV, "native") == "sdpa" or torch.compiler.is_compiling():
        return False
    dtype = q.dtype
    if dtype not in _DTYPES or any(
        not x.is_cpu or x.dtype != dtype or x.stride(-1) != 1 for x in (q, k, v, out)
    ):
        return False
    lib = native.load_library("prefill_attention")
    if lib is None or not out.is_contiguous():
        return False
    begins = torch.tensor([b for b, _ in rows], dtype=torch.int64)
    ends = torch.tensor([e for _, e in rows], dtype=torch.int64)
    kvb = None if kv_begins is None else torch.tensor(kv_begins, dtype=torch.int64)
    offs = None if q_offsets is None else torch.tensor(q_offsets, dtype=torch.int64)
    _, h, d = q.shape
    rc = lib.pdserve_prefill_attention(
        q.data_ptr(), q.stride(0), q.stride(1), k.data_ptr(), k.stride(0), k.stride(1),
        v.data_ptr(), v.stride(0), v.stride(1), out.data_ptr(), begins.data_ptr(),
        ends.data_ptr(), None if kvb is None else kvb.data_ptr(),
        None if offs is None else offs.data_ptr(), len(rows), h, k.shape[1], d, scale,
        _DTYPES[dtype], torch.get_num_threads(),
    )  # fmt: skip
    return rc == 0


def _native_cached(q, k_cache, v_cache, block_tables, out, idx, starts, lens, scale) -> bool:
    """The native kernel for sequences `idx` that have a cached prefix: their contexts
    gathered from the cache into one K and one V tensor, one call."""
    if os.environ.get(PREFILL_ATTENTION_ENV, "native") == "sdpa" or not available():
        return False
    ks, vs, kv_begins, offsets, at = [], [], [], [], 0
    for i in idx:
        ks.append(_gather_kv(k_cache, block_tables[i], lens[i]))
        vs.append(_gather_kv(v_cache, block_tables[i], lens[i]))
        if ks[-1].shape[0] != lens[i]:  # the kernel reads lens[i] keys: never past the gather
            raise IndexError(
                f"prefill attention: a block table covers {ks[-1].shape[0]} of {lens[i]} keys"
            )
        kv_begins.append(at)
        offsets.append(lens[i] - (starts[i + 1] - starts[i]))
        at += lens[i]
    k = ks[0] if len(ks) == 1 else torch.cat(ks)
    v = vs[0] if len(vs) == 1 else torch.cat(vs)
    rows = [(starts[i], starts[i + 1]) for i in idx]
    return _native(q, k, v, out, rows, scale, kv_begins, offsets)


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
    out = torch.empty_like(q)
    done: set[int] = set()  # sequences the native kernel has written
    if new_kv is not None and t:
        idx = [i for i in range(len(lens)) if fresh[i] and q_lens[i]]
        if idx and _native(q, *new_kv, out, [(starts[i], starts[i + 1]) for i in idx], scale):
            done = set(idx)
    cached = [i for i in range(len(lens)) if not fresh[i] and q_lens[i]]
    if t and cached:
        if _native_cached(q, k_cache, v_cache, block_tables, out, cached, starts, lens, scale):
            done |= set(cached)
    if done and all(i in done or not q_lens[i] for i in range(len(lens))):
        return out
    if not done and new_kv is not None and lens and all(fresh) and len(set(q_lens)) == 1 and t:
        b, n = len(lens), q_lens[0]
        k, v = new_kv
        o = _sdpa(q.view(b, n, h, d), k.view(b, n, *k.shape[1:]),
                  v.view(b, n, *v.shape[1:]), scale, causal=True)  # fmt: skip
        return o.transpose(1, 2).reshape(t, h, d)
    for i, seq_len in enumerate(lens):
        s, e = starts[i], starts[i + 1]
        q_len = e - s
        if q_len == 0 or i in done:
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
