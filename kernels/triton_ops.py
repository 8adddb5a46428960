"""The Triton backend: every op of `pdserve.kernels.reference`, same names, signatures, contracts.

`pdserve.kernels.ops.get_ops("triton")` returns this module. The kernels live by concept in
`pdserve.kernels.triton_attention` (paged decode and prefill/extend attention) and
`pdserve.kernels.triton_elementwise` (KV store, RMSNorm, rotary embedding, SiLU-and-mul). On a
machine without CUDA they run under the Triton interpreter, which must be switched on
with `TRITON_INTERPRET=1` before triton is first imported.
"""

from __future__ import annotations

from pdserve.kernels.reference import FUSES_MLP_ACTIVATION, gate_up_silu, norm_linear
from pdserve.kernels.triton_attention import paged_decode_attention, paged_prefill_attention
from pdserve.kernels.triton_elementwise import (
    fused_add_rms_norm,
    rms_norm,
    rotary_embedding,
    silu_and_mul,
    store_kv,
)

__all__ = [
    "FUSES_MLP_ACTIVATION",
    "fused_add_rms_norm",
    "gate_up_silu",
    "norm_linear",
    "paged_decode_attention",
    "paged_prefill_attention",
    "rms_norm",
    "rotary_embedding",
    "silu_and_mul",
    "store_kv",
]
