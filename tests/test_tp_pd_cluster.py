"""PD between nodes of different tensor-parallel sizes, launched from one YAML each
(`pdserve launch`: embedded Redis, router, one prefill node, one decode node, real NIXL).

For prefill TP -> decode TP of 1 -> 2, 2 -> 1 and 2 -> 2, greedy completions through the
router equal transformers and the colocated engine token for token, every prompt was
prefilled remotely with no checksum mismatch, and both nodes end with no KV block used.
The model is a tiny random Llama with 2 KV heads (no tokenizer: prompts are token ids).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from pdserve.engine import LLM
from pdserve.engine.sampling_params import SamplingParams
from tests.hf_reference import hf_greedy, load_hf
from tests.servers import ROOT, alive, dies_with_test, free_port, wait_idle
from tests.test_pd_engine import prompts_of

pytest.importorskip("nixl")

MAX_TOKENS = 8


def cluster_yaml(model: str, run_dir: Path, tps: tuple[int, int]) -> str:
    node = "num_threads: 1, kv_cache_bytes: 4MiB, connector: {kind: nixl}"
    return f"""
model: {{name: {model}, block_size: 16}}
redis: embedded
router: {{port: {free_port()}, prefill_policy: round_robin, decode_policy: round_robin}}
prefill: {{port: {free_port()}, kv_port: {free_port()}, tensor_parallel_size: {tps[0]}, {node}}}
decode: {{port: {free_port()}, tensor_parallel_size: {tps[1]}, local_prefill_max_tokens: 0, {node}}}
launcher: {{run_dir: {run_dir}, log_level: warning}}
"""


def launch(path: Path, run_dir: Path) -> tuple[subprocess.Popen, dict]:
    out = open(run_dir / "launcher.out", "wb")
    proc = subprocess.Popen(
        dies_with_test([sys.executable, "-m", "pdserve", "launch", str(path)]),
        cwd=ROOT,
        stdout=out,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    deadline = time.monotonic() + 300
    state_file = run_dir / "pdserve-latest" / "cluster.json"
    while True:
        assert proc.poll() is None, (run_dir / "launcher.out").read_text()
        state = json.loads(state_file.read_text()) if state_file.exists() else {}
        services = state.get("services", [])
        if services and all(s["state"] == "up" for s in services):
            return proc, state
        assert time.monotonic() < deadline, f"cluster not up: {state}"
        time.sleep(0.5)


def stop(proc: subprocess.Popen, state: dict) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    left = [s["pid"] for s in state.get("services", []) if s.get("pid") and alive(s["pid"])]
    assert not left, f"left behind: {left}"


def complete(router: str, prompt: list[int]) -> list[int]:
    body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
            "logprobs": 0}  # fmt: skip
    r = httpx.post(f"{router}/v1/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    toks = r.json()["choices"][0]["logprobs"]["tokens"]  # "token_id:N": no tokenizer
    return [int(t.removeprefix("token_id:")) for t in toks]


@pytest.fixture(scope="module")
def reference(tiny_llama_dir):
    prompts = prompts_of([20, 70, 150], seed=3)  # every one past one 16-token block
    hf = load_hf(tiny_llama_dir)
    want = [hf_greedy(hf, p, MAX_TOKENS) for p in prompts]
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    colocated = [o.token_ids for o in LLM(tiny_llama_dir, num_blocks=64).generate(prompts, params)]
    assert colocated == want
    return prompts, want


@pytest.mark.parametrize("tps", [(1, 2), (2, 1), (2, 2)], ids=["1to2", "2to1", "2to2"])
def test_tp_pd_cluster_from_yaml_equals_hf(tiny_llama_dir, reference, tps, tmp_path):
    prompts, want = reference
    path = tmp_path / "cluster.yaml"
    path.write_text(cluster_yaml(tiny_llama_dir, tmp_path, tps))
    proc, state = launch(path, tmp_path)
    try:
        urls = {s["name"]: s["url"] for s in state["services"]}
        for p, ref in zip(prompts, want):
            assert complete(state["router_url"], p) == ref, (tps, len(p))
        stats = wait_idle(urls["decode-0"])
        assert stats["pd_remote_prefills"] == len(prompts) and stats["pd_failures"] == 0, stats
        assert stats["kv_checksum_mismatches"] == 0, stats
        assert wait_idle(urls["prefill-0"])["kv_blocks_used"] == 0
    finally:
        stop(proc, state)
