"""Triton paged attention: decode (one query per sequence, split-K) and prefill/extend.

Both read K/V through block tables from the paged cache `[N, bs, Hkv, D]` described in
`pdserve.kernels.reference` (blocks contiguous, the stride between them passed in, so a
block-major cache's layer view works as is), with the same contracts as `paged_decode_attention` and
`paged_prefill_attention` there. Softmax is the online (flash) form in fp32, with the
scale folded into a base-2 exponent. Keys are visited in tiles of BLOCK_N positions; each
position's block id is gathered from the block table, so any block size works.

Decode runs one program per (sequence, KV head, split): the program holds all query heads
of its GQA group as the rows of one tile, so each K/V byte is read once per group. With
more than one split, every split writes a normalised partial output and its log-sum-exp,
and `_decode_reduce_kernel` merges them. Split boundaries come from the block table's
capacity (M * bs), never from `context_lens`, so the launch needs no device-to-host sync.

Compiled variants: what changes from step to step (batch, block-table width, split count
and length) is passed as runtime arguments that Triton does not specialise on, and the
split count is bucketed to a power of two, so one model compiles two decode variants
(split or not), one reduce and two prefill tiles; `ModelRunner.warm_up` compiles them all
at start instead of during the first requests.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.kernels.triton_launch import DECODE_MAX_SPLITS, DECODE_MIN_SPLIT_KEYS, PREFILL_BLOCK_M

_LOG2E = 1.4426950408889634
MAX_SPLITS = DECODE_MAX_SPLITS
_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _check_paged(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    h, d = q.shape[1], q.shape[2]
    assert k_cache.dim() == 4 and k_cache.shape == v_cache.shape, "caches [N, bs, Hkv, D]"
    hkv = k_cache.shape[2]
    assert k_cache.shape[3] == d, f"cache head_dim {k_cache.shape[3]} != q head_dim {d}"
    assert h % hkv == 0, f"num_heads {h} must be a multiple of num_kv_heads {hkv}"
    assert d >= 16 and d & (d - 1) == 0, f"head_dim must be a power of two >= 16, got {d}"
    assert q.dtype in _FLOAT_DTYPES, f"unsupported dtype {q.dtype}"
    assert q.dtype == k_cache.dtype == v_cache.dtype, "q and caches must share a dtype"
    assert q.stride(2) == 1, "q: head_dim must be contiguous"
    hkv_d = (k_cache.shape[2] * d, d, 1)
    assert k_cache.stride()[1:] == hkv_d, "caches: each block [bs, Hkv, D] must be contiguous"
    assert k_cache.stride() == v_cache.stride(), "k and v caches must share their strides"


@triton.jit
def _dot(a, b, UPCAST: tl.constexpr):
    """a @ b with fp32 accumulation; fp32 operands stay fp32 (no TF32). UPCAST feeds fp32
    operands (exact for 16-bit inputs): the CPU interpreter would multiply bf16 bit patterns
    as integers."""
    if UPCAST:
        out = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    elif a.dtype == tl.float32:
        out = tl.dot(a, b, input_precision="ieee")
    else:
        out = tl.dot(a, b)
    return out


# ---------------------------------------------------------------------------- decode


@triton.jit(do_not_specialize=["stride_bt", "split_len", "num_splits"])
def _decode_kernel(
    q_ptr, k_ptr, v_ptr, bt_ptr, lens_ptr, out_ptr, mid_o_ptr, mid_lse_ptr,
    qk_scale, stride_qb, stride_qh, stride_bt, stride_ob, stride_oh,
    stride_kn, stride_kb, stride_kh, split_len, num_splits,
    G: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr, BS: tl.constexpr,
    BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    ctx = tl.load(lens_ptr + b)
    lo = split * split_len
    hi = tl.minimum(lo + split_len, ctx)

    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, D)
    heads = kvh * G + g  # [BLOCK_G]
    g_mask = g < G
    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + d[None, :],
                mask=g_mask[:, None], other=0.0)  # fmt: skip

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, D], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        valid = pos < hi
        block = tl.load(bt_ptr + b * stride_bt + pos // BS, mask=valid, other=0).to(tl.int64)
        kv_off = block * stride_kn + (pos % BS) * stride_kb + kvh * stride_kh  # [BLOCK_N]
        k = tl.load(k_ptr + kv_off[:, None] + d[None, :], mask=valid[:, None], other=0.0)
        s = _dot(q, tl.trans(k), UPCAST) * qk_scale  # [BLOCK_G, BLOCK_N]
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_ptr + kv_off[:, None] + d[None, :], mask=valid[:, None], other=0.0)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, UPCAST)
        m_i = m_new

    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    o = acc / l_safe[:, None]
    if not SPLIT:
        out = out_ptr + b * stride_ob + heads[:, None] * stride_oh + d[None, :]
        tl.store(out, o.to(out_ptr.dtype.element_ty), mask=g_mask[:, None])
    else:
        # mid_o: [B, H, num_splits, D] fp32, mid_lse: [B, H, num_splits] fp32 (base 2).
        row = (b * (tl.num_programs(1) * G) + heads) * num_splits + split  # [BLOCK_G]
        tl.store(mid_o_ptr + row[:, None] * D + d[None, :], o, mask=g_mask[:, None])
        lse = tl.where(l_i > 0.0, m_i + tl.log2(l_safe), float("-inf"))
        tl.store(mid_lse_ptr + row, lse, mask=g_mask)


@triton.jit(do_not_specialize=["num_splits"])
def _decode_reduce_kernel(
    mid_o_ptr, mid_lse_ptr, out_ptr, stride_ob, stride_oh, num_splits,
    H: tl.constexpr, D: tl.constexpr, BLOCK_S: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, D)
    row = (b * H + h) * num_splits + s
    s_mask = s < num_splits
    lse = tl.load(mid_lse_ptr + row, mask=s_mask, other=float("-inf"))
    w = tl.exp2(lse - tl.max(lse, axis=0))  # empty splits (lse = -inf) weigh 0
    o = tl.load(mid_o_ptr + row[:, None] * D + d[None, :], mask=s_mask[:, None], other=0.0)
    o = tl.sum(o * w[:, None], axis=0) / tl.sum(w, axis=0)
    tl.store(out_ptr + b * stride_ob + h * stride_oh + d, o.to(out_ptr.dtype.element_ty))


def default_num_splits(batch: int, num_kv_heads: int, max_context: int) -> int:
    """Enough (sequence, KV head, split) programs to fill a large GPU, >= 256 keys each,
    rounded down to a power of two (1, 2, 4, ... MAX_SPLITS)."""
    target_programs = 512
    want = triton.cdiv(target_programs, max(batch * num_kv_heads, 1))
    want = max(1, min(want, triton.cdiv(max_context, DECODE_MIN_SPLIT_KEYS), MAX_SPLITS))
    return 1 << (want.bit_length() - 1)


def decode_split(capacity: int, num_splits: int, block_n: int) -> tuple[int, int]:
    """(splits, keys per split): splits of whole BLOCK_N tiles covering `capacity` keys,
    with splits that would be empty dropped."""
    split_len = triton.cdiv(triton.cdiv(capacity, num_splits), block_n) * block_n
    return triton.cdiv(capacity, split_len), split_len


def decode_constexprs(
    group: int, head_dim: int, block_size: int, block_n: int, num_splits: int, upcast: bool
) -> dict:
    """The compile-time arguments of one decode launch: a kernel variant per distinct dict."""
    return dict(
        G=group, BLOCK_G=max(16, triton.next_power_of_2(group)), D=head_dim, BS=block_size,
        BLOCK_N=block_n, SPLIT=num_splits > 1, UPCAST=upcast,
    )  # fmt: skip


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    *,
    num_splits: int | None = None,
    block_n: int = 64,
    num_warps: int = 4,
    num_stages: int = 2,
) -> torch.Tensor:
    """`paged_decode_attention` with its launch knobs exposed (benchmarks sweep them)."""
    assert q.dim() == 3, f"q must be [B, H, D], got {tuple(q.shape)}"
    _check_paged(q, k_cache, v_cache)
    b, h, d = q.shape
    bs, hkv = k_cache.shape[1], k_cache.shape[2]
    assert block_tables.dim() == 2 and block_tables.shape[0] == b
    assert block_tables.dtype == torch.int32 and block_tables.stride(1) == 1
    assert context_lens.shape == (b,) and context_lens.dtype == torch.int32
    assert context_lens.is_contiguous()
    assert block_n >= 16 and block_n & (block_n - 1) == 0, "block_n: power of two >= 16"
    out = torch.empty((b, h, d), dtype=q.dtype, device=q.device)
    if b == 0:
        return out
    capacity = block_tables.shape[1] * bs
    if num_splits is None:
        num_splits = default_num_splits(b, hkv, capacity)
    assert 1 <= num_splits <= MAX_SPLITS, f"num_splits must be in [1, {MAX_SPLITS}]"
    num_splits, split_len = decode_split(capacity, num_splits, block_n)
    group = h // hkv
    if num_splits > 1:
        mid_o = torch.empty((b, h, num_splits, d), dtype=torch.float32, device=q.device)
        mid_lse = torch.empty((b, h, num_splits), dtype=torch.float32, device=q.device)
    else:
        mid_o = mid_lse = out  # unused
    _decode_kernel[(b, hkv, num_splits)](
        q, k_cache, v_cache, block_tables, context_lens, out, mid_o, mid_lse,
        scale * _LOG2E, q.stride(0), q.stride(1), block_tables.stride(0),
        out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), split_len, num_splits,
        **decode_constexprs(group, d, bs, block_n, num_splits, upcast=not q.is_cuda),
        num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    if num_splits > 1:
        _decode_reduce_kernel[(b, h)](
            mid_o, mid_lse, out, out.stride(0), out.stride(1), num_splits,
            H=h, D=d, BLOCK_S=MAX_SPLITS,
        )  # fmt: skip
    return out


def paged_decode_attention(
    q: torch.Tensor,  # [B, H, D], one query token per sequence
    k_cache: torch.Tensor,  # [N, bs, Hkv, D]
    v_cache: torch.Tensor,  # [N, bs, Hkv, D]
    block_tables: torch.Tensor,  # [B, M] int32
    context_lens: torch.Tensor,  # [B] int32, tokens in cache including this step's token
    scale: float,
) -> torch.Tensor:  # [B, H, D]
    """Attention of each sequence's newest token over its whole paged context (GQA aware)."""
    return decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale)


# ---------------------------------------------------------------------------- prefill


@triton.jit(do_not_specialize=["stride_bt"])
def _prefill_kernel(
    q_ptr, k_ptr, v_ptr, bt_ptr, qsl_ptr, lens_ptr, out_ptr, qk_scale,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_bt,
    stride_kn, stride_kb, stride_kh,
    G: tl.constexpr, D: tl.constexpr, BS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    tile = tl.program_id(0)
    seq = tl.program_id(1).to(tl.int64)
    h = tl.program_id(2)
    q_start = tl.load(qsl_ptr + seq)
    q_len = tl.load(qsl_ptr + seq + 1) - q_start
    if tile * BLOCK_M >= q_len:
        return
    seq_len = tl.load(lens_ptr + seq)
    prefix = seq_len - q_len
    kvh = h // G

    m = tile * BLOCK_M + tl.arange(0, BLOCK_M)  # row within this sequence's chunk
    m_mask = m < q_len
    qpos = prefix + m  # absolute position of each query row
    d = tl.arange(0, D)
    rows = (q_start + m).to(tl.int64)
    q = tl.load(q_ptr + rows[:, None] * stride_qt + h * stride_qh + d[None, :],
                mask=m_mask[:, None], other=0.0)  # fmt: skip

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    # Keys past the tile's last query position are masked for every row: stop there.
    hi = tl.minimum(seq_len, prefix + (tile + 1) * BLOCK_M)
    for start in range(0, hi, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        valid = pos < hi
        block = tl.load(bt_ptr + seq * stride_bt + pos // BS, mask=valid, other=0).to(tl.int64)
        kv_off = block * stride_kn + (pos % BS) * stride_kb + kvh * stride_kh
        k = tl.load(k_ptr + kv_off[:, None] + d[None, :], mask=valid[:, None], other=0.0)
        s = _dot(q, tl.trans(k), UPCAST) * qk_scale  # [BLOCK_M, BLOCK_N]
        s = tl.where(valid[None, :] & (pos[None, :] <= qpos[:, None]), s, float("-inf"))
        # Key 0 is visible to every row, so m_new is finite from the first tile on.
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_ptr + kv_off[:, None] + d[None, :], mask=valid[:, None], other=0.0)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, UPCAST)
        m_i = m_new

    o = acc / l_i[:, None]
    out = out_ptr + rows[:, None] * stride_ot + h * stride_oh + d[None, :]
    tl.store(out, o.to(out_ptr.dtype.element_ty), mask=m_mask[:, None])


def paged_prefill_attention(
    q: torch.Tensor,  # [T, H, D], the new tokens of every sequence, concatenated
    k_cache: torch.Tensor,  # [N, bs, Hkv, D]; the new tokens' K/V are already stored
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, M] int32
    query_start_loc: torch.Tensor,  # [B + 1] int32, offsets of each sequence's rows in q
    seq_lens: torch.Tensor,  # [B] int32, context length after this step (prefix + new)
    scale: float,
    new_kv: tuple[torch.Tensor, torch.Tensor] | None = None,  # unused: reads the cache
) -> torch.Tensor:  # [T, H, D]
    """Causal attention of variable-length query chunks over their paged context.

    Sequence i's queries are its last `q_len_i` tokens, at positions
    `seq_len_i - q_len_i ... seq_len_i - 1`; each attends to every cached token at or
    before its own position (the prefix cache and earlier chunks included).
    """
    assert q.dim() == 3, f"q must be [T, H, D], got {tuple(q.shape)}"
    _check_paged(q, k_cache, v_cache)
    t, h, d = q.shape
    bs, hkv = k_cache.shape[1], k_cache.shape[2]
    b = seq_lens.shape[0]
    assert block_tables.dim() == 2 and block_tables.shape[0] == b
    assert block_tables.dtype == torch.int32 and block_tables.stride(1) == 1
    assert query_start_loc.shape == (b + 1,) and query_start_loc.dtype == torch.int32
    assert seq_lens.dtype == torch.int32
    assert query_start_loc.is_contiguous() and seq_lens.is_contiguous()
    out = torch.empty((t, h, d), dtype=q.dtype, device=q.device)
    if t == 0 or b == 0:
        return out
    max_q_len = int((query_start_loc[1:] - query_start_loc[:-1]).max())
    block_m = PREFILL_BLOCK_M[1] if max_q_len > 32 else PREFILL_BLOCK_M[0]
    block_n = 64 if d <= 64 else 32
    grid = (triton.cdiv(max_q_len, block_m), b, h)
    _prefill_kernel[grid](
        q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, out, scale * _LOG2E,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        G=h // hkv, D=d, BS=bs, BLOCK_M=block_m, BLOCK_N=block_n,
        UPCAST=not q.is_cuda, num_warps=4, num_stages=2,
    )  # fmt: skip
    return out
