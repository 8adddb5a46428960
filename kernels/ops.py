"""One registry of kernel implementations: `get_ops("torch")` or `get_ops("triton")`.

Every backend exposes the same functions with the contracts documented in
`kernels.reference`: store_kv, paged_decode_attention, paged_prefill_attention, rms_norm,
fused_add_rms_norm, rotary_embedding, silu_and_mul.
"""

from __future__ import annotations

from types import ModuleType

BACKENDS = ("torch", "triton")


def get_ops(name: str) -> ModuleType:
    if name == "torch":
        from kernels import reference

        return reference
    if name == "triton":
        from kernels import triton_ops

        return triton_ops
    raise ValueError(f"unknown kernel backend {name!r}; expected one of {BACKENDS}")


def default_backend(device: str) -> str:
    """Triton on CUDA, torch elsewhere."""
    return "triton" if device.startswith("cuda") else "torch"
