"""Prepacked GEMMs on CPU: every projection's weight reordered once, at load, for oneDNN.

`F.linear` on CPU hands the weight to MKL or oneDNN in its plain layout on every call
(and the earlier OneDNNLinear converted the activations to and from oneDNN tensors around
every call). Here each projection's weight is reordered once into the blocked layout
oneDNN's matmul wants (`mkldnn._reorder_linear_weight`), and every call runs
`mkldnn._linear_pointwise` on the plain activations: no per-call conversion is left.
At this model's shapes that is as fast as or faster than `F.linear` at 1, 32 and 256
rows, in fp32 and bf16, and well ahead on the 49152-wide lm_head (figures:
docs/benchmarks-history.md).

The packed weight is an opaque oneDNN tensor, which torch.compile cannot take as a graph
input. So the GEMM is the custom op `pdserve::packed_linear(x, weight, bias)`: the graph
sees the plain weight (one graph serves every layer, the weights being inputs), and the
op looks the packed copy up by the plain weight's storage. A weight that was never packed
(or whose packing died with its model) falls back to `F.linear`, so the op is always
correct. fp32 results differ from `F.linear` only by summation order (~1e-5 relative).

The MLP's gate_up projection (`PackedGateUp`) is packed as its two halves, so prefill
rows run SiLU(gate) * up inside the GEMMs (`silu_mul`): the gate GEMM applies SiLU to its
fp32 accumulators as a oneDNN post-op ("swish"), the up GEMM multiplies its accumulators
by that output (binary "mul" post-op). No [T, 2 I] intermediate is written and read back,
and no separate SiLU * mul pass runs (docs/benchmarks-history.md, "Third round").

With `model.prompt_gemm: panel` nothing is packed for oneDNN: each projection's entry is
its `PanelForm`, the batched decode forward's panel copy (kernels/gemm_packed.py), which
`linear` and `silu_mul` run at any row count (engine/models/fused_decode.py,
`FusedDecode.serve_prompt_steps`).
"""

from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.kernels import ops


class PanelForm:
    """A projection's panel copy (kernels/gemm_packed.py, the batched decode forward's) in
    place of oneDNN's (`model.prompt_gemm: panel`): `linear` and `silu_mul` run it at any
    row count. A row's result does not depend on the rows beside it (one fp32 chain over k
    per output), so no lone row is doubled (`_rows`). A gate_up copy gives SiLU(gate) * up
    of the fp32 accumulators only, as oneDNN's post-ops do."""

    def __init__(self, packed) -> None:
        self.packed = packed

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        if rows.stride(-1) != 1:
            rows = rows.contiguous()
        return self.packed.gemm(rows, bias=bias).reshape(*x.shape[:-1], self.packed.n)


# plain weight's data_ptr -> (weak ref to the plain weight, packed oneDNN weight; for a
# gate_up weight, the (gate, up) halves packed apart; or the weight's PanelForm)
_PACKED: dict[
    int, tuple[weakref.ref, torch.Tensor | tuple[torch.Tensor, torch.Tensor] | PanelForm]
] = {}


def onednn_available(device: torch.device, dtype: torch.dtype) -> bool:
    """Prepacking applies on CPU in fp32, and in bf16 where the CPU has native bf16."""
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.float32:
        return True
    return dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def row_invariant(dtype: torch.dtype) -> bool:
    """Whether a row's result from the packed GEMMs is the same bits whatever rows run beside
    it (`_rows`; the engine's "same request twice, same logprobs"). Not for bf16 on a CPU
    with AMX (Sapphire Rapids on): oneDNN picks its AMX kernels by the row count and shape,
    and they sum in other orders, ~1 bf16 ulp apart (e.g. K = 2048, or 4096 x 14336 at any
    row count below a few hundred; tests/test_cpu_linear.py). fp32 never runs on AMX."""
    return not onednn_amx(dtype)


def onednn_amx(dtype: torch.dtype) -> bool:
    """Whether oneDNN's packed GEMMs run on AMX tiles for `dtype`: bf16 on a CPU with AMX.
    There they outrun the batched decode forward's bf16 panel GEMM (kernels/gemm_packed.py,
    built on avx512_bf16 dot products) from 8 rows on, 5-10x at 64-512 rows
    (benchmarks/weight_forms.py), so the runner keeps decode steps of more than 8 rows on
    them (engine/model_runner.py)."""
    if dtype != torch.bfloat16 or not onednn_available(torch.device("cpu"), dtype):
        return False
    return cpu_amx()


def cpu_amx() -> bool:
    """Whether this CPU has AMX tiles (as torch's CPU capability check reports them)."""
    amx = getattr(torch.cpu, "_is_amx_tile_supported", None)
    return amx is not None and bool(amx())


def silu_fused(weight: torch.Tensor) -> bool:
    """True where the MLP's per-op path computes SiLU(gate) * up from the gate_up GEMM's fp32
    accumulators (`PackedGateUp.silu_mul`: `weight` packed as halves); False where it
    rounds the GEMM's output to the weight's dtype first (no oneDNN packing: a CPU without
    native bf16, or oneDNN switched off)."""
    return isinstance(_packed(weight), tuple)


def _packed(
    weight: torch.Tensor,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor] | PanelForm | None:
    entry = _PACKED.get(weight.data_ptr())
    if entry is None or entry[0]() is None:
        return None
    return entry[1]


def _rows(x: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """x contiguous for the packed GEMMs, a lone row [1, K] doubled (and whether it was).
    oneDNN computes one row with its M = 1 kernel, in another summation order than the
    same row among others (SmolLM2's down projection, K = 1536, differed): a prompt's last
    token computed alone (the rest from the prefix cache) would not get the bits it gets
    within the whole prompt, and the same request twice would give different logprobs. From
    two rows on, a row's result does not depend on the row count (tests/test_cpu_linear.py)."""
    if x.dim() == 2 and x.shape[0] == 1:
        return x.expand(2, -1).contiguous(), True
    return x.contiguous(), False


def linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, gemv: bool = True
) -> torch.Tensor:
    """y = x W^T (+ b): a few rows (decode) through the native GEMV, which streams the plain
    weight (kernels.ops.gemv_linear); more, or any number in a step with prompt tokens
    (gemv False, engine/step_plan.py), through the packed weight when there is one."""
    if gemv and x.numel() <= ops.GEMV_MAX_ROWS * x.shape[-1]:
        y = ops.gemv_linear(x, weight, bias)
        if y is not None:
            return y
    packed = _packed(weight)
    if packed is None:
        if released(weight):
            raise RuntimeError("a released plain weight has no packed copy")
        return F.linear(x, weight, bias)
    if isinstance(packed, PanelForm):
        if packed.packed.silu:
            raise RuntimeError("a gate_up weight's panel copy gives SiLU(gate) * up: silu_mul")
        return packed(x, bias)
    x, lone = _rows(x)
    if isinstance(packed, tuple):  # gate_up packed as halves (bias-free): both, side by side
        y = torch.cat([torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], "")
                       for p in packed], dim=-1)  # fmt: skip
    else:
        y = torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    return y[:1] if lone else y


@torch.library.custom_op("pdserve::packed_linear", mutates_args=())
def packed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return linear(x, weight, bias)


@packed_linear.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


class PackedLinear(nn.Linear):
    """nn.Linear whose forward runs through the packed weight (after `pack()`)."""

    def pack(self) -> bool:
        return pack_weight(self.weight)

    def forward(self, x: torch.Tensor, gemv: bool = True) -> torch.Tensor:
        if torch.compiler.is_compiling():  # compiled decode steps: the GEMV for few rows
            return torch.ops.pdserve.packed_linear(x, self.weight, self.bias)
        return linear(x, self.weight, self.bias, gemv)


class PackedGateUp(PackedLinear):
    """The MLP's gate_up projection, [2 I, K] (gate rows, then up rows), bias-free; packed
    as its two halves so that `silu_mul` runs the activation inside the GEMMs."""

    def pack(self) -> bool:
        return pack_weight(self.weight, halves=True)

    def silu_mul(self, x: torch.Tensor) -> torch.Tensor | None:
        """silu(x gate^T) * (x up^T), [T, I], through the packed halves with oneDNN
        post-ops; None when not packed (or traced). fp32: equal to the reference's
        silu_and_mul(linear(x, W)) but for summation order and oneDNN's exp. bf16: rounded
        twice (SiLU(gate), then the product) where the reference's ops round four times
        (gate, up, SiLU, product): ~1 bf16 ulp apart where they differ, and the closer to
        fp32 (tests/test_cpu_linear.py)."""
        if torch.compiler.is_compiling():
            return None
        packed = _packed(self.weight)
        if isinstance(packed, PanelForm):
            return packed(x, None)
        if x.dim() != 2 or not isinstance(packed, tuple):
            return None
        gate_w, up_w = packed
        x, lone = _rows(x)
        gate = torch.ops.mkldnn._linear_pointwise(x, gate_w, None, "swish", [], "")
        y = torch.ops.mkldnn._linear_pointwise.binary(x, gate, up_w, None, "mul")
        return y[:1] if lone else y


def pack_weight(weight: torch.Tensor, halves: bool = False) -> bool:
    """Reorder `weight` [out, in] for oneDNN once; calls through `linear` then use it.
    halves: pack rows [:out/2] and [out/2:] apart (a gate_up weight). Returns False, and
    packs nothing, where oneDNN cannot take the weight (`onednn_available`: off the CPU, or
    bf16 on a CPU without native bf16, where torch's reorder raises): `linear` then runs
    `F.linear` on it, as on any weight never packed."""
    if not onednn_available(weight.device, weight.dtype):
        return False
    w = weight.detach()
    reorder = torch.ops.mkldnn._reorder_linear_weight
    if halves:
        n = w.shape[0] // 2
        packed = (reorder(w[:n].contiguous(), None), reorder(w[n:].contiguous(), None))
    else:
        packed = reorder(w, None)
    _register(weight, packed)
    return True


def serve_with_panel(weight: torch.Tensor, packed) -> None:
    """Run `linear` (gate_up: `silu_mul`) on `weight` through its panel copy `packed` (a
    kernels.gemm_packed.Packed of the same values), in place of any oneDNN copy."""
    _register(weight, PanelForm(packed))


def _register(weight: torch.Tensor, form) -> None:
    """`form` becomes what `linear` runs for `weight`; entries of dead weights go."""
    for key in [k for k, (ref, _) in _PACKED.items() if ref() is None]:
        del _PACKED[key]
    _PACKED[weight.data_ptr()] = (weakref.ref(weight), form)


def release_plain(weight: nn.Parameter) -> int:
    """Free a packed weight's plain values: its data becomes one zero broadcast to its shape
    (one element of storage, so the native GEMVs, which need contiguous rows, decline it)
    and calls through `linear` run the packed copy at any row count. Returns the bytes
    freed (0: not packed, nothing done). Whoever else points into the values must have
    let go of them (engine/models/fused_decode.py, `FusedDecode.release_plain`)."""
    packed = _packed(weight)
    if packed is None or released(weight):
        return 0
    nbytes = weight.numel() * weight.element_size()
    del _PACKED[weight.data_ptr()]
    weight.data = weight.new_zeros(()).expand(weight.shape)
    _PACKED[weight.data_ptr()] = (weakref.ref(weight), packed)
    return nbytes


def drop_packed(weight: torch.Tensor) -> int:
    """Forget `weight`'s packed copy (`linear` then runs `F.linear` on the plain weight);
    returns the plain weight's bytes (about what the copy held), 0 if there was none."""
    entry = _PACKED.pop(weight.data_ptr(), None)
    if entry is None or entry[0]() is None:
        return 0
    return weight.numel() * weight.element_size()


def released(weight: torch.Tensor) -> bool:
    """Whether `weight`'s plain values were freed (`release_plain`)."""
    return weight.dim() == 2 and weight.stride() == (0, 0) and weight.numel() > 1


def is_packed(weight: torch.Tensor) -> bool:
    """Whether `weight` has a packed copy that `linear` runs (oneDNN's or a PanelForm)."""
    return _packed(weight) is not None


def pack_linears(model: nn.Module) -> int:
    """Pack every PackedLinear of `model`; returns how many were packed."""
    return sum(m.pack() for m in model.modules() if isinstance(m, PackedLinear))
