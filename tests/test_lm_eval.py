"""lm-evaluation-harness against a live node: its `local-completions` model (echo=True,
logprobs=1, token-id prompts in batches) scores a small multiple-choice task from a local
file, and every per-choice loglikelihood equals what lm-eval's own `hf` backend computes
for the same model (real SmolLM2, fp32)."""

from __future__ import annotations

import json
import os

import pytest

from tests.servers import kill_server, start_server, wait_idle

pytestmark = pytest.mark.slow
lm_eval = pytest.importorskip("lm_eval")

MODEL = "smollm2-135m-instruct"
QUESTIONS = [
    ("What colour is the sky on a clear day?", ["blue", "green", "red", "black"], 0),
    ("How many legs does a spider have?", ["six", "eight", "four", "ten"], 1),
    ("Which animal says moo?", ["a dog", "a cat", "a cow", "a duck"], 2),
    ("What is the capital of France?", ["Berlin", "Madrid", "Rome", "Paris"], 3),
    ("What do bees make?", ["honey", "milk", "silk", "wax paper"], 0),
    ("Which is the largest planet?", ["Mars", "Jupiter", "Venus", "Mercury"], 1),
    ("What is frozen water called?", ["steam", "fog", "ice", "rain"], 2),
    ("How many days are in a week?", ["five", "six", "eight", "seven"], 3),
]


def write_task(root) -> str:
    data = root / "mc.jsonl"
    data.write_text(
        "".join(
            json.dumps({"question": q, "choices": c, "answer": a}) + "\n" for q, c, a in QUESTIONS
        )
    )
    (root / "pdserve_mc.yaml").write_text(
        f"""task: pdserve_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
"""
    )
    return str(root)


def loglikelihoods(model: str, model_args: str, include: str) -> dict[tuple[int, int], float]:
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    out = simple_evaluate(
        model=model,
        model_args=model_args,
        tasks=["pdserve_mc"],
        task_manager=TaskManager(include_path=include),
        log_samples=True,
        batch_size=4,
    )
    lls = {}
    for s in out["samples"]["pdserve_mc"]:
        for j, resp in enumerate(s["resps"]):
            lls[(s["doc_id"], j)] = float(resp[0][0])
    return lls


def test_local_completions_loglikelihoods_equal_the_hf_backend(tmp_path):
    from pdserve.common.model_files import resolve_model

    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    model_dir = str(resolve_model(MODEL))
    include = write_task(tmp_path)
    url, proc = start_server(
        ["--model", MODEL, "--kv-cache-bytes", str(128 << 20), "--num-threads", "1",
         "--log-level", "warning"]
    )  # fmt: skip
    try:
        served = loglikelihoods(
            "local-completions",
            f"base_url={url}/v1/completions,model={MODEL},tokenizer={model_dir},"
            "tokenized_requests=True,num_concurrent=1,max_retries=1",
            include,
        )
        wait_idle(url)
    finally:
        kill_server(proc)
    ref = loglikelihoods("hf", f"pretrained={model_dir},dtype=float32,device=cpu", include)
    assert set(served) == set(ref) and len(ref) == 4 * len(QUESTIONS)
    worst = max(abs(served[k] - ref[k]) for k in ref)
    assert worst < 5e-4, worst  # measured: 3e-5
