"""Paged decode attention on CPU that reads the KV blocks in place (kernels/csrc/paged_decode.cpp).

Same contract as `pdserve.kernels.reference.paged_decode_attention`; the reference gathers every
sequence's blocks into a contiguous K/V (`aten::index`) and runs SDPA, this kernel walks
the block table instead. Inputs it does not handle (a non-CPU device, a dtype other than
fp32/bf16, a cache whose blocks are not each contiguous) and a machine where the kernel
cannot be built go to the reference. Blocks may be strided (a block-major cache's layer
view, engine/kv_tensor.py): the kernel takes the block stride.
"""

from __future__ import annotations

import torch

from pdserve.kernels import native, reference

_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
MIN_SPLIT_KEYS = 128  # a key split gets at least this many keys
ITEMS_PER_THREAD = 4  # split long contexts until there are this many work items per thread


def available() -> bool:
    """Whether the native kernel is built and loaded on this machine."""
    return native.load_library("paged_decode") is not None


def blocks_contiguous(cache: torch.Tensor) -> bool:
    """Whether each block `[bs, Hkv, D]` of a `[N, bs, Hkv, D]` cache is contiguous (the
    stride between blocks is free)."""
    _, bs, hkv, d = cache.shape
    return cache.stride()[1:] == (hkv * d, d, 1) and cache.stride(0) >= bs * hkv * d


def supports(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    return (
        q.device.type == "cpu"
        and q.dtype in _DTYPES
        and k_cache.dtype == q.dtype
        and v_cache.dtype == q.dtype
        and blocks_contiguous(k_cache)
        and k_cache.stride() == v_cache.stride()
        and q.stride(-1) == 1
        and head_dim_supported(q.shape[-1])
    )


def head_dim_supported(d: int) -> bool:
    """The head dims the kernel is instantiated for: multiples of 16 up to 128, and 256."""
    return (d % 16 == 0 and 0 < d <= 128) or d == 256


def num_splits(num_seqs: int, max_len: int, threads: int) -> int:
    """Key splits per sequence: 1 unless too few sequences to keep every thread busy."""
    want = ITEMS_PER_THREAD * threads
    if num_seqs >= want:
        return 1
    return max(1, min(-(-want // num_seqs), max_len // MIN_SPLIT_KEYS))


def paged_decode_attention(
    q: torch.Tensor,  # [B, H, D], one query token per sequence
    k_cache: torch.Tensor,  # [N, bs, Hkv, D]
    v_cache: torch.Tensor,  # [N, bs, Hkv, D]
    block_tables: torch.Tensor,  # [B, M] int32
    context_lens: torch.Tensor,  # [B] int32
    scale: float,
) -> torch.Tensor:  # [B, H, D]
    """Attention of each sequence's newest token over its whole paged context (GQA aware)."""
    lib = native.load_library("paged_decode")
    if lib is None or not supports(q, k_cache, v_cache):
        return reference.paged_decode_attention(
            q, k_cache, v_cache, block_tables, context_lens, scale
        )
    b, h, d = q.shape
    _, bs, hkv, _ = k_cache.shape
    out = torch.empty((b, h, d), dtype=q.dtype)
    if b == 0:
        return out
    tables = block_tables.to(torch.int32).contiguous()
    lens = context_lens.to(torch.int32).contiguous()
    max_len = int(lens.max())
    threads = torch.get_num_threads()
    splits = num_splits(b, max_len, threads)
    split_keys = max(1, -(-max_len // splits))
    rc = lib.pdserve_paged_decode(
        q.data_ptr(),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        tables.data_ptr(),
        lens.data_ptr(),
        out.data_ptr(),
        b,
        h,
        hkv,
        d,
        bs,
        tables.shape[1],
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        split_keys,
        splits,
        scale,
        _DTYPES[q.dtype],
        threads,
    )
    if rc != 0:
        raise ValueError(f"paged_decode_attention: unsupported shapes q={tuple(q.shape)}")
    return out
