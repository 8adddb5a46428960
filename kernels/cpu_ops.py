"""The CPU kernel set behind `get_ops("torch")`: native C++ ops where they exist (paged
decode attention reading the KV blocks in place, pdserve.kernels.paged_decode; the layer's
elementwise ops one call each, pdserve.kernels.elementwise), and prefill attention on fresh
prompts' own K/V (pdserve.kernels.prefill_attention: a native kernel, torch's flash SDPA for the rest).
Two ops beyond the reference's set (pdserve.kernels.gemv), for decode rows: `gate_up_silu`, the
gate_up projection and SiLU(gate) * up in one native call, and `norm_linear`, a layer's
(residual add +) RMSNorm and the projection after it (qkv, or gate_up + SiLU) in one;
every op set declares them (the reference's and Triton's decline every input: None).

Select the plain reference for every op with `PDSERVE_CPU_ATTENTION=reference` (see
`pdserve.kernels.ops.get_ops`). Same contracts as `pdserve.kernels.reference`.
"""

from __future__ import annotations

from pdserve.kernels.elementwise import (
    fused_add_rms_norm,
    rms_norm,
    rotary_embedding,
    silu_and_mul,
    store_kv,
)
from pdserve.kernels.gemv import gate_up_silu, norm_linear
from pdserve.kernels.paged_decode import paged_decode_attention
from pdserve.kernels.prefill_attention import paged_prefill_attention

# the MLP runs SiLU * up inside its GEMMs: `gate_up_silu` for decode rows, else the packed
# oneDNN halves' post-ops (engine/models/cpu_linear.py PackedGateUp.silu_mul)
FUSES_MLP_ACTIVATION = True

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
