"""Where each paged KV block of a node lives in memory, and how block lists become descriptors.

A node's KV cache is ONE contiguous tensor

    kv_cache  # [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]  (2 = K, V)

so block `b` of layer `l`, plane `kv` (0 = K, 1 = V) is the contiguous byte range

    base_addr + ((l * 2 + kv) * num_blocks + b) * block_bytes   ...  + block_bytes

and consecutive block ids are adjacent in memory inside one (layer, kv) plane. `KVLayout`
records exactly the numbers needed to compute those addresses on a *remote* node, and is
sent with the node's NIXL metadata (msgspec, never pickle).

`merge_runs` turns a src->dst block mapping into maximal runs where both sides are
consecutive; `block_descs` turns runs into one (addr, len, dev) descriptor per
(layer, kv, run), which is what the transport hands to NIXL.
"""

from __future__ import annotations

from typing import NamedTuple

import msgspec
import numpy as np
import torch

_DTYPES: dict[torch.dtype, str] = {
    torch.float32: "float32",
    torch.float16: "float16",
    torch.bfloat16: "bfloat16",
    torch.float8_e4m3fn: "float8_e4m3fn",
    torch.float8_e5m2: "float8_e5m2",
    torch.uint8: "uint8",
}

# Fields two layouts must share for a block of one to be a block of the other.
_SHAPE_FIELDS = ("num_layers", "block_size", "num_kv_heads", "head_dim", "dtype", "itemsize")


class KVLayout(msgspec.Struct, frozen=True):
    """Shape, dtype and address of one node's paged KV cache tensor."""

    num_layers: int
    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str  # torch dtype name without the "torch." prefix, e.g. "float32"
    itemsize: int  # bytes per element
    mem_type: str  # "DRAM" (CPU tensor) or "VRAM" (CUDA tensor)
    device_id: int  # CUDA device index; 0 for DRAM
    base_addr: int  # address of kv_cache[0, 0, 0]

    @property
    def block_bytes(self) -> int:
        """Bytes of one block in one (layer, kv) plane."""
        return self.block_size * self.num_kv_heads * self.head_dim * self.itemsize

    @property
    def plane_bytes(self) -> int:
        """Bytes of one (layer, kv) plane: all blocks of K (or V) of one layer."""
        return self.num_blocks * self.block_bytes

    @property
    def total_bytes(self) -> int:
        return self.num_layers * 2 * self.plane_bytes

    @classmethod
    def from_tensor(cls, kv_cache: torch.Tensor) -> KVLayout:
        """Describe `kv_cache`; raises ValueError unless it is a contiguous 6-d KV tensor."""
        if kv_cache.dim() != 6 or kv_cache.shape[1] != 2:
            raise ValueError(
                "kv_cache must be [num_layers, 2, num_blocks, block_size, num_kv_heads, "
                f"head_dim], got shape {tuple(kv_cache.shape)}"
            )
        if not kv_cache.is_contiguous():
            raise ValueError("kv_cache must be contiguous (one registered memory region)")
        if kv_cache.dtype not in _DTYPES:
            raise ValueError(f"unsupported kv_cache dtype {kv_cache.dtype}")
        if kv_cache.device.type not in ("cpu", "cuda"):
            raise ValueError(f"kv_cache must live on cpu or cuda, not {kv_cache.device}")
        layers, _, blocks, block_size, heads, head_dim = kv_cache.shape
        is_cuda = kv_cache.device.type == "cuda"
        return cls(
            num_layers=layers,
            num_blocks=blocks,
            block_size=block_size,
            num_kv_heads=heads,
            head_dim=head_dim,
            dtype=_DTYPES[kv_cache.dtype],
            itemsize=kv_cache.element_size(),
            mem_type="VRAM" if is_cuda else "DRAM",
            device_id=(kv_cache.device.index or 0) if is_cuda else 0,
            base_addr=kv_cache.data_ptr(),
        )

    def check_compatible(self, other: KVLayout) -> None:
        """Raise ValueError unless blocks of `other` have this layout's shape and dtype.

        The number of blocks may differ: each side validates ids against its own count.
        """
        diff = [
            f"{f}: {getattr(self, f)} != {getattr(other, f)}"
            for f in _SHAPE_FIELDS
            if getattr(self, f) != getattr(other, f)
        ]
        if diff:
            raise ValueError("incompatible KV layouts (" + ", ".join(diff) + ")")

    def check_block_ids(self, ids: np.ndarray, side: str) -> None:
        """Raise ValueError if any id is outside [0, num_blocks)."""
        if ids.size and (ids.min() < 0 or ids.max() >= self.num_blocks):
            bad = ids[(ids < 0) | (ids >= self.num_blocks)]
            raise ValueError(
                f"{side} block ids out of range [0, {self.num_blocks}): {bad[:8].tolist()}"
            )

    def check_layers(self, layers: range) -> None:
        if len(layers) == 0:
            raise ValueError("layers is empty")
        if min(layers) < 0 or max(layers) >= self.num_layers:
            raise ValueError(f"layers {layers} outside [0, {self.num_layers})")


class BlockRuns(NamedTuple):
    """Maximal runs of a src->dst block mapping where both sides are consecutive."""

    src_starts: np.ndarray  # [R] int64
    dst_starts: np.ndarray  # [R] int64
    lengths: np.ndarray  # [R] int64, number of blocks in each run

    @property
    def num_blocks(self) -> int:
        return int(self.lengths.sum())


def merge_runs(src_ids: np.ndarray, dst_ids: np.ndarray) -> BlockRuns:
    """Split the pairing `src_ids[i] -> dst_ids[i]` into runs consecutive on both sides.

    Example: src [4, 5, 6, 9], dst [0, 1, 7, 8] -> runs (4->0, 2), (6->7, 1), (9->8, 1).
    """
    if src_ids.size == 0:
        empty = np.zeros(0, dtype=np.int64)
        return BlockRuns(empty, empty, empty)
    breaks = (np.diff(src_ids) != 1) | (np.diff(dst_ids) != 1)
    starts = np.concatenate(([0], np.flatnonzero(breaks) + 1))
    lengths = np.diff(np.concatenate((starts, [src_ids.size])))
    return BlockRuns(src_ids[starts], dst_ids[starts], lengths.astype(np.int64))


def block_descs(
    layout: KVLayout, layers: range, starts: np.ndarray, lengths: np.ndarray
) -> np.ndarray:
    """NIXL descriptors [N, 3] (addr, len, dev) for runs `starts/lengths` in every plane.

    One row per (layer in `layers`, kv in (K, V), run), ordered plane-major; the same
    call on the peer's layout with the dst starts yields the matching remote rows.
    """
    planes = np.array([layer * 2 + kv for layer in layers for kv in (0, 1)], dtype=np.uint64)
    bb = np.uint64(layout.block_bytes)
    offsets = planes[:, None] * np.uint64(layout.num_blocks) + starts.astype(np.uint64)[None, :]
    descs = np.empty((offsets.size, 3), dtype=np.uint64)
    descs[:, 0] = np.uint64(layout.base_addr) + offsets.reshape(-1) * bb
    descs[:, 1] = np.tile(lengths.astype(np.uint64) * bb, len(planes))
    descs[:, 2] = layout.device_id
    return descs


def coalesce(local: np.ndarray, remote: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Merge descriptor i+1 into i wherever it directly follows i on BOTH sides.

    Runs never cross a (layer, kv) plane by themselves; this joins a run that ends a plane
    with one that starts the next (e.g. whole-cache copies), so fewer, larger puts go out.
    """
    if local.shape[0] < 2:
        return local, remote
    follows = (local[1:, 0] == local[:-1, 0] + local[:-1, 1]) & (
        remote[1:, 0] == remote[:-1, 0] + remote[:-1, 1]
    )
    if not follows.any():
        return local, remote
    starts = np.concatenate(([0], np.flatnonzero(~follows) + 1))
    lengths = np.add.reduceat(local[:, 1], starts)
    local, remote = local[starts].copy(), remote[starts].copy()
    local[:, 1] = lengths
    remote[:, 1] = lengths
    return local, remote
