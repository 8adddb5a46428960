"""`pdserve bench kv-store`: the LMCache path (our paged cache <-> Redis) vs plain redis-py.

    pdserve bench kv-store --out results/kv_store.json [--tokens 256 1024 2048]

For each request size (tokens), in the default model's KV shapes (SmolLM2-135M: 30
layers, 3 KV heads, head_dim 64, fp32, block 16) and the store's chunking:
  * lmcache store->visible: `LMCacheKVStore.store` of a prompt's blocks plus the wait
    until every chunk is visible in Redis (what a node on another machine needs);
  * lmcache retrieve: a second store (its own, empty local CPU tier, so every chunk comes
    from Redis) loads the prompt into scattered blocks of its paged cache, through our
    direct reader of LMCache's Redis chunks (`kv_transfer/lmcache_redis_reader.py`, the
    default);
  * lmcache retrieve (builtin): the same through LMCache's own Redis backend
    (`fast_retrieve=False`, a third store), for comparison;
  * redis-py SET / GET: the same bytes, one value per chunk, pipelined (the floor the
    connector is measured against; goal: LMCache within 1.5x of it);
  * memcpy: a torch copy of the same bytes.
The lmcache rows are measured for each KV cache layout (`--layouts`): `lmcache_*` on a
layer-major cache, `lmcache_bm_*` on a block-major one (a block holds every layer's K
and V: chunk rows are copied per block), interleaved per iteration.
GB/s is bytes / median wall time, each iteration on fresh token ids (nothing is cached).
Both paths run side by side in one process, against one local redis-server.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import time
from pathlib import Path
from typing import NamedTuple

import torch

from pdserve.cluster.embedded_redis import EmbeddedRedis
from pdserve.engine.kv_tensor import allocate_kv_cache
from pdserve.kv_transfer.lmcache_store import LMCacheKVStore

logger = logging.getLogger(__name__)

LAYERS, KV_HEADS, HEAD_DIM, BLOCK = 30, 3, 64, 16
DEFAULT_TOKENS = (256, 1024, 2048)
LAYOUTS = ("layer_major", "block_major")


def _gbps(nbytes: int, times: list[float]) -> dict:
    med = statistics.median(times)
    p99 = sorted(times)[min(len(times) - 1, int(0.99 * len(times)))]
    return {"p50_s": med, "p99_s": p99, "min_s": min(times), "gbps": nbytes / med / 1e9}


class LayoutStores(NamedTuple):
    """One layout's stores: `a` stores from `kv_a`, `b` retrieves into `kv_b`."""

    prefix: str  # method prefix: "lmcache" (layer-major) or "lmcache_bm" (block-major)
    a: LMCacheKVStore
    b: LMCacheKVStore
    kv_a: torch.Tensor
    kv_b: torch.Tensor


def _rows(kv: torch.Tensor, slots: list[int]) -> torch.Tensor:
    """The logical rows of `slots` (either storage order): [L, 2, len(slots), H, D]."""
    idx = torch.tensor(slots)
    return kv[:, :, idx // BLOCK, idx % BLOCK]


def bench_size(tokens: int, iters: int, chunk: int, url: str, paths: list[LayoutStores], c) -> dict:
    """One request size through every layout's stores, interleaved per iteration (load
    shifts hit them alike); `c` (LMCache's own Redis reader, layer-major) may be None."""
    import redis

    nblocks = paths[0].kv_a.shape[2]
    need = -(-tokens // BLOCK)
    src_blocks = list(range(need))
    dst_blocks = list(range(nblocks - 1, nblocks - 1 - 2 * need, -2))  # scattered, reversed
    src_slots = [s * BLOCK + i for s in src_blocks for i in range(BLOCK)][:tokens]
    dst_slots = [d * BLOCK + i for d in dst_blocks for i in range(BLOCK)][:tokens]
    per_token = LAYERS * 2 * KV_HEADS * HEAD_DIM * paths[0].kv_a.element_size()
    nbytes = tokens * per_token
    gen = torch.Generator().manual_seed(tokens)
    # fresh token ids per iteration and per layout: chunk keys do not name the layout
    prompts = [
        [torch.randint(3, 50000, (tokens,), generator=gen).tolist() for _ in paths]
        for _ in range(iters)
    ]
    put = {p.prefix: [] for p in paths}
    get = {p.prefix: [] for p in paths}
    for ps in prompts:
        for path, p in zip(paths, ps):
            t = time.perf_counter()
            path.a.store(p, src_slots)
            assert path.a.wait_visible(p, time.monotonic() + 120), "chunks never became visible"
            put[path.prefix].append(time.perf_counter() - t)
    builtin = []
    for ps in prompts:
        for path, p in zip(paths, ps):
            t = time.perf_counter()
            n = path.b.retrieve(p, dst_slots)
            get[path.prefix].append(time.perf_counter() - t)
            assert n == tokens, f"{path.prefix}: retrieved {n} of {tokens} tokens"
        if c is not None:
            t = time.perf_counter()
            n = c.retrieve(ps[0], dst_slots)
            builtin.append(time.perf_counter() - t)
            assert n == tokens, f"retrieved {n} of {tokens} tokens (builtin)"
    # Bit-exact: the last prompt's KV in b's scattered blocks equals a's source blocks.
    for path in paths:
        got, want = _rows(path.kv_b, dst_slots), _rows(path.kv_a, src_slots)
        assert torch.equal(got, want), f"{path.prefix}: retrieved KV differs from stored KV"
    if c is not None:
        assert torch.equal(_rows(c._kv_cache, dst_slots), _rows(paths[0].kv_b, dst_slots)), (
            "the two retrieve paths disagree"
        )

    # redis-py: the same bytes as one value per chunk, pipelined.
    client = redis.Redis.from_url(url, socket_timeout=300)  # a busy box stalls big writes
    chunk_bytes = [min(chunk, tokens - s) * per_token for s in range(0, tokens, chunk)]  # per chunk
    payload = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, generator=gen).numpy()
    views = []
    off = 0
    for cb in chunk_bytes:
        views.append(payload[off : off + cb].tobytes())
        off += cb
    rset, rget = [], []
    for it in range(iters):
        keys = [f"bench:{tokens}:{it}:{i}" for i in range(len(views))]
        t = time.perf_counter()
        pipe = client.pipeline(transaction=False)
        for k, v in zip(keys, views):
            pipe.set(k, v)
        pipe.execute()
        rset.append(time.perf_counter() - t)
        t = time.perf_counter()
        pipe = client.pipeline(transaction=False)
        for k in keys:
            pipe.get(k)
        got = pipe.execute()
        rget.append(time.perf_counter() - t)
        assert sum(len(g) for g in got) == nbytes
    client.flushall()
    client.close()

    src = torch.empty(nbytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    mem = []
    for _ in range(iters):
        t = time.perf_counter()
        dst.copy_(src)
        mem.append(time.perf_counter() - t)
    row = {
        "tokens": tokens,
        "bytes": nbytes,
        "chunks": len(chunk_bytes),
        "redis_py_set": _gbps(nbytes, rset),
        "redis_py_get": _gbps(nbytes, rget),
        "memcpy": _gbps(nbytes, mem),
    }
    for path in paths:
        pre = path.prefix
        row[f"{pre}_store_visible"] = _gbps(nbytes, put[pre])
        row[f"{pre}_retrieve"] = _gbps(nbytes, get[pre])
        row[f"{pre}_store_vs_redis_set"] = (
            row["redis_py_set"]["gbps"] / row[f"{pre}_store_visible"]["gbps"]
        )
        row[f"{pre}_retrieve_vs_redis_get"] = (
            row["redis_py_get"]["gbps"] / row[f"{pre}_retrieve"]["gbps"]
        )
    if builtin:
        row["lmcache_retrieve_builtin"] = _gbps(nbytes, builtin)
        row["builtin_retrieve_vs_redis_get"] = (
            row["redis_py_get"]["gbps"] / row["lmcache_retrieve_builtin"]["gbps"]
        )
    return row


# Method prefix per cache layout (the layer-major rows keep their historical names)
PREFIX = {"layer_major": "lmcache", "block_major": "lmcache_bm"}


def kv_table(layouts: list[str]) -> list[tuple[str, str | None]]:
    """The `bench kv` table's LMCache rows: (method = row key, its redis-py yardstick)."""
    out: list[tuple[str, str | None]] = []
    for layout in layouts:
        pre = PREFIX[layout]
        out += [(f"{pre}_store_visible", "redis_py_set"), (f"{pre}_retrieve", "redis_py_get")]
    return out + [("redis_py_set", None), ("redis_py_get", None)]


def kv_table_rows(
    tokens: list[int],
    iters: int,
    chunk: int,
    url: str | None,
    flat_gbps: dict[int, float],
    layouts: tuple[str, ...] | list[str] = LAYOUTS,
) -> list[dict]:
    """The LMCache path as `pdserve bench kv` rows (same fields as its NIXL rows), plus
    `x_redis_py`: LMCache's p50 time over redis-py's for the same bytes (goal <= 1.5).
    One pair of rows per cache layout. `url`: the Redis to go through (None: a local
    redis-server started here)."""
    out = []
    for row in run_sizes(tokens, iters, chunk, url, builtin=False, layouts=layouts):
        for method, yardstick in kv_table(layouts):
            m = row[method]
            out.append({
                "tokens": row["tokens"],
                "method": method,
                "bytes": row["bytes"],
                "descriptors": row["chunks"],  # one Redis value per chunk
                "p50_ms": round(m["p50_s"] * 1e3, 4),
                "p99_ms": round(m["p99_s"] * 1e3, 4),
                "gbps": round(m["gbps"], 3),
                "vs_nixl_flat": round(m["gbps"] / flat_gbps[row["tokens"]], 3)
                if row["tokens"] in flat_gbps else None,
                "x_redis_py": round(m["p50_s"] / row[yardstick]["p50_s"], 3)
                if yardstick else None,
            })  # fmt: skip
    return out


def run_sizes(
    tokens_list: list[int],
    iters: int,
    chunk: int,
    url: str | None,
    builtin: bool = True,
    layouts: tuple[str, ...] | list[str] = LAYOUTS,
) -> list[dict]:
    """Every size through two stores per layout (and LMCache's own reader, `builtin`) on
    one Redis (`url`, or a local one started here)."""
    if url is None:
        with EmbeddedRedis() as server:
            return run_sizes(tokens_list, iters, chunk, server.url, builtin, layouts)
    nblocks = 2 * -(-max(tokens_list) // BLOCK) + 1
    dims = (LAYERS, nblocks, BLOCK, KV_HEADS, HEAD_DIM)
    values = torch.randn((LAYERS, 2, *dims[1:]), generator=torch.Generator().manual_seed(0))
    biggest = max(tokens_list) * LAYERS * 2 * KV_HEADS * HEAD_DIM * 4
    local = max(64 << 20, (iters + 1) * biggest)
    kw = dict(namespace="bench", chunk_size=chunk, local_cpu_bytes=local)
    paths: list[LayoutStores] = []
    c = None  # LMCache's own Redis reader, for comparison
    rows = []
    try:
        for layout in layouts:
            kv_a, kv_b = allocate_kv_cache(layout, *dims), allocate_kv_cache(layout, *dims)
            kv_a.copy_(values)
            a = LMCacheKVStore(kv_a, remote_url=url, **kw)
            b = LMCacheKVStore(kv_b, remote_url=url, **kw)
            paths.append(LayoutStores(PREFIX[layout], a, b, kv_a, kv_b))
        if builtin:
            zeros = allocate_kv_cache(layouts[0], *dims)
            c = LMCacheKVStore(zeros, remote_url=url, fast_retrieve=False, **kw)
        for tokens in tokens_list:
            row = bench_size(tokens, iters, chunk, url, paths, c)
            for p in paths:
                logger.info(
                    "%5d tokens %6.1f MB: %s put %.2f / get %.2f GB/s, "
                    "redis-py set %.2f / get %.2f GB/s (ratios %.2fx / %.2fx)",
                    tokens,
                    row["bytes"] / 1e6,
                    p.prefix,
                    row[f"{p.prefix}_store_visible"]["gbps"],
                    row[f"{p.prefix}_retrieve"]["gbps"],
                    row["redis_py_set"]["gbps"],
                    row["redis_py_get"]["gbps"],
                    row[f"{p.prefix}_store_vs_redis_set"],
                    row[f"{p.prefix}_retrieve_vs_redis_get"],
                )
            rows.append(row)
    finally:
        for s in [p.a for p in paths] + [p.b for p in paths] + [c]:
            if s is not None:
                s.close()
    return rows


def bench(args: argparse.Namespace) -> dict:
    rows = run_sizes(args.tokens, args.iters, args.chunk, None, layouts=args.layouts)
    return {
        "benchmark": "kv_store",
        "model_shapes": {"layers": LAYERS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM},
        "dtype": "float32",
        "block_size": BLOCK,
        "chunk_size": args.chunk,
        "layouts": args.layouts,
        "iters": args.iters,
        "rows": rows,
    }


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", type=Path, default=Path("results/kv_store.json"))
    p.add_argument("--tokens", type=int, nargs="+", default=list(DEFAULT_TOKENS))
    p.add_argument("--chunk", type=int, default=256, help="LMCache chunk size (tokens)")
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--layouts", nargs="+", choices=LAYOUTS, default=list(LAYOUTS),
                   help="KV cache layouts to measure, side by side")  # fmt: skip


def run(args: argparse.Namespace) -> None:
    logging.basicConfig(level=getattr(logging, args.log_level.upper()), format="%(message)s")
    report = bench(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    logger.info("wrote %s", args.out)
