"""Kernel warm-up: compile every Triton variant at start, not during the first requests.

What varies from step to step (batch, block-table width, split count) is a runtime
argument of the attention kernels (kernels/triton_attention.py), so a model has a handful
of compiled variants: decode with and without split-K, the split-K reduce, two prefill
query tiles, and the elementwise kernels. Three dummy steps reach them all.
"""

from __future__ import annotations

import torch

from pdserve.engine.attention import AttentionMetadata
from pdserve.kernels.ops import DECODE_MIN_SPLIT_KEYS, PREFILL_BLOCK_M


@torch.inference_mode()
def warm_up_kernels(model: torch.nn.Module, kv_cache: torch.Tensor, block_size: int) -> None:
    """Run three forward passes on dummy rows whose slots are -1 (the cache is untouched).

    (query lengths, block-table width): a decode row beside a long prefill chunk (decode
    without split-K, the 64-row prefill tile); a decode row over a long block table
    (split-K and its reduce); a short prefill chunk (the 16-row prefill tile).
    """
    long_q = PREFILL_BLOCK_M[0] * 2 + 1  # > 32 rows: the 64-row tile
    long_table = -(-2 * DECODE_MIN_SPLIT_KEYS // block_size)  # room for two splits
    steps = [([1, long_q], 1), ([1], long_table), ([PREFILL_BLOCK_M[0] // 2 + 1], 1)]
    for q_lens, width in steps:
        hidden = model(*dummy_batch(q_lens, width, kv_cache, block_size))
        model.compute_logits(hidden[-1:])
    if kv_cache.is_cuda:
        torch.cuda.synchronize(kv_cache.device)


def dummy_batch(q_lens: list[int], width: int, kv_cache: torch.Tensor, block_size: int):
    """Model inputs of one step whose rows all start fresh sequences (decode rows, of one
    token, first), with block tables at least `width` wide, all pointing at block 0."""
    dev = kv_cache.device
    total = sum(q_lens)
    width = max(width, -(-max(q_lens) // block_size))
    nd = sum(1 for q in q_lens if q == 1)
    seq = torch.tensor(q_lens, dtype=torch.int32, device=dev)
    starts = [0]
    for q in q_lens[nd:]:
        starts.append(starts[-1] + q)
    bt = torch.zeros((len(q_lens), width), dtype=torch.int32, device=dev)
    meta = AttentionMetadata(
        slot_mapping=torch.full((total,), -1, dtype=torch.int64, device=dev),
        num_decode_tokens=nd,
        decode_block_tables=bt[:nd],
        decode_context_lens=seq[:nd],
        prefill_block_tables=bt[nd:],
        prefill_query_start_loc=torch.tensor(starts, dtype=torch.int32, device=dev),
        prefill_seq_lens=seq[nd:],
    )
    positions = torch.cat([torch.arange(q, device=dev) for q in q_lens])
    input_ids = torch.zeros(total, dtype=torch.int64, device=dev)
    return input_ids, positions, kv_cache, meta
