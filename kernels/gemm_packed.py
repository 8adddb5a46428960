"""GEMMs on weights packed once into column panels (kernels/csrc/gemm_packed.cpp), fp32 or
bf16.

Decode steps of more than `gemv.MAX_ROWS` (`kernels.ops.GEMV_MAX_ROWS`) rows run their whole forward as one native
call (kernels/csrc/decode_forward.cpp `pdserve_decode_forward_batch`) on packed copies of
the projection weights, made at load by `Packed`; the lm_head of such a step runs through
`Packed.linear`. The packed layout belongs to the library's vector width: pack and
multiply with the same build. Accumulation is fp32, each output one chain over k in order
(bf16: pairs of k, on the CPU's bf16 dot products where it has them), so a row's result
does not depend on the number of rows in the step; bf16 results are rounded where the
per-op path's bf16 tensors round.

`available()` is False where the library cannot be built; callers then keep oneDNN.
"""

from __future__ import annotations

import torch

from pdserve.kernels import hugepages, native

DTYPES = (torch.float32, torch.bfloat16)


def available() -> bool:
    return native.load_library("gemm_packed") is not None


def bf16_native() -> bool:
    """True where the bf16 GEMM runs on the CPU's bf16 dot products (avx512_bf16)."""
    lib = native.load_library("gemm_packed")
    return lib is not None and bool(lib.pdserve_gemm_packed_bf16_native())


def vector_bits() -> int:
    """The library build's vector width in bits: 512 (AVX-512), 256 (AVX2), 32 (plain C++);
    0 where it cannot be built."""
    lib = native.load_library("gemm_packed")
    return 0 if lib is None else int(lib.pdserve_gemm_packed_isa())


def bf16_amx(k: int = 32) -> bool:
    """True where bf16 GEMMs of inner dimension `k` run on AMX tiles (a CPU with AMX whose
    kernel granted this process the tile state, `k` a multiple of 32; kernels/csrc/
    gemm_packed.cpp `gemm_panels_amx`)."""
    lib = native.load_library("gemm_packed")
    return lib is not None and bool(lib.pdserve_gemm_packed_bf16_amx(k))


def team_address(dtype: torch.dtype = torch.float32) -> int | None:
    """Address of `pdserve_gemm_packed[_bf16]_team` (for decode_forward.cpp), or None."""
    lib = native.load_library("gemm_packed")
    if lib is None or dtype not in DTYPES:
        return None
    bf16 = "_bf16" if dtype == torch.bfloat16 else ""
    fn = f"pdserve_gemm_packed{bf16}_team"
    return native.address(lib, fn)


class Packed:
    """A weight [n, k] (silu: a gate_up weight [2 n, k], gate rows then up rows) packed,
    fp32 or bf16 (the weight's dtype)."""

    def __init__(self, weight: torch.Tensor, silu: bool = False) -> None:
        lib = native.load_library("gemm_packed")
        if lib is None:
            raise RuntimeError("gemm_packed library unavailable")
        if weight.dtype not in DTYPES or weight.dim() != 2 or weight.stride(1) != 1:
            raise ValueError("packing takes an fp32 or bf16 [n, k] weight with contiguous rows")
        if not weight.is_cpu or (silu and weight.shape[0] % 2):
            raise ValueError("packing takes a CPU weight (silu: an even number of rows)")
        rows, self.k = weight.shape
        self.n = rows // 2 if silu else rows
        self.silu = silu
        self.dtype = weight.dtype
        bf16 = self.dtype == torch.bfloat16
        size = (lib.pdserve_packed_bf16_elems if bf16 else lib.pdserve_packed_floats)(
            self.n, self.k, int(silu)
        )
        # huge pages where offered: the decode step streams every panel from DRAM
        self.data = hugepages.empty((size,), self.dtype)
        w = weight.detach()
        rc = (lib.pdserve_pack_bf16 if bf16 else lib.pdserve_pack)(
            w.data_ptr(), w.stride(0), self.n, self.k, int(silu), self.data.data_ptr(),
            torch.get_num_threads(),
        )  # fmt: skip
        if rc != 0:
            raise ValueError(f"pdserve_pack refused a {tuple(weight.shape)} weight")

    def ptr(self) -> int:
        return self.data.data_ptr()

    def silu_mode(self, round_gate_up: bool) -> int:
        """The native `silu` argument: 0 a plain projection; a gate_up weight 1 (SiLU * up
        of the fp32 accumulators) or 2 (gate and up rounded to the dtype first)."""
        if not self.silu:
            return 0
        return 2 if round_gate_up else 1

    def _check_rows(self, x: torch.Tensor) -> torch.Tensor:
        if (
            x.dtype != self.dtype
            or x.dim() != 2
            or x.shape[1] != self.k
            or x.stride(1) != 1
            or not x.is_cpu
        ):
            raise ValueError(
                f"packed GEMM takes CPU {self.dtype} [m, {self.k}] rows, got {x.dtype} "
                f"{tuple(x.shape)} on {x.device}"
            )
        return x

    def gemm(
        self,
        x: torch.Tensor,
        bias: torch.Tensor | None = None,
        res: torch.Tensor | None = None,
        out_dtype: torch.dtype | None = None,
        threads: int | None = None,
        round_gate_up: bool = False,
    ) -> torch.Tensor:
        """x [m, k] (the weight's dtype) -> [m, n]: x W^T + bias + res (silu: silu(x gate^T)
        * (x up^T), no bias or res), in `out_dtype` (default the weight's; a bf16 weight
        can give fp32 holding the bf16 values). round_gate_up (silu, bf16): gate and up
        rounded to bf16 before SiLU, as an unfused gate_up GEMM's output would be."""
        x = self._check_rows(x)
        m = x.shape[0]
        for t, shape in ((bias, (self.n,)), (res, (m, self.n))):
            if t is not None and (
                t.dtype != self.dtype or t.shape != shape or t.stride(-1) != 1 or not t.is_cpu
            ):
                raise ValueError(
                    f"bias / residual must be CPU {self.dtype} {shape}, contiguous rows"
                )
        out_dtype = out_dtype or self.dtype
        if out_dtype not in (self.dtype, torch.float32):
            raise ValueError(f"packed GEMM gives {self.dtype} or float32, not {out_dtype}")
        y = torch.empty((m, self.n), dtype=out_dtype)
        args = (
            x.data_ptr(), x.stride(0), self.ptr(), self.n, self.k, self.silu_mode(round_gate_up),
            None if bias is None else bias.data_ptr(), None if res is None else res.data_ptr(),
            0 if res is None else res.stride(0), y.data_ptr(), self.n, m,
        )  # fmt: skip
        threads = threads or torch.get_num_threads()
        if self.dtype == torch.float32:
            rc = native.load_library("gemm_packed").pdserve_gemm_packed(*args, threads)
        else:
            rc = native.load_library("gemm_packed").pdserve_gemm_packed_bf16(
                *args, int(out_dtype == torch.float32), threads
            )
        if rc != 0:
            raise RuntimeError("pdserve_gemm_packed refused its arguments")
        return y

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        """x [m, k] -> [m, n]: x W^T (silu: silu(x gate^T) * (x up^T)); fp32 out either way
        (a bf16 weight's values rounded to bf16, as its bf16 GEMM's would be)."""
        if self.silu:
            return self.gemm(x, out_dtype=torch.float32)
        return self.logits(x)

    def logits(self, x: torch.Tensor, threads: int | None = None) -> torch.Tensor:
        """x [m, k] -> fp32 [m, n] = x W^T (bf16: the bf16 values), the same values as
        `gemm(x, out_dtype=torch.float32)`, written with non-temporal stores
        (`pdserve_gemm_packed[_bf16]_logits`): for the lm_head, whose [rows, vocab] output
        is far larger than L2 and read once, later, by the sampler."""
        if self.silu:
            raise ValueError("logits takes a plain projection, not a gate_up weight")
        x = self._check_rows(x)
        m = x.shape[0]
        y = torch.empty((m, self.n), dtype=torch.float32)
        lib = native.load_library("gemm_packed")
        fn = lib.pdserve_gemm_packed_logits
        if self.dtype == torch.bfloat16:
            fn = lib.pdserve_gemm_packed_bf16_logits
        rc = fn(x.data_ptr(), x.stride(0), self.ptr(), self.n, self.k, y.data_ptr(), self.n, m,
                threads or torch.get_num_threads())  # fmt: skip
        if rc != 0:
            raise RuntimeError("pdserve_gemm_packed_logits refused its arguments")
        return y
