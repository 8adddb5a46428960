"""Where each paged KV block of a node lives in memory, and how block lists become descriptors.

A node's KV cache is ONE contiguous tensor

    kv_cache  # [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]  (2 = K, V)

so block `b` of layer `l`, plane `kv` (0 = K, 1 = V) is the contiguous byte range

    base_addr + ((l * 2 + kv) * num_blocks + b) * block_bytes   ...  + block_bytes

and consecutive block ids are adjacent in memory inside one (layer, kv) plane
("layer-major"). A block-major cache stores the same logical tensor as the view
`storage.permute(1, 2, 0, 3, 4, 5)` of a contiguous `[num_blocks, num_layers, 2, ...]`
tensor (`alloc_block_major`): then block `b` of EVERY layer, K and V, is one contiguous
range `base_addr + b * num_layers * 2 * block_bytes`, so a scattered block costs one
descriptor instead of `2 * num_layers`. `KVLayout` records exactly the numbers needed to
compute those addresses on a *remote* node, and is sent with the node's NIXL metadata
(msgspec, never pickle). Both sides of a transfer must use the same kind of layout.

`merge_runs` turns a src->dst block mapping into maximal runs where both sides are
consecutive; `block_descs` turns runs into one (addr, len, dev) descriptor per
(layer, kv, run) (layer-major) or per run (block-major, all layers; per block for a
subset of layers), which is what the transport hands to NIXL.

A tensor-parallel node has one such tensor per rank, each holding some KV heads
(`KVRanks`; one `KVLayout` per rank, `kv_head_start`): kv_transfer/tp_staging.py plans a
WRITE between nodes of any two TP sizes (docs/architecture.md, "PD between TP sizes").
"""

from __future__ import annotations

from typing import NamedTuple

import msgspec
import numpy as np
import torch

from pdserve.engine.kv_tensor import BLOCK_MAJOR, KVRanks, allocate_kv_cache

_DTYPES: dict[torch.dtype, str] = {
    torch.float32: "float32",
    torch.float16: "float16",
    torch.bfloat16: "bfloat16",
    torch.float8_e4m3fn: "float8_e4m3fn",
    torch.float8_e5m2: "float8_e5m2",
    torch.uint8: "uint8",
}

# Fields two layouts must share for a block of one to be a block of the other.
_SHAPE_FIELDS = (
    "num_layers",
    "block_size",
    "total_kv_heads",
    "head_dim",
    "dtype",
    "itemsize",
    "block_major",
)


def alloc_block_major(
    num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, **kw
) -> torch.Tensor:
    """A zeroed `[L, 2, N, bs, Hkv, D]` KV cache whose storage is block-major (a view)."""
    return allocate_kv_cache(
        BLOCK_MAJOR, num_layers, num_blocks, block_size, num_kv_heads, head_dim, **kw
    )


def storage_of(kv_cache: torch.Tensor) -> torch.Tensor:
    """The contiguous tensor behind `kv_cache` (itself, or a block-major cache's storage)."""
    return kv_cache if kv_cache.is_contiguous() else kv_cache.permute(2, 0, 1, 3, 4, 5)


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
    block_major: bool = False  # storage [N, L, 2, ...]: a block's layers are contiguous
    # A rank of a tensor-parallel node holds KV heads [kv_head_start, + num_kv_heads) of
    # the model's `model_kv_heads` (0: a one-device node, which holds them all).
    kv_head_start: int = 0
    model_kv_heads: int = 0
    tp_size: int = 1

    @property
    def total_kv_heads(self) -> int:
        """The model's KV heads (this layout holds `num_kv_heads` of them)."""
        return self.model_kv_heads or self.num_kv_heads

    @property
    def head_range(self) -> tuple[int, int]:
        return self.kv_head_start, self.kv_head_start + self.num_kv_heads

    @property
    def block_bytes(self) -> int:
        """Bytes of one block in one (layer, kv) plane."""
        return self.block_size * self.num_kv_heads * self.head_dim * self.itemsize

    @property
    def stride_bytes(self) -> int:
        """Bytes from block b to block b + 1 of one (layer, kv) plane."""
        return self.block_bytes * (2 * self.num_layers if self.block_major else 1)

    @property
    def plane_bytes(self) -> int:
        """Bytes of one (layer, kv) plane: all blocks of K (or V) of one layer."""
        return self.num_blocks * self.block_bytes

    @property
    def total_bytes(self) -> int:
        return self.num_layers * 2 * self.plane_bytes

    @classmethod
    def of_ranks(cls, kv: torch.Tensor | KVRanks) -> list[KVLayout]:
        """One layout per rank of a node's KV cache (one for a one-device node's tensor)."""
        if not isinstance(kv, KVRanks):
            return [cls.from_tensor(kv)]
        tp = len(kv.caches)
        return [
            msgspec.structs.replace(
                cls.from_tensor(c), kv_head_start=s, model_kv_heads=kv.total_heads, tp_size=tp
            )
            for c, s in zip(kv.caches, kv.head_starts)
        ]

    @classmethod
    def from_tensor(cls, kv_cache: torch.Tensor) -> KVLayout:
        """Describe `kv_cache`; raises ValueError unless it is a 6-d KV tensor that is
        contiguous (layer-major) or a block-major view (`alloc_block_major`)."""
        if kv_cache.dim() != 6 or kv_cache.shape[1] != 2:
            raise ValueError(
                "kv_cache must be [num_layers, 2, num_blocks, block_size, num_kv_heads, "
                f"head_dim], got shape {tuple(kv_cache.shape)}"
            )
        block_major = not kv_cache.is_contiguous()
        if block_major and not storage_of(kv_cache).is_contiguous():
            raise ValueError(
                "kv_cache must be contiguous, or a block-major view of a contiguous "
                "[num_blocks, num_layers, 2, ...] tensor (one registered memory region)"
            )
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
            block_major=block_major,
        )

    def check_compatible(self, other: KVLayout, same_storage: bool = True) -> None:
        """Raise ValueError unless blocks of `other` have this layout's shape and dtype.

        The number of blocks may differ: each side validates ids against its own count.
        `same_storage=False`: the storage order may differ too (LMCache's chunks are the
        same bytes from either layout; NIXL's descriptors are not).
        """
        fields = _SHAPE_FIELDS if same_storage else _SHAPE_FIELDS[:-1]
        diff = [
            f"{f}: ours {getattr(self, f)}, peer's {getattr(other, f)}"
            for f in fields
            if getattr(self, f) != getattr(other, f)
        ]
        if same_storage and self.block_major != other.block_major:
            diff.append("prefill and decode nodes need the same cache.kv_layout (--kv-layout)")
        if diff and self.tp_size * other.tp_size > 1:
            diff.append(f"tensor_parallel_size: ours {self.tp_size}, peer's {other.tp_size}")
        if diff:
            raise ValueError("incompatible KV layouts (" + "; ".join(diff) + ")")

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

    Layer-major: one row per (layer in `layers`, kv in (K, V), run), ordered plane-major.
    Block-major: one row per run when `layers` is every layer (the run's whole range), else
    one row per (block, run) covering `layers`' K and V. The same call on the peer's layout
    (of the same kind) with the dst starts yields the matching remote rows.
    """
    if layout.block_major:
        return _block_major_descs(layout, layers, starts, lengths)
    planes = np.array([layer * 2 + kv for layer in layers for kv in (0, 1)], dtype=np.uint64)
    bb = np.uint64(layout.block_bytes)
    offsets = planes[:, None] * np.uint64(layout.num_blocks) + starts.astype(np.uint64)[None, :]
    descs = np.empty((offsets.size, 3), dtype=np.uint64)
    descs[:, 0] = np.uint64(layout.base_addr) + offsets.reshape(-1) * bb
    descs[:, 1] = np.tile(lengths.astype(np.uint64) * bb, len(planes))
    descs[:, 2] = layout.device_id
    return descs


def _block_major_descs(
    layout: KVLayout, layers: range, starts: np.ndarray, lengths: np.ndarray
) -> np.ndarray:
    per_layer = np.uint64(2 * layout.block_bytes)
    block = np.uint64(layout.stride_bytes)
    first = np.uint64(layers.start) * per_layer
    if len(layers) == layout.num_layers and layers.step == 1:
        blocks, sizes = starts.astype(np.uint64), lengths.astype(np.uint64) * block
    else:
        if layers.step != 1:
            raise ValueError(f"layers {layers} must be a contiguous range")
        blocks = np.concatenate([np.arange(s, s + n) for s, n in zip(starts, lengths)])
        blocks = blocks.astype(np.uint64)
        sizes = np.full(blocks.size, np.uint64(len(layers)) * per_layer, dtype=np.uint64)
    descs = np.empty((blocks.size, 3), dtype=np.uint64)
    descs[:, 0] = np.uint64(layout.base_addr) + blocks * block + first
    descs[:, 1] = sizes
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


def check_ranks(ours: KVLayout, peer: list[KVLayout]) -> None:
    """Raise ValueError unless a peer's rank layouts (from its metadata: untrusted) describe
    one node whose blocks are ours: each rank compatible with ours, its heads inside the
    model's, the same blocks on every rank, every head held by some rank."""
    if not peer or len(peer) != peer[0].tp_size or len(peer) > 1024:
        raise ValueError(f"peer announces {len(peer)} rank layouts for TP {peer[0].tp_size}")
    held: set[int] = set()
    for r in peer:
        ours.check_compatible(r)
        start, end = r.head_range
        if r.tp_size != peer[0].tp_size or r.num_blocks != peer[0].num_blocks:
            raise ValueError("peer's ranks differ in TP size or number of blocks")
        if start < 0 or r.num_kv_heads < 1 or end > r.total_kv_heads:
            raise ValueError(f"peer rank holds KV heads [{start}, {end}) of {r.total_kv_heads}")
        held.update(range(start, end))
    if len(held) != ours.total_kv_heads:
        raise ValueError(f"peer's ranks hold {len(held)} of the {ours.total_kv_heads} KV heads")
