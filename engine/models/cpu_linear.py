"""Faster fp32 GEMMs on CPU for the widest projections, through oneDNN.

Measured on the 2-core AMD EPYC CI box (AVX2, torch 2.13, 2 threads; docs/benchmarks.md):
MKL's sgemm is slow for wide outputs there (gate_up 576x3072 at 32 rows: 4.1 ms vs 2.4 ms
in oneDNN; the 49152-wide lm_head: 76 ms vs 36 ms), while for narrow outputs (qkv, o,
down) MKL is as fast or faster. So projections with at least `MIN_OUT_FEATURES` outputs
run through oneDNN with a pre-packed weight; everything else stays on `F.linear`.
"""

from __future__ import annotations

import torch
from torch import nn

MIN_OUT_FEATURES = 2048


def onednn_available(device: torch.device, dtype: torch.dtype) -> bool:
    return device.type == "cpu" and dtype == torch.float32 and torch.backends.mkldnn.is_available()


class OneDNNLinear(nn.Module):
    """y = x W^T (+ b) with W held as a oneDNN tensor. x: [T, in] fp32 -> [T, out]."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.weight_onednn = weight.detach().contiguous().to_mkldnn()
        self.bias = None if bias is None else bias.detach().contiguous()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch._C._nn.mkldnn_linear(x.contiguous().to_mkldnn(), self.weight_onednn, None)
        out = out.to_dense()
        return out if self.bias is None else out + self.bias


def use_onednn_for_wide_linears(model: nn.Module) -> int:
    """Swap every nn.Linear with >= MIN_OUT_FEATURES outputs for a OneDNNLinear; returns count."""
    swapped = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear) and child.out_features >= MIN_OUT_FEATURES:
                setattr(parent, name, OneDNNLinear(child.weight, child.bias))
                swapped += 1
    return swapped
