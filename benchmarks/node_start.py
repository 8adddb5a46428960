"""A node's start: `pdserve serve` (default model, 1 GiB KV cache) to healthy, the split
of it (weights loaded, packed, KV cache faulted in), the first burst's TTFT and the node's
RSS. Modes, alternated run by run on the same box:

- `background`: the default: the KV cache faults in on a thread, lowest blocks first,
  while the model loads and after the node is healthy (kernels/fault_in.py);
- `lazy`: `--no-kv-populate`: each page faults in at its first write, on the request path.
- `plain`: `background` with `--keep-plain-weights`: the plain projection weights kept beside
  their packed copies (by default they are freed where both packed copies hold them).
- `panel` / `onednn`: `background` with `--prompt-gemm panel` / `onednn`: prompt steps on
  the batched forward's panel copies, no oneDNN copy of the projections (one form of each
  weight) / on oneDNN's copy (two forms). `background` is the default, `auto`, which is one
  of the two by the CPU (engine/model_build.py, `prompt_gemm_form`).

The earlier design (the whole cache faulted in before the engine is ready) took load +
pack + fault-in seconds to become healthy: the split below gives that sum too.

    .venv/bin/python benchmarks/node_start.py [--runs 3] [--modes background,lazy]

Writes benchmarks/results/node_start.json (`--out`). Needs the model converted once
(any earlier start did it).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from tqdm import tqdm

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from tests.servers import descendants, free_port, wait_healthy  # noqa: E402

BURST, PROMPT_TOKENS, OUT_TOKENS = 16, 128, 16
LOG_TIME = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3})")
SPLIT = {
    "load_s": re.compile(r"model weights loaded in ([\d.]+) s, packed in"),
    "pack_s": re.compile(r"model weights loaded in [\d.]+ s, packed in ([\d.]+) s"),
    "engine_s": re.compile(r"engine loaded .* in ([\d.]+) s"),
    "kv_fault_s": re.compile(r"KV cache faulted in: \d+ MiB in ([\d.]+) s"),
}


def rss_mb(pid: int) -> dict[str, float]:
    """RSS (MiB) of the node's HTTP process, its engine process and any other child."""
    out: dict[str, float] = {}
    for p in [pid, *descendants(pid)]:
        try:
            with open(f"/proc/{p}/status") as f:
                kb = next(int(x.split()[1]) for x in f if x.startswith("VmRSS"))
            with open(f"/proc/{p}/cmdline", "rb") as f:
                cmd = f.read()
        except (OSError, StopIteration):
            continue
        name = "http" if p == pid else "engine" if b"spawn_main" in cmd else f"child-{p}"
        out[name] = round(out.get(name, 0) + kb / 1024, 1)
    out["total"] = round(sum(out.values()), 1)
    return out


async def burst(url: str, seed: int) -> list[float]:
    """BURST concurrent streamed completions of fresh prompts: each one's TTFT (s)."""

    async def one(client: httpx.AsyncClient, i: int) -> float:
        prompt = [(seed * 7919 + i * 131 + j * 17) % 40000 + 100 for j in range(PROMPT_TOKENS)]
        body = {"prompt": prompt, "max_tokens": OUT_TOKENS, "temperature": 0,
                "ignore_eos": True, "stream": True}  # fmt: skip
        t0 = time.monotonic()
        async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
            r.raise_for_status()
            async for line in r.aiter_lines():
                if line.startswith("data: ") and '"text"' in line:
                    return time.monotonic() - t0
        raise RuntimeError("no token streamed")

    async with httpx.AsyncClient(timeout=600) as client:
        return list(await asyncio.gather(*(one(client, i) for i in range(BURST))))


def one_run(mode: str, seed: int, args) -> dict:
    port = free_port()
    log = Path(tempfile.mkstemp(prefix=f"node-start-{mode}-", suffix=".log")[1])
    cmd = [sys.executable, "-m", "pdserve", "serve", "--model", args.model, "--port", str(port),
           "--kv-cache-bytes", args.kv_cache_bytes, "--num-threads", str(args.threads),
           "--log-level", "info"]  # fmt: skip
    if mode == "lazy":
        cmd.append("--no-kv-populate")
    if mode == "plain":
        cmd.append("--keep-plain-weights")
    if mode in ("panel", "onednn"):
        cmd += ["--prompt-gemm", mode]
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    env.pop("PDSERVE_KV_POPULATE", None)
    started = dt.datetime.now()
    t0 = time.monotonic()
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        try:
            wait_healthy(url, proc, timeout_s=600, poll_s=0.05)
        except AssertionError as e:
            raise RuntimeError(f"{e}; log {log}") from None
        healthy_s = time.monotonic() - t0
        ttfts = asyncio.run(burst(url, seed))
        burst_end_s = time.monotonic() - t0
        rss = rss_mb(proc.pid)
        if mode != "lazy":  # wait for the thread to finish, for its figure
            deadline = time.monotonic() + 120
            while "KV cache faulted in" not in log.read_text() and time.monotonic() < deadline:
                time.sleep(0.2)
    finally:
        proc.terminate()
        proc.wait(60)
    text = log.read_text()
    split = {}
    for name, pattern in SPLIT.items():
        m = pattern.search(text)
        split[name] = float(m.group(1)) if m else None
    faulted_at_s = None
    for line in text.splitlines():
        if "KV cache faulted in" in line and (m := LOG_TIME.match(line)):
            at = dt.datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f")
            faulted_at_s = round((at - started).total_seconds(), 2)
    return {
        "mode": mode,
        "healthy_s": round(healthy_s, 2),
        "split_s": split,
        "kv_faulted_in_at_s": faulted_at_s,  # from the start, by this host's one clock
        "burst_ttft_s": {"median": round(statistics.median(ttfts), 3), "max": round(max(ttfts), 3)},
        "burst_done_at_s": round(burst_end_s, 2),
        "node_rss_mib": rss,
        "log": str(log),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--modes", default="background,lazy")
    p.add_argument("--kv-cache-bytes", default="1GiB")
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "node_start.json"))
    args = p.parse_args()
    modes = args.modes.split(",")
    plan = [(m, r) for r in range(args.runs) for m in modes]
    runs = [one_run(m, r, args) for m, r in tqdm(plan, desc="node starts")]
    summary = {}
    for m in modes:
        mine = [r for r in runs if r["mode"] == m]
        summary[m] = {
            "healthy_s_median": statistics.median(r["healthy_s"] for r in mine),
            "burst_ttft_median_s": statistics.median(r["burst_ttft_s"]["median"] for r in mine),
            "burst_ttft_max_s": statistics.median(r["burst_ttft_s"]["max"] for r in mine),
            "engine_rss_mib_median": statistics.median(r["node_rss_mib"]["engine"] for r in mine),
        }
    cpu = next(
        (x.split(":", 1)[1].strip() for x in open("/proc/cpuinfo") if x.startswith("model name")),
        "?",
    )
    flags = next((x for x in open("/proc/cpuinfo") if x.startswith("flags")), "").split()
    result = {
        "cpu": cpu,
        "isa": [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_tile") if f in flags],
        "cpus": len(os.sched_getaffinity(0)),
        "model": args.model,
        "kv_cache_bytes": args.kv_cache_bytes,
        "burst": {"requests": BURST, "prompt_tokens": PROMPT_TOKENS, "max_tokens": OUT_TOKENS},
        "summary": summary,
        "runs": runs,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
