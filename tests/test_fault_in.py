"""kernels/fault_in.py: the KV cache faulted in on a thread, lowest blocks first, beside
the engine's own writes (which it must never change)."""

from __future__ import annotations

import os

import pytest
import torch

from pdserve.engine.kv_tensor import BLOCK_MAJOR, LAYER_MAJOR, allocate_kv_cache
from pdserve.kernels import fault_in
from pdserve.kernels.fault_in import BackgroundFault, block_spans


@pytest.fixture(autouse=True)
def _normal_priority(monkeypatch, huge_pages):
    """The thread runs at nice 19 in a node; here at the test's own priority: on a loaded
    2-vCPU CI box a nice-19 thread got too little CPU to fault 192 MiB in within 120 s."""
    monkeypatch.setattr(fault_in, "NICE", 0)  # and on huge pages, as a node's cache is


def _addresses(t: torch.Tensor) -> set[int]:
    """Byte addresses of every element of t (a small strided view)."""
    elt, base = t.element_size(), t.data_ptr()
    offsets = torch.zeros((), dtype=torch.int64)
    for size, stride in zip(t.shape, t.stride()):
        offsets = offsets.unsqueeze(-1) + torch.arange(size) * stride
    return {base + int(o) * elt + i for o in offsets.flatten() for i in range(elt)}


@pytest.mark.parametrize("layout", [LAYER_MAJOR, BLOCK_MAJOR])
def test_block_spans_cover_exactly_those_blocks(layout):
    kv = allocate_kv_cache(layout, 3, 7, 4, 2, 8, dtype=torch.float32, device="cpu")
    for first, last in [(0, 1), (2, 5), (0, 7)]:
        spans = block_spans(kv, first, last)
        covered = {a + i for a, n in spans for i in range(n)}
        assert covered == _addresses(kv[:, :, first:last])
        assert len(spans) == (1 if layout == BLOCK_MAJOR else 6)


@pytest.mark.skipif(os.uname().sysname != "Linux", reason="madvise(MADV_POPULATE_WRITE)")
@pytest.mark.parametrize("layout", [LAYER_MAJOR, BLOCK_MAJOR])
def test_faults_in_lowest_blocks_first_and_keeps_concurrent_writes(layout):
    # 24 layers x 2 x 512 blocks x 16 x 2 x 64 x 4 B = 192 MiB: many chunks of 2 MiB
    kv = allocate_kv_cache(layout, 24, 512, 16, 2, 64, dtype=torch.float32, device="cpu")
    fault = BackgroundFault(kv, chunk_bytes=2 << 20)
    if not fault.start():  # a kernel before 5.14: nothing started, nothing touched
        assert fault.blocks_done == 0
        return
    assert fault.blocks_done >= fault.chunk_blocks > 0  # the first chunk before start returns
    first = kv[:, :, : fault.chunk_blocks]
    assert _resident_span(first)  # the first steps' blocks are in already
    # the engine writes blocks while the thread is still faulting others in
    for b in (0, 3, 200, 511):
        kv[:, :, b] = float(b + 1)
    assert fault.wait(120) and fault.error is None and fault.done
    assert fault.blocks_done == 512 and fault.seconds is not None
    assert _resident_span(kv)  # every block of every layer
    for b in (0, 3, 200, 511):  # nothing the engine wrote was changed
        assert bool((kv[:, :, b] == float(b + 1)).all())
    untouched = kv[:, :, [1, 2, 100, 510]]
    assert not untouched.any()  # and the rest still reads as zeros


def test_stop_ends_the_thread_early():
    kv = allocate_kv_cache(LAYER_MAJOR, 8, 2048, 16, 2, 64, dtype=torch.float32, device="cpu")
    fault = BackgroundFault(kv, chunk_bytes=1 << 20)
    fault.stop()  # before the thread's first chunk: it ends after at most one
    if not fault.start():
        return
    assert fault.wait(60)
    assert fault.blocks_done < 2048 and fault.seconds is None


def test_a_gpu_or_empty_cache_is_not_faulted_in():
    assert not BackgroundFault(torch.zeros(0, 2, 0, 16, 2, 8)).start()


def _resident_span(t: torch.Tensor) -> bool:
    """Every page under each block span of this (sliced) cache is resident."""
    import ctypes
    import mmap

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    page = mmap.PAGESIZE
    for a, n in block_spans(t, 0, t.shape[2]):
        start = a - a % page
        length = (a + n - start + page - 1) // page * page
        vec = ctypes.create_string_buffer(length // page)
        assert libc.mincore(start, length, vec) == 0
        if not all(b & 1 for b in vec.raw):
            return False
    return True
