"""fp32 GEMMs on weights packed once into column panels (kernels/csrc/gemm_packed.cpp).

Decode steps of more than `cpu_gemv.MAX_ROWS` rows run their whole forward as one native
call (kernels/csrc/decode_forward.cpp `pdserve_decode_forward_batch`) on packed copies of
the projection weights, made at load by `pack`; the lm_head of such a step runs through
`linear`. The packed layout belongs to the library's vector width: pack and multiply with
the same build. Each output is one fp32 FMA chain over k in order, so a row's result does
not depend on the number of rows in the step.

`available()` is False where the library cannot be built; callers then keep oneDNN.
"""

from __future__ import annotations

import ctypes

import torch

from kernels import hugepages
from kernels.native import load_library

_p, _i64, _int = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
_GEMM_ARGTYPES = [_p, _i64, _p, _i64, _i64, _int, _p, _p, _i64, _p, _i64, _i64, _int]


def _lib() -> ctypes.CDLL | None:
    lib = load_library("gemm_packed")
    if lib is not None and lib.pdserve_gemm_packed.argtypes is None:
        lib.pdserve_packed_floats.argtypes, lib.pdserve_packed_floats.restype = (
            [_i64, _i64, _int],
            _i64,
        )
        lib.pdserve_pack.argtypes = [_p, _i64, _i64, _i64, _int, _p, _int]
        lib.pdserve_pack.restype = _int
        lib.pdserve_gemm_packed.argtypes = _GEMM_ARGTYPES
        lib.pdserve_gemm_packed.restype = _int
    return lib


def available() -> bool:
    return _lib() is not None


def team_address() -> int | None:
    """Address of `pdserve_gemm_packed_team` (for decode_forward.cpp), or None."""
    lib = _lib()
    if lib is None:
        return None
    return ctypes.cast(lib.pdserve_gemm_packed_team, ctypes.c_void_p).value


class Packed:
    """A weight [n, k] (silu: a gate_up weight [2 n, k], gate rows then up rows) packed."""

    def __init__(self, weight: torch.Tensor, silu: bool = False) -> None:
        lib = _lib()
        if lib is None:
            raise RuntimeError("gemm_packed library unavailable")
        if weight.dtype != torch.float32 or weight.dim() != 2 or weight.stride(1) != 1:
            raise ValueError("packing takes an fp32 [n, k] weight with contiguous rows")
        if not weight.is_cpu or (silu and weight.shape[0] % 2):
            raise ValueError("packing takes a CPU weight (silu: an even number of rows)")
        rows, self.k = weight.shape
        self.n = rows // 2 if silu else rows
        self.silu = silu
        # huge pages where offered: the decode step streams every panel from DRAM
        self.data = hugepages.empty(
            (lib.pdserve_packed_floats(self.n, self.k, int(silu)),), torch.float32
        )
        w = weight.detach()
        rc = lib.pdserve_pack(
            w.data_ptr(), w.stride(0), self.n, self.k, int(silu), self.data.data_ptr(),
            torch.get_num_threads(),
        )  # fmt: skip
        if rc != 0:
            raise ValueError(f"pdserve_pack refused a {tuple(weight.shape)} weight")

    def ptr(self) -> int:
        return self.data.data_ptr()

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        """x [m, k] fp32 -> [m, n]: x W^T (silu: silu(x gate^T) * (x up^T))."""
        if x.dtype != torch.float32 or x.dim() != 2 or x.shape[1] != self.k or x.stride(1) != 1:
            raise ValueError(f"packed linear takes fp32 [m, {self.k}] rows, got {tuple(x.shape)}")
        m = x.shape[0]
        y = torch.empty((m, self.n), dtype=torch.float32)
        rc = _lib().pdserve_gemm_packed(
            x.data_ptr(), x.stride(0), self.ptr(), self.n, self.k, int(self.silu), None, None,
            0, y.data_ptr(), self.n, m, torch.get_num_threads(),
        )  # fmt: skip
        if rc != 0:
            raise RuntimeError("pdserve_gemm_packed refused its arguments")
        return y
