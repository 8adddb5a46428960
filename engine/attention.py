"""Attention metadata for one step, and the layer that reads/writes the paged KV cache.

Rows of a step are ordered decode-like rows first (one new token), then prefill rows
(several new tokens: a prompt chunk). Decode rows use the paged decode kernel, prefill
rows the paged prefill (extend) kernel; both run after this step's K/V have been stored,
so prefix-cache hits and earlier chunks are seen the same way. The prefill kernel also
gets this step's K/V (`new_kv`): a sequence with no cached prefix can attend over them
directly instead of reading them back from the cache (pdserve.kernels.prefill_attention does).
"""

from __future__ import annotations

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
        if torch.compiler.is_compiling():  # one opaque graph node (engine/attention_op.py)
            from pdserve.engine import attention_op

            return attention_op.call(self, q, k, v, k_cache, v_cache, meta)
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
