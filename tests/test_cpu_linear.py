"""Prepacked oneDNN GEMMs compute the same product as F.linear, eager and compiled.

bf16 is packed only where the CPU has native bf16 (`onednn_available`); elsewhere (an
AVX2-only box) `pack()` packs nothing and returns False, and the same calls run torch's
own bf16 GEMM: every check below runs on both kinds, against what holds there."""

import gc
import os

import pytest
import torch

from pdserve.engine.models import cpu_linear
from pdserve.engine.models.cpu_linear import (
    PackedGateUp,
    PackedLinear,
    linear,
    onednn_available,
    pack_weight,
    row_invariant,
)
from pdserve.kernels import reference

pytestmark = [
    pytest.mark.isa,  # scripts/avx2_view.sh runs it as an AVX2-only CPU
    pytest.mark.skipif(
        not onednn_available(torch.device("cpu"), torch.float32), reason="no oneDNN in this torch"
    ),
]


@pytest.mark.parametrize("rows", [1, 7, 64])
def test_packed_linear_equals_f_linear(rows):
    torch.manual_seed(rows)
    m = PackedLinear(576, 3072)
    x = torch.randn(rows, 576)
    with torch.no_grad():
        ref = torch.nn.functional.linear(x, m.weight, m.bias)
        m.pack()
        assert cpu_linear._packed(m.weight) is not None
        out = m(x)
    assert out.shape == ref.shape and out.dtype == torch.float32
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)


def test_packed_linear_bf16():
    m = PackedLinear(576, 960, bias=False).to(torch.bfloat16)
    x = torch.randn(32, 576, dtype=torch.bfloat16)
    with torch.no_grad():
        ref = torch.nn.functional.linear(x.float(), m.weight.float())
        packed = m.pack()
        assert packed == onednn_available(torch.device("cpu"), torch.bfloat16)
        assert (cpu_linear._packed(m.weight) is not None) == packed
        out = m(x)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [9, 300])
def test_packed_gate_up_silu_mul_equals_reference(rows, dtype):
    """The gate_up weight packed as halves: silu_mul (SiLU and * as oneDNN post-ops) equals
    the reference's silu_and_mul of the projection, and the plain projection still equals
    F.linear (both halves side by side). Where oneDNN cannot pack bf16, nothing is packed:
    silu_mul stays None and the caller's plain path (the reference's ops) runs."""
    packable = onednn_available(torch.device("cpu"), dtype)
    torch.manual_seed(rows)
    m = PackedGateUp(96, 2 * 160, bias=False)
    with torch.no_grad():
        m.weight.mul_(0.2)
    m = m.to(dtype)
    x = torch.randn(rows, 96).to(dtype)
    with torch.no_grad():
        assert m.silu_mul(x) is None  # not packed yet: the caller takes the plain path
        proj = torch.nn.functional.linear(x.float(), m.weight.float())
        ref = reference.silu_and_mul(proj)  # fp32 throughout
        rounded = reference.silu_and_mul(torch.nn.functional.linear(x, m.weight)).float()
        assert m.pack() == packable
        out = m.silu_mul(x)
        plain = m(x)
    assert cpu_linear.silu_fused(m.weight) == packable
    if not packable:
        assert out is None  # the caller computes silu_and_mul(m(x)): the reference's ops
        torch.testing.assert_close(plain.float(), proj, rtol=1e-2, atol=1e-2)
        return
    assert out.shape == (rows, 160) and out.dtype == dtype and plain.dtype == dtype
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(out.float(), ref, **tol)
    torch.testing.assert_close(plain.float(), proj, **tol)
    if dtype == torch.bfloat16:  # fewer roundings than the reference's bf16 ops: closer to fp32
        assert (out.float() - ref).abs().mean() < (rounded - ref).abs().mean()


def test_unpacked_and_dead_weights_fall_back_to_f_linear():
    w = torch.randn(64, 32)
    x = torch.randn(3, 32)
    torch.testing.assert_close(linear(x, w, None), x @ w.T)  # never packed
    pack_weight(w)
    ptr = w.data_ptr()
    del w
    gc.collect()
    w2 = torch.randn(64, 32)  # may reuse the freed storage: must not see the old pack
    out = linear(x, w2, None)
    torch.testing.assert_close(out, x @ w2.T)
    pack_weight(torch.randn(8, 8))  # packing prunes entries whose weight died
    assert ptr not in cpu_linear._PACKED or cpu_linear._PACKED[ptr][0]() is not None


def test_packed_linear_compiled_equals_eager():
    m = PackedLinear(64, 96)
    m.pack()
    f = torch.compile(lambda layer, x: torch.relu(layer(x)) * 2, dynamic=True, fullgraph=True)
    with torch.inference_mode():
        for rows in (1, 5, 9):
            x = torch.randn(rows, 64)
            torch.testing.assert_close(f(m, x), torch.relu(m(x)) * 2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_row_gets_the_same_bits_alone_or_with_others(dtype):
    """A prompt's last token alone (the rest from the prefix cache) runs the packed GEMMs
    with one row: it must get the bits it gets among the whole prompt's rows, or the same
    request twice gives different logprobs. (oneDNN computes a lone row with its M = 1
    kernel, another summation order: SmolLM2's down projection, K = 1536, differed.)
    bf16 without native bf16: nothing packed, torch's own bf16 GEMM, the same promise."""
    # a step with prompt tokens: no decode GEMV (gemv=False, the runner's step plan)
    torch.manual_seed(0)
    shapes = [(1536, 576), (576, 1536)]  # SmolLM2's
    if not os.environ.get("PDSERVE_ISA_VIEW"):  # K = 2048: where AMX kernels differed; the
        shapes.append((2048, 2048))  # emulated AVX2 CPU has no AMX (most of the view's 8 minutes)
    for k, n in shapes:
        x = torch.randn(40, k).to(dtype)
        lin = PackedLinear(k, n).to(dtype)
        gate_up = PackedGateUp(k, 2 * n, bias=False).to(dtype)
        with torch.no_grad():
            packed = lin.pack()
            assert gate_up.pack() == packed == onednn_available(torch.device("cpu"), dtype)
            same = _same if row_invariant(dtype) else _within_a_bf16_ulp
            # the whole prompt's rows once (the AVX2 view emulates every GEMM: minutes)
            whole = lin(x, False), gate_up(x, False), gate_up.silu_mul(x) if packed else None
            for rows in (1, 2, 3):
                part = x[-rows:]
                same(lin(part, False), whole[0][-rows:], (k, n, rows))
                same(gate_up(part, False), whole[1][-rows:], (k, n, rows))
                if not packed:
                    assert gate_up.silu_mul(part) is None
                    continue
                same(gate_up.silu_mul(part), whole[2][-rows:], (k, n, rows))


def _same(a: torch.Tensor, b: torch.Tensor, what) -> None:
    assert torch.equal(a, b), what


def _within_a_bf16_ulp(a: torch.Tensor, b: torch.Tensor, what) -> None:
    """Where rows are not bit-invariant (bf16 on AMX): apart by at most one bf16 ulp."""
    ulp = b.float().abs().clamp_min(2**-20) * 2**-7  # bf16 keeps 8 significant bits
    assert bool(((a.float() - b.float()).abs() <= ulp).all()), what
