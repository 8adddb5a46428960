"""TTFT and TPOT of one request at a time: a PD pair (prefill + decode node) vs one
colocated node, same model, same prompts, measured over HTTP streaming.

    python benchmarks/pd_latency.py --out results/pd_latency.json
    python benchmarks/pd_latency.py --kv-layouts layer_major,block_major --skip-colocated

`--kv-layouts`: one PD pair per KV cache layout (`--kv-layout` on both nodes), one after
the other; each reports the median of the decode node's `kv_transfer` stage
(`pdserve_timings`) besides TTFT and TPOT.

Each setup runs alone (the other is stopped first), so they never share the CPU. Prompts
are seeded random token ids of --prompt-len tokens, each different (no prefix-cache hits);
TTFT is request sent -> first streamed token; TPOT is (last - first token) / (tokens - 1).
Writes JSON to results/pd_latency.json (or --out).
"""

from __future__ import annotations

import argparse
import json
import random
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx
from tqdm import tqdm

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(args: list[str]) -> tuple[str, subprocess.Popen]:
    return wait_healthy(*launch(args))


def launch(args: list[str]) -> tuple[str, subprocess.Popen]:
    """Start a node (`pdserve serve` with `args`); see `wait_healthy`."""
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "pdserve",
        "serve",
        "--port",
        str(port),
        "--log-level",
        "warning",
        *args,
    ]
    return f"http://127.0.0.1:{port}", subprocess.Popen(cmd, cwd=ROOT)


def wait_healthy(url: str, proc: subprocess.Popen) -> tuple[str, subprocess.Popen]:
    deadline = time.monotonic() + 600
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited: {' '.join(proc.args)}")
        if time.monotonic() > deadline:
            raise TimeoutError("server did not become healthy")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return url, proc
        except httpx.HTTPError:
            pass
        time.sleep(0.5)


def stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        p.terminate()
    for p in procs:
        try:
            p.wait(30)
        except subprocess.TimeoutExpired:
            p.kill()


def one_request(url: str, prompt: list[int], max_tokens: int) -> tuple[float, float, dict]:
    body = {
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    times = []
    stages: dict = {}
    t0 = time.perf_counter()
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                if chunk["choices"][0].get("text") is not None:
                    times.append(time.perf_counter())
                stages = chunk.get("pdserve_timings", {}).get("stages", stages)
    ttft = times[0] - t0
    tpot = (times[-1] - times[0]) / max(1, len(times) - 1)
    return ttft, tpot, stages


def measure(url: str, prompts: list[list[int]], max_tokens: int, label: str) -> dict:
    one_request(url, prompts[0][:64], 4)  # warm-up (and the first WRITE to the peer)
    ttfts, tpots, kv = [], [], []
    for p in tqdm(prompts, desc=label):
        ttft, tpot, stages = one_request(url, p, max_tokens)
        ttfts.append(ttft)
        tpots.append(tpot)
        if "kv_transfer" in stages:
            kv.append(stages["kv_transfer"])
    return {
        "ttft_s_median": statistics.median(ttfts),
        "tpot_s_median": statistics.median(tpots),
        "kv_transfer_s_median": statistics.median(kv) if kv else None,
        "ttft_s": ttfts,
        "tpot_s": tpots,
        "kv_transfer_s": kv,
    }


def measure_pd(common: list[str], prompts, args, label: str) -> dict:
    ctl = f"tcp://127.0.0.1:{free_port()}"
    # Both nodes start at once (nothing is measured before both are healthy).
    pnode = launch([*common, "--role", "prefill", "--kv-control", ctl])
    dnode = launch(
        [*common, "--role", "decode", "--prefill-node", ctl, "--local-prefill-max-tokens", "0"]
    )
    try:
        wait_healthy(*pnode)
        durl, _ = wait_healthy(*dnode)
        return measure(durl, prompts, args.max_tokens, label)
    finally:
        stop([dnode[1], pnode[1]])


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--requests", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2, help="torch threads of every node")
    ap.add_argument("--kv-layouts", default="layer_major", help="one PD pair per layout")
    ap.add_argument("--kv-cache-bytes", type=int, default=512 << 20, help="of every node")
    ap.add_argument("--skip-colocated", action="store_true")
    ap.add_argument("--out", default="results/pd_latency.json")
    args = ap.parse_args()
    rng = random.Random(0)
    prompts = [
        [rng.randrange(100, 49000) for _ in range(args.prompt_len)] for _ in range(args.requests)
    ]
    common = [
        "--model",
        args.model,
        "--num-threads",
        str(args.threads),
        "--kv-cache-bytes",
        str(args.kv_cache_bytes),
        "--no-prefix-caching",
    ]
    results: dict = {"config": vars(args)}

    if not args.skip_colocated:
        url, proc = start(common)
        try:
            results["colocated"] = measure(url, prompts, args.max_tokens, "colocated")
        finally:
            stop([proc])

    layouts = args.kv_layouts.split(",")
    for i, layout in enumerate(layouts):
        key = "pd" if i == 0 else f"pd_{layout}" + (f"_{i}" if f"pd_{layout}" in results else "")
        results[key] = measure_pd(common + ["--kv-layout", layout], prompts, args, key)
    summary = {
        f"kv_transfer_{k}_s": v["kv_transfer_s_median"] for k, v in results.items() if "pd" in k
    }
    print(json.dumps(summary))
    if args.skip_colocated:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(results, indent=2))
        return
    c, p = results["colocated"], results["pd"]
    results["ttft_pd_over_colocated"] = p["ttft_s_median"] / c["ttft_s_median"]
    results["tpot_pd_over_colocated"] = p["tpot_s_median"] / c["tpot_s_median"]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    print(
        json.dumps(
            {
                "ttft_colocated_s": round(c["ttft_s_median"], 4),
                "ttft_pd_s": round(p["ttft_s_median"], 4),
                "ttft_ratio": round(results["ttft_pd_over_colocated"], 3),
                "tpot_colocated_s": round(c["tpot_s_median"], 4),
                "tpot_pd_s": round(p["tpot_s_median"], 4),
                "tpot_ratio": round(results["tpot_pd_over_colocated"], 3),
            }
        )
    )


if __name__ == "__main__":
    main()
