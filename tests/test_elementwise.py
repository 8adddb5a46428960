"""The native CPU elementwise ops (kernels/csrc/elementwise.cpp) equal the pure-torch
reference, on the model's strided views as well, one thread and several; and what they do
not take falls back to the reference.

fp32: rotary embedding and the KV store are bit-exact (no FMA contraction, the same
rounding); RMSNorm and SiLU differ by summation order / exp polynomial only (rtol 1e-5).
bf16: rounded where the reference's torch ops round, so within one bf16 ulp (rtol 1e-2).
"""

from __future__ import annotations

import pytest
import torch

from pdserve.kernels import elementwise as ew
from pdserve.kernels import native
from pdserve.kernels import reference as ref

pytestmark = pytest.mark.isa  # scripts/avx2_view.sh runs it as an AVX2-only CPU

TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=1e-2, rtol=1e-2)}
DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(scope="module", autouse=True)
def built():
    if native.find_compiler() is None:
        pytest.skip("no C++ compiler on this machine: the ops fall back (tested below)")
    assert ew.available()


@pytest.fixture(params=[1, 2], ids=["1thread", "2threads"])
def threads(request, monkeypatch):
    """Both the serial path and the OpenMP split over rows (threshold lowered to 1)."""
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    monkeypatch.setattr(ew, "PARALLEL_MIN_ELEMENTS", 1 if request.param > 1 else 1 << 62)
    yield request.param
    torch.set_num_threads(before)


def rand(*shape, dtype, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * scale).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 32, 300])
def test_rms_norm_and_fused_add(dtype, rows, threads):
    x = rand(rows, 576, dtype=dtype, seed=1, scale=3.0)
    res = rand(rows, 576, dtype=dtype, seed=2)
    w = rand(576, dtype=dtype, seed=3)
    torch.testing.assert_close(ew.rms_norm(x, w, 1e-5), ref.rms_norm(x, w, 1e-5), **TOL[dtype])
    out, r = ew.fused_add_rms_norm(x, res, w, 1e-5)
    out_ref, r_ref = ref.fused_add_rms_norm(x, res, w, 1e-5)
    assert torch.equal(r, r_ref)  # one rounded add: exact
    torch.testing.assert_close(out, out_ref, **TOL[dtype])
    # a strided input (a column slice of a wider buffer) reads the right rows
    wide = rand(rows, 1000, dtype=dtype, seed=4)
    torch.testing.assert_close(
        ew.rms_norm(wide[:, :576], w, 1e-5), ref.rms_norm(wide[:, :576], w, 1e-5), **TOL[dtype]
    )


def test_bf16_rounding_of_denormals_ties_and_specials(threads):
    """The residual add rounds to bf16 exactly as torch does for every input: denormals
    (the AVX-512 BF16 path's vcvtneps2bf16 reads one as zero; such lanes take the integer
    rounding, kernels/csrc/bf16.h), ties to even, infinities; NaN stays NaN."""
    tiny = 2.0**-133  # a bf16 denormal
    pairs = [
        (tiny, tiny), (-3 * tiny, tiny), (5 * tiny, 0.0), (2.0**-126, -tiny),  # denormal sums
        (1.0, 2.0**-8), (1.0 + 2.0**-7, 2.0**-8), (-1.0, -(2.0**-8)),  # ties: to even
        (1.0, 3 * 2.0**-9), (3.0e38, 3.0e38), (float("-inf"), 1.0), (-0.0, 0.0),
        (float("nan"), 1.0),
    ]  # fmt: skip
    for rows in (1, 3):
        x = rand(rows, 576, dtype=torch.bfloat16, seed=8)
        res = rand(rows, 576, dtype=torch.bfloat16, seed=9)
        for j, (a, b) in enumerate(pairs):
            x[:, 20 * j], res[:, 20 * j] = a, b  # in lanes 0, 4, 8, 12 of 16-lane groups
        w = rand(576, dtype=torch.bfloat16, seed=3)
        out, r = ew.fused_add_rms_norm(x, res, w, 1e-5)
        out_ref, r_ref = ref.fused_add_rms_norm(x, res, w, 1e-5)
        nan = torch.isnan(r_ref)
        assert nan.sum() == rows and torch.equal(torch.isnan(r), nan)
        assert torch.equal(r[~nan], r_ref[~nan])
        assert r[0, 0].item() == 2 * tiny and r[0, 80].item() == 1.0  # kept; tie to even
        # finite rows (the NaN and inf lanes cleared) also normalise as the reference
        x[:, 160:240], res[:, 160:240] = 0.5, 0.25
        out, _ = ew.fused_add_rms_norm(x, res, w, 1e-5)
        out_ref, _ = ref.fused_add_rms_norm(x, res, w, 1e-5)
        torch.testing.assert_close(out, out_ref, **TOL[torch.bfloat16])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 32, 300])
def test_silu_and_mul(dtype, rows, threads):
    x = rand(rows, 2 * 1536, dtype=dtype, seed=5, scale=4.0)
    x[0, :8] = torch.tensor([-100.0, -30.0, -1e-3, 0.0, 1e-3, 30.0, 90.0, 100.0], dtype=dtype)
    torch.testing.assert_close(ew.silu_and_mul(x), ref.silu_and_mul(x), **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [1, 32, 300])
def test_rotary_embedding_on_qkv_views(dtype, tokens, threads):
    """q and k are views into one qkv row buffer, as the model's split leaves them."""
    h, hkv, d = 9, 3, 64
    qkv = rand(tokens, (h + 2 * hkv) * d, dtype=dtype, seed=6)
    positions = torch.randint(0, 2048, (tokens,), generator=torch.Generator().manual_seed(7))
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    ang = torch.arange(2048).float()[:, None] * inv[None, :]
    cos_sin = torch.cat([ang.cos(), ang.sin()], dim=-1)

    def views(buf):
        q = buf[:, : h * d].view(tokens, h, d)
        k = buf[:, h * d : (h + hkv) * d].view(tokens, hkv, d)
        return q, k

    a, b = qkv.clone(), qkv.clone()
    ew.rotary_embedding(positions, *views(a), cos_sin)
    ref.rotary_embedding(positions, *views(b), cos_sin)
    if dtype == torch.float32:
        assert torch.equal(a, b)
    else:
        torch.testing.assert_close(a, b, **TOL[dtype])
    assert torch.equal(a[:, (h + hkv) * d :], qkv[:, (h + hkv) * d :])  # v untouched


@pytest.mark.parametrize("dtype", DTYPES)
def test_store_kv_strided_and_skipped_slots(dtype, threads):
    n, bs, hkv, d, t = 10, 16, 3, 64, 40
    qkv = rand(t, 15 * d, dtype=dtype, seed=8)
    k = qkv[:, 9 * d : 12 * d].view(t, hkv, d)
    v = qkv[:, 12 * d :].view(t, hkv, d)
    slots = torch.randperm(n * bs, generator=torch.Generator().manual_seed(9))[:t]
    slots[::7] = -1
    caches = [rand(n, bs, hkv, d, dtype=dtype, seed=s) for s in (10, 11)]
    expect = [c.clone() for c in caches]
    ew.store_kv(k, v, *caches, slots)
    ref.store_kv(k, v, *expect, slots)
    assert torch.equal(caches[0], expect[0]) and torch.equal(caches[1], expect[1])


def test_store_kv_into_strided_blocks(threads):
    """A block-major cache's layer view: blocks contiguous, the stride between them wider."""
    n, bs, hkv, d, t, layers = 6, 4, 2, 8, 12, 3
    whole = torch.zeros(n, layers, 2, bs, hkv, d)
    k_cache, v_cache = whole[:, 1, 0], whole[:, 1, 1]
    assert not k_cache.is_contiguous()
    k, v = torch.randn(t, hkv, d), torch.randn(t, hkv, d)
    slots = torch.randperm(n * bs, generator=torch.Generator().manual_seed(12))[:t]
    expect = whole.clone()
    ew.store_kv(k, v, k_cache, v_cache, slots)
    ref.store_kv(k, v, expect[:, 1, 0], expect[:, 1, 1], slots)
    assert torch.equal(whole, expect)  # other layers' blocks untouched


def test_store_kv_slot_out_of_range_raises_and_writes_nothing():
    k_cache, v_cache = torch.zeros(2, 4, 1, 8), torch.zeros(2, 4, 1, 8)
    kv = torch.ones(2, 1, 8)
    with pytest.raises(IndexError):
        ew.store_kv(kv, kv, k_cache, v_cache, torch.tensor([3, 8]))
    assert not k_cache.any() and not v_cache.any()


def test_unsupported_inputs_fall_back_to_the_reference():
    x = torch.randn(4, 64, dtype=torch.float64)
    w = torch.randn(64, dtype=torch.float64)
    torch.testing.assert_close(ew.rms_norm(x, w, 1e-6), ref.rms_norm(x, w, 1e-6))
    xt = torch.randn(64, 4).t()  # inner dim not contiguous
    torch.testing.assert_close(ew.silu_and_mul(xt), ref.silu_and_mul(xt))
    x3 = torch.randn(2, 3, 64)  # not 2-D
    torch.testing.assert_close(ew.silu_and_mul(x3), ref.silu_and_mul(x3))


def test_library_missing_falls_back(monkeypatch):
    monkeypatch.setattr(native, "load_library", lambda name: None)  # as a failed build
    x, w = torch.randn(3, 64), torch.randn(64)
    assert torch.equal(ew.rms_norm(x, w, 1e-5), ref.rms_norm(x, w, 1e-5))
