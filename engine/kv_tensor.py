"""The paged KV cache tensor: one allocation per node, in either storage order.

Every kernel and connector sees the same logical tensor

    kv_cache  # [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]  (2 = K, V)

and a layer reads `kv_cache[layer, 0]` / `kv_cache[layer, 1]`, each `[N, bs, Hkv, D]`.
What differs is the storage behind it (`cache.kv_layout`):

- `layer_major`: the tensor is contiguous. One layer's K (or V) is one contiguous plane,
  block `b` of it at `b * bs * Hkv * D`.
- `block_major`: the storage is a contiguous `[N, L, 2, bs, Hkv, D]` tensor and the
  logical tensor is its permuted view. A block holds every layer's K and V in one
  contiguous range (one NIXL descriptor per run of blocks, kv_transfer/kv_layout.py);
  a layer's `[N, bs, Hkv, D]` view steps `2 * L * bs * Hkv * D` elements from block to
  block, while each block's `[bs, Hkv, D]` stays contiguous. The kernels take that block
  stride (kernels/reference.py documents the contract).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from pdserve.kernels import hugepages

LAYER_MAJOR = "layer_major"
BLOCK_MAJOR = "block_major"


def _zeros(shape, dtype=None, device=None) -> torch.Tensor:
    """torch.zeros; on CPU on huge pages where the kernel offers them (kernels/hugepages.py):
    attention reads blocks scattered over the whole cache."""
    if device is None or torch.device(device).type == "cpu":
        return hugepages.zeros(shape, dtype or torch.get_default_dtype())
    return torch.zeros(shape, dtype=dtype, device=device)


def allocate_kv_cache(
    layout: str,
    num_layers: int,
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    **tensor_kw,
) -> torch.Tensor:
    """A zeroed `[L, 2, N, bs, Hkv, D]` KV cache stored in `layout` order."""
    if layout == LAYER_MAJOR:
        shape = (num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim)
        return _zeros(shape, **tensor_kw)
    if layout == BLOCK_MAJOR:
        shape = (num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim)
        return _zeros(shape, **tensor_kw).permute(1, 2, 0, 3, 4, 5)
    raise ValueError(f"unknown KV cache layout {layout!r}; expected {LAYER_MAJOR} or {BLOCK_MAJOR}")


def layout_of(kv_cache: torch.Tensor) -> str:
    """`layer_major` for a contiguous cache, `block_major` for the permuted view."""
    return LAYER_MAJOR if kv_cache.is_contiguous() else BLOCK_MAJOR


def shared_kv_cache(
    layout: str,
    path: str,
    num_layers: int,
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    """The `[L, 2, N, bs, Hkv, D]` KV cache stored in the shared file `path` (MAP_SHARED),
    in `layout` order: a tensor-parallel rank's cache, which its node's engine process maps
    too (engine/tp_runner.py), so that one NIXL agent there moves every rank's blocks."""
    if layout not in (LAYER_MAJOR, BLOCK_MAJOR):
        raise ValueError(f"unknown KV cache layout {layout!r}")
    shape = (num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim)
    numel = num_layers * 2 * num_blocks * block_size * num_kv_heads * head_dim
    flat = torch.from_file(path, shared=True, size=numel, dtype=dtype)
    if layout == LAYER_MAJOR:
        return flat.view(shape)
    return flat.view(num_blocks, num_layers, 2, *shape[3:]).permute(1, 2, 0, 3, 4, 5)


@dataclass(frozen=True)
class KVRanks:
    """A tensor-parallel node's KV cache as the connector sees it: one tensor per rank, rank
    r holding the model's KV heads `[head_starts[r], head_starts[r] + caches[r].shape[4])`
    of `total_heads` (ranks share heads when there are fewer KV heads than ranks). Every
    rank has the same blocks: block b of the node is block b of each rank."""

    caches: tuple[torch.Tensor, ...]
    head_starts: tuple[int, ...]
    total_heads: int

    def __post_init__(self) -> None:
        if len(self.caches) != len(self.head_starts) or not self.caches:
            raise ValueError("one head start per rank cache, at least one rank")
        for c, s in zip(self.caches, self.head_starts):
            if (
                c.shape[:4] != self.caches[0].shape[:4]
                or not 0 <= s <= self.total_heads - c.shape[4]
            ):
                raise ValueError(f"rank cache {tuple(c.shape)} at head {s} does not fit")

    @functools.cached_property
    def distinct(self) -> list[int]:
        """The ranks that together hold every KV head once, in head order."""
        seen, out = set(), []
        for r in sorted(range(len(self.caches)), key=lambda r: self.head_starts[r]):
            if self.head_starts[r] not in seen:
                seen.add(self.head_starts[r])
                out.append(r)
        return out

    def logical_block(self, layer: int, kv: int, block: int, rows: int) -> torch.Tensor:
        """`[rows, total_heads, D]`: the first `rows` token rows of a block of one layer's K
        or V, every head, as one single-device node would hold it (a copy)."""
        parts = [self.caches[r][layer, kv, block, :rows] for r in self.distinct]
        return torch.cat(parts, dim=1)
