"""The rotary-embedding cos/sin table, computed exactly as Hugging Face does."""

from __future__ import annotations

import torch

from pdserve.engine.model_arch import ModelArch


def build_cos_sin_cache(arch: ModelArch) -> torch.Tensor:
    """[max_position_embeddings, head_dim] fp32 on the CPU: cos in the first half, sin in
    the second. Computed on the CPU even inside a `torch.device("meta")` block (the model
    is built under one), since transformers' init functions make their own CPU tensors."""
    with torch.device("cpu"):
        return _build(arch)


def _build(arch: ModelArch) -> torch.Tensor:
    params = arch.rope_parameters
    rope_type = params.get("rope_type", "default")
    dim = arch.head_dim
    if rope_type == "default":
        base = params["rope_theta"]
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
        scaling = 1.0
    else:  # llama3, yarn, ...: exactly transformers' own init function
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](arch.to_hf_config(), torch.device("cpu"))
    positions = torch.arange(arch.max_position_embeddings, dtype=torch.float)
    freqs = positions[:, None] * inv_freq[None, :].float()  # [P, D/2]
    return torch.cat([freqs.cos() * scaling, freqs.sin() * scaling], dim=-1)
