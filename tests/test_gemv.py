"""The native small-M GEMM (kernels/csrc/gemv.cpp) equals F.linear: odd shapes (K not a
multiple of the vector width, N not a multiple of the row block), 1-9 activation rows
(several register-block chunks), bias or none, strided rows, one thread and two; the
AVX-512, AVX2 and plain C++ builds alike (the latter two built with another -march in a
subprocess); and what it does not take is refused (None), so the caller's GEMM runs.

fp32: summation order only (within the error bound of any fp32 summation order). bf16:
products exact in fp32, fp32 accumulation, one rounding at the end, so within one bf16
rounding of that.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from pdserve.kernels import gemv, native
from tests.conftest import skip_in_isa_view

pytestmark = pytest.mark.isa  # scripts/avx2_view.sh runs it as an AVX2-only CPU

ROOT = Path(__file__).resolve().parent.parent
SHAPES = [(1, 1), (5, 7), (37, 131), (33, 576), (960, 576), (19, 1536), (70, 1000)]  # (N, K)


@pytest.fixture(scope="module", autouse=True)
def built():
    if native.find_compiler() is None:
        pytest.skip("no C++ compiler on this machine: linear returns None (tested below)")
    assert gemv.available()


@pytest.fixture(params=[1, 2], ids=["1thread", "2threads"])
def threads(request):
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


def rand(*shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g).to(dtype)


def check(y, x, w, b):
    """y is F.linear(x, w, b) up to fp32 summation in any order (error at most (K + 2) u
    times the sum of |x w| terms, u = 2^-24) and, in bf16, one rounding (2^-8 relative)."""
    xd, wd = x.double().reshape(-1, x.shape[-1]), w.double()
    ref = F.linear(xd, wd, None if b is None else b.double())
    assert y is not None and y.dtype == x.dtype and y.shape == (*x.shape[:-1], w.shape[0])
    bound = (xd.abs() @ wd.abs().T + (0 if b is None else b.double().abs())) * (x.shape[-1] + 2)
    bound = bound * 2**-24 + (2**-8 * ref.abs() if x.dtype == torch.bfloat16 else 0) + 1e-30
    err = (y.double().reshape(ref.shape) - ref).abs()
    assert bool((err <= bound).all()), f"max err {err.max()}, over bound {(err / bound).max()}x"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,k", SHAPES)
def test_matches_f_linear(dtype, n, k, threads, monkeypatch):
    monkeypatch.setattr(gemv, "MAX_ROWS", 9)  # 5-9 rows: a second register-block chunk
    w = rand(n, k, dtype=dtype, seed=n)
    b = rand(n, dtype=dtype, seed=k)
    for m in (1, 2, 3, 4, 5, 9):
        x = rand(m, k, dtype=dtype, seed=m)
        check(gemv.linear(x, w, None), x, w, None)
        check(gemv.linear(x, w, b), x, w, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_strided_rows_and_leading_dims(dtype, threads):
    wide = rand(70, 1200, dtype=dtype, seed=1)
    w = wide[:, 3:1003]  # rows 1200 elements apart, K = 1000
    xs = rand(3, 1100, dtype=dtype, seed=2)[:, 50:1050]  # activation rows strided too
    check(gemv.linear(xs, w, None), xs, w, None)
    x3 = rand(1, 2, 1000, dtype=dtype, seed=3)  # [B, T, K] -> [B, T, N]
    y = gemv.linear(x3, w, None)
    assert y.shape == (1, 2, 70)
    check(y.reshape(2, 70), x3.reshape(2, 1000), w, None)


def test_refuses_what_it_does_not_take():
    w = torch.randn(8, 16)
    assert gemv.linear(torch.randn(gemv.MAX_ROWS + 1, 16), w, None) is None
    assert gemv.linear(torch.randn(0, 16), w, None) is None
    assert gemv.linear(torch.randn(1, 16, dtype=torch.float16), w.half(), None) is None
    assert gemv.linear(torch.randn(1, 16).bfloat16(), w, None) is None  # mixed dtypes
    assert gemv.linear(torch.randn(1, 16), torch.randn(16, 8).T, None) is None  # K strided
    assert gemv.linear(torch.randn(16, 2)[:, :1].T, w, None) is None  # x's K strided
    assert gemv.linear(torch.randn(1, 16), w, torch.randn(8).double()) is None


def test_packed_linear_takes_decode_rows_through_the_gemv(monkeypatch):
    """engine/models/cpu_linear.linear: up to MAX_ROWS rows go to the GEMV, which gives the
    same as F.linear; with MAX_ROWS 0 the same rows take the oneDNN/F.linear path."""
    from pdserve.engine.models.cpu_linear import linear
    from pdserve.kernels import ops

    w = rand(960, 576, dtype=torch.float32, seed=5)
    x = rand(1, 576, dtype=torch.float32, seed=6)
    calls = []
    real = gemv.linear
    monkeypatch.setattr(gemv, "linear", lambda *a: calls.append(1) or real(*a))
    check(linear(x, w, None), x, w, None)
    assert calls == [1]
    monkeypatch.setattr(ops, "GEMV_MAX_ROWS", 0)  # the engine's threshold (kernels.ops)
    check(linear(x, w, None), x, w, None)
    assert calls == [1]


_OTHER_BUILD = """
import torch
import torch.nn.functional as F
from pdserve.kernels import gemv
from tests.test_gemv import check
assert gemv.isa() == {isa}, gemv.isa()
torch.set_num_threads(2)
torch.manual_seed(0)
for dtype in (torch.float32, torch.bfloat16):
    for n, k in {shapes}:
        w, b = torch.randn(n, k).to(dtype), torch.randn(n).to(dtype)
        for m in (1, 2, 3, 4, 5):
            x = torch.randn(m, k).to(dtype)
            check(gemv.linear(x, w, b), x, w, b)
            if n % 2 == 0:  # gate | up halves: fused SiLU * up, within a few bf16 ulps
                ref = F.silu(x.double() @ w[: n // 2].double().T) * (x.double() @ w[n // 2 :].double().T)
                got = gemv.gate_up_silu(x, w).double()
                assert (got - ref).abs().max() <= 2**-6 * ref.abs().max() + 1e-3, (got - ref).abs().max()
print("ok")
"""


@pytest.mark.parametrize("march,isa", [("haswell", 256), ("x86-64", 32)], ids=["avx2", "scalar"])
def test_other_vector_paths(march, isa, tmp_path):
    """The CI box kind has AVX2 and no AVX-512: its build, and the plain C++ one."""
    skip_in_isa_view()
    if not os.uname().machine.startswith("x86"):
        pytest.skip("x86 -march values")
    env = dict(os.environ, PDSERVE_KERNEL_MARCH=march, PYTHONPATH=str(ROOT))
    env["PDSERVE_KERNEL_CACHE"] = str(tmp_path)
    code = _OTHER_BUILD.format(isa=isa, shapes=SHAPES)
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]


@pytest.mark.parametrize("vendor", ["AuthenticAMD", "GenuineIntel"])
def test_bf16_prefetch_hint_by_vendor(vendor, monkeypatch, tmp_path):
    """bf16 weight rows are prefetched non-temporally on AMD only (faster there, 4-6x slower
    on an Intel Xeon with AMX: kernels/csrc/gemv.cpp): the define is in the flags, and so in
    the library's cached name, and both builds give the same bits (a hint changes no result)."""
    monkeypatch.setattr(native, "_cpu_vendor", lambda: vendor)
    nta = "-DPDSERVE_BF16_PREFETCH_NTA=1"
    assert (nta in native.flags("gemv")) == (vendor == "AuthenticAMD")
    assert all(nta not in native.flags(lib) for lib in ("gemm_packed", "decode_forward"))
    monkeypatch.setenv("PDSERVE_KERNEL_CACHE", str(tmp_path))
    lib = native.load_library.__wrapped__("gemv")
    assert lib is not None
    torch.manual_seed(3)
    w, x = torch.randn(960, 576).bfloat16(), torch.randn(3, 576).bfloat16()
    y = torch.empty(3, 960, dtype=torch.bfloat16)
    lib.pdserve_gemv(x.data_ptr(), 576, w.data_ptr(), 576, None, y.data_ptr(), 960, 3, 960, 576,
                     1, 2, 0)  # fmt: skip
    assert torch.equal(y, gemv.linear(x, w, None))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("i,k", [(1, 3), (37, 131), (1536, 576)])
def test_gate_up_silu_equals_linear_then_silu_and_mul(dtype, i, k, threads):
    """One call for a gate_up projection and SiLU(gate) * up: the unfused reference's
    result (fp32: to summation order; bf16: rounded at the same three places, so within a
    bf16 ulp or two)."""
    from pdserve.kernels import reference

    w = rand(2 * i, k, dtype=dtype, seed=i) * 0.5
    for m in (1, 2, 5):
        x = rand(m, k, dtype=dtype, seed=m)
        y = gemv.gate_up_silu(x, w)
        ref = reference.silu_and_mul(F.linear(x.double(), w.double()))
        assert y is not None and y.dtype == dtype and y.shape == (m, i)
        scale = ref.abs().max().item()  # fp32 error of g and u carries into g * u near zero
        tol = dict(rtol=1e-4, atol=1e-6 * scale) if dtype == torch.float32 else dict(rtol=2**-6)
        torch.testing.assert_close(y.double(), ref, **{"atol": 1e-3 * scale, **tol})
    assert gemv.gate_up_silu(x, w[:-1]) is None  # odd row count: not gate | up
    assert gemv.gate_up_silu(rand(gemv.MAX_ROWS + 1, k, dtype=dtype, seed=0), w) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("silu", [False, True], ids=["qkv", "gate_up"])
def test_norm_linear_equals_norm_then_projection(dtype, silu, threads):
    """(Residual add +) RMSNorm and the projection after it in one call: the residual
    sum is the reference's exactly; the projection equals the reference norm's output
    through F.linear (or SiLU * up) to fp32 summation order (bf16: a few ulps)."""
    from pdserve.kernels import reference

    k, n = 131, 74
    w = rand(n, k, dtype=dtype, seed=7) * 0.2
    bias = None if silu else rand(n, dtype=dtype, seed=8)
    nw = rand(k, dtype=dtype, seed=9)
    for m in (1, 3, 6):
        x, res = rand(m, k, dtype=dtype, seed=m), rand(m, k, dtype=dtype, seed=m + 10)
        for r in (res, None):
            out = gemv.norm_linear(x, r, nw, 1e-5, w, bias, silu)
            assert out is not None
            y, res_out = out
            if r is None:
                h, want_res = reference.rms_norm(x, nw, 1e-5), x
            else:
                h, want_res = reference.fused_add_rms_norm(x, r, nw, 1e-5)
            assert torch.equal(res_out, want_res)
            lin = F.linear(h.double(), w.double(), None if bias is None else bias.double())
            want = reference.silu_and_mul(lin) if silu else lin
            assert y.shape == want.shape and y.dtype == dtype
            scale = want.abs().max().item()
            tol = 1e-4 if dtype == torch.float32 else 2**-6
            torch.testing.assert_close(y.double(), want, rtol=tol, atol=tol * scale)
    assert gemv.norm_linear(x, res, nw, 1e-5, w[:-1], None, True) is None  # odd rows
    big = rand(gemv.MAX_ROWS + 1, k, dtype=dtype, seed=0)
    assert gemv.norm_linear(big, None, nw, 1e-5, w, bias, silu) is None
