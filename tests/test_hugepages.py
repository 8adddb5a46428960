"""kernels/hugepages.py: large CPU buffers asked for on 2 MiB pages, usable like torch.empty."""

from __future__ import annotations

import torch

from kernels import hugepages


def test_empty_is_a_usable_tensor(monkeypatch):
    t = hugepages.empty((3, 1 << 20), torch.float32)
    assert t.shape == (3, 1 << 20) and t.dtype == torch.float32 and t.is_contiguous()
    t.fill_(2.0)
    assert float(t.sum()) == 2.0 * 3 * (1 << 20)
    if hugepages._madvise() is not None:  # the span starts on a 2 MiB boundary
        assert t.data_ptr() % hugepages.HUGE == 0
    small = hugepages.empty((5,), torch.bfloat16)  # under 2 MiB: a plain tensor
    assert small.shape == (5,) and small.dtype == torch.bfloat16


def test_switched_off(monkeypatch):
    monkeypatch.setenv("PDSERVE_HUGEPAGES", "0")
    hugepages._madvise.cache_clear()
    try:
        assert hugepages._madvise() is None
        t = hugepages.empty((1 << 21,), torch.float32)
        assert t.numel() == 1 << 21 and t.untyped_storage().nbytes() == 4 << 21
    finally:
        monkeypatch.delenv("PDSERVE_HUGEPAGES")
        hugepages._madvise.cache_clear()


def test_kv_cache_is_zeroed_on_huge_pages():
    from engine.kv_tensor import allocate_kv_cache

    for layout in ("layer_major", "block_major"):
        kv = allocate_kv_cache(layout, 2, 64, 16, 2, 64, dtype=torch.float32, device="cpu")
        assert kv.shape == (2, 2, 64, 16, 2, 64) and not kv.any()
