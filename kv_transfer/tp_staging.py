"""A WRITE between nodes of different tensor-parallel sizes, gathered into staging buffers.

A block's rows interleave its KV heads (`[bs, Hkv, D]` per layer and K/V), so a decode
rank holding other heads than any one prefill rank cannot receive its share of a block as
one range. Described row by row it takes one descriptor per (block, layer, K/V, token
row): 184,320 descriptors of 256 B for a 1k-token prompt of the default model, which took
1.0-1.5 s over loopback TCP where whole blocks took 35 ms (one run of benchmarks/tp_kv.py,
with NIXL progress threads, before this module). Instead the
prefill side copies, for each such decode rank, the heads that rank holds of the blocks
being sent (from its own ranks' caches, all mapped in its engine process) into one
contiguous buffer laid out as that rank's blocks (its storage order, `KVLayout`), registers
it, and WRITEs it as whole blocks. A decode rank holding exactly one prefill rank's heads
is written directly from that rank's cache. The buffer lives until NIXL frees the
transfer's request (kv_transfer/nixl_requests.py).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from pdserve.engine.kv_tensor import KVRanks
from pdserve.kv_transfer.kv_layout import BlockRuns, KVLayout, block_descs, merge_runs


class RankPlan(NamedTuple):
    """How one dst rank gets its heads: straight from `direct` (a src rank holding exactly
    its heads), else gathered from `parts`: (src rank, first head, end head) each."""

    dst: int
    direct: int | None
    parts: list[tuple[int, int, int]]


def plan(src: list[KVLayout], dst: list[KVLayout]) -> list[RankPlan]:
    """Which src rank(s) each dst rank's heads come from; ValueError if some head is held
    by no src rank. A replicated head is read from the first src rank holding it."""
    out = []
    for i, d in enumerate(dst):
        same = [j for j, s in enumerate(src) if s.head_range == d.head_range]
        if same:
            out.append(RankPlan(i, same[0], []))
            continue
        need, parts = set(range(*d.head_range)), []
        for j, s in enumerate(src):
            a, b = max(d.head_range[0], s.head_range[0]), min(d.head_range[1], s.head_range[1])
            if a < b and need.intersection(range(a, b)):
                need.difference_update(range(a, b))
                parts.append((j, a, b))
        if need:
            raise ValueError(
                f"no rank of TP {src[0].tp_size} holds KV heads {sorted(need)} of a TP "
                f"{d.tp_size} rank"
            )
        out.append(RankPlan(i, None, parts))
    return out


def gather(
    kv: KVRanks,
    src: list[KVLayout],
    d: KVLayout,
    parts,
    layers: range,
    runs: BlockRuns,
    buf: torch.Tensor,
) -> None:
    """Fill `buf` (flat, contiguous, of the caches' dtype) with the blocks of `runs`
    (layers `layers`; the runs' src starts are src block ids, their dst starts positions
    in the buffer) as dst rank `d` stores its blocks: `[n, L, 2, bs, H, D]` for a
    block-major rank, `[L, 2, n, bs, H, D]` otherwise. One strided copy per (part, run):
    no gathered intermediate, so no fresh pages to fault in beyond the buffer's own."""
    n, nl = int(runs.lengths.sum()), len(layers)
    shape = (d.block_size, d.num_kv_heads, d.head_dim)
    if d.block_major:
        view = buf.view(n, nl, 2, *shape).permute(1, 2, 0, 3, 4, 5)
    else:
        view = buf.view(nl, 2, n, *shape)
    sel = slice(layers.start, layers.stop, layers.step)
    for j, a, b in parts:
        s0, d0 = src[j].kv_head_start, d.kv_head_start
        cache = kv.caches[j][sel]
        for s, i, k in zip(
            runs.src_starts.tolist(), runs.dst_starts.tolist(), runs.lengths.tolist()
        ):
            view[:, :, i : i + k, :, a - d0 : b - d0] = cache[:, :, s : s + k, :, a - s0 : b - s0]


def staged_descs(
    base_addr: int, d: KVLayout, layers: range, dst_ids: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Descriptors (buffer rows, dst rank rows) for a `gather` buffer at `base_addr`."""
    n, nl = len(dst_ids), len(layers)
    stage = KVLayout(
        num_layers=nl, num_blocks=n, block_size=d.block_size, num_kv_heads=d.num_kv_heads,
        head_dim=d.head_dim, dtype=d.dtype, itemsize=d.itemsize, mem_type="DRAM",
        device_id=0, base_addr=base_addr, block_major=d.block_major,
    )  # fmt: skip
    order = np.arange(n, dtype=np.int64)
    dst_ids = np.asarray(dst_ids, dtype=np.int64)
    if d.block_major and nl != d.num_layers:  # a layer subset: one range per block, both
        runs = BlockRuns(order, dst_ids, np.ones(n, dtype=np.int64))
    else:
        runs = merge_runs(order, dst_ids)
    local = block_descs(stage, range(nl), runs.src_starts, runs.lengths)
    return local, block_descs(d, layers, runs.dst_starts, runs.lengths)


def write_descs(
    kv: KVRanks | None,
    src: list[KVLayout],
    dst: list[KVLayout],
    layers: range,
    src_ids: np.ndarray,
    dst_ids: np.ndarray,
    take=None,
) -> tuple[np.ndarray, np.ndarray, list]:
    """Descriptors (ours, the peer's) writing blocks `src_ids` of a node of ranks `src`
    (caches `kv`) into blocks `dst_ids` of a node of ranks `dst`, and the staging buffers
    they read: `take(nbytes)` returns `(key, flat uint8 tensor of nbytes, registered)`;
    the keys are returned, to give back once the transfer's request is freed. `kv` None:
    plan only (buffers at a made-up address)."""
    runs = merge_runs(src_ids, dst_ids)
    local, remote, keys = [], [], []
    n = len(src_ids)
    for p in plan(src, dst):
        d = dst[p.dst]
        if p.direct is not None:
            local.append(block_descs(src[p.direct], layers, runs.src_starts, runs.lengths))
            remote.append(block_descs(d, layers, runs.dst_starts, runs.lengths))
            continue
        base = 1 << 40
        if kv is not None:
            nbytes = n * len(layers) * 2 * d.block_bytes
            key, raw = take(nbytes)
            keys.append(key)
            order = merge_runs(src_ids, np.arange(n, dtype=np.int64))
            gather(kv, src, d, p.parts, layers, order, raw.view(kv.caches[0].dtype))
            base = raw.data_ptr()
        ours, theirs = staged_descs(base, d, layers, dst_ids)
        local.append(ours)
        remote.append(theirs)
    return np.concatenate(local), np.concatenate(remote), keys


class StagingPool:
    """Registered host buffers for staging, reused: a fresh buffer's pages fault in on its
    first write (seconds a GiB in some VMs), and registering costs a NIXL call. Up to
    `keep_bytes` of idle buffers are kept; beyond that the largest idle ones are freed."""

    def __init__(self, register, deregister, keep_bytes: int = 256 << 20) -> None:
        self._register, self._deregister = register, deregister
        self.keep_bytes = keep_bytes
        self._idle: list[tuple[torch.Tensor, object]] = []  # (uint8 buffer, registration)
        self._busy: dict[int, tuple[torch.Tensor, object]] = {}
        self._next = 0

    def take(self, nbytes: int) -> tuple[int, torch.Tensor]:
        fits = [e for e in self._idle if e[0].numel() >= nbytes]
        if fits:
            entry = min(fits, key=lambda e: e[0].numel())
            self._idle.remove(entry)
        else:
            buf = torch.empty(max(nbytes, 1 << 20), dtype=torch.uint8)
            entry = (buf, self._register(buf))
        self._next += 1
        self._busy[self._next] = entry
        return self._next, entry[0][:nbytes]

    def give(self, key: int) -> None:
        self._idle.append(self._busy.pop(key))
        self._idle.sort(key=lambda e: e[0].numel())
        while self._idle and sum(e[0].numel() for e in self._idle) > self.keep_bytes:
            buf, reg = self._idle.pop()
            self._deregister(reg)

    @property
    def num_busy(self) -> int:
        return len(self._busy)

    def close(self) -> None:
        """Deregister every buffer (the busy ones too: the agent is going away)."""
        for _buf, reg in [*self._idle, *self._busy.values()]:
            self._deregister(reg)
        self._idle.clear()
        self._busy.clear()
        self._register = self._deregister = None  # they hold the agent: let it go
