"""Row-wise argmax of fp32 logits on CPU in one native call (kernels/csrc/argmax.cpp).

The sampler's greedy pick: `argmax_rows(x)` equals `x.argmax(dim=-1)` (first index of the
maximum; a row with a NaN gives its first NaN's index). torch's argmax is slower at a
[32, 49152] batch even on one thread, and on two it opens a parallel region whose join
waits for a descheduled thread on a busy box; this runs on the calling thread.
Anything else (not CPU, not fp32, not 2-D, an inner dimension that is not contiguous, no
compiler) goes to torch.
"""

from __future__ import annotations

import torch

from pdserve.kernels import native


def available() -> bool:
    """Whether the native library is built and loaded on this machine."""
    return native.load_library("argmax") is not None


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """[rows, n] -> [rows] int64, as `x.argmax(dim=-1)`."""
    if (
        x.device.type != "cpu"
        or x.dtype != torch.float32
        or x.dim() != 2
        or x.shape[1] == 0
        or x.stride(1) != 1
        or torch.compiler.is_compiling()
    ):
        return x.argmax(dim=-1)
    lib = native.load_library("argmax")
    if lib is None:
        return x.argmax(dim=-1)
    out = torch.empty(x.shape[0], dtype=torch.int64)
    if x.shape[0]:
        lib.pdserve_argmax_rows(x.data_ptr(), x.stride(0), x.shape[0], x.shape[1], out.data_ptr())
    return out
