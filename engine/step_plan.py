"""The forward path of one step, chosen once by the runner and passed down to the model.

`ForwardPath`: COMPILED (the decode step compiled per batch bucket, engine/compiled_model.py),
FUSED (a CPU decode step in one native call, engine/models/fused_decode.py) or PER_OP (the
model's own forward, op by op). `gemv`: whether projections of a few rows may take the
native decode GEMV (`kernels.ops.gemv_linear`) and the norm/SiLU fusions built on it. A
step with prompt tokens runs the GEMM at any row count, so a prompt's rows get the same
bits whether its prefix was cached (a few rows left to compute) or not: the same request
twice gives the same logprobs.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch


class ForwardPath(enum.Enum):
    COMPILED = "compiled"
    FUSED = "fused"
    PER_OP = "per_op"


@dataclass(frozen=True)
class StepPlan:
    path: ForwardPath = ForwardPath.PER_OP
    gemv: bool = True


PER_OP = StepPlan()


def plan_step(model: torch.nn.Module, meta, prompt_tokens: bool = False) -> StepPlan:
    """The path for a step of `meta` (engine.attention.AttentionMetadata) on `model`: the
    compiled decode where it takes the step, else the fused native decode where the model
    has one and the step only decodes, else op by op. The fused forward still declines
    inputs it finds out of range (nothing written): the model then runs them op by op."""
    if prompt_tokens:
        return StepPlan(ForwardPath.PER_OP, gemv=False)
    if torch.compiler.is_compiling():
        return PER_OP
    compiled = model.compiled_decode
    if compiled is not None and compiled.takes(meta):
        return StepPlan(ForwardPath.COMPILED)
    fused = model.fused_decode
    if fused is not None and meta.num_prefills == 0 and meta.num_decode_tokens > 0:
        return StepPlan(ForwardPath.FUSED)
    return PER_OP
