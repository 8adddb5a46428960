"""The packed-panel GEMM, fp32 and bf16 (kernels/csrc/gemm_packed.cpp, kernels/gemm_packed.py;
bf16 on AMX tiles where the CPU has them, or on tiles in software elsewhere):
equal to a float64 reference but for fp32 summation and (bf16) the rounding of its result, for every row count and ragged shapes, with its
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

from pdserve.kernels import cpu_ops, gemm_packed, native
from tests.conftest import skip_in_isa_view

ROOT = Path(__file__).resolve().parent.parent
pytestmark = [
    pytest.mark.isa,  # scripts/avx2_view.sh runs it as an AVX2-only CPU
    pytest.mark.skipif(not gemm_packed.available(), reason="no C++ compiler"),
]


def _gemm(x, packed, bias=None, res=None, threads=2):
    """The packed GEMM with its bias and residual epilogues."""
    return packed.gemm(x, bias, res, threads=threads)


def _close(got, ref, k, dtype=torch.float32, inner=None):
    """fp32: equal but for fp32 summation error. bf16: that, plus the bf16 roundings (half
    an ulp, 2^-8 relative, each) of the result and of `inner`, the GEMM's own result where
    a residual is added to it after rounding."""
    err = (got.double() - ref).abs()
    tol = 1e-6 * k**0.5 * max(1.0, ref.abs().max().item())
    if dtype == torch.bfloat16:
        tol = tol + 2.0**-8 * (ref.abs() + (ref if inner is None else inner).abs())
    assert (err <= tol).all(), (err - tol).max().item()


def check_all(dtype=torch.float32) -> None:
    g = torch.Generator().manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, generator=g).to(dtype)

    # K a multiple of 32 (64, 96): bf16 on AMX tiles where the CPU has them (a panel's
    # columns past n: 40); the others on vdpbf16ps / widened pairs
    for n, k in [(96, 64), (40, 96), (100, 37), (33, 5), (17, 130), (1, 1)]:
        w = rand(n, k)
        b, packed = rand(n), gemm_packed.Packed(w)
        for m in [1, 2, 5, 8, 9, 13, 32, 33, 70]:  # 70: bf16 12-row chunks on vdpbf16ps
            x, res = rand(m, k), rand(m, n)
            ref = x.double() @ w.double().T
            got = packed.linear(x)  # the logits path: non-temporal stores where aligned
            assert got.dtype == torch.float32
            _close(got, ref, k, dtype)
            # the same bits as the cached-store path (n 96: whole aligned panels streamed;
            # the others' partial panels and unaligned rows stored the usual way)
            assert torch.equal(packed.gemm(x, out_dtype=torch.float32), got)
            if dtype == torch.bfloat16:  # fp32 out holding bf16 values
                assert torch.equal(got.to(dtype).float(), got)
                assert torch.equal(packed.gemm(x).float(), got)
            y = _gemm(x, packed, b, res)
            assert y.dtype == dtype
            _close(y, ref + b.double() + res.double(), k, dtype, inner=ref + b.double())
            for rows, threads in [(1, 1), (m // 2 + 1, 2), (m, 1)]:  # any row count, threads
                assert torch.equal(_gemm(x[:rows], packed, b, res[:rows], threads), y[:rows])
        wg = rand(2 * n, k)
        gate_up = gemm_packed.Packed(wg, silu=True)
        for m in [1, 9, 33, 70]:  # 70: a bf16 call of 12-row chunks on vdpbf16ps
            x = rand(m, k)
            h = x.double() @ wg.double().T
            ref = torch.nn.functional.silu(h[:, :n]) * h[:, n:]
            _close(gate_up.linear(x), ref, k, dtype)
            y = gate_up.gemm(x)
            assert y.dtype == dtype and torch.equal(gate_up.gemm(x[:1], threads=1), y[:1])
            # gate and up rounded first (the unfused per-op MLP: the gate_up GEMM's output
            # in the weight's dtype, then silu_and_mul); the same in fp32
            rounded = gate_up.gemm(x, round_gate_up=True)
            want = cpu_ops.silu_and_mul(h.to(dtype))  # the per-op ops on the rounded GEMM
            _close(rounded, want.double(), k, dtype)
            if dtype == torch.float32:
                assert torch.equal(rounded, y)
            elif m > 1:  # closer to the per-op ops' result than the fp32-accumulator mode
                assert (rounded.float() - want.float()).abs().sum() < (
                    y.float() - want.float()
                ).abs().sum()
    # x larger than the kernel's row-block threshold (2 MiB: 1100 rows of K 1031, fp32 and
    # bf16), so the call runs in blocks of rows: each row's bits as in a call of a few rows
    n, k, m = 40, 1031, 1100
    w, wg = rand(n, k), rand(2 * n, k)
    b, packed, gate_up = rand(n), gemm_packed.Packed(w), gemm_packed.Packed(wg, silu=True)
    x, res = rand(m, k), rand(m, n)
    y, g = _gemm(x, packed, b, res), gate_up.gemm(x)
    ref = x.double() @ w.double().T
    _close(y, ref + b.double() + res.double(), k, dtype, inner=ref + b.double())
    for r0, r1 in [(0, 9), (500, 570), (1030, 1100)]:
        assert torch.equal(_gemm(x[r0:r1], packed, b, res[r0:r1], threads=1), y[r0:r1])
        assert torch.equal(gate_up.gemm(x[r0:r1], threads=1), g[r0:r1])
    print("ok")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_gemm(dtype):
    check_all(dtype)


def test_bad_inputs_are_refused():
    with pytest.raises(ValueError):
        gemm_packed.Packed(torch.randn(4, 4, dtype=torch.float16))
    with pytest.raises(ValueError):
        gemm_packed.Packed(torch.randn(5, 4), silu=True)
    with pytest.raises(ValueError):
        gemm_packed.Packed(torch.randn(4, 8).t())  # rows not contiguous
    p = gemm_packed.Packed(torch.randn(4, 8))
    with pytest.raises(ValueError):
        p.linear(torch.randn(3, 7))
    with pytest.raises(ValueError):
        p.logits(torch.randn(3, 8, dtype=torch.bfloat16))  # rows of another dtype
    with pytest.raises(ValueError):
        gemm_packed.Packed(torch.randn(8, 8), silu=True).logits(torch.randn(3, 8))
    x = torch.randn(3, 8)
    for bad in [dict(bias=torch.zeros(5)), dict(res=torch.zeros(3, 4, dtype=torch.bfloat16)),
                dict(out_dtype=torch.float16)]:  # fmt: skip
        with pytest.raises(ValueError):
            p.gemm(x, **bad)
    with pytest.raises(ValueError):
        gemm_packed.Packed(torch.randn(4, 8, dtype=torch.bfloat16)).gemm(x)  # fp32 rows
    lib = native.load_library("gemm_packed")
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
    # the logits entry points: a negative row count, zero threads: refused
    for fn in (lib.pdserve_gemm_packed_logits, lib.pdserve_gemm_packed_bf16_logits):
        assert fn(x.data_ptr(), 8, *args, y.data_ptr(), 4, -1, 1) == 1
        assert fn(x.data_ptr(), 8, *args, y.data_ptr(), 4, 2, 0) == 1
    for mode in (3, -1):  # silu modes are 0, 1 and 2
        assert (
            lib.pdserve_gemm_packed(
                x.data_ptr(), 8, *args, mode, None, None, 0, y.data_ptr(), 4, 2, 1
            )
            == 1
        )


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    line = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
    return set(line.split(":", 1)[-1].split())


def test_bf16_dot_products_where_the_cpu_has_them():
    if os.environ.get("PDSERVE_KERNEL_MARCH"):
        pytest.skip("the library is built for another CPU than this one")
    assert gemm_packed.bf16_native() == ("avx512_bf16" in _cpu_flags())


@pytest.mark.parametrize("march,bits", [("haswell", 256), ("x86-64", 32), ("skylake-avx512", 512)])
def test_other_builds(tmp_path, march, bits):
    """The CI box kind has AVX2 and no AVX-512; a CPU without AVX2 gets the plain C++; an
    AVX-512 CPU without avx512_bf16 widens bf16 pairs to fp32 (the skylake-avx512 build)."""
    skip_in_isa_view()
    if not os.uname().machine.startswith("x86"):
        pytest.skip("x86 -march values")
    if bits == 512 and "avx512f" not in _cpu_flags():
        pytest.skip("this CPU cannot run an AVX-512 build")
    env = dict(os.environ, PDSERVE_KERNEL_MARCH=march, PYTHONPATH=str(ROOT))
    env["PDSERVE_KERNEL_CACHE"] = str(tmp_path)
    _check_all_in_child(env, f"assert lib.pdserve_gemm_packed_isa() == {bits}\n")


def test_amx_path_on_tiles_in_software(tmp_path):
    """The bf16 AMX path (gemm_panels_amx: tile configuration for 1-32 rows, 32-row chunks,
    the k chunks of a panel, its epilogues) on any AVX-512 bf16 CPU: built on AMX tiles in
    software (kernels/csrc/amx_emulate.h, `$PDSERVE_KERNEL_AMX_EMULATE`), it takes every K
    that fills whole tiles, and its results pass the checks every build passes. On a CPU
    with AMX, test_bf16_panels_on_amx_tiles_where_the_cpu_has_them and the bf16 checks run
    the real tiles."""
    skip_in_isa_view()
    if "avx512_bf16" not in _cpu_flags():
        pytest.skip("the AMX path's epilogue needs avx512_bf16")
    env = dict(os.environ, PYTHONPATH=str(ROOT), PDSERVE_KERNEL_CACHE=str(tmp_path))
    env[native.AMX_EMULATE_ENV] = "1"
    env.pop("PDSERVE_KERNEL_MARCH", None)
    _check_all_in_child(
        env,
        "assert [lib.pdserve_gemm_packed_bf16_amx(k) for k in (32, 64, 576, 48, 0)] == "
        "[1, 1, 1, 0, 0]\n",
    )


def _check_all_in_child(env: dict, check_lib: str) -> None:
    """`check_all` in fp32 and bf16 in a child process built with `env`, after `check_lib`
    (code that asserts on `lib`, the child's packed GEMM library)."""
    code = (
        "from pdserve.kernels import native\n"
        "lib = native.load_library('gemm_packed')\n"
        f"{check_lib}"
        "import torch\nfrom tests.test_gemm_packed import check_all\n"
        "check_all()\ncheck_all(torch.bfloat16)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0 and out.stdout.split() == ["ok", "ok"], out.stderr[-3000:]
