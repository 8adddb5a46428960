"""The kernel contract: every op the engine calls, declared here; the engine imports this
module and no other of `pdserve.kernels` (hugepages, a memory utility, aside).

Per-layer ops come as an op set, `get_ops("torch")` or `get_ops("triton")`, a module whose
functions have the signatures and semantics of their torch reference,
`pdserve.kernels.reference` (the oracle for tests):
  store_kv, paged_decode_attention, paged_prefill_attention, rms_norm, fused_add_rms_norm,
  rotary_embedding, silu_and_mul: computed by every op set;
  gate_up_silu, norm_linear: decode-row fusions an op set may decline (None), the model
  then runs the unfused ops; FUSES_MLP_ACTIVATION: whether the MLP runs SiLU * up inside
  its GEMMs.
Implementations: `torch` on CPU is `pdserve.kernels.cpu_ops` (native C++ ops built with the
system compiler on first use, kernels/csrc/<name>.cpp <-> kernels/<name>.py, each falling
back to the reference for what it does not take; `PDSERVE_CPU_ATTENTION=reference` selects
the pure reference); `triton` is `pdserve.kernels.triton_ops`.

Engine-wide CPU ops, declared below: `argmax_rows` (the sampler's greedy pick), `gemv_linear`
(decode rows' projections), `PackedWeight` (GEMMs on weights packed once), and the fused
decode forward (`DecodeModel`, `DecodeLayer`, `decode_forward_libraries`): a whole decode
step in one native call.
"""

from __future__ import annotations

import os
from types import ModuleType

import torch

from pdserve.kernels import (
    argmax,
    cpu_ops,
    decode_forward,
    elementwise,
    gemm_packed,
    gemv,
    paged_decode,
    prefill_attention,
    reference,
)
from pdserve.kernels.triton_launch import (
    DECODE_MAX_SPLITS,
    DECODE_MIN_SPLIT_KEYS,
    PREFILL_BLOCK_M,
)

__all__ = [
    "BACKENDS",
    "DECODE_FORWARD_ERRORS",
    "DECODE_MAX_SPLITS",
    "DECODE_MIN_SPLIT_KEYS",
    "GEMV_MAX_ROWS",
    "PREFILL_BLOCK_M",
    "DecodeLayer",
    "DecodeModel",
    "PackedWeight",
    "argmax_rows",
    "blocks_contiguous",
    "decode_forward_constants",
    "decode_forward_libraries",
    "default_backend",
    "gemv_linear",
    "get_ops",
    "is_native_cpu_ops",
    "paged_decode_head_dim_supported",
    "packed_team_address",
    "unsupported_head_dim",
]

BACKENDS = ("torch", "triton")
CPU_ATTENTION_ENV = "PDSERVE_CPU_ATTENTION"
CPU_ATTENTION_CHOICES = ("native", "reference")


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """[rows, n] -> [rows] int64, equal to `x.argmax(dim=-1)` (first index of the maximum;
    a row with a NaN: its first NaN). Native for CPU fp32 rows, torch otherwise."""
    return argmax.argmax_rows(x)


GEMV_MAX_ROWS = gemv.MAX_ROWS  # decode steps of up to this many rows take the GEMV


def gemv_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor | None:
    """`F.linear(x, weight, bias)` with fp32 accumulation for up to GEMV_MAX_ROWS rows,
    streaming the plain weight; None for what it does not take (the caller's GEMM then)."""
    return gemv.linear(x, weight, bias)


# A weight packed once into column panels: `PackedWeight(w, silu=False)`, `.gemm(x, ...)`,
# `.linear(x)` (kernels/gemm_packed.py); `packed_team_address(dtype)` is the per-thread
# GEMM the fused decode forward calls inside its own parallel region.
PackedWeight = gemm_packed.Packed
packed_team_address = gemm_packed.team_address
# whether bf16 panel GEMMs of an inner dimension run on AMX tiles
packed_bf16_amx = gemm_packed.bf16_amx
# the panel GEMM library's vector width in bits (512, 256, 32; 0: none), and whether its
# bf16 runs on the CPU's bf16 dot products (avx512_bf16)
packed_vector_bits = gemm_packed.vector_bits
packed_bf16_native = gemm_packed.bf16_native

# The fused decode forward (kernels/decode_forward.py): the model described once
# (`DecodeModel` with a `DecodeLayer` per layer), a step passes only its inputs.
DecodeModel = decode_forward.Model
DecodeLayer = decode_forward.Layer
DECODE_FORWARD_ERRORS = decode_forward.ERRORS
decode_forward_libraries = decode_forward.libraries
decode_forward_constants = decode_forward.wrapper_constants
blocks_contiguous = paged_decode.blocks_contiguous
paged_decode_head_dim_supported = paged_decode.head_dim_supported


def is_native_cpu_ops(ops: ModuleType) -> bool:
    """Whether `ops` is the native CPU op set (the one the fused decode forward chains)."""
    return ops is cpu_ops


def get_ops(name: str) -> ModuleType:
    """The op set `name` ("torch" or "triton"); see the module doc. Triton is imported only
    here, when asked for."""
    if name == "torch":
        choice = os.environ.get(CPU_ATTENTION_ENV) or "native"
        if choice not in CPU_ATTENTION_CHOICES:
            raise ValueError(
                f"{CPU_ATTENTION_ENV}={choice!r}; expected one of {CPU_ATTENTION_CHOICES}"
            )
        if choice == "reference":
            return reference
        paged_decode.available()  # build (or load) the kernels now, not in the first step
        elementwise.available()
        prefill_attention.available()
        return cpu_ops
    if name == "triton":
        from pdserve.kernels import triton_ops

        return triton_ops
    raise ValueError(f"unknown kernel backend {name!r}; expected one of {BACKENDS}")


def unsupported_head_dim(backend: str, head_dim: int) -> str | None:
    """Why `backend` cannot run attention heads of `head_dim`, or None if it can.

    Rotary embedding rotates the two halves of a head, so it must be even; the Triton
    kernels tile a head in one power-of-two block (16 to 256, what fits on chip).
    """
    if head_dim < 2 or head_dim % 2:
        return f"{head_dim} is not an even number (rotary embedding rotates its two halves)"
    if backend == "triton" and (head_dim < 16 or head_dim > 256 or head_dim & (head_dim - 1)):
        return (
            f"{head_dim} is not supported by the triton kernels (a power of two from 16 "
            "to 256); model.kernel_backend: torch runs any even head_dim"
        )
    return None


def default_backend(device: str) -> str:
    """Triton on CUDA, torch elsewhere."""
    return "triton" if device.startswith("cuda") else "torch"
