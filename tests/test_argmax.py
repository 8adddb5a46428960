"""The native row-wise argmax (kernels/csrc/argmax.cpp) equals torch.argmax(dim=-1): first
index of the maximum, ties and NaN rows included; what it does not take goes to torch."""

from __future__ import annotations

import pytest
import torch

from pdserve.kernels import argmax, native

pytestmark = pytest.mark.isa  # scripts/avx2_view.sh runs it as an AVX2-only CPU


@pytest.fixture(scope="module", autouse=True)
def built():
    if native.find_compiler() is None:
        pytest.skip("no C++ compiler on this machine: argmax_rows falls back to torch")
    assert argmax.available()


@pytest.mark.parametrize("n", [1, 5, 16, 63, 64, 65, 130, 4096, 49152])
def test_equals_torch_on_random_rows(n):
    x = torch.randn(33, n, generator=torch.Generator().manual_seed(n))
    assert torch.equal(argmax.argmax_rows(x), x.argmax(dim=-1))


def test_ties_nan_and_infinite_rows_follow_torch():
    x = torch.randn(8, 1000, generator=torch.Generator().manual_seed(0))
    x[0, 700] = x[0, 20] = 50.0  # a tie: the first index
    x[1, 999] = x[1, 0] = 50.0  # at both ends
    x[2, 300] = x[2, 40] = float("nan")  # NaN counts as the maximum: the first NaN
    x[3, 999] = float("nan")  # in the scalar tail
    x[4] = float("-inf")  # all -inf: index 0
    x[5, 512] = float("inf")
    x[6] = 0.0  # all equal
    got = argmax.argmax_rows(x)
    assert torch.equal(got, x.argmax(dim=-1))
    assert got[:7].tolist() == [20, 0, 40, 999, 0, 512, 0]


def test_strided_rows_and_empty_batch():
    wide = torch.randn(4, 300, generator=torch.Generator().manual_seed(1))
    view = wide[:, 10:210]  # rows 300 apart, 200 long
    assert torch.equal(argmax.argmax_rows(view), view.argmax(dim=-1))
    empty = torch.empty(0, 49152)
    assert argmax.argmax_rows(empty).shape == (0,)


@pytest.mark.parametrize(
    "x",
    [
        torch.randn(4, 100).to(torch.bfloat16),  # not fp32
        torch.randn(100),  # not 2-D
        torch.randn(100, 4).t(),  # inner dimension not contiguous
    ],
)
def test_what_it_does_not_take_goes_to_torch(x):
    assert torch.equal(argmax.argmax_rows(x), x.argmax(dim=-1))
