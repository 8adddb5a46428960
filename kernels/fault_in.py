"""Faulting a CPU KV cache in from a background thread, lowest blocks first.

In a VM the first write to long-free guest memory costs seconds per GiB (the host backs
it page by page; docs/benchmarks-history.md, "KV cache populated at start"). Faulting the
whole cache in before the engine is ready made a node start in ~20 s; faulting it lazily
charged the same seconds to the first requests. Here a daemon thread faults it in while
the model loads and packs, and goes on after the engine is ready: the block pool hands
blocks out from its free queue's front, block 0 upward, and the thread walks the cache in
that order (every layer's K and V of blocks [i, i + n) per chunk), so the first steps'
blocks are resident first and a request writes into a faulted page unless it outruns it.

`MADV_POPULATE_WRITE` never changes a value, so the thread may run beside the engine's own
KV writes. Where the kernel lacks it (before 5.14), `start` says so and the caller zero-
fills instead, before anything writes the cache (a zero-fill beside a writer loses writes).
"""

from __future__ import annotations

import logging
import os
import threading
import time

import torch

from pdserve.kernels.hugepages import populate_span

logger = logging.getLogger(__name__)

NICE = int(os.environ.get("PDSERVE_FAULT_NICE", "19"))
CHUNK_BYTES = 32 << 20  # one madvise call's worth: small enough to stop soon, few calls


def block_spans(kv_cache: torch.Tensor, first: int, last: int) -> list[tuple[int, int]]:
    """(address, bytes) spans that hold blocks [first, last) of every layer's K and V of a
    `[L, 2, N, bs, Hkv, D]` cache in either storage order (engine/kv_tensor.py)."""
    elt = kv_cache.element_size()
    s_layer, s_kv, s_block = kv_cache.stride()[:3]
    base = kv_cache.data_ptr()
    length = (last - first) * s_block * elt
    if s_block >= s_layer:  # block_major: a block holds every layer's K and V, contiguous
        return [(base + first * s_block * elt, length)]
    layers, kv = kv_cache.shape[:2]
    return [
        (base + (layer * s_layer + k * s_kv + first * s_block) * elt, length)
        for layer in range(layers)
        for k in range(kv)
    ]


class BackgroundFault:
    """Faults `kv_cache` in, lowest blocks first, on a daemon thread (see the module)."""

    def __init__(self, kv_cache: torch.Tensor, chunk_bytes: int = CHUNK_BYTES):
        self.kv_cache = kv_cache  # held: the memory stays mapped while the thread works
        self.num_blocks = kv_cache.shape[2]
        block_bytes = kv_cache.numel() // max(1, self.num_blocks) * kv_cache.element_size()
        self.total_bytes = block_bytes * self.num_blocks
        self.chunk_blocks = max(1, chunk_bytes // max(1, block_bytes))
        self.blocks_done = 0  # blocks [0, blocks_done) are resident
        self.seconds: float | None = None  # the whole cache's time, once done
        self.error: str | None = None
        self._done = threading.Event()
        self._stop = threading.Event()
        self._t0 = 0.0

    def start(self) -> bool:
        """Fault in the first chunk here, the rest on a thread; False (nothing started)
        where the kernel cannot populate pages."""
        if not self.kv_cache.is_cpu or self.num_blocks == 0:
            return False
        self._t0 = time.perf_counter()
        if not self._chunk(0):
            return False
        threading.Thread(target=self._run, name="kv-fault-in", daemon=True).start()
        return True

    def _chunk(self, first: int) -> bool:
        last = min(self.num_blocks, first + self.chunk_blocks)
        if not all(populate_span(a, n) for a, n in block_spans(self.kv_cache, first, last)):
            return False
        self.blocks_done = last
        return True

    def _run(self) -> None:
        if NICE:  # Linux: a thread's own priority; what loads and serves goes first
            try:
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), NICE)
            except OSError:
                pass
        try:
            while self.blocks_done < self.num_blocks and not self._stop.is_set():
                if not self._chunk(self.blocks_done):
                    self.error = f"madvise failed at block {self.blocks_done}"
                    logger.warning("KV cache fault-in stopped: %s", self.error)
                    return
            if self.blocks_done == self.num_blocks:
                self.seconds = time.perf_counter() - self._t0
                logger.info(
                    "KV cache faulted in: %.0f MiB in %.1f s (background)",
                    self.total_bytes / 2**20,
                    self.seconds,
                )
        finally:
            self._done.set()

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout_s: float | None = None) -> bool:
        """True once the thread has ended (the whole cache faulted in, or stopped)."""
        return self._done.wait(timeout_s)

    def stop(self) -> None:
        """Ask the thread to end after its current chunk (e.g. at shutdown)."""
        self._stop.set()
