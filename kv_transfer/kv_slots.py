"""Token slots of a paged KV cache as rows: the copies between it and LMCache's chunks.

LMCache's chunk tensor is `[2, num_layers, tokens, hidden]` (hidden = heads * head_dim),
one row per token per (kv, layer), whatever the cache's layout. A token's slot is
`block_id * block_size + offset`. `SlotRows` copies a run of consecutive slots between a
chunk (viewed `[layers, 2, tokens, hidden]`) and the cache:

* layer-major cache (`[L, 2, N, bs, H, D]` contiguous): the slots of one (layer, kv)
  plane are adjacent, so a run of any length is one strided slice
  `[L, 2, n, hidden]` of the view `[L, 2, N * bs, hidden]`;
* block-major cache (storage `[N, L, 2, bs, H, D]`, `kv_layout.alloc_block_major`): each
  block holds every layer's K and V together, so slots are adjacent only inside a block;
  a run is split at block boundaries and each piece is the slice
  `[L, 2, k, hidden]` of that block (one contiguous `[L, 2, bs, hidden]` range).

Both give the same chunk bytes for the same KV values, so chunks are layout-independent:
a block-major node reads what a layer-major node stored and the other way round.
`runs` splits a slot mapping into those runs; `copy_kv` is the copy they use.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch

_SAME_SIZE_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def runs(slots: torch.Tensor) -> list[tuple[int, int, int]]:
    """Split a slot mapping into runs of consecutive slots: (first token, end token, first
    slot); a run of -1s (tokens to skip) is reported with first slot -1.

    Paged blocks make long runs (a whole block at least), so copies are slices, not a
    per-token gather: [0, 1, 2, 7, 8, -1, -1] -> (0, 3, 0), (3, 5, 7), (5, 7, -1).
    """
    s = slots.tolist()
    out, i = [], 0
    for k in range(1, len(s) + 1):
        follows = s[k - 1] >= 0 and s[k] == s[k - 1] + 1 if k < len(s) else False
        if k == len(s) or not (follows or s[k] == s[k - 1] == -1):
            out.append((i, k, s[i] if s[i] >= 0 else -1))
            i = k
    return out


def copy_kv(dst: torch.Tensor, src: torch.Tensor) -> None:
    """`dst.copy_(src)`; between CPU tensors through numpy, one thread: torch splits a
    copy of a block run (~0.7 MB) over its OpenMP pool, which on a busy box waits on
    every thread (docs/benchmarks-history.md, "After: direct chunk reader")."""
    if dst.device.type != "cpu" or src.device.type != "cpu":
        dst.copy_(src, non_blocking=True)
        return
    as_int = _SAME_SIZE_INT[dst.element_size()]
    np.copyto(dst.view(as_int).numpy(), src.view(as_int).numpy())


class SlotRows:
    """Copies between token rows of a chunk and slot runs of one paged KV cache."""

    def __init__(self, kv_cache: torch.Tensor) -> None:
        layers, two, blocks, block_size, heads, head_dim = kv_cache.shape
        self.layers, self.hidden, self.block_size = layers, heads * head_dim, block_size
        self.dtype = kv_cache.dtype
        self.block_major = not kv_cache.is_contiguous()
        # [L, 2, N, bs, hidden]: a view in either layout (heads and head_dim are adjacent)
        self._blocks = kv_cache.view(layers, two, blocks, block_size, self.hidden)
        self._flat = (
            None if self.block_major else kv_cache.view(layers, two, -1, self.hidden)
        )  # [L, 2, slots, hidden]

    def pieces(self, first_slot: int, n: int) -> Iterator[tuple[int, int, torch.Tensor]]:
        """The cache rows of slots [first_slot, first_slot + n) as (offset in the run,
        tokens, view) pieces. Layer-major: one `[L, 2, n, hidden]` view. Block-major: a
        partial block is a `[L, 2, k, hidden]` view; consecutive whole blocks are one
        `[L, 2, blocks, bs, hidden]` view (one copy however many blocks)."""
        if self._flat is not None:
            yield 0, n, self._flat[:, :, first_slot : first_slot + n]
            return
        bs, done = self.block_size, 0
        while done < n:
            b, off = divmod(first_slot + done, bs)
            whole = (n - done) // bs if off == 0 else 0
            if whole:
                yield done, whole * bs, self._blocks[:, :, b : b + whole]
                done += whole * bs
                continue
            k = min(bs - off, n - done)
            yield done, k, self._blocks[:, :, b, off : off + k]
            done += k

    def read(self, dst: torch.Tensor, slots: torch.Tensor) -> None:
        """Copy the cache rows of `slots` into `dst` `[L, 2, len(slots), hidden]`."""
        for i, j, s in runs(slots):
            if s < 0:
                raise ValueError(f"tokens {i}..{j} have no slot (-1): nothing to read")
            for off, k, rows in self.pieces(s, j - i):
                copy_kv(_like(dst[:, :, i + off : i + off + k], rows), rows)

    def write(self, slots: torch.Tensor, src: torch.Tensor) -> None:
        """Copy `src` `[L, 2, len(slots), hidden]` into the cache rows of `slots`; tokens
        whose slot is -1 (present locally) are left alone."""
        for i, j, s in runs(slots):
            if s < 0:
                continue
            for off, k, rows in self.pieces(s, j - i):
                copy_kv(rows, _like(src[:, :, i + off : i + off + k], rows))


def _like(chunk_rows: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """`chunk_rows` `[L, 2, T, hidden]` viewed as `rows`' shape (`[L, 2, T / bs, bs, hidden]`
    for a span of whole blocks)."""
    return chunk_rows if rows.dim() == 4 else chunk_rows.unflatten(2, rows.shape[2:4])
