"""The oneDNN path for wide CPU projections computes the same product as F.linear."""

import pytest
import torch

from engine.models.cpu_linear import OneDNNLinear, onednn_available, use_onednn_for_wide_linears

pytestmark = pytest.mark.skipif(
    not onednn_available(torch.device("cpu"), torch.float32), reason="no oneDNN in this torch"
)


@pytest.mark.parametrize("rows", [1, 7, 64])
def test_onednn_linear_equals_f_linear(rows):
    torch.manual_seed(rows)
    w, b = torch.randn(3072, 576), torch.randn(3072)
    x = torch.randn(rows, 576)
    ref = torch.nn.functional.linear(x, w, b)
    out = OneDNNLinear(w, b)(x)
    assert out.shape == ref.shape and out.dtype == torch.float32
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)


def test_only_wide_linears_are_swapped():
    m = torch.nn.Sequential(torch.nn.Linear(64, 4096), torch.nn.Linear(4096, 64))
    x = torch.randn(3, 64)
    ref = m(x)
    assert use_onednn_for_wide_linears(m) == 1
    assert isinstance(m[0], OneDNNLinear) and isinstance(m[1], torch.nn.Linear)
    torch.testing.assert_close(m(x), ref, rtol=1e-4, atol=1e-4)
