"""What checksumming KV blocks costs: hash throughput of the candidates, and TTFT of a PD
pair with and without `--kv-checksums` (issue 30), on the default model.

    python benchmarks/kv_checksum.py --out benchmarks/results/kv_checksum.json

1. Hash throughput (GB/s, one core) of each candidate that is installed (xxh3_64,
   xxh3_128, crc32c, blake3, zlib.crc32) over 1024-token prompts' worth of the default
   model's KV blocks, and of `engine.kv_checksum.block_checksums` itself (hashing the
   cache in place).
2. The checksum work of one 1024-token prompt on the default model's KV layout (the
   prefill node hashes the blocks it sends, the decode node the blocks that landed).
3. TTFT through real nodes: two PD pairs (prefill + decode, `pdserve serve`) run at once,
   one with checksums and one without; requests alternate between them one at a time (so
   drift of a shared machine hits both alike), each a different seeded 1024-token prompt;
   the medians and their relative difference are reported, with the share that the
   measured checksum work (2.) is of the checksummed pair's median TTFT.
"""

from __future__ import annotations

import argparse
import importlib
import json
import random
import statistics
import sys
import time
import zlib
from pathlib import Path

import httpx
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.pd_latency import free_port, launch, stop, wait_healthy  # noqa: E402
from pdserve.engine.kv_checksum import block_checksums  # noqa: E402

# SmolLM2-135M-Instruct (the default model): 30 layers, 3 KV heads of 64; float32 on CPU
LAYERS, KV_HEADS, HEAD_DIM, BLOCK = 30, 3, 64, 16


def _candidates() -> dict:
    out = {"zlib.crc32": zlib.crc32}
    try:
        import xxhash

        out["xxh3_64"] = xxhash.xxh3_64_intdigest
        out["xxh3_128"] = xxhash.xxh3_128_intdigest
    except ImportError:
        pass
    for mod, name, fn in (("crc32c", "crc32c", "crc32c"), ("blake3", "blake3", None)):
        try:
            m = importlib.import_module(mod)
        except ImportError:
            continue
        out[name] = getattr(m, fn) if fn else (lambda b, m=m: m.blake3(b).digest())
    return out


def _best(fn, repeats: int = 5) -> float:
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def hash_throughput(prompt_len: int, dtype: torch.dtype) -> dict:
    n = prompt_len // BLOCK
    kv = torch.randn(LAYERS, 2, 2 * n, BLOCK, KV_HEADS, HEAD_DIM).to(dtype)
    ids = list(range(0, 2 * n, 2))  # every other block: scattered, as in a real cache
    rows = kv[:, :, ids].permute(2, 0, 1, 3, 4, 5).contiguous().view(torch.uint8)
    rows = rows.reshape(n, -1).numpy()  # each block's bytes, contiguous
    nbytes = rows.nbytes
    gbps = {
        name: nbytes / _best(lambda f=f: [f(r) for r in rows]) / 1e9
        for name, f in _candidates().items()
    }
    secs = _best(lambda: block_checksums(kv, ids))
    gbps["block_checksums (in place)"] = nbytes / secs / 1e9
    return {
        "dtype": str(dtype).removeprefix("torch."),
        "block_bytes": nbytes // n,
        "blocks": n,
        "gb_per_s": {k: round(v, 2) for k, v in gbps.items()},
        "checksum_s_per_side": secs,
    }


def first_token(url: str, prompt: list[int], max_tokens: int) -> tuple[float, str | None]:
    """(TTFT, where the prompt was prefilled: `pdserve_timings.prefill`) of one request."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}  # fmt: skip
    t0, ttft, path = time.perf_counter(), None, None
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                if ttft is None and chunk["choices"] and chunk["choices"][0].get("text"):
                    ttft = time.perf_counter() - t0
                path = chunk.get("pdserve_timings", {}).get("prefill", path)
    return ttft if ttft is not None else time.perf_counter() - t0, path


def ttft_pair(args) -> dict:
    rng = random.Random(0)
    prompts = [
        [rng.randrange(100, 49000) for _ in range(args.prompt_len)]
        for _ in range(2 * args.requests)
    ]
    common = ["--model", args.model, "--num-threads", str(args.threads), "--kv-cache-bytes",
              str(args.kv_cache_bytes), "--no-prefix-caching"]  # fmt: skip
    pairs, procs = {}, []
    try:
        for label, flag in (("on", "--kv-checksums"), ("off", "--no-kv-checksums")):
            ctl = f"tcp://127.0.0.1:{free_port()}"
            p = launch([*common, "--role", "prefill", "--kv-control", ctl])
            d = launch([*common, "--role", "decode", "--prefill-node", ctl,
                        "--local-prefill-max-tokens", "0", "--kv-peer-timeout-s", "120",
                        "--kv-engine-stall-s", "120", flag])  # fmt: skip
            procs += [p[1], d[1]]
            pairs[label] = (p, d)
        urls = {}
        for label, (p, d) in pairs.items():
            wait_healthy(*p)
            urls[label] = wait_healthy(*d)[0]
        ttft: dict[str, list[float]] = {"on": [], "off": []}
        dropped: dict[str, list[str | None]] = {"on": [], "off": []}
        for url in urls.values():
            first_token(url, prompts[0][:64], 2)  # warm-up (the first WRITE to the peer)
        for i in range(args.requests):
            order = ("on", "off") if i % 2 == 0 else ("off", "on")
            for j, label in enumerate(order):
                t, path = first_token(urls[label], prompts[2 * i + j], args.max_tokens)
                if path == "remote":  # only prefills that crossed (a fallback is no sample)
                    ttft[label].append(t)
                else:
                    dropped[label].append(path)
        return {
            k: {
                "ttft_s_median": statistics.median(v) if v else None,
                "ttft_s": v,
                "not_remote": dropped[k],
            }
            for k, v in ttft.items()
        }
    finally:
        stop(procs)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--max-tokens", type=int, default=2)
    ap.add_argument("--requests", type=int, default=9, help="per pair")
    ap.add_argument("--threads", type=int, default=1, help="torch threads of every node")
    ap.add_argument("--kv-cache-bytes", type=int, default=256 << 20, help="of every node")
    ap.add_argument("--skip-ttft", action="store_true", help="hash figures only")
    ap.add_argument("--out", default="benchmarks/results/kv_checksum.json")
    args = ap.parse_args()
    results: dict = {"config": vars(args)}
    results["hash"] = [
        hash_throughput(args.prompt_len, dt) for dt in (torch.float32, torch.bfloat16)
    ]
    work_s = 2 * results["hash"][0]["checksum_s_per_side"]  # float32: the CPU default
    results["checksum_s_per_request"] = work_s
    if not args.skip_ttft:
        t = ttft_pair(args)
        on, off = t["on"]["ttft_s_median"], t["off"]["ttft_s_median"]
        results["ttft"] = t
        if on is not None and off is not None:
            results["ttft_median_diff_share"] = (on - off) / off
            results["checksum_work_share_of_ttft"] = work_s / on
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    summary = {k: v for k, v in results.items() if k not in ("config", "ttft")}
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
