"""Paged attention as one torch custom op, `pdserve::paged_attention`, for compiled graphs.

The kernels behind `PagedAttention` (the native CPU decode kernel called through ctypes,
the reference's per-sequence prefill loop, Triton launches) cannot be traced by dynamo:
called inside a compiled function they would break the graph. Wrapped as one custom op
with a fake (meta) implementation, attention is a single opaque node, so a whole model
forward compiles to one graph (engine/compiled_model.py).

Contract: the same as `PagedAttention.__call__` with the metadata unpacked into tensors
(the op stores this step's K/V into the caches in place, then attends). The number of
decode rows is `decode_block_tables.shape[0]`, so no Python int of the step's metadata
reaches the graph. `backend` names the kernel module (`pdserve.kernels.cpu_ops`,
`pdserve.kernels.reference`, `pdserve.kernels.triton_ops`): the op runs whatever `PagedAttention.ops` is.
"""

from __future__ import annotations

import functools
import importlib

import torch

from pdserve.engine.attention import AttentionMetadata, PagedAttention


@torch.library.custom_op("pdserve::paged_attention", mutates_args=("k_cache", "v_cache"))
def paged_attention(
    q: torch.Tensor,  # [T, H, D]
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, D]
    k_cache: torch.Tensor,  # [N, bs, Hkv, D], written in place
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [T] int64, -1 = do not store
    decode_block_tables: torch.Tensor,  # [num_decodes, M] int32
    decode_context_lens: torch.Tensor,  # [num_decodes] int32
    prefill_block_tables: torch.Tensor,  # [num_prefills, M] int32
    prefill_query_start_loc: torch.Tensor,  # [num_prefills + 1] int32
    prefill_seq_lens: torch.Tensor,  # [num_prefills] int32
    scale: float,
    backend: str,
) -> torch.Tensor:  # [T, H, D]
    attn = _attention(backend, q.shape[1], k.shape[1], q.shape[2], scale)
    meta = AttentionMetadata(
        slot_mapping=slot_mapping,
        num_decode_tokens=decode_block_tables.shape[0],
        decode_block_tables=decode_block_tables,
        decode_context_lens=decode_context_lens,
        prefill_block_tables=prefill_block_tables,
        prefill_query_start_loc=prefill_query_start_loc,
        prefill_seq_lens=prefill_seq_lens,
    )
    return attn(q, k, v, k_cache, v_cache, meta)


@functools.cache
def _attention(backend: str, heads: int, kv_heads: int, head_dim: int, scale: float):
    attn = PagedAttention(importlib.import_module(backend), heads, kv_heads, head_dim)
    attn.scale = scale
    return attn


@paged_attention.register_fake
def _(q, k, v, k_cache, v_cache, slot_mapping, dbt, dcl, pbt, pqsl, psl, scale, backend):
    return torch.empty_like(q, memory_format=torch.contiguous_format)


def call(attn: PagedAttention, q, k, v, k_cache, v_cache, meta: AttentionMetadata):
    """`attn(q, k, v, k_cache, v_cache, meta)` through the custom op (traceable)."""
    return torch.ops.pdserve.paged_attention(
        q,
        k,
        v,
        k_cache,
        v_cache,
        meta.slot_mapping,
        meta.decode_block_tables,
        meta.decode_context_lens,
        meta.prefill_block_tables,
        meta.prefill_query_start_loc,
        meta.prefill_seq_lens,
        attn.scale,
        attn.ops.__name__,
    )
