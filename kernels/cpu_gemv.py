"""Small-M linear on CPU for decode steps (kernels/csrc/gemv.cpp): y = x W^T (+ b).

A decode step of a few sequences reads every projection's whole weight for a few rows of
activations: memory-bound. The kernel streams the weight in its plain [out, in] layout
(no packed copy) with all rows of x sharing each weight load, output rows split over
the OpenMP threads in one parallel region per call. Contract: `F.linear` with fp32
accumulation (fp32 and bf16; in bf16 the result is rounded once, at the end).

`linear` returns None for what the kernel does not take (more than `MAX_ROWS` rows, a
dtype other than fp32/bf16 or mixed dtypes, a non-CPU tensor, an inner dimension that
is not contiguous, inside a torch.compile trace) and on a machine where the library
cannot be built: the caller then runs its own GEMM.
"""

from __future__ import annotations

import ctypes

import torch

from kernels.native import load_library

_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
MAX_ROWS = 8  # above this the prepacked oneDNN GEMM (docs/benchmarks.md, gemv_ab.py)

_i64 = ctypes.c_int64
_ARGTYPES = [ctypes.c_void_p, _i64, ctypes.c_void_p, _i64, ctypes.c_void_p, ctypes.c_void_p]
_ARGTYPES += [_i64] * 4 + [ctypes.c_int] * 2
_fn: ctypes._CFuncPtr | None | bool = False  # False: not loaded yet


def _load():
    global _fn
    if _fn is False:
        lib = load_library("gemv")
        if lib is None:
            _fn = None
        else:
            fn = lib.pdserve_gemv
            fn.argtypes, fn.restype = _ARGTYPES, ctypes.c_int
            _fn = fn
    return _fn


def available() -> bool:
    """Whether the native library is built and loaded on this machine."""
    return _load() is not None


def isa() -> int:
    """The build's vector width in bits (512, 256, 32), +1 with the avx512_bf16 dot."""
    lib = load_library("gemv")
    return -1 if lib is None else int(lib.pdserve_gemv_isa())


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
    """x [..., K] @ weight [N, K]^T (+ bias [N]) -> [..., N], or None (not taken here)."""
    dtype = x.dtype
    if not x.is_cpu or dtype not in _DTYPES or weight.dtype != dtype or weight.dim() != 2:
        return None
    k = x.shape[-1]
    x2 = x.reshape(-1, k)
    m, n = x2.shape[0], weight.shape[0]
    if m > MAX_ROWS or m == 0 or not weight.is_cpu or weight.shape[1] != k:
        return None
    if weight.stride(1) != 1 or x2.stride(1) != 1 or torch.compiler.is_compiling():
        return None
    if bias is not None and (bias.dtype != dtype or not bias.is_contiguous() or bias.shape != (n,)):
        return None
    fn = _fn if _fn else _load()
    if fn is None:
        return None
    y = torch.empty((m, n), dtype=dtype)
    fn(
        x2.data_ptr(), x2.stride(0), weight.data_ptr(), weight.stride(0),
        None if bias is None else bias.data_ptr(), y.data_ptr(), n, m, n, k, _DTYPES[dtype],
        torch.get_num_threads(),
    )  # fmt: skip
    return y.view(*x.shape[:-1], n)
