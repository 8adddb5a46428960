"""Large CPU buffers on transparent huge pages (2 MiB), where the kernel offers them.

A decode step streams every weight and reads the KV of every running sequence from DRAM:
~1 GB a step at 32 rows in fp32, scattered over the KV cache's blocks. On 4 KiB pages that
is a TLB miss every 4 KiB (the TLB covers ~16 MB), and the hardware prefetchers stop at
page boundaries. Linux's transparent huge pages are often in `madvise` mode (Debian,
Ubuntu): a region gets 2 MiB pages only if asked before it is first touched. `empty`
returns an uninitialised tensor whose pages were asked for that way (`madvise(MADV_HUGEPAGE)`
on its 2 MiB-aligned span); the caller's first write then faults them in as huge pages.
Where THP is `never`, off Linux, or with `PDSERVE_HUGEPAGES=0`, a buffer of 2 MiB or more is
still a fresh mapping of its own, on 4 KiB pages: `zeros` writes nothing, so the pages nobody
touches never become resident (smaller ones are a plain `torch.empty`).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import mmap
import os

import torch

logger = logging.getLogger(__name__)

HUGE = 2 << 20


@functools.cache
def available() -> bool:
    """Whether huge pages can be asked for here (Linux, THP not `never`, not switched off)."""
    if os.environ.get("PDSERVE_HUGEPAGES", "1") == "0" or os.uname().sysname != "Linux":
        return False
    if not hasattr(mmap, "MADV_HUGEPAGE"):
        return False
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return "[never]" not in f.read()
    except OSError:
        return False


def _allocate(shape: tuple[int, ...], dtype: torch.dtype) -> tuple[torch.Tensor, bool]:
    """(uninitialised tensor, whether it is a fresh mapping: zeros until written). A buffer of
    2 MiB or more is always a fresh anonymous mapping, with or without huge pages, so that
    memory nobody writes (most of a GiB-sized KV cache, for a while) is never resident."""
    numel = 1
    for s in shape:
        numel *= s
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    if nbytes < HUGE:
        return torch.empty(shape, dtype=dtype), False
    huge = available()
    # private: a shared anonymous mapping is shmem, whose huge pages are another setting
    buf = mmap.mmap(
        -1, nbytes + HUGE if huge else nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
    )
    raw = torch.frombuffer(buf, dtype=torch.uint8)  # keeps `buf` alive
    start = (-raw.data_ptr()) % HUGE if huge else 0  # huge: the first 2 MiB boundary
    advice = mmap.MADV_HUGEPAGE if huge else getattr(mmap, "MADV_NOHUGEPAGE", None)
    try:  # off: 4 KiB pages, also where THP is `always`
        if advice is not None and (huge or os.environ.get("PDSERVE_HUGEPAGES") == "0"):
            buf.madvise(advice, start, (nbytes // HUGE) * HUGE)
    except OSError as e:
        logger.debug("madvise(%s) failed: %s", advice, e)
    return raw[start : start + nbytes].view(dtype).view(shape), True


def empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """`torch.empty(shape, dtype=dtype)` on CPU, on huge pages where possible (see above).

    The memory is a fresh anonymous mapping of its own (never pages the heap already
    touched, which madvise could no longer turn into huge pages), unmapped when the last
    tensor using it goes."""
    return _allocate(shape, dtype)[0]


def zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """`torch.zeros` on CPU, on huge pages where possible. A fresh mapping reads as zeros
    already: nothing is written (its pages fault in, huge, at their first use, as calloc'd
    memory would), so a GiB-sized KV cache costs nothing at start."""
    t, fresh = _allocate(shape, dtype)
    return t if fresh else t.zero_()


MADV_POPULATE_WRITE = 23  # Linux >= 5.14 (include/uapi/asm-generic/mman-common.h)


def populate(t: torch.Tensor) -> bool:
    """Fault in every page of t's storage now, writable, with one `madvise(MADV_POPULATE_WRITE)`
    (huge pages where the region asked for them), so that no later write pays a page fault.
    Values are unchanged (a fresh mapping stays zeros). False where that is not possible
    (a kernel before 5.14, not Linux, a non-CPU or empty tensor): nothing happened then.

    Why: in a VM the first write to guest memory can cost far more than zeroing it (seconds
    per GiB of long-free memory). A lazily faulted KV cache pays that on the request path,
    block by block, as the first requests arrive (docs/benchmarks-history.md, "KV cache
    populated at start")."""
    if not t.is_cpu or t.numel() == 0:
        return False
    return populate_span(*page_span(t))


def populate_span(address: int, length: int) -> bool:
    """`populate` for the pages under [address, address + length): whole pages, so a span's
    edges may take in a neighbour's page (populating never changes a value). Releases the
    GIL while the kernel works (a ctypes call)."""
    if os.uname().sysname != "Linux" or length <= 0:
        return False
    libc = _libc()
    if libc is None:
        return False
    page = mmap.PAGESIZE
    start = address - address % page
    length = (address + length - start + page - 1) // page * page
    return libc.madvise(start, length, MADV_POPULATE_WRITE) == 0


def page_span(t: torch.Tensor) -> tuple[int, int]:
    """(address, bytes) of the whole pages that t's storage lies on."""
    storage = t.untyped_storage()
    page = mmap.PAGESIZE
    begin = storage.data_ptr()
    start = begin - begin % page
    return start, (begin + storage.nbytes() - start + page - 1) // page * page


@functools.cache
def _libc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        libc.madvise.restype = ctypes.c_int
    except (OSError, AttributeError):
        return None
    return libc


def move_parameters(module: torch.nn.Module, keep_values: bool = True) -> int:
    """Put every CPU parameter of at least 2 MiB on huge pages (new storage becomes the
    parameter's data, the values copied unless keep_values is False: parameters about to
    be loaded); returns how many moved. Call before anything keeps a parameter's address
    (prepacking, native plans): the old storage is freed."""
    if not available():
        return 0
    moved = 0
    for p in module.parameters():
        if not p.is_cpu or p.numel() * p.element_size() < HUGE or not p.is_contiguous():
            continue
        data = empty(tuple(p.shape), p.dtype)
        if keep_values:
            data.copy_(p.detach())
        p.data = data
        moved += 1
    return moved
