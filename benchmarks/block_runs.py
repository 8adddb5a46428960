"""How many runs (NIXL descriptors per layer-kv) a PD request's KV transfer needs under churn.

    python benchmarks/block_runs.py --out results/block_runs.json

A seeded workload drives a prefill node's and a decode node's `KVCacheManager` the way
the PD path does: the decode node admits each request with all its prompt blocks held
(`allocate_slots(..., cache=False)`), the prefill node computes the prompt in chunks
(`kv_export` request, one `allocate_slots` per chunk) and finishes it (its blocks go to
the prefix cache); the decode node then decodes it, growing one block per 16 tokens, and
frees it. Many requests overlap, so the free lists fragment. For every transfer the
src -> dst block pairing is split into runs consecutive on both sides (`merge_runs`):
one run is one descriptor per (layer, K/V). Reports runs per request (1 = the contiguous
case, = blocks: the fully scattered case measured by `pdserve bench kv`) and the time
each allocation takes.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from pdserve.engine.kv_cache_manager import KVCacheManager  # noqa: E402
from pdserve.engine.request import Request  # noqa: E402
from pdserve.engine.sampling_params import SamplingParams  # noqa: E402
from pdserve.kv_transfer.kv_layout import merge_runs  # noqa: E402

BLOCK = 16


def run(args: argparse.Namespace) -> dict:
    rng = np.random.default_rng(args.seed)
    prefill = KVCacheManager(args.prefill_blocks, BLOCK)
    decode = KVCacheManager(args.decode_blocks, BLOCK)
    params = SamplingParams(max_tokens=1)
    running: list[tuple[Request, int]] = []  # decode side: (request, tokens left)
    runs, blocks, alloc_s = [], [], []
    next_id = 0
    for _tick in range(args.ticks):
        # decode: every running request grows by one token; finished ones free
        still = []
        for req, left in running:
            req.num_computed_tokens = req.num_tokens
            req.append_output_token(1)
            t0 = time.perf_counter()
            ok = decode.allocate_slots(req, 1) is not None
            alloc_s.append(time.perf_counter() - t0)
            if not ok or left <= 1:
                decode.free(req)
            else:
                still.append((req, left - 1))
        running = still
        if rng.random() > args.arrival_p or len(running) >= args.max_running:
            continue
        n = int(rng.integers(args.min_prompt, args.max_prompt + 1))
        prompt = rng.integers(100, 40000, size=n).tolist()  # unique: no prefix hits
        rid = f"r{next_id}"
        next_id += 1
        d_req = Request(rid, prompt, params, BLOCK)
        d_req.remote_prefill = "tcp://prefill"
        t0 = time.perf_counter()
        got = decode.allocate_slots(d_req, n, cache=False)
        alloc_s.append(time.perf_counter() - t0)
        if got is None:
            decode.free(d_req)
            continue
        p_req = Request(rid, prompt, params, BLOCK)
        p_req.kv_export = True
        done = 0
        while done < n:  # chunked prefill on the prefill node
            chunk = min(args.chunk, n - done)
            t0 = time.perf_counter()
            ok = prefill.allocate_slots(p_req, chunk) is not None
            alloc_s.append(time.perf_counter() - t0)
            assert ok, "prefill pool too small for one request"
            done += chunk
            p_req.num_computed_tokens = done
        src = np.asarray(prefill.get_block_ids(rid), dtype=np.int64)
        dst = np.asarray(decode.get_block_ids(rid), dtype=np.int64)
        runs.append(int(merge_runs(src, dst).lengths.size))
        blocks.append(int(src.size))
        prefill.free(p_req)  # exported: its blocks stay as prefix cache
        d_req.num_computed_tokens = n
        running.append((d_req, int(rng.integers(args.min_output, args.max_output + 1))))
    for req, _ in running:
        decode.free(req)
    prefill.check_integrity()
    decode.check_integrity()
    r, b = np.asarray(runs), np.asarray(blocks)
    return {
        "config": vars(args) | {"out": str(args.out)},
        "transfers": len(runs),
        "mean_blocks": float(b.mean()),
        "mean_runs": float(r.mean()),
        "median_runs": float(np.median(r)),
        "p90_runs": float(np.percentile(r, 90)),
        "runs_per_block": float(r.sum() / b.sum()),
        "contiguous_fraction": float(np.mean(r == 1)),
        "alloc_us_mean": float(np.mean(alloc_s) * 1e6),
        "alloc_us_p99": float(np.percentile(alloc_s, 99) * 1e6),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("results/block_runs.json"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ticks", type=int, default=20000)
    p.add_argument("--prefill-blocks", type=int, default=4096)
    p.add_argument("--decode-blocks", type=int, default=4096)
    p.add_argument("--arrival-p", type=float, default=0.05, help="chance of a request per tick")
    p.add_argument("--max-running", type=int, default=64)
    p.add_argument("--min-prompt", type=int, default=64)
    p.add_argument("--max-prompt", type=int, default=2048)
    p.add_argument("--min-output", type=int, default=16)
    p.add_argument("--max-output", type=int, default=512)
    p.add_argument("--chunk", type=int, default=256, help="prefill chunk (tokens)")
    args = p.parse_args()
    report = run(args)
    print(json.dumps(report, indent=1))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
