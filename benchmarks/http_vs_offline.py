"""Output tokens/s of 32 concurrent HTTP streams against the offline engine, same work.

Both sides run the same engine config on the same prompts: N prompts of ~P random token
ids, greedy, `ignore_eos`, M output tokens each. The HTTP side starts a real node
(`python -m pdserve serve`), warms it up, then times N concurrent streaming
/v1/completions requests from first send to last `[DONE]`. The node is stopped before the
offline side (`LLM.generate` on the same prompts, warmed up the same way) is timed, so the
two never share the CPU. Writes JSON to results/http_vs_offline.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
logger = logging.getLogger("benchmarks.http_vs_offline")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_prompts(n: int, length: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 40000) for _ in range(length)] for _ in range(n)]


async def stream_one(
    http: httpx.AsyncClient, model: str, prompt: list[int], max_tokens: int
) -> int:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    tokens = 0
    async with http.stream("POST", "/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                usage = json.loads(line[6:]).get("usage")
                if usage:
                    tokens = usage["completion_tokens"]
    return tokens


async def run_http(
    url: str, model: str, prompts: list[list[int]], max_tokens: int
) -> tuple[float, int]:
    limits = httpx.Limits(max_connections=len(prompts) + 4)
    async with httpx.AsyncClient(base_url=url, timeout=3600, limits=limits) as http:
        await stream_one(http, model, prompts[0][:16], 8)  # warm-up
        t = time.perf_counter()
        counts = await asyncio.gather(*(stream_one(http, model, p, max_tokens) for p in prompts))
        return time.perf_counter() - t, sum(counts)


def bench_http(args, prompts: list[list[int]]) -> dict:
    port = free_port()
    cmd = [
        sys.executable, "-m", "pdserve", "serve", "--model", args.model, "--port", str(port),
        "--kv-cache-bytes", str(args.kv_cache_bytes), "--log-level", "warning",
    ]  # fmt: skip
    if args.num_threads:
        cmd += ["--num-threads", str(args.num_threads)]
    proc = subprocess.Popen(cmd, cwd=ROOT)
    url = f"http://127.0.0.1:{port}"
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited with {proc.returncode}")
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        elapsed, tokens = asyncio.run(run_http(url, args.model, prompts, args.output_len))
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
    return {"seconds": elapsed, "output_tokens": tokens, "tokens_per_s": tokens / elapsed}


def bench_offline(args, prompts: list[list[int]]) -> dict:
    from engine import LLM, SamplingParams

    llm = LLM(args.model, kv_cache_bytes=args.kv_cache_bytes, num_threads=args.num_threads)
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    llm.generate(prompts[0][:16], SamplingParams(temperature=0, max_tokens=8))  # warm-up
    t = time.perf_counter()
    outs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - t
    tokens = sum(len(o.token_ids) for o in outs)
    return {"seconds": elapsed, "output_tokens": tokens, "tokens_per_s": tokens / elapsed}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--kv-cache-bytes", type=int, default=512 << 20)
    p.add_argument(
        "--num-threads", type=int, default=None, help="engine torch threads (both sides)"
    )
    p.add_argument("--out", default=str(ROOT / "results" / "http_vs_offline.json"))
    args = p.parse_args()
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )

    prompts = make_prompts(args.num_prompts, args.prompt_len)
    http = bench_http(args, prompts)
    logger.info("HTTP: %.1f tokens/s", http["tokens_per_s"])
    offline = bench_offline(args, prompts)
    logger.info("offline: %.1f tokens/s", offline["tokens_per_s"])
    result = {
        "config": {k: v for k, v in vars(args).items() if k != "out"},
        "http": http,
        "offline": offline,
        "http_over_offline": http["tokens_per_s"] / offline["tokens_per_s"],
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    logger.info("HTTP / offline = %.3f -> %s", result["http_over_offline"], out)


if __name__ == "__main__":
    main()
