"""The measured side of `pdserve bench kv`: NIXL transports, the cases, the timing.

Shapes are the default model's (SmolLM2-135M: 30 layers, 3 KV heads, head_dim 64, engine
block 16). For each request size (tokens) the peer moves the request's KV blocks into the
listener's paged KV tensor with `NixlTransport.write_blocks`:
- `paged_contig`: consecutive block ids on both sides (2 descriptors per layer);
- `paged_scattered`: every other source block (one descriptor per block per layer-kv);
- `blockmajor_contig`, `blockmajor_scattered`: the same two block lists between block-major
  KV caches (`kv_layout.alloc_block_major`: a block holds every layer's K and V, so a
  run, or a lone scattered block, is ONE descriptor);
- `nixl_flat`: one contiguous NIXL WRITE of the same byte count (a flat region);
- `memcpy`: a torch `copy_` of the same byte count in one process (one thread).
Latency is post-to-DONE wall time; GB/s is bytes / p50 latency. Methods run round-robin
so background noise hits them alike. Imports torch and nixl: only `bench kv` loads it.
"""

from __future__ import annotations

import hashlib
import time
from typing import NamedTuple

import numpy as np
import torch

from pdserve.bench.kv_wire import KVGeometry
from pdserve.kv_transfer.kv_layout import alloc_block_major
from pdserve.kv_transfer.nixl_transport import NixlTransport, TransferState

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
METHODS = ("memcpy", "nixl_flat", "paged_contig", "paged_scattered", "blockmajor_contig",
           "blockmajor_scattered")  # fmt: skip


class Side(NamedTuple):
    """One side's transports and the KV tensors behind them."""

    kv: NixlTransport  # layer-major paged cache (the engine's layout)
    flat: NixlTransport
    bm: NixlTransport  # block-major paged cache
    kv_tensor: torch.Tensor
    bm_tensor: torch.Tensor

    def close(self) -> None:
        for t in (self.kv, self.flat, self.bm):
            t.close()


def geometry_bytes(g: KVGeometry) -> int:
    """Bytes one side allocates for `g` (paged KV tensor + flat region)."""
    item = DTYPES[g.dtype].itemsize
    paged = g.layers * 2 * g.max_blocks * g.block_size * g.kv_heads * g.head_dim * item
    return 2 * paged + g.flat_layers * 2 * g.flat_granule


def transports(g: KVGeometry, name: str, fill: bool) -> Side:
    """The paged KV caches (layer- and block-major) and a flat byte region of one side.

    The flat region is shaped so that block 0 of layers [0, n) is the region's first
    n * 2 * granule bytes: those 2n planes are adjacent on both sides, so the transport
    coalesces them into ONE descriptor, the contiguous-WRITE baseline.
    """
    kv = torch.zeros(g.layers, 2, g.max_blocks, g.block_size, g.kv_heads, g.head_dim,
                     dtype=DTYPES[g.dtype])  # fmt: skip
    bm = alloc_block_major(g.layers, g.max_blocks, g.block_size, g.kv_heads, g.head_dim,
                           dtype=DTYPES[g.dtype])  # fmt: skip
    if fill:
        kv.uniform_()
        bm.copy_(kv)
    flat = torch.zeros(g.flat_layers, 2, 1, g.flat_granule, 1, 1, dtype=torch.uint8)
    kw = {
        "backend_params": {"ucx_error_handling_mode": g.error_mode},
        "progress_thread": g.progress_thread,
    }
    return Side(
        NixlTransport(f"{name}-kv", kv, **kw),
        NixlTransport(f"{name}-flat", flat, **kw),
        NixlTransport(f"{name}-bm", bm, **kw),
        kv,
        bm,
    )


def blocks_digest(kv: torch.Tensor, block_ids: list[int]) -> str:
    """sha256 of blocks `block_ids` of every layer and plane, in that order (the same
    for a layer-major and a block-major cache holding the same values)."""
    idx = torch.tensor(block_ids, dtype=torch.long)
    data = kv.index_select(2, idx).contiguous().view(torch.uint8)
    return hashlib.sha256(data.numpy().tobytes()).hexdigest()


def _time_write(t: NixlTransport, peer: str, src, dst, layers=None) -> tuple[float, int]:
    t0 = time.perf_counter()
    h = t.write_blocks(peer, src, dst, layers=layers)
    state = t.wait(h, timeout_s=120)
    elapsed = time.perf_counter() - t0
    t.release(h)
    if state is not TransferState.DONE:
        raise RuntimeError(f"transfer to {peer} ended {state.name}")
    return elapsed, h.stats.descriptors


def summary(tokens: int, method: str, nbytes: int, descs: int, times: list[float]) -> dict:
    p50, p99 = np.percentile(times, 50), np.percentile(times, 99)
    return {
        "tokens": tokens,
        "method": method,
        "bytes": nbytes,
        "descriptors": descs,
        "iters": len(times),
        "p50_ms": round(float(p50) * 1e3, 4),
        "p99_ms": round(float(p99) * 1e3, 4),
        "gbps": round(nbytes / float(p50) / 1e9, 3),
    }


def measure(
    g: KVGeometry,
    side: Side,
    peers: tuple[str, str, str],
    tokens_list: list[int],
    iters: int,
    warmup: int,
    on_row=None,
    progress: bool = True,
) -> list[dict]:
    from tqdm import tqdm

    kv, flat, bm = side.kv, side.flat, side.bm
    kv_peer, flat_peer, bm_peer = peers
    block_bytes = g.block_size * g.kv_heads * g.head_dim * DTYPES[g.dtype].itemsize
    torch.set_num_threads(1)  # memcpy baseline: one copying thread, like one CMA put
    src_mem = torch.empty(flat.layout.total_bytes, dtype=torch.uint8).random_()
    dst_mem = torch.empty_like(src_mem)

    def memcpy(nb: int, nbytes: int) -> tuple[float, int]:
        t0 = time.perf_counter()
        dst_mem[:nbytes].copy_(src_mem[:nbytes])
        return time.perf_counter() - t0, 1

    cases = {
        "memcpy": memcpy,
        "nixl_flat": lambda nb, _: _time_write(flat, flat_peer, [0], [0], layers=range(nb)),
        "paged_contig": lambda nb, _: _time_write(kv, kv_peer, list(range(nb)), list(range(nb))),
        "paged_scattered": lambda nb, _: _time_write(
            kv, kv_peer, list(range(0, 2 * nb, 2)), list(range(nb))
        ),
        "blockmajor_contig": lambda nb, _: _time_write(
            bm, bm_peer, list(range(nb)), list(range(nb))
        ),
        "blockmajor_scattered": lambda nb, _: _time_write(
            bm, bm_peer, list(range(0, 2 * nb, 2)), list(range(nb))
        ),
    }
    plan = []
    for tokens in tokens_list:
        nb = -(-tokens // g.block_size)
        nbytes = nb * g.layers * 2 * block_bytes
        plan.append((tokens, nb, nbytes, max(5, min(iters, int(iters * 2**24 / nbytes)))))
    bar = tqdm(total=sum(warmup + n for *_, n in plan), desc="kv transfer", unit="round",
               disable=not progress)  # fmt: skip
    rows = []
    for tokens, nb, nbytes, n_iters in plan:
        times: dict[str, list[float]] = {m: [] for m in cases}
        descs: dict[str, int] = {}
        for i in range(warmup + n_iters):
            for method, fn in cases.items():
                dt, descs[method] = fn(nb, nbytes)
                if i >= warmup:
                    times[method].append(dt)
            bar.update()
        for method in cases:
            row = summary(tokens, method, nbytes, descs[method], times[method])
            rows.append(row)
            if on_row is not None:
                on_row(row)
    bar.close()
    return with_ratios(rows)


def first_write(t: NixlTransport, metadata: bytes, warm: int = 20) -> tuple[str, dict]:
    """Meet a new peer: `add_peer` (which connects, `nixl_transport.CONNECT_S`, and posts
    the connection warm-up, kv_transfer/nixl_warmup.py), the warm-up driven to its end
    every 1 ms (as an idle engine loop does), the first 1-block WRITE, then `warm` more of
    the same. Returns the peer's name and the times in ms (`warm_write_ms`: their median)."""
    t0 = time.perf_counter()
    peer = t.add_peer(metadata)
    t1 = time.perf_counter()
    ended: list[tuple[str, str | None]] = []
    while t.num_warming:
        ended += t.progress_warmups()  # bounded: every warm-up ends by its deadline
        time.sleep(1e-3)
    warmup = time.perf_counter() - t1
    ended += t.progress_warmups()
    first, _ = _time_write(t, peer, [0], [0])
    warm_times = [_time_write(t, peer, [0], [0])[0] for _ in range(warm)]
    return peer, {
        "add_peer_ms": round((t1 - t0) * 1e3, 4),
        "warmup_ms": round(warmup * 1e3, 4),
        "warmup_ok": ended == [(peer, None)],
        "first_write_ms": round(first * 1e3, 4),
        "warm_write_ms": round(float(np.median(warm_times)) * 1e3, 4),
        "write_bytes": t.layout.block_bytes * 2 * t.layout.num_layers,
    }


def final_write(t: NixlTransport, peer: str, tensor: torch.Tensor, nb: int, step: int) -> str:
    """WRITE src blocks 0, step, 2 * step, ... into dst blocks [0, nb) once more; the
    digest of the source blocks, for the listener's digest of [0, nb) to match."""
    src = list(range(0, step * nb, step))
    _time_write(t, peer, src, list(range(nb)))
    return blocks_digest(tensor, src)


def with_ratios(rows: list[dict]) -> list[dict]:
    """Add each row's bandwidth as a fraction of the contiguous NIXL WRITE of that size."""
    flat = {r["tokens"]: r["gbps"] for r in rows if r["method"] == "nixl_flat"}
    for r in rows:
        r["vs_nixl_flat"] = round(r["gbps"] / flat[r["tokens"]], 3) if r["tokens"] in flat else None
    return rows
