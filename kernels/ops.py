"""One registry of kernel implementations: `get_ops("torch")` or `get_ops("triton")`.

Every backend exposes the same functions with the contracts documented in
`pdserve.kernels.reference`: store_kv, paged_decode_attention, paged_prefill_attention, rms_norm,
fused_add_rms_norm, rotary_embedding, silu_and_mul.

`torch` on CPU is `pdserve.kernels.cpu_ops`: the reference plus native ops (paged decode attention
reading the KV blocks in place, fused elementwise ops), built with the system C++ compiler
on first use (the reference if none). `PDSERVE_CPU_ATTENTION=reference` selects the pure reference instead.
"""

from __future__ import annotations

import os
from types import ModuleType

BACKENDS = ("torch", "triton")
# Launch buckets of the Triton attention kernels (kernels.triton_attention), here so the
# engine can plan its warm-up without importing triton.
DECODE_MAX_SPLITS = 32  # decode split-K: a power of two up to this
DECODE_MIN_SPLIT_KEYS = 256  # a split gets at least this many keys
PREFILL_BLOCK_M = (16, 64)  # query rows per prefill program: chunks <= 32 rows, longer
CPU_ATTENTION_ENV = "PDSERVE_CPU_ATTENTION"
CPU_ATTENTION_CHOICES = ("native", "reference")


def get_ops(name: str) -> ModuleType:
    if name == "torch":
        choice = os.environ.get(CPU_ATTENTION_ENV) or "native"
        if choice not in CPU_ATTENTION_CHOICES:
            raise ValueError(
                f"{CPU_ATTENTION_ENV}={choice!r}; expected one of {CPU_ATTENTION_CHOICES}"
            )
        if choice == "reference":
            from pdserve.kernels import reference

            return reference
        from pdserve.kernels import cpu_ops, elementwise, paged_decode, prefill_attention

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
