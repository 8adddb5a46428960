"""The model runner's own per-step Python (engine/model_runner.py) at a git ref vs now, in one engine.

    python benchmarks/runner_step_ab.py --baseline-ref 1af3235 --dtypes bfloat16,float32 \
        --rounds 7 --out results/runner_step_ab.json

Workload A (1 prompt x 32 -> 128 new tokens, greedy, prefix cache reset so each run
prefills), one thread, one engine per dtype. Variants alternate run by run: `baseline`
binds `ModelRunner._execute` and `_prepare` as they are in engine/model_runner.py at
`--baseline-ref` to the live runner; `current` uses today's. Reported per variant (median):
thread CPU ms per output token, and the part of it outside the model's forward and
`compute_logits` (the runner, scheduler, sampler and frontend: what the change is about,
without the weight-streaming noise of the rest). Same tokens checked.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.engine_throughput import WORKLOADS, make_prompts  # noqa: E402
from pdserve.engine import LLM, SamplingParams  # noqa: E402


def module_at(ref: str, path: str, name: str):
    """The module `path` (repository-relative) as it is at git `ref`, imported as `name`."""
    src = subprocess.run(
        ["git", "-C", str(ROOT), "show", f"{ref}:{path}"], capture_output=True, check=True
    ).stdout
    file = Path(tempfile.mkdtemp(prefix="pdserve-ab-")) / f"{name}.py"
    file.write_bytes(src)
    spec = importlib.util.spec_from_file_location(name, file)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--baseline-ref", required=True)
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--out", default="results/runner_step_ab.json")
    args = ap.parse_args()
    old = module_at(args.baseline_ref, "engine/model_runner.py", "baseline_model_runner")
    n, prompt_len, new = WORKLOADS["A"]
    inside = [0.0]  # thread CPU in model.forward + compute_logits

    def timed(fn):
        def wrapped(*a, **kw):
            t0 = time.thread_time()
            try:
                return fn(*a, **kw)
            finally:
                inside[0] += time.thread_time() - t0

        return wrapped

    results = []
    for dtype in args.dtypes.split(","):
        llm = LLM(args.model, dtype=dtype, num_threads=1, kv_cache_bytes=1 << 30)
        runner, model = llm.engine.runner, llm.engine.runner.model
        prompts = make_prompts(n, prompt_len, llm.engine.vocab_size)
        bind = lambda f, r=runner: types.MethodType(f, r)  # noqa: E731
        variants = {
            "baseline": (bind(old.ModelRunner._execute), bind(old.ModelRunner._prepare)),
            "current": (runner._execute, runner._prepare),
        }
        model.forward, model.compute_logits = timed(model.forward), timed(model.compute_logits)
        params = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)
        llm.generate(prompts, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
        rows = {v: {"cpu_ms_per_tok": [], "outside_model_ms_per_tok": []} for v in variants}
        tokens = {}
        for _ in range(args.rounds):
            for name, (execute, prepare) in variants.items():
                runner._execute, runner._prepare = execute, prepare
                llm.engine.kv.pool.reset_prefix_cache()
                inside[0] = 0.0
                c0 = time.thread_time()
                out = llm.generate(prompts, params)
                c = time.thread_time() - c0
                tokens[name] = out[0].token_ids
                rows[name]["cpu_ms_per_tok"].append(round(c / new * 1e3, 3))
                rows[name]["outside_model_ms_per_tok"].append(round((c - inside[0]) / new * 1e3, 3))
        summary = {
            "dtype": dtype,
            "baseline_ref": args.baseline_ref,
            "median": {v: {k: statistics.median(x) for k, x in r.items()} for v, r in rows.items()},
            "same_tokens": tokens["baseline"] == tokens["current"],
            "rounds": rows,
        }
        print(json.dumps({k: v for k, v in summary.items() if k != "rounds"}), flush=True)
        results.append(summary)
        del llm
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
