"""A decoder layer's elementwise ops on CPU, one native call each (kernels/csrc/elementwise.cpp).

rms_norm, fused_add_rms_norm, rotary_embedding, silu_and_mul and store_kv, with the
contracts of `pdserve.kernels.reference`. The reference runs each as 4-26 eager torch ops; on a
one-row decode step that dispatch overhead (a few microseconds per op, ~2,000 ops a step)
is a large part of everything that is not a GEMM. Here each is one ctypes call.

Falls back to the reference (same results) for what the kernel does not take: inside a
torch.compile trace (inductor fuses these itself), a non-CPU tensor, a dtype other than
fp32/bf16, an inner dimension that is not contiguous, or a machine where the library
cannot be built. Rows are split over threads only above `PARALLEL_MIN_ELEMENTS` (a
fork/join costs more than a small call's work).
"""

from __future__ import annotations

import torch

from pdserve.kernels import native, reference
from pdserve.kernels.paged_decode import blocks_contiguous

_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
PARALLEL_MIN_ELEMENTS = 1 << 16


def available() -> bool:
    """Whether the native library is built and loaded on this machine."""
    return native.load_library("elementwise") is not None


def _threads(elements: int) -> int:
    return torch.get_num_threads() if elements >= PARALLEL_MIN_ELEMENTS else 1


def _native(*tensors: torch.Tensor):
    """The library if every tensor suits it (CPU, one supported dtype, inner dim
    contiguous, not being traced), else None."""
    if torch.compiler.is_compiling():
        return None
    dtype = tensors[0].dtype
    if dtype not in _DTYPES:
        return None
    for t in tensors:
        if not t.is_cpu or t.dtype != dtype or t.stride(-1) != 1:
            return None
    return native.load_library("elementwise")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    lib = _native(x, weight)
    if lib is None or x.dim() != 2:
        return reference.rms_norm(x, weight, eps)
    rows, n = x.shape
    out = torch.empty_like(x)  # 2-D, inner stride 1: row-major (strided x: contiguous)
    lib.pdserve_rms_norm(
        x.data_ptr(), x.stride(0), None, 0, weight.data_ptr(), out.data_ptr(), out.stride(0),
        None, 0, rows, n, eps, _DTYPES[x.dtype], _threads(x.numel()),
    )  # fmt: skip
    return out


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    lib = _native(x, residual, weight)
    if lib is None or x.dim() != 2 or residual.shape != x.shape:
        return reference.fused_add_rms_norm(x, residual, weight, eps)
    rows, n = x.shape
    out, res_out = torch.empty_like(x), torch.empty_like(x)
    lib.pdserve_rms_norm(
        x.data_ptr(), x.stride(0), residual.data_ptr(), residual.stride(0), weight.data_ptr(),
        out.data_ptr(), out.stride(0), res_out.data_ptr(), res_out.stride(0), rows, n, eps,
        _DTYPES[x.dtype],
        _threads(x.numel()),
    )  # fmt: skip
    return out, res_out


def rotary_embedding(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor
) -> None:
    lib = _native(q, k)
    if (
        lib is None
        or positions.dtype != torch.int64
        or not positions.is_contiguous()
        or cos_sin_cache.dtype != torch.float32
        or not cos_sin_cache.is_contiguous()
        or cos_sin_cache.shape[1] != q.shape[-1]
    ):
        reference.rotary_embedding(positions, q, k, cos_sin_cache)
        return
    t, hq, d = q.shape
    rc = lib.pdserve_rope(
        positions.data_ptr(), q.data_ptr(), q.stride(0), q.stride(1), hq,
        k.data_ptr(), k.stride(0), k.stride(1), k.shape[1], cos_sin_cache.data_ptr(), d, t,
        _DTYPES[q.dtype], _threads(q.numel()),
    )  # fmt: skip
    if rc != 0:
        raise ValueError(f"rotary_embedding: unsupported head dim {d}")


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    lib = _native(x)
    if lib is None or x.dim() != 2:
        return reference.silu_and_mul(x)
    rows, n2 = x.shape
    n = n2 // 2
    out = torch.empty((rows, n), dtype=x.dtype)
    lib.pdserve_silu_and_mul(
        x.data_ptr(), x.stride(0), out.data_ptr(), n, rows, n, _DTYPES[x.dtype],
        _threads(x.numel()),
    )  # fmt: skip
    return out


def store_kv(
    key: torch.Tensor,  # [T, Hkv, D]
    value: torch.Tensor,
    k_cache: torch.Tensor,  # [N, bs, Hkv, D]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [T] int64; -1 = skip
) -> None:
    lib = _native(key, value, k_cache, v_cache)
    row = key.shape[1] * key.shape[2]
    if (
        lib is None
        or slot_mapping.dtype != torch.int64
        or not slot_mapping.is_contiguous()
        or not blocks_contiguous(k_cache)
        or k_cache.stride() != v_cache.stride()
        or key.stride(1) != key.shape[2]
        or value.stride(1) != value.shape[2]
        or k_cache.shape[2] * k_cache.shape[3] != row
    ):
        reference.store_kv(key, value, k_cache, v_cache, slot_mapping)
        return
    elem = key.element_size()
    rc = lib.pdserve_store_kv(
        key.data_ptr(), key.stride(0) * elem, value.data_ptr(), value.stride(0) * elem,
        k_cache.data_ptr(), v_cache.data_ptr(), slot_mapping.data_ptr(), key.shape[0],
        row * elem, k_cache.shape[1], k_cache.stride(0) * elem, k_cache.shape[0] * k_cache.shape[1],
        _threads(key.numel()),
    )  # fmt: skip
    if rc != 0:
        raise IndexError(f"store_kv: a slot is outside the cache's {k_cache.shape[0]} blocks")
