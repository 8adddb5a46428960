"""The packed-panel fp32 GEMM (kernels/csrc/gemm_packed.cpp, kernels/cpu_packed.py): equal to
a float64 reference but for fp32 rounding, for every row count and ragged shapes, with its
epilogues (bias, residual, SiLU * up); a row's bits independent of the other rows and of
the thread count; the AVX2 and plain C++ builds too."""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kernels import cpu_packed

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.skipif(not cpu_packed.available(), reason="no C++ compiler")


def _gemm(x, packed, bias=None, res=None, threads=2):
    """pdserve_gemm_packed with its bias and residual epilogues (Packed.linear has neither)."""
    m = x.shape[0]
    y = torch.empty((m, packed.n))
    lib = cpu_packed._lib()
    rc = lib.pdserve_gemm_packed(
        x.data_ptr(), x.stride(0), packed.ptr(), packed.n, packed.k, int(packed.silu),
        None if bias is None else bias.data_ptr(), None if res is None else res.data_ptr(),
        0 if res is None else res.stride(0), y.data_ptr(), packed.n, m, threads,
    )  # fmt: skip
    assert rc == 0
    return y


def _close(got, ref, k):
    err = (got.double() - ref).abs().max().item()
    assert err <= 1e-6 * k**0.5 * max(1.0, ref.abs().max().item()), err


def check_all() -> None:
    g = torch.Generator().manual_seed(0)
    for n, k in [(96, 64), (100, 37), (33, 5), (17, 130), (1, 1)]:
        w = torch.randn(n, k, generator=g)
        b, packed = torch.randn(n, generator=g), cpu_packed.Packed(w)
        for m in [1, 2, 5, 8, 9, 13, 32, 33, 70]:
            x, res = torch.randn(m, k, generator=g), torch.randn(m, n, generator=g)
            ref = x.double() @ w.double().T
            _close(packed.linear(x), ref, k)
            y = _gemm(x, packed, b, res)
            _close(y, ref + b.double() + res.double(), k)
            for rows, threads in [(1, 1), (m // 2 + 1, 2), (m, 1)]:  # any row count, threads
                assert torch.equal(_gemm(x[:rows], packed, b, res[:rows], threads), y[:rows])
        wg = torch.randn(2 * n, k, generator=g)
        gate_up = cpu_packed.Packed(wg, silu=True)
        for m in [1, 9, 33]:
            x = torch.randn(m, k, generator=g)
            h = x.double() @ wg.double().T
            ref = torch.nn.functional.silu(h[:, :n]) * h[:, n:]
            _close(gate_up.linear(x), ref, k)
    print("ok")


def test_packed_gemm():
    check_all()


def test_bad_inputs_are_refused():
    with pytest.raises(ValueError):
        cpu_packed.Packed(torch.randn(4, 4, dtype=torch.bfloat16))
    with pytest.raises(ValueError):
        cpu_packed.Packed(torch.randn(5, 4), silu=True)
    with pytest.raises(ValueError):
        cpu_packed.Packed(torch.randn(4, 8).t())  # rows not contiguous
    p = cpu_packed.Packed(torch.randn(4, 8))
    with pytest.raises(ValueError):
        p.linear(torch.randn(3, 7))
    lib = cpu_packed._lib()
    y = torch.empty(2, 4)
    bias = torch.zeros(4)
    args = (ctypes.c_void_p(p.ptr()), 4, 8)
    # silu with a bias, a negative row count, zero threads: refused, nothing run
    x = torch.randn(2, 8)
    assert (
        lib.pdserve_gemm_packed(
            x.data_ptr(), 8, *args, 1, bias.data_ptr(), None, 0, y.data_ptr(), 4, 2, 1
        )
        == 1
    )
    assert (
        lib.pdserve_gemm_packed(x.data_ptr(), 8, *args, 0, None, None, 0, y.data_ptr(), 4, -1, 1)
        == 1
    )
    assert (
        lib.pdserve_gemm_packed(x.data_ptr(), 8, *args, 0, None, None, 0, y.data_ptr(), 4, 2, 0)
        == 1
    )


@pytest.mark.parametrize("march,bits", [("haswell", 256), ("x86-64", 32)])
def test_other_builds(tmp_path, march, bits):
    """The CI box kind has AVX2 and no AVX-512; a CPU without AVX2 gets the plain C++."""
    if not os.uname().machine.startswith("x86"):
        pytest.skip("x86 -march values")
    env = dict(os.environ, PDSERVE_KERNEL_MARCH=march, PYTHONPATH=str(ROOT))
    env["PDSERVE_KERNEL_CACHE"] = str(tmp_path)
    code = (
        "from kernels import cpu_packed\n"
        f"assert cpu_packed._lib().pdserve_gemm_packed_isa() == {bits}\n"
        "from tests.test_cpu_packed import check_all\ncheck_all()\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]
