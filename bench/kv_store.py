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

import torch

from cluster.embedded_redis import EmbeddedRedis
from kv_transfer.lmcache_store import LMCacheKVStore

logger = logging.getLogger(__name__)

LAYERS, KV_HEADS, HEAD_DIM, BLOCK = 30, 3, 64, 16
DEFAULT_TOKENS = (256, 1024, 2048)


def _gbps(nbytes: int, times: list[float]) -> dict:
    med = statistics.median(times)
    p99 = sorted(times)[min(len(times) - 1, int(0.99 * len(times)))]
    return {"p50_s": med, "p99_s": p99, "min_s": min(times), "gbps": nbytes / med / 1e9}


def bench_size(tokens: int, iters: int, chunk: int, url: str, a, b, c, kv_a, kv_b) -> dict:
    """One request size; `c` (LMCache's own Redis reader) may be None: not measured."""
    import redis

    nblocks = kv_a.shape[2]
    need = -(-tokens // BLOCK)
    src_blocks = list(range(need))
    dst_blocks = list(range(nblocks - 1, nblocks - 1 - 2 * need, -2))  # scattered, reversed
    src_slots = [s * BLOCK + i for s in src_blocks for i in range(BLOCK)][:tokens]
    dst_slots = [d * BLOCK + i for d in dst_blocks for i in range(BLOCK)][:tokens]
    per_token = LAYERS * 2 * KV_HEADS * HEAD_DIM * kv_a.element_size()
    nbytes = tokens * per_token
    gen = torch.Generator().manual_seed(tokens)
    prompts = [torch.randint(3, 50000, (tokens,), generator=gen).tolist() for _ in range(iters)]
    put, get = [], []
    for p in prompts:
        t = time.perf_counter()
        a.store(p, src_slots)
        assert a.wait_visible(p, time.monotonic() + 120), "chunks never became visible"
        put.append(time.perf_counter() - t)
    builtin = []
    for p in prompts:  # the two readers alternate, so load shifts hit both alike
        t = time.perf_counter()
        n = b.retrieve(p, dst_slots)
        get.append(time.perf_counter() - t)
        assert n == tokens, f"retrieved {n} of {tokens} tokens"
        if c is not None:
            t = time.perf_counter()
            n = c.retrieve(p, dst_slots)
            builtin.append(time.perf_counter() - t)
            assert n == tokens, f"retrieved {n} of {tokens} tokens (builtin)"
    # Bit-exact: the last prompt's KV in b's scattered blocks equals a's source blocks.
    flat_a = kv_a.view(LAYERS, 2, -1, KV_HEADS * HEAD_DIM)
    flat_b = kv_b.view(LAYERS, 2, -1, KV_HEADS * HEAD_DIM)
    assert torch.equal(
        flat_a[:, :, torch.tensor(src_slots)], flat_b[:, :, torch.tensor(dst_slots)]
    ), "retrieved KV differs from the stored KV"
    if c is not None:
        flat_c = c._kv_cache.view(LAYERS, 2, -1, KV_HEADS * HEAD_DIM)
        assert torch.equal(flat_b, flat_c), "the two retrieve paths disagree"

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
        "lmcache_store_visible": _gbps(nbytes, put),
        "lmcache_retrieve": _gbps(nbytes, get),
        "redis_py_set": _gbps(nbytes, rset),
        "redis_py_get": _gbps(nbytes, rget),
        "memcpy": _gbps(nbytes, mem),
    }
    row["store_vs_redis_set"] = row["redis_py_set"]["gbps"] / row["lmcache_store_visible"]["gbps"]
    row["retrieve_vs_redis_get"] = row["redis_py_get"]["gbps"] / row["lmcache_retrieve"]["gbps"]
    if builtin:
        row["lmcache_retrieve_builtin"] = _gbps(nbytes, builtin)
        row["builtin_retrieve_vs_redis_get"] = (
            row["redis_py_get"]["gbps"] / row["lmcache_retrieve_builtin"]["gbps"]
        )
    return row


# The `bench kv` table's LMCache rows: (method, this row's key, its redis-py yardstick)
KV_TABLE = (
    ("lmcache_store_visible", "lmcache_store_visible", "redis_py_set"),
    ("lmcache_retrieve", "lmcache_retrieve", "redis_py_get"),
    ("redis_py_set", "redis_py_set", None),
    ("redis_py_get", "redis_py_get", None),
)


def kv_table_rows(
    tokens: list[int], iters: int, chunk: int, url: str | None, flat_gbps: dict[int, float]
) -> list[dict]:
    """The LMCache path as `pdserve bench kv` rows (same fields as its NIXL rows), plus
    `x_redis_py`: LMCache's p50 time over redis-py's for the same bytes (goal <= 1.5).
    `url`: the Redis to go through (None: a local redis-server started here)."""
    out = []
    for row in run_sizes(tokens, iters, chunk, url, builtin=False):
        for method, key, yardstick in KV_TABLE:
            m = row[key]
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
    tokens_list: list[int], iters: int, chunk: int, url: str | None, builtin: bool = True
) -> list[dict]:
    """Every size through three stores on one Redis (`url`, or a local one started here)."""
    if url is None:
        with EmbeddedRedis() as server:
            return run_sizes(tokens_list, iters, chunk, server.url, builtin)
    nblocks = 2 * -(-max(tokens_list) // BLOCK) + 1
    shape = (LAYERS, 2, nblocks, BLOCK, KV_HEADS, HEAD_DIM)
    kv_a = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    kv_b = torch.zeros(shape)
    biggest = max(tokens_list) * LAYERS * 2 * KV_HEADS * HEAD_DIM * 4
    local = max(64 << 20, (iters + 1) * biggest)
    rows = []
    kw = dict(namespace="bench", chunk_size=chunk, local_cpu_bytes=local)
    a = LMCacheKVStore(kv_a, remote_url=url, **kw)
    b = LMCacheKVStore(kv_b, remote_url=url, **kw)
    c = None  # LMCache's own Redis reader, for comparison
    if builtin:
        c = LMCacheKVStore(torch.zeros(shape), remote_url=url, fast_retrieve=False, **kw)
    try:
        for tokens in tokens_list:
            row = bench_size(tokens, iters, chunk, url, a, b, c, kv_a, kv_b)
            logger.info(
                "%5d tokens %6.1f MB: lmcache put %.2f / get %.2f GB/s, "
                "redis-py set %.2f / get %.2f GB/s (ratios %.2fx / %.2fx)",
                tokens,
                row["bytes"] / 1e6,
                row["lmcache_store_visible"]["gbps"],
                row["lmcache_retrieve"]["gbps"],
                row["redis_py_set"]["gbps"],
                row["redis_py_get"]["gbps"],
                row["store_vs_redis_set"],
                row["retrieve_vs_redis_get"],
            )
            rows.append(row)
    finally:
        for s in (a, b, c):
            if s is not None:
                s.close()
    return rows


def bench(args: argparse.Namespace) -> dict:
    rows = run_sizes(args.tokens, args.iters, args.chunk, None)
    return {
        "benchmark": "kv_store",
        "model_shapes": {"layers": LAYERS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM},
        "dtype": "float32",
        "block_size": BLOCK,
        "chunk_size": args.chunk,
        "iters": args.iters,
        "rows": rows,
    }


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", type=Path, default=Path("results/kv_store.json"))
    p.add_argument("--tokens", type=int, nargs="+", default=list(DEFAULT_TOKENS))
    p.add_argument("--chunk", type=int, default=256, help="LMCache chunk size (tokens)")
    p.add_argument("--iters", type=int, default=5)


def run(args: argparse.Namespace) -> None:
    logging.basicConfig(level=getattr(logging, args.log_level.upper()), format="%(message)s")
    report = bench(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    logger.info("wrote %s", args.out)
