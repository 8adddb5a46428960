"""Triton kernels for the per-token ops: KV store, RMSNorm, rotary embedding, SiLU-and-mul.

Each kernel sits beside a thin wrapper with the contract of its namesake in
`pdserve.kernels.reference`; the wrapper checks shapes, dtypes and strides before launching.
Tensors may be row views into a wider buffer (e.g. q, k and v sliced from one qkv
projection): the leading stride is free, the innermost dimensions must be contiguous.

Rounding follows the reference step by step (fp32 math, cast to the activation dtype
where torch would round), so bf16/fp16 results match it to within an ulp or so.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _check_rows(x: torch.Tensor, name: str) -> None:
    assert x.dtype in _FLOAT_DTYPES, f"{name}: unsupported dtype {x.dtype}"
    assert x.stride(-1) == 1, f"{name}: last dimension must be contiguous"


def _as_rows(x: torch.Tensor, name: str) -> torch.Tensor:
    """[..., N] -> [R, N] without copying; rows may be strided, elements contiguous."""
    _check_rows(x, name)
    if x.dim() == 2:
        return x
    assert x.is_contiguous(), f"{name}: a >2-D input must be contiguous"
    return x.view(-1, x.shape[-1])


# ---------------------------------------------------------------------------- store_kv


@triton.jit
def _store_kv_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    stride_kt, stride_vt, stride_cache_block,
    BS: tl.constexpr, ROW: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot < 0:  # padding token: leave the cache untouched
        return
    offs = tl.arange(0, BLOCK)
    mask = offs < ROW
    k = tl.load(key_ptr + t * stride_kt + offs, mask=mask)
    v = tl.load(value_ptr + t * stride_vt + offs, mask=mask)
    dst = (slot // BS) * stride_cache_block + (slot % BS) * ROW + offs
    tl.store(k_cache_ptr + dst, k, mask=mask)
    tl.store(v_cache_ptr + dst, v, mask=mask)


def store_kv(
    key: torch.Tensor,  # [T, Hkv, D]
    value: torch.Tensor,  # [T, Hkv, D]
    k_cache: torch.Tensor,  # [N, bs, Hkv, D]
    v_cache: torch.Tensor,  # [N, bs, Hkv, D]
    slot_mapping: torch.Tensor,  # [T] int64; -1 = skip this token
) -> None:
    """Write each token's K and V into the paged cache at its slot, in place."""
    t, hkv, d = key.shape
    assert value.shape == key.shape, f"value {tuple(value.shape)} != key {tuple(key.shape)}"
    assert k_cache.shape == v_cache.shape and k_cache.dim() == 4
    assert k_cache.shape[2:] == (hkv, d), f"cache {tuple(k_cache.shape)} vs key {(hkv, d)}"
    assert key.dtype == value.dtype == k_cache.dtype == v_cache.dtype
    _, bs, _, _ = k_cache.shape
    assert k_cache.stride()[1:] == (hkv * d, d, 1), "cache blocks [bs, Hkv, D] must be contiguous"
    assert k_cache.stride() == v_cache.stride(), "k and v caches must share their strides"
    for x, name in ((key, "key"), (value, "value")):
        assert x.stride(2) == 1 and x.stride(1) == d, f"{name}: [Hkv, D] must be contiguous"
    assert slot_mapping.shape == (t,) and slot_mapping.dtype in (torch.int64, torch.int32)
    if t == 0:
        return
    row = hkv * d
    _store_kv_kernel[(t,)](
        key, value, k_cache, v_cache, slot_mapping,
        key.stride(0), value.stride(0), k_cache.stride(0),
        BS=bs, ROW=row, BLOCK=triton.next_power_of_2(row),
    )  # fmt: skip


# ---------------------------------------------------------------------------- RMSNorm


@triton.jit
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr,
    stride_x, stride_r, stride_o, stride_ro, eps,
    N: tl.constexpr, BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_r + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(res_out_ptr.dtype.element_ty)
        tl.store(res_out_ptr + row * stride_ro + offs, x, mask=mask)
    xf = x.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(xf * xf, axis=0) / N + eps)
    y = (xf * inv_rms).to(x.dtype).to(tl.float32)  # the reference rounds before the weight
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, (w * y).to(out_ptr.dtype.element_ty), mask=mask)


def _launch_rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor | None]:
    n = x.shape[-1]
    assert weight.shape == (n,) and weight.is_contiguous(), f"weight {tuple(weight.shape)}"
    assert weight.dtype in _FLOAT_DTYPES
    x2 = _as_rows(x, "x")
    res_dtype = x.dtype
    if residual is not None:
        assert residual.shape == x.shape, f"residual {tuple(residual.shape)} vs x"
        res_dtype = torch.promote_types(x.dtype, residual.dtype)
        r2 = _as_rows(residual, "residual")
    out_dtype = torch.promote_types(weight.dtype, res_dtype)
    out = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    out2 = out.view(-1, n)
    res_out = res_out2 = None
    if residual is not None:
        res_out = torch.empty(x.shape, dtype=res_dtype, device=x.device)
        res_out2 = res_out.view(-1, n)
    rows = x2.shape[0]
    if rows > 0:
        _rms_norm_kernel[(rows,)](
            x2, r2 if residual is not None else x2, weight, out2,
            res_out2 if res_out2 is not None else out2,
            x2.stride(0), r2.stride(0) if residual is not None else 0, out2.stride(0),
            res_out2.stride(0) if res_out2 is not None else 0, eps,
            N=n, BLOCK=triton.next_power_of_2(n), HAS_RESIDUAL=residual is not None,
        )  # fmt: skip
    return out, res_out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """y = weight * x / rms(x), computed in fp32 and cast back (as Hugging Face Llama does)."""
    return _launch_rms_norm(x, None, weight, eps)[0]


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """residual' = x + residual; returns (rms_norm(residual'), residual')."""
    out, res_out = _launch_rms_norm(x, residual, weight, eps)
    assert res_out is not None
    return out, res_out


# ---------------------------------------------------------------------------- rotary


@triton.jit
def _rotate_heads(x_ptr, t, stride_t, stride_h, cos, sin, NH: tl.constexpr,
                  BLOCK_H: tl.constexpr, HALF: tl.constexpr):  # fmt: skip
    """Rotate the NH heads of token t in place; cos/sin are [HALF] in x's dtype, as fp32."""
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, HALF)[None, :]
    mask = h < NH
    p1 = x_ptr + t * stride_t + h * stride_h + d
    x1 = tl.load(p1, mask=mask, other=0.0)
    x2 = tl.load(p1 + HALF, mask=mask, other=0.0)
    dt = x1.dtype
    x1 = x1.to(tl.float32)
    x2 = x2.to(tl.float32)
    # Round every product like the reference's elementwise ops in x's dtype do.
    o1 = (x1 * cos[None, :]).to(dt).to(tl.float32) - (x2 * sin[None, :]).to(dt).to(tl.float32)
    o2 = (x2 * cos[None, :]).to(dt).to(tl.float32) + (x1 * sin[None, :]).to(dt).to(tl.float32)
    tl.store(p1, o1.to(dt), mask=mask)
    tl.store(p1 + HALF, o2.to(dt), mask=mask)


@triton.jit
def _rotary_kernel(
    pos_ptr, q_ptr, k_ptr, cs_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_cs,
    H: tl.constexpr, HKV: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HKV: tl.constexpr,
    HALF: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    d = tl.arange(0, HALF)
    cos = tl.load(cs_ptr + pos * stride_cs + d)
    sin = tl.load(cs_ptr + pos * stride_cs + HALF + d)
    dt = q_ptr.dtype.element_ty
    cos = cos.to(dt).to(tl.float32)
    sin = sin.to(dt).to(tl.float32)
    _rotate_heads(q_ptr, t, stride_qt, stride_qh, cos, sin, H, BLOCK_H, HALF)
    _rotate_heads(k_ptr, t, stride_kt, stride_kh, cos, sin, HKV, BLOCK_HKV, HALF)


def rotary_embedding(
    positions: torch.Tensor,  # [T] int64
    q: torch.Tensor,  # [T, H, D], rotated in place
    k: torch.Tensor,  # [T, Hkv, D], rotated in place
    cos_sin_cache: torch.Tensor,  # [max_pos, D] fp32: cos in [:, :D/2], sin in [:, D/2:]
) -> None:
    """Llama/NeoX rotary embedding: x*cos + rotate_half(x)*sin on the two halves of D."""
    t, h, d = q.shape
    assert k.dim() == 3 and k.shape[0] == t and k.shape[2] == d, f"k {tuple(k.shape)}"
    assert q.dtype == k.dtype and q.dtype in _FLOAT_DTYPES
    assert q.stride(2) == 1 and k.stride(2) == 1, "q/k: head_dim must be contiguous"
    assert d >= 2 and d & (d - 1) == 0, f"head_dim must be a power of two, got {d}"
    assert cos_sin_cache.dim() == 2 and cos_sin_cache.shape[1] == d, "cos_sin_cache [P, D]"
    assert cos_sin_cache.dtype == torch.float32 and cos_sin_cache.stride(1) == 1
    assert positions.shape == (t,) and positions.dtype in (torch.int64, torch.int32)
    if t == 0:
        return
    hkv = k.shape[1]
    _rotary_kernel[(t,)](
        positions, q, k, cos_sin_cache,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos_sin_cache.stride(0),
        H=h, HKV=hkv, BLOCK_H=triton.next_power_of_2(h),
        BLOCK_HKV=triton.next_power_of_2(hkv), HALF=d // 2,
    )  # fmt: skip


# ---------------------------------------------------------------------------- SiLU and mul


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, INTER: tl.constexpr,
                         BLOCK: tl.constexpr):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < INTER
    gate = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * stride_x + INTER + offs, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(gate.dtype).to(tl.float32)  # F.silu rounds here
    tl.store(out_ptr + row * stride_o + offs, (act * up.to(tl.float32)).to(gate.dtype), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """[T, 2I] (gate | up) -> silu(gate) * up, [T, I]."""
    assert x.shape[-1] % 2 == 0, f"last dim must be even, got {x.shape[-1]}"
    x2 = _as_rows(x, "x")
    i = x.shape[-1] // 2
    out = torch.empty((*x.shape[:-1], i), dtype=x.dtype, device=x.device)
    out2 = out.view(-1, i)
    block = min(triton.next_power_of_2(i), 1024)
    if x2.shape[0] > 0:
        grid = (x2.shape[0], triton.cdiv(i, block))
        _silu_and_mul_kernel[grid](x2, out2, x2.stride(0), out2.stride(0), INTER=i, BLOCK=block)
    return out
