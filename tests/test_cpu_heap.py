"""engine/cpu_heap.py: with glibc's thresholds raised, a freed multi-MB tensor's memory is
reused by the next one of its size (no page faults), where glibc's defaults unmap it and
fault it in again."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

_CHILD = """
import ctypes, sys, torch
from pdserve.engine.cpu_heap import keep_freed_memory
class Info(ctypes.Structure):  # glibc's struct mallinfo2
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd",
                "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]
info = ctypes.CDLL(None).mallinfo2
info.restype = Info
if sys.argv[1] == "keep":
    assert keep_freed_memory()
t = torch.empty(6 << 20).fill_(1.0)  # 24 MB
mapped = info().hblkhd  # bytes in blocks of their own mmap (unmapped again on free)
del t
print(mapped, info().fordblks)  # and the free bytes the heap keeps
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_freed_tensors_stay_in_the_heap():
    """Kept: a 24 MB tensor comes from the heap, and its bytes stay there once freed (the
    next tensor reuses its pages: no page faults, no zeroing by the kernel). glibc's
    defaults: it gets an mmap of its own, unmapped on free."""
    root = Path(__file__).resolve().parent.parent
    env = dict(os.environ, PYTHONPATH=str(root))

    def heap(mode: str) -> tuple[int, int]:
        out = subprocess.run([sys.executable, "-c", _CHILD, mode], env=env, capture_output=True,
                             text=True, timeout=300)  # fmt: skip
        if "mallinfo2" in out.stderr:
            pytest.skip("no glibc mallinfo2 here")
        assert out.returncode == 0, out.stderr[-2000:]
        mapped, free = (int(n) for n in out.stdout.split())
        return mapped, free

    size = 24 << 20
    mapped, free = heap("keep")
    assert mapped < size and free >= size
    mapped, _ = heap("default")
    assert mapped >= size
