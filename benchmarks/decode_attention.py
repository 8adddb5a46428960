"""Paged decode attention on CPU: the reference (gather + SDPA) vs the native in-place kernel.

    python benchmarks/decode_attention.py --out results/decode_attention.json [--inductor]
    python benchmarks/decode_attention.py --block-major --cases 32x150,1x2000 --dtypes float32

SmolLM2-135M's attention shape (9 query heads, 3 kv heads, head_dim 64, block size 16,
30 layers) at 32 rows x context 150, 32 rows x 1000 and 1 row x 2000, fp32 and bf16.
Implementations run round-robin, one call each per round, so a busy machine disturbs
them alike; per-layer min and median over the rounds, and the median x 30 layers (one
decode step's attention). `--inductor` adds a torch.compile formulation whose loads index
the cache through the block table inside the compiled loop (no gather buffer), with its
compile time. Also the process CPU time per call (with --threads 1: the work itself,
robust to a busy machine). `--block-major` adds both implementations reading a layer's
views of a block-major cache (engine/kv_tensor.py: all 30 layers allocated, blocks
`2 x 30` block sizes apart; keys `*_block_major`), with the same values as the contiguous
one. Prints one JSON line per case and writes them all to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pdserve.engine.kv_tensor import BLOCK_MAJOR, allocate_kv_cache  # noqa: E402
from pdserve.kernels import native, paged_decode, reference  # noqa: E402

CASES = {"32x150": [150] * 32, "32x1000": [1000] * 32, "1x2000": [2000]}
HEADS, KV_HEADS, HEAD_DIM, BLOCK, LAYERS = 9, 3, 64, 16, 30
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def make_case(lens: list[int], dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    need = [(n + BLOCK - 1) // BLOCK for n in lens]
    n_blocks = sum(need) + 1
    shape = (n_blocks, BLOCK, KV_HEADS, HEAD_DIM)
    k_cache = torch.randn(shape, generator=g).to(dtype)
    v_cache = torch.randn(shape, generator=g).to(dtype)
    perm = torch.randperm(n_blocks - 1, generator=g) + 1
    table = torch.zeros((len(lens), max(need)), dtype=torch.int32)
    used = 0
    for i, n in enumerate(need):
        table[i, :n] = perm[used : used + n]
        used += n
    q = torch.randn((len(lens), HEADS, HEAD_DIM), generator=g).to(dtype)
    return q, k_cache, v_cache, table, torch.tensor(lens, dtype=torch.int32)


def decode_in_loop(q, k_cache, v_cache, block_tables, context_lens, scale):
    """Decode attention written so inductor fuses the block-table loads into its loops."""
    b, h, d = q.shape
    bs, hkv = k_cache.shape[1], k_cache.shape[2]
    keys = torch.arange(block_tables.shape[1] * bs)
    slot = block_tables[:, keys // bs].long() * bs + keys % bs  # [B, L]
    qg = q.view(b, hkv, h // hkv, 1, d).float()
    k = k_cache.view(-1, hkv, d)[slot].permute(0, 2, 1, 3)[:, :, None]  # [B, Hkv, 1, L, D]
    s = (qg * k.float()).sum(-1) * scale
    live = keys[None, :] < context_lens[:, None]
    p = torch.softmax(s.masked_fill(~live[:, None, None, :], float("-inf")), dim=-1)
    v = v_cache.view(-1, hkv, d)[slot].permute(0, 2, 1, 3)[:, :, None]
    return (p[..., None] * v.float()).sum(-2).reshape(b, h, d).to(q.dtype)


def block_major_views(args: tuple) -> tuple:
    """`args` with k/v replaced by a middle layer's views of a block-major cache."""
    q, k_cache, v_cache, table, lens = args
    n_blocks = k_cache.shape[0]
    kv = allocate_kv_cache(
        BLOCK_MAJOR, LAYERS, n_blocks, BLOCK, KV_HEADS, HEAD_DIM, dtype=k_cache.dtype
    )
    layer = kv[LAYERS // 2]
    layer[0].copy_(k_cache)
    layer[1].copy_(v_cache)
    return q, layer[0], layer[1], table, lens


def bench_case(name: str, dtype: str, rounds: int, inductor: bool, block_major: bool) -> dict:
    args = make_case(CASES[name], DTYPES[dtype])
    scale = HEAD_DIM**-0.5
    impls = {
        "gather_sdpa": (reference.paged_decode_attention, args),
        "native": (paged_decode.paged_decode_attention, args),
    }
    if block_major:
        bm = block_major_views(args)
        assert paged_decode.supports(bm[0], bm[1], bm[2])  # read in place, no fallback
        impls["gather_sdpa_block_major"] = (reference.paged_decode_attention, bm)
        impls["native_block_major"] = (paged_decode.paged_decode_attention, bm)
    row: dict = {"case": name, "dtype": dtype}
    if inductor:
        compiled = torch.compile(decode_in_loop, dynamic=False)
        t0 = time.perf_counter()
        compiled(*args, scale)
        row["inductor_compile_s"] = round(time.perf_counter() - t0, 1)
        impls["inductor"] = (compiled, args)
    expected = reference.paged_decode_attention(*args, scale).float()
    for key, (fn, a) in impls.items():
        row[f"{key}_max_abs_err"] = float((fn(*a, scale).float() - expected).abs().max())
    times: dict[str, list[float]] = {k: [] for k in impls}
    cpu: dict[str, list[float]] = {k: [] for k in impls}
    for _ in range(rounds):
        for key, (fn, a) in impls.items():
            c0, t0 = time.process_time(), time.perf_counter()
            fn(*a, scale)
            times[key].append(time.perf_counter() - t0)
            cpu[key].append(time.process_time() - c0)
    for key, ts in times.items():
        med = statistics.median(ts)
        row[f"{key}_ms_per_layer_min"] = round(min(ts) * 1e3, 3)
        row[f"{key}_ms_per_layer_median"] = round(med * 1e3, 3)
        row[f"{key}_ms_per_step_x{LAYERS}"] = round(med * LAYERS * 1e3, 1)
        # CPU time of the process (all threads): with --threads 1 the work itself, which a
        # busy machine does not inflate by descheduling the way it inflates wall time.
        row[f"{key}_cpu_ms_per_layer_median"] = round(statistics.median(cpu[key]) * 1e3, 3)
    row["speedup_native_vs_gather_median"] = round(
        statistics.median(times["gather_sdpa"]) / statistics.median(times["native"]), 2
    )
    row["speedup_native_vs_gather_min"] = round(min(times["gather_sdpa"]) / min(times["native"]), 2)
    if block_major:
        for key in ("native", "gather_sdpa"):
            row[f"{key}_block_major_over_layer_major_median"] = round(
                statistics.median(times[f"{key}_block_major"]) / statistics.median(times[key]), 3
            )
            row[f"{key}_block_major_over_layer_major_cpu_median"] = round(
                statistics.median(cpu[f"{key}_block_major"]) / statistics.median(cpu[key]), 3
            )
    return row


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--rounds", type=int, default=60)
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--inductor", action="store_true", help="add the torch.compile formulation")
    ap.add_argument(
        "--block-major", action="store_true", help="add both kernels on a block-major cache"
    )
    ap.add_argument("--out", default="results/decode_attention.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    if not paged_decode.available():
        raise SystemExit("the native kernel could not be built (see the log)")
    build_s = time.perf_counter() - t0
    results = []
    with torch.inference_mode():
        for dtype in args.dtypes.split(","):
            for name in args.cases.split(","):
                row = bench_case(name, dtype, args.rounds, args.inductor, args.block_major)
                print(json.dumps(row), flush=True)
                results.append(row)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {
        "threads": args.threads,
        "rounds": args.rounds,
        "native_load_or_build_s": round(build_s, 2),
        "kernel_library": str(native.build("paged_decode")),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "loadavg_at_end": os.getloadavg()[0],
    }
    out.write_text(json.dumps({**meta, "results": results}, indent=2))


if __name__ == "__main__":
    main()
