"""The CPU kernel set behind `get_ops("torch")`: the pure-torch reference, except paged
decode attention, which runs the native in-place kernel (kernels.cpu_attention).

Select the plain reference for every op with `PDSERVE_CPU_ATTENTION=reference` (see
`kernels.ops.get_ops`). Same contracts as `kernels.reference`.
"""

from __future__ import annotations

from kernels.cpu_attention import paged_decode_attention
from kernels.reference import (
    fused_add_rms_norm,
    paged_prefill_attention,
    rms_norm,
    rotary_embedding,
    silu_and_mul,
    store_kv,
)

__all__ = [
    "fused_add_rms_norm",
    "paged_decode_attention",
    "paged_prefill_attention",
    "rms_norm",
    "rotary_embedding",
    "silu_and_mul",
    "store_kv",
]
