"""Prepacked GEMMs on CPU: every projection's weight reordered once, at load, for oneDNN.

`F.linear` on CPU hands the weight to MKL or oneDNN in its plain layout on every call
(and the earlier OneDNNLinear converted the activations to and from oneDNN tensors around
every call). Here each projection's weight is reordered once into the blocked layout
oneDNN's matmul wants (`mkldnn._reorder_linear_weight`), and every call runs
`mkldnn._linear_pointwise` on the plain activations: no per-call conversion is left.
Measured at this model's shapes on an AVX-512/bf16 box (docs/benchmarks.md): as fast as
or faster than `F.linear` at 1, 32 and 256 rows, in fp32 and bf16; the 49152-wide
lm_head at 32 rows fp32 ~29 ms vs ~80 ms.

The packed weight is an opaque oneDNN tensor, which torch.compile cannot take as a graph
input. So the GEMM is the custom op `pdserve::packed_linear(x, weight, bias)`: the graph
sees the plain weight (one graph serves every layer, the weights being inputs), and the
op looks the packed copy up by the plain weight's storage. A weight that was never packed
(or whose packing died with its model) falls back to `F.linear`, so the op is always
correct. fp32 results differ from `F.linear` only by summation order (~1e-5 relative).
"""

from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F
from torch import nn

from kernels import cpu_gemv

# plain weight's data_ptr -> (weak ref to the plain weight, packed oneDNN weight)
_PACKED: dict[int, tuple[weakref.ref, torch.Tensor]] = {}


def onednn_available(device: torch.device, dtype: torch.dtype) -> bool:
    """Prepacking applies on CPU in fp32, and in bf16 where the CPU has native bf16."""
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.float32:
        return True
    return dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def _packed(weight: torch.Tensor) -> torch.Tensor | None:
    entry = _PACKED.get(weight.data_ptr())
    if entry is None or entry[0]() is None:
        return None
    return entry[1]


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """y = x W^T (+ b): a few rows (decode) through the native GEMV, which streams the plain
    weight (kernels/cpu_gemv.py); more through the packed weight when there is one."""
    if x.numel() <= cpu_gemv.MAX_ROWS * x.shape[-1]:
        y = cpu_gemv.linear(x, weight, bias)
        if y is not None:
            return y
    packed = _packed(weight)
    if packed is None:
        return F.linear(x, weight, bias)
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, bias, "none", [], "")


@torch.library.custom_op("pdserve::packed_linear", mutates_args=())
def packed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return linear(x, weight, bias)


@packed_linear.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


class PackedLinear(nn.Linear):
    """nn.Linear whose forward runs through the packed weight (after `pack()`)."""

    def pack(self) -> None:
        pack_weight(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            return torch.ops.pdserve.packed_linear(x, self.weight, self.bias)
        return linear(x, self.weight, self.bias)


def pack_weight(weight: torch.Tensor) -> None:
    """Reorder `weight` [out, in] for oneDNN once; calls through `linear` then use it."""
    for key in [k for k, (ref, _) in _PACKED.items() if ref() is None]:
        del _PACKED[key]
    w = weight.detach()
    _PACKED[w.data_ptr()] = (weakref.ref(weight), torch.ops.mkldnn._reorder_linear_weight(w, None))


def pack_linears(model: nn.Module) -> int:
    """Pack every PackedLinear of `model`; returns how many."""
    layers = [m for m in model.modules() if isinstance(m, PackedLinear)]
    for m in layers:
        m.pack()
    return len(layers)
