"""Every Triton kernel equals its pure-torch reference (`pdserve.kernels.reference`).

Without CUDA the kernels run under the Triton interpreter on CPU, so shapes are small.
Tolerances: fp32 atol 1e-5 / rtol 1e-4; bf16 and fp16 atol 2e-2 / rtol 2e-2 (the
attention kernels round the softmax weights to the activation dtype before P @ V, as
flash attention does; the elementwise kernels round where the reference does, but the
interpreter's fp32 -> bf16 cast truncates where a GPU rounds to nearest even). store_kv
is exact.
"""

from __future__ import annotations

import inspect
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # read when the kernels are decorated
pytest.importorskip("triton")

from pdserve.kernels import reference as ref  # noqa: E402
from pdserve.kernels import triton_ops as tri  # noqa: E402
from pdserve.kernels.ops import get_ops  # noqa: E402
from pdserve.kernels.triton_attention import decode_attention  # noqa: E402

pytestmark = pytest.mark.isa  # scripts/avx2_view.sh runs it as an AVX2-only CPU

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {
    torch.float32: dict(atol=1e-5, rtol=1e-4),
    torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
    torch.float16: dict(atol=2e-2, rtol=2e-2),
}
OPS = [
    "store_kv",
    "paged_decode_attention",
    "paged_prefill_attention",
    "rms_norm",
    "fused_add_rms_norm",
    "rotary_embedding",
    "silu_and_mul",
]


def assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(actual, expected, **TOL[expected.dtype])


def make_paged_kv(
    seq_lens: list[int], hkv: int, d: int, bs: int, dtype: torch.dtype, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random caches with spare blocks, and shuffled block tables padded with block 0."""
    g = torch.Generator().manual_seed(seed)
    need = [(n + bs - 1) // bs for n in seq_lens]
    num_blocks = sum(need) + 3
    shape = (num_blocks, bs, hkv, d)
    k_cache = torch.randn(shape, generator=g).to(dtype).to(DEVICE)
    v_cache = torch.randn(shape, generator=g).to(dtype).to(DEVICE)
    perm = torch.randperm(num_blocks - 1, generator=g) + 1  # block 0 is only padding
    table = torch.zeros((len(seq_lens), max(need) + 1), dtype=torch.int32)
    used = 0
    for i, n in enumerate(need):
        table[i, :n] = perm[used : used + n]
        used += n
    return k_cache, v_cache, table.to(DEVICE)


def test_triton_ops_has_the_reference_signatures():
    for name in OPS:
        assert inspect.signature(getattr(tri, name)) == inspect.signature(getattr(ref, name))
    assert get_ops("triton") is tri


# ---------------------------------------------------------------------------- attention

EDGE_LENS = [1, 15, 16, 17, 300]  # block_size 16: 1, bs-1, bs, bs+1, long


@pytest.mark.parametrize("h,hkv", [(4, 4), (6, 2), (8, 1)])
def test_decode_attention_context_edges_and_gqa(h: int, hkv: int):
    d, bs = 64, 16
    k_cache, v_cache, table = make_paged_kv(EDGE_LENS, hkv, d, bs, torch.float32)
    q = torch.randn(len(EDGE_LENS), h, d).to(DEVICE)
    lens = torch.tensor(EDGE_LENS, dtype=torch.int32, device=DEVICE)
    expected = ref.paged_decode_attention(q, k_cache, v_cache, table, lens, d**-0.5)
    assert_close(tri.paged_decode_attention(q, k_cache, v_cache, table, lens, d**-0.5), expected)
    # Split-K: several splits per sequence, some of them empty for the short ones.
    split = decode_attention(q, k_cache, v_cache, table, lens, d**-0.5, num_splits=5, block_n=32)
    assert_close(split, expected)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_decode_attention_half_precision_head_dim_128(dtype: torch.dtype):
    lens, h, hkv, d, bs = [3, 40, 130], 8, 2, 128, 16
    k_cache, v_cache, table = make_paged_kv(lens, hkv, d, bs, dtype, seed=1)
    q = torch.randn(len(lens), h, d).to(dtype).to(DEVICE)
    ctx = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    expected = ref.paged_decode_attention(q, k_cache, v_cache, table, ctx, 0.1)
    assert_close(decode_attention(q, k_cache, v_cache, table, ctx, 0.1, num_splits=1), expected)
    assert_close(decode_attention(q, k_cache, v_cache, table, ctx, 0.1, num_splits=3), expected)


def test_decode_attention_odd_block_size_and_strided_q():
    lens, h, hkv, d, bs = [5, 23], 4, 2, 64, 7  # bs need not be a power of two
    k_cache, v_cache, table = make_paged_kv(lens, hkv, d, bs, torch.float32, seed=2)
    qkv = torch.randn(len(lens), h + 2 * hkv, d).to(DEVICE)
    q = qkv[:, :h]  # a view into a fused projection, as the model produces it
    ctx = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    expected = ref.paged_decode_attention(q, k_cache, v_cache, table, ctx, 0.2)
    assert_close(tri.paged_decode_attention(q, k_cache, v_cache, table, ctx, 0.2), expected)


def _prefill_case(
    chunks: list[tuple[int, int]], h: int, hkv: int, d: int, dtype: torch.dtype, seed: int
) -> None:
    """chunks: (prefix already cached, new tokens) per sequence."""
    bs = 16
    lens = [p + n for p, n in chunks]
    k_cache, v_cache, table = make_paged_kv(lens, hkv, d, bs, dtype, seed=seed)
    q = torch.randn(sum(n for _, n in chunks), h, d).to(dtype).to(DEVICE)
    starts = torch.tensor([0] + [n for _, n in chunks]).cumsum(0).to(torch.int32).to(DEVICE)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    args = (q, k_cache, v_cache, table, starts, seq_lens, d**-0.5)
    assert_close(tri.paged_prefill_attention(*args), ref.paged_prefill_attention(*args))


def test_prefill_attention_prefix_plus_chunk_fp32_gqa3():
    # Fresh prompt; prefix ending mid-block; prefix of exactly one block with one new token;
    # an empty chunk; a long prefix with a chunk spanning two query tiles.
    chunks = [(0, 20), (33, 17), (16, 1), (5, 0), (200, 70)]
    _prefill_case(chunks, h=6, hkv=2, d=64, dtype=torch.float32, seed=3)


def test_prefill_attention_bf16_head_dim_128_gqa8():
    _prefill_case([(0, 17), (15, 2), (40, 24)], h=8, hkv=1, d=128, dtype=torch.bfloat16, seed=4)


def test_store_then_prefill_then_decode_matches_reference_pipeline():
    """Triton store_kv fills the cache the attention kernels then read, chunk by chunk."""
    h, hkv, d, bs = 4, 2, 64, 16
    table = torch.tensor([[2, 5, 7, 0]], dtype=torch.int32, device=DEVICE)
    k_all, v_all = torch.randn(2, 40, hkv, d).to(DEVICE)
    q_all = torch.randn(40, h, d).to(DEVICE)
    pos = torch.arange(40, device=DEVICE)
    slots = table[0].long()[pos // bs] * bs + pos % bs
    caches = {ops: torch.zeros(2, 8, bs, hkv, d, device=DEVICE) for ops in (ref, tri)}
    for lo, hi in ((0, 18), (18, 39), (39, 40)):  # two prefill chunks, then one decode step
        outs = {}
        for ops, (kc, vc) in caches.items():
            ops.store_kv(k_all[lo:hi], v_all[lo:hi], kc, vc, slots[lo:hi])
            lens = torch.tensor([hi], dtype=torch.int32, device=DEVICE)
            if hi - lo == 1:
                outs[ops] = ops.paged_decode_attention(q_all[lo:hi], kc, vc, table, lens, 0.125)
            else:
                starts = torch.tensor([0, hi - lo], dtype=torch.int32, device=DEVICE)
                args = (q_all[lo:hi], kc, vc, table, starts, lens, 0.125)
                outs[ops] = ops.paged_prefill_attention(*args)
        assert torch.equal(caches[tri], caches[ref])
        assert_close(outs[tri], outs[ref])


def test_attention_rejects_head_dim_not_power_of_two():
    k_cache, v_cache, table = make_paged_kv([4], 1, 48, 16, torch.float32)
    q = torch.randn(1, 1, 48, device=DEVICE)
    lens = torch.tensor([4], dtype=torch.int32, device=DEVICE)
    with pytest.raises(AssertionError, match="power of two"):
        tri.paged_decode_attention(q, k_cache, v_cache, table, lens, 1.0)


# ---------------------------------------------------------------------------- elementwise


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_kv_skips_negative_slots(dtype: torch.dtype):
    t, hkv, d, n, bs = 6, 2, 64, 4, 4
    key = torch.randn(t, hkv, d).to(dtype).to(DEVICE)
    value = torch.randn(t, hkv, d).to(dtype).to(DEVICE)
    slots = torch.tensor([3, -1, 0, 15, -1, 9], device=DEVICE)
    sentinel = torch.full((n, bs, hkv, d), 7.0, dtype=dtype, device=DEVICE)
    caches = [sentinel.clone() for _ in range(4)]
    ref.store_kv(key, value, caches[0], caches[1], slots)
    tri.store_kv(key, value, caches[2], caches[3], slots)
    assert torch.equal(caches[2], caches[0]) and torch.equal(caches[3], caches[1])
    flat = caches[2].view(-1, hkv, d)
    untouched = [s for s in range(n * bs) if s not in (3, 0, 15, 9)]
    assert bool((flat[untouched] == 7.0).all())
    assert torch.equal(flat[9], key[5])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_and_fused_add(dtype: torch.dtype):
    x = torch.randn(5, 100).to(dtype).to(DEVICE)  # hidden size not a power of two
    residual = torch.randn(5, 100).to(dtype).to(DEVICE)
    weight = (1 + 0.1 * torch.randn(100)).to(dtype).to(DEVICE)
    assert_close(tri.rms_norm(x, weight, 1e-6), ref.rms_norm(x, weight, 1e-6))
    out, res = tri.fused_add_rms_norm(x, residual, weight, 1e-5)
    ref_out, ref_res = ref.fused_add_rms_norm(x, residual, weight, 1e-5)
    assert_close(out, ref_out)
    assert_close(res, ref_res)  # the interpreter truncates fp32 -> bf16; a GPU rounds to even
    wide = torch.randn(5, 2, 64).to(dtype).to(DEVICE)  # per-head norm on a [T, H, D] view
    w64 = weight[:64].contiguous()
    assert_close(tri.rms_norm(wide, w64, 1e-6), ref.rms_norm(wide, w64, 1e-6))


def _cos_sin_cache(max_pos: int, d: int) -> torch.Tensor:
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, d, 2).float() / d))
    freqs = torch.outer(torch.arange(max_pos).float(), inv_freq)
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1).to(DEVICE)


@pytest.mark.parametrize("dtype,d", [(torch.float32, 64), (torch.bfloat16, 128)])
def test_rotary_embedding_in_place_on_strided_views(dtype: torch.dtype, d: int):
    t, h, hkv = 5, 6, 2
    cache = _cos_sin_cache(4096, d)
    positions = torch.tensor([0, 1, 17, 511, 4095], device=DEVICE)
    qkv = torch.randn(t, h + 2 * hkv, d).to(dtype).to(DEVICE)
    ref_q, ref_k = qkv[:, :h].clone(), qkv[:, h : h + hkv].clone()
    q, k = qkv[:, :h], qkv[:, h : h + hkv]  # rotated in place through the views
    v_before = qkv[:, h + hkv :].clone()
    ref.rotary_embedding(positions, ref_q, ref_k, cache)
    tri.rotary_embedding(positions, q, k, cache)
    assert_close(q, ref_q)
    assert_close(k, ref_k)
    assert torch.equal(qkv[:, h + hkv :], v_before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_and_mul(dtype: torch.dtype):
    x = torch.randn(3, 2 * 1500).to(dtype).to(DEVICE)  # I > one program's block
    assert_close(tri.silu_and_mul(x), ref.silu_and_mul(x))
    x3 = torch.randn(2, 3, 2 * 48).to(dtype).to(DEVICE)
    assert_close(tri.silu_and_mul(x3), ref.silu_and_mul(x3))
