"""Attention metadata for one step, and the layer that reads/writes the paged KV cache.

Rows of a step are ordered decode-like rows first (one new token), then prefill rows
(several new tokens: a prompt chunk). Decode rows use the paged decode kernel, prefill
rows the paged prefill (extend) kernel; both run after this step's K/V have been stored,
so prefix-cache hits and earlier chunks are seen the same way. The prefill kernel also
gets this step's K/V (`new_kv`): a sequence with no cached prefix can attend over them
directly instead of reading them back from the cache (pdserve.kernels.prefill_attention does).
"""

from __future__ import annotations

import functools
import importlib
from dataclasses import dataclass
from types import ModuleType

import torch


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64
    num_decode_tokens: int  # first rows, one token per sequence
    decode_block_tables: torch.Tensor  # [num_decodes, M] int32
    decode_context_lens: torch.Tensor  # [num_decodes] int32
    prefill_block_tables: torch.Tensor  # [num_prefills, M] int32
    prefill_query_start_loc: torch.Tensor  # [num_prefills + 1] int32, relative to prefill rows
    prefill_seq_lens: torch.Tensor  # [num_prefills] int32

    @property
    def num_prefills(self) -> int:
        return self.prefill_seq_lens.shape[0]


class PagedAttention:
    """softmax(q k^T * scale) v over the paged cache, for one layer."""

    def __init__(self, ops: ModuleType, num_heads: int, num_kv_heads: int, head_dim: int):
        self.ops = ops
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5

    def __call__(
        self,
        q: torch.Tensor,  # [T, H, D]
        k: torch.Tensor,  # [T, Hkv, D]
        v: torch.Tensor,  # [T, Hkv, D]
        k_cache: torch.Tensor,  # [N, bs, Hkv, D]
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [T, H, D]
        if torch.compiler.is_compiling():  # one opaque graph node (`paged_attention` below)
            return call(self, q, k, v, k_cache, v_cache, meta)
        ops = self.ops
        ops.store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        nd = meta.num_decode_tokens
        if meta.num_prefills == 0:
            return ops.paged_decode_attention(
                q, k_cache, v_cache, meta.decode_block_tables, meta.decode_context_lens, self.scale
            )
        prefill = ops.paged_prefill_attention(
            q[nd:],
            k_cache,
            v_cache,
            meta.prefill_block_tables,
            meta.prefill_query_start_loc,
            meta.prefill_seq_lens,
            self.scale,
            new_kv=(k[nd:], v[nd:]),
        )
        if not nd:
            return prefill
        decode = ops.paged_decode_attention(
            q[:nd], k_cache, v_cache, meta.decode_block_tables, meta.decode_context_lens, self.scale
        )
        return torch.cat([decode, prefill])


# Paged attention as one torch custom op, `pdserve::paged_attention`, for compiled graphs.
# The kernels behind `PagedAttention` (ctypes calls, the reference's per-sequence prefill
# loop, Triton launches) cannot be traced by dynamo: wrapped as one custom op with a fake
# implementation, attention is a single opaque node, so a whole model forward compiles to
# one graph (engine/compiled_model.py). Contract: `PagedAttention.__call__` with the
# metadata unpacked into tensors; the number of decode rows is
# `decode_block_tables.shape[0]`, so no Python int of the step's metadata reaches the
# graph; `backend` names the op set's module (`PagedAttention.ops.__name__`).


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
