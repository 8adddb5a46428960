"""Output tokens/s of N concurrent HTTP streams against the offline engine, same work.

Both sides run the same engine config on the same prompts: N prompts of ~P random token
ids, greedy, `ignore_eos`, M output tokens each. The HTTP side starts a real node
(`python -m pdserve serve`), warms it up, then times N concurrent streaming
/v1/completions requests from first send to last `[DONE]`, with each request's TTFT and
TPOT. The node is stopped before the offline side (`LLM.generate` on the same prompts,
warmed up the same way) is timed, so the two never share the CPU. `--rounds R` alternates
the two sides R times (a shared box's load drifts; the ratio of each round is reported).

Besides wall time, each side's CPU seconds are read from /proc (Linux): the node's API
process and its engine process separately, and the offline process. CPU seconds per
output token do not depend on how much of the CPU other processes took, so they show
what the node spends beyond the engine even on a loaded box.

    python benchmarks/http_vs_offline.py --num-prompts 64 --num-threads 1
    python benchmarks/http_vs_offline.py --model DIR --rounds 3   # DIR: any HF model directory

Writes JSON to results/http_vs_offline.json (or --out).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import random
import signal
import socket
import statistics
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


def cpu_seconds(pid: int) -> float:
    """CPU seconds of a process, all its threads (Linux /proc): the nanoseconds each live
    thread has run (`task/*/schedstat`), or where the kernel keeps no schedstat the user +
    system clock ticks of `stat`. Ticks are 10 ms: a short run (the smoke test's 32 tokens
    in ~20 ms) could read 0 CPU by them."""
    total, seen = 0, False
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            total += int((task / "schedstat").read_text().split()[0])
            seen = True
        except (OSError, ValueError, IndexError):  # a thread that ended, or no schedstat
            continue
    if seen:
        return total / 1e9
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def child_pids(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        out += [int(x) for x in (task / "children").read_text().split()]
    return out


def engine_pid(node_pid: int) -> int:
    """The node's EngineCore process (its spawned child that is not the resource tracker)."""
    for pid in child_pids(node_pid):
        if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes():
            return pid
    raise RuntimeError(f"no engine process under {node_pid}")


def wait_healthy(url: str, proc: subprocess.Popen, timeout_s: float = 600.0) -> None:
    """Until the node at `url` answers /health; raises if it exits or takes `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"server at {url} exited with {proc.returncode}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"server at {url} not healthy after {timeout_s:.0f} s")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)


def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


async def stream_one(
    http: httpx.AsyncClient, model: str, prompt: list[int], max_tokens: int, rec: dict
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
    start = time.perf_counter()
    first = None
    async with http.stream("POST", "/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                event = json.loads(line[6:])
                if first is None and event.get("choices") and event["choices"][0].get("text"):
                    first = time.perf_counter()
                usage = event.get("usage")
                if usage:
                    tokens = usage["completion_tokens"]
    end = time.perf_counter()
    if first is not None:
        rec["ttft_s"] = first - start
        # as `pdserve bench serve` (bench/client.py) and vLLM's benchmark: the time from the
        # first text to the stream's end over the tokens after the first. The last text
        # event is not the end: a detokenizer holds back partial characters, so a model's
        # text can arrive in one event with the first (a TPOT of 0 on a loaded box)
        if tokens > 1:
            rec["tpot_s"] = (end - first) / (tokens - 1)
    return tokens


async def run_http(
    url: str, model: str, prompts: list[list[int]], max_tokens: int, pids: list[int]
) -> dict:
    limits = httpx.Limits(max_connections=len(prompts) + 4)
    async with httpx.AsyncClient(base_url=url, timeout=3600, limits=limits) as http:
        await stream_one(http, model, prompts[0][:16], 8, {})  # warm-up
        recs: list[dict] = [{} for _ in prompts]
        cpu0 = [cpu_seconds(pid) for pid in pids]
        client0 = time.process_time()
        t = time.perf_counter()
        counts = await asyncio.gather(
            *(stream_one(http, model, p, max_tokens, r) for p, r in zip(prompts, recs))
        )
        elapsed = time.perf_counter() - t
        client_cpu = time.process_time() - client0
        cpu = [cpu_seconds(pid) - c for pid, c in zip(pids, cpu0)]
    tokens = sum(counts)
    return {
        "seconds": elapsed,
        "output_tokens": tokens,
        "tokens_per_s": tokens / elapsed,
        "median_ttft_s": _median([r["ttft_s"] for r in recs if "ttft_s" in r]),
        "median_tpot_s": _median([r["tpot_s"] for r in recs if "tpot_s" in r]),
        "api_cpu_s": cpu[0],
        "engine_cpu_s": cpu[1],
        "client_cpu_s": client_cpu,
        "cpu_ms_per_token": 1000 * (cpu[0] + cpu[1]) / tokens,
        "api_cpu_ms_per_token": 1000 * cpu[0] / tokens,
    }


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
        wait_healthy(url, proc)
        pids = [proc.pid, engine_pid(proc.pid)]
        return asyncio.run(run_http(url, args.model, prompts, args.output_len, pids))
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)


def bench_offline(args, prompts: list[list[int]]) -> dict:
    from pdserve.engine import LLM, SamplingParams

    llm = LLM(args.model, kv_cache_bytes=args.kv_cache_bytes, num_threads=args.num_threads)
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    llm.generate(prompts[0][:16], SamplingParams(temperature=0, max_tokens=8))  # warm-up
    cpu0 = time.process_time()
    t = time.perf_counter()
    outs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - t
    cpu = time.process_time() - cpu0
    tokens = sum(len(o.token_ids) for o in outs)
    return {
        "seconds": elapsed,
        "output_tokens": tokens,
        "tokens_per_s": tokens / elapsed,
        "engine_cpu_s": cpu,
        "cpu_ms_per_token": 1000 * cpu / tokens,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    # the node's default: 64 x (128 + 128) tokens fit without preemption (512 MiB does not)
    p.add_argument("--kv-cache-bytes", type=int, default=1 << 30)
    p.add_argument(
        "--num-threads", type=int, default=None, help="engine torch threads (both sides)"
    )
    p.add_argument("--rounds", type=int, default=1, help="alternate HTTP and offline R times")
    p.add_argument("--out", default=str(ROOT / "results" / "http_vs_offline.json"))
    args = p.parse_args()
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )

    logging.getLogger("httpx").setLevel(logging.WARNING)  # no line per request
    prompts = make_prompts(args.num_prompts, args.prompt_len)
    rounds = []
    for i in range(args.rounds):
        http = bench_http(args, prompts)
        logger.info(
            "round %d HTTP: %.1f tokens/s, %.2f CPU ms/token (API %.2f)",
            i, http["tokens_per_s"], http["cpu_ms_per_token"], http["api_cpu_ms_per_token"],
        )  # fmt: skip
        offline = bench_offline(args, prompts)
        logger.info(
            "round %d offline: %.1f tokens/s, %.2f CPU ms/token",
            i, offline["tokens_per_s"], offline["cpu_ms_per_token"],
        )  # fmt: skip
        rounds.append(
            {
                "http": http,
                "offline": offline,
                "http_over_offline": http["tokens_per_s"] / offline["tokens_per_s"],
                "cpu_per_token_http_over_offline": http["cpu_ms_per_token"]
                / offline["cpu_ms_per_token"],
            }
        )
    ratios = [r["http_over_offline"] for r in rounds]
    result = {
        "config": {k: v for k, v in vars(args).items() if k != "out"},
        "rounds": rounds,
        "http_over_offline": statistics.median(ratios),
        "cpu_per_token_http_over_offline": statistics.median(
            r["cpu_per_token_http_over_offline"] for r in rounds
        ),
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    logger.info(
        "HTTP / offline = %.3f tokens/s, %.3f CPU/token -> %s",
        result["http_over_offline"], result["cpu_per_token_http_over_offline"], out,
    )  # fmt: skip


if __name__ == "__main__":
    main()
