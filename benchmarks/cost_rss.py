"""Peak RSS of a node (HTTP process + EngineCore) under one costly request (issue 29 item 1):
`/v1/completions` with many prompts, `n`, `echo` and `logprobs`, on a tiny random Llama.

    python benchmarks/cost_rss.py --out rss.json                  # this tree's node
    python benchmarks/cost_rss.py --python OLD/.venv/bin/python   # another tree's node

It samples the RSS of the node's process tree every 20 ms from before the request until
its answer (or until `--max-rss-mb`, where it kills the node: a guard for a shared box),
and writes the peak, the answer's status and time as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx


def tiny_llama(path: str, max_len: int) -> str:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=1024, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=max_len, tie_word_embeddings=True,
                      bos_token_id=1, eos_token_id=2, torch_dtype="float32")  # fmt: skip
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(path, safe_serialization=True)
    return path


def tree_rss_mb(pid: int) -> float:
    """RSS of `pid` and every process below it, in MiB."""
    kids: dict[int, list[int]] = {}
    for e in Path("/proc").iterdir():
        if e.name.isdigit():
            try:
                ppid = int((e / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except OSError:
                continue
            kids.setdefault(ppid, []).append(int(e.name))
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        todo += kids.get(p, [])
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
        except OSError:
            pass
    return total / 1024


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--python", default=sys.executable, help="interpreter of the node's tree")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=40)
    ap.add_argument("--n", type=int, default=16)
    ap.add_argument("--logprobs", type=int, default=20)
    ap.add_argument("--max-rss-mb", type=float, default=2000)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="cost-rss-")
    model = tiny_llama(f"{tmp}/model", 1024)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [a.python, "-m", "pdserve", "serve", "--model", model, "--port", str(port),
           "--num-threads", "1", "--kv-cache-bytes", str(128 << 20), "--log-level", "warning"]  # fmt: skip
    node = subprocess.Popen(cmd, cwd=tmp, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        idle = tree_rss_mb(node.pid)
        body = {"prompt": [[42] * a.prompt_len] * a.prompts, "n": a.n, "echo": True,
                "logprobs": a.logprobs, "max_tokens": 1}  # fmt: skip
        answer: dict = {}

        def ask() -> None:
            t0 = time.monotonic()
            try:
                r = httpx.post(f"{url}/v1/completions", json=body, timeout=3600)
                answer.update(status=r.status_code, bytes=len(r.content))
            except httpx.HTTPError as e:
                answer.update(status=None, error=type(e).__name__)
            answer["seconds"] = round(time.monotonic() - t0, 2)

        t = threading.Thread(target=ask)
        t.start()
        peak, guarded = idle, False
        while t.is_alive():
            peak = max(peak, tree_rss_mb(node.pid))
            if peak > a.max_rss_mb:
                guarded = True
                os.killpg(node.pid, signal.SIGKILL)
                break
            time.sleep(0.02)
        t.join()
        result = {"python": a.python, "request": {k: v for k, v in body.items() if k != "prompt"}
                  | {"prompts": a.prompts, "prompt_len": a.prompt_len},
                  "idle_rss_mb": round(idle, 1), "peak_rss_mb": round(peak, 1),
                  "killed_at_max_rss": guarded, **answer}  # fmt: skip
        print(json.dumps(result))
        if a.out:
            Path(a.out).write_text(json.dumps(result, indent=1))
    finally:
        if node.poll() is None:
            os.killpg(node.pid, signal.SIGKILL)


if __name__ == "__main__":
    main()
