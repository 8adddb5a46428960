"""Large CPU buffers on transparent huge pages (2 MiB), where the kernel offers them.

A decode step streams every weight and reads the KV of every running sequence from DRAM:
~1 GB a step at 32 rows in fp32, scattered over the KV cache's blocks. On 4 KiB pages that
is a TLB miss every 4 KiB (the TLB covers ~16 MB), and the hardware prefetchers stop at
page boundaries. Linux's transparent huge pages are often in `madvise` mode (Debian,
Ubuntu): a region gets 2 MiB pages only if asked before it is first touched. `empty`
returns an uninitialised tensor whose pages were asked for that way (`madvise(MADV_HUGEPAGE)`
on its 2 MiB-aligned span); the caller's first write then faults them in as huge pages.
Where THP is `never`, off Linux, or with `PDSERVE_HUGEPAGES=0`, it is a plain `torch.empty`.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import os

import torch

logger = logging.getLogger(__name__)

HUGE = 2 << 20
_MADV_HUGEPAGE = 14


@functools.cache
def _madvise():
    if os.environ.get("PDSERVE_HUGEPAGES", "1") == "0" or not os.uname().sysname == "Linux":
        return None
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            if "[never]" in f.read():
                return None
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None
    fn = libc.madvise
    fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    return fn


def empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """`torch.empty(shape, dtype=dtype)` on CPU, on huge pages where possible (see above)."""
    numel = 1
    for s in shape:
        numel *= s
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    madvise = _madvise()
    if madvise is None or nbytes < HUGE:
        return torch.empty(shape, dtype=dtype)
    raw = torch.empty(nbytes + HUGE, dtype=torch.uint8)
    start = (-raw.data_ptr()) % HUGE  # first 2 MiB boundary
    span = (nbytes // HUGE) * HUGE
    if madvise(raw.data_ptr() + start, span, _MADV_HUGEPAGE) != 0:
        logger.debug("madvise(MADV_HUGEPAGE) failed: errno %d", ctypes.get_errno())
    return raw[start : start + nbytes].view(dtype).view(shape)


def move_parameters(module: torch.nn.Module) -> int:
    """Put every CPU parameter of at least 2 MiB on huge pages (a copy, then the copy
    becomes the parameter's data); returns how many moved. Call before anything keeps a
    parameter's address (prepacking, native plans): the old storage is freed."""
    if _madvise() is None:
        return 0
    moved = 0
    for p in module.parameters():
        if not p.is_cpu or p.numel() * p.element_size() < HUGE or not p.is_contiguous():
            continue
        data = empty(tuple(p.shape), p.dtype)
        data.copy_(p.detach())
        p.data = data
        moved += 1
    return moved
