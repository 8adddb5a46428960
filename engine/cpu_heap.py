"""Keep freed memory in the process heap (glibc), so a CPU step's large tensors reuse pages.

A prefill step allocates several MB-sized tensors per layer (GEMM outputs, attention
output) and frees each moments later. glibc serves a block above its mmap threshold with
a fresh mmap and unmaps it on free (and trims the heap top past its trim threshold), so
every such tensor's pages fault in again and are zeroed by the kernel, a visible share of a
prefill step's CPU spent as system time (docs/benchmarks-history.md, "Third round"), and
page faults of several threads contend on the process's memory-map lock.

`keep_freed_memory` raises the mmap threshold to glibc's maximum (32 MiB) and the trim
threshold to 1 GiB: a freed block stays in the heap for the next allocation. The cost: the
heap keeps the step's peak working set instead of returning it to the OS between steps.
Process-wide; the engine calls it once on CPU (`ModelConfig.cpu_keep_freed_memory`).
"""

from __future__ import annotations

import ctypes
import logging

logger = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1  # glibc's mallopt parameters (malloc.h)
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20  # glibc's largest (HEAP_MAX_SIZE / 2 on 64-bit)
TRIM_THRESHOLD = 1 << 30


def keep_freed_memory() -> bool:
    """Set both thresholds; False (nothing changed that matters) where the C library has no
    glibc `mallopt` or refuses the values."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        logger.info("no mallopt in this C library: the heap keeps its defaults")
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    ok = mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1
    ok = mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1 and ok
    if not ok:
        logger.info("mallopt refused the thresholds: the heap keeps its defaults")
    return ok
