"""Every kernel is correct on a block-major cache's layer views (strided blocks).

A block-major KV cache (engine/kv_tensor.py) gives each layer `[N, bs, Hkv, D]` views whose
blocks are `2 * L * bs * Hkv * D` elements apart. Each backend's store_kv fills one layer's
views of such a cache from the same tokens as a contiguous (layer-major) cache; the views
must then hold exactly the contiguous cache's blocks, every other layer must stay
untouched, and decode and prefill attention over the views must equal the reference over
the contiguous cache. Backends: the pure-torch reference, the native CPU decode kernel,
and the Triton kernels (under TRITON_INTERPRET=1 without CUDA, so shapes are small).
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # read when the kernels are decorated

from pdserve.engine.kv_tensor import BLOCK_MAJOR, LAYER_MAJOR, allocate_kv_cache, layout_of  # noqa: E402
from pdserve.kernels import native, paged_decode  # noqa: E402
from pdserve.kernels import reference as ref  # noqa: E402

pytestmark = pytest.mark.isa  # scripts/avx2_view.sh runs it as an AVX2-only CPU

LAYERS, LAYER = 3, 1  # the views under test are layer 1's, between two other layers
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-4), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


def _backends() -> dict[str, object]:
    out: dict[str, object] = {"reference": ref}
    if native.find_compiler() is not None and paged_decode.available():
        from pdserve.kernels import cpu_ops

        out["native"] = cpu_ops
    try:
        from pdserve.kernels import triton_ops

        out["triton"] = triton_ops
    except ImportError:
        pass
    return out


BACKENDS = _backends()


def test_allocation_gives_the_same_logical_tensor_in_either_order():
    lm = allocate_kv_cache(LAYER_MAJOR, LAYERS, 5, 4, 2, 8)
    bm = allocate_kv_cache(BLOCK_MAJOR, LAYERS, 5, 4, 2, 8)
    assert lm.shape == bm.shape == (LAYERS, 2, 5, 4, 2, 8)
    assert layout_of(lm) == LAYER_MAJOR and layout_of(bm) == BLOCK_MAJOR
    # block b of every layer, K and V, is one contiguous range of the block-major storage
    per_block = LAYERS * 2 * 4 * 2 * 8
    assert bm[:, :, 3].data_ptr() == bm.data_ptr() + 3 * per_block * bm.element_size()
    assert bm[LAYER, 0].stride(0) == per_block
    with pytest.raises(ValueError, match="unknown KV cache layout"):
        allocate_kv_cache("blocky", LAYERS, 5, 4, 2, 8)


def _case(dtype, hkv=2, d=16, bs=4, seed=0):
    """Two sequences' tokens and shuffled block tables over a cache of spare blocks."""
    g = torch.Generator().manual_seed(seed)
    lens = [19, 7]
    need = [(n + bs - 1) // bs for n in lens]
    num_blocks = sum(need) + 3
    perm = (torch.randperm(num_blocks - 1, generator=g) + 1).tolist()
    table = torch.zeros((2, max(need) + 1), dtype=torch.int32)
    table[0, : need[0]] = torch.tensor(perm[: need[0]])
    table[1, : need[1]] = torch.tensor(perm[need[0] : need[0] + need[1]])
    keys = [torch.randn(n, hkv, d, generator=g).to(dtype) for n in lens]
    values = [torch.randn(n, hkv, d, generator=g).to(dtype) for n in lens]
    slots = [
        table[i].long()[torch.arange(n) // bs] * bs + torch.arange(n) % bs
        for i, n in enumerate(lens)
    ]
    return lens, num_blocks, table, keys, values, slots


def _device():
    return "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", list(BACKENDS))
def test_store_prefill_decode_on_strided_block_views(name, dtype):
    ops = BACKENDS[name]
    dev = _device() if name == "triton" else "cpu"
    hkv, d, bs, h = 2, 16, 4, 4
    lens, n, table, keys, values, slots = _case(dtype, hkv, d, bs)
    table = table.to(dev)
    flat = allocate_kv_cache(LAYER_MAJOR, 1, n, bs, hkv, d, dtype=dtype, device=dev)[0]
    bm = allocate_kv_cache(BLOCK_MAJOR, LAYERS, n, bs, hkv, d, dtype=dtype, device=dev)
    kc, vc = bm[LAYER, 0], bm[LAYER, 1]
    assert not kc.is_contiguous()
    # prefill: sequence 0 in two chunks, sequence 1 in one, each chunk stored first
    chunks = [(0, 0, 11), (0, 11, 18), (1, 0, 6)]
    g = torch.Generator().manual_seed(1)
    for seq, lo, hi in chunks:
        k, v, s = keys[seq][lo:hi].to(dev), values[seq][lo:hi].to(dev), slots[seq][lo:hi].to(dev)
        ref.store_kv(k, v, flat[0], flat[1], s)
        ops.store_kv(k, v, kc, vc, s)
        q = torch.randn(hi - lo, h, d, generator=g).to(dtype).to(dev)
        starts = torch.tensor([0, hi - lo], dtype=torch.int32, device=dev)
        seq_len = torch.tensor([hi], dtype=torch.int32, device=dev)
        bt = table[seq : seq + 1]
        expected = ref.paged_prefill_attention(q, flat[0], flat[1], bt, starts, seq_len, 0.25)
        actual = ops.paged_prefill_attention(q, kc, vc, bt, starts, seq_len, 0.25)
        torch.testing.assert_close(actual, expected, **TOL[dtype])
    # decode: each sequence's last token (sequence 1 crosses into a new block)
    for seq in (0, 1):
        t = lens[seq] - 1
        s = slots[seq][t : t + 1].to(dev)
        ref.store_kv(keys[seq][t:].to(dev), values[seq][t:].to(dev), flat[0], flat[1], s)
        ops.store_kv(keys[seq][t:].to(dev), values[seq][t:].to(dev), kc, vc, s)
    assert torch.equal(kc, flat[0]) and torch.equal(vc, flat[1])  # stores are exact
    assert not bm[[i for i in range(LAYERS) if i != LAYER]].any()  # other layers untouched
    q = torch.randn(2, h, d, generator=g).to(dtype).to(dev)
    ctx = torch.tensor(lens, dtype=torch.int32, device=dev)
    expected = ref.paged_decode_attention(q, flat[0], flat[1], table, ctx, 0.25)
    actual = ops.paged_decode_attention(q, kc, vc, table, ctx, 0.25)
    torch.testing.assert_close(actual, expected, **TOL[dtype])


@pytest.mark.skipif("native" not in BACKENDS, reason="no C++ compiler: native kernel absent")
def test_native_decode_reads_strided_blocks_in_place():
    """The native kernel takes the block-major view itself (no fallback to the gather)."""
    hkv, d, bs = 3, 64, 16
    bm = allocate_kv_cache(BLOCK_MAJOR, LAYERS, 40, bs, hkv, d)
    bm.normal_()
    kc, vc = bm[LAYER, 0], bm[LAYER, 1]
    assert paged_decode.supports(torch.zeros(2, 9, d), kc, vc)
    assert not paged_decode.supports(torch.zeros(2, 9, d), kc, vc.contiguous())  # strides differ
    table = torch.randperm(40)[:26].to(torch.int32).view(2, 13)
    ctx = torch.tensor([200, 150], dtype=torch.int32)
    q = torch.randn(2, 9, d)
    torch.testing.assert_close(
        paged_decode.paged_decode_attention(q, kc, vc, table, ctx, 0.125),
        ref.paged_decode_attention(q, kc.contiguous(), vc.contiguous(), table, ctx, 0.125),
        **TOL[torch.float32],
    )
