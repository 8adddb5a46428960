"""Where a whole engine decode step goes: Python phases and torch ops, for workloads A and B.

    python benchmarks/step_phases.py --workload B --steps 16 --out results/step_phases_B.json

Runs `LLM.generate` on the workload's prompts (A: 1 x 32 -> 128, B: 32 x 128 -> 128, the
prompts of benchmarks/engine_throughput.py) and times, for every decode-only step (no
prefill row), spans around each phase:

  frontend   LLM._run's loop around engine.step (output bookkeeping, detokenization)
  schedule   Scheduler.schedule
  prepare    ModelRunner._execute minus forward, logits and sample (input tensors, metadata)
  forward    the model forward (embedding, 30 layers, final norm)
  logits     compute_logits (lm_head + fp32 copy)
  sample     pdserve.engine.sampler.sample
  update     EngineCore.step minus schedule and execute (update_from_output, outputs)

(the spans wrap the real methods; nothing else changes). `--clock cpu` (the default
with one thread) times the spans in this thread's CPU time, so a busy machine's waiting
for a core is left out; `wall` uses time.perf_counter. Then `--steps` decode steps are
profiled with the torch profiler and the per-op table (self CPU time per step) printed.
Both engines' phases go to --out as JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

from torch.profiler import ProfilerActivity, profile, record_function

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import pdserve.engine.model_runner as model_runner  # noqa: E402
from benchmarks.engine_throughput import WORKLOADS, make_prompts  # noqa: E402
from pdserve.engine import LLM, SamplingParams  # noqa: E402

PHASES = ("frontend", "schedule", "prepare", "forward", "logits", "sample", "update")


class Spans:
    """Per-step time of each wrapped phase (only steps whose rows all decode count)."""

    def __init__(self, clock) -> None:
        self.clock = clock
        self.cur: dict[str, float] = defaultdict(float)
        self.steps: list[dict[str, float]] = []
        self.decode_only = False

    def wrap(self, owner, name: str, phase: str) -> None:
        fn = getattr(owner, name)
        spans = self

        def wrapped(*a, **kw):
            t0 = spans.clock()
            with record_function(f"phase::{phase}"):
                try:
                    return fn(*a, **kw)
                finally:
                    spans.cur[phase] += spans.clock() - t0

        setattr(owner, name, wrapped)


def instrument(llm: LLM, spans: Spans) -> None:
    eng = llm.engine
    runner = eng.runner
    sched = eng.scheduler
    spans.wrap(sched, "schedule", "schedule")
    spans.wrap(runner.model, "forward", "forward")
    spans.wrap(runner.model, "compute_logits", "logits")
    spans.wrap(model_runner, "sample", "sample")
    inner_execute = runner.execute

    def execute(out, block_ids):
        spans.decode_only = all(s.num_new_tokens == 1 for s in out.scheduled)
        t0 = spans.clock()
        try:
            return inner_execute(out, block_ids)
        finally:
            spans.cur["execute"] += spans.clock() - t0

    runner.execute = execute
    inner_step = eng.step
    last_end = [None]

    def step():
        t0 = spans.clock()
        if last_end[0] is not None:  # time since the previous step returned: the frontend
            spans.cur["frontend"] = t0 - last_end[0]
        spans.decode_only = False
        try:
            with record_function("engine_step"):
                return inner_step()
        finally:
            t1 = spans.clock()
            cur = spans.cur
            cur["step"] = t1 - t0
            cur["update"] = cur["step"] - cur["execute"] - cur["schedule"]
            cur["prepare"] = cur["execute"] - cur["forward"] - cur["logits"] - cur["sample"]
            if spans.decode_only:
                spans.steps.append(dict(cur))
            spans.cur = defaultdict(float)
            last_end[0] = t1

    eng.step = step


def summarize(steps: list[dict[str, float]]) -> dict[str, float]:
    keys = [*PHASES, "step"]
    return {k: round(statistics.median(s.get(k, 0.0) for s in steps) * 1e3, 3) for k in keys}


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--workload", choices=["A", "B"], default="B")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--new", type=int, default=None, help="new tokens (default: the workload's)")
    ap.add_argument("--clock", choices=["cpu", "wall"], default=None,
                    help="span clock (default: cpu with one thread, else wall)")  # fmt: skip
    ap.add_argument("--steps", type=int, default=16, help="decode steps under the profiler")
    ap.add_argument("--rows", type=int, default=25, help="rows of the per-op table")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    n, plen, new = WORKLOADS[args.workload]
    new = args.new or new
    clock = args.clock or ("cpu" if args.threads == 1 else "wall")
    llm = LLM(
        args.model,
        dtype=args.dtype,
        num_threads=args.threads,
        max_num_seqs=64,
        max_num_batched_tokens=4096,
    )
    prompts = make_prompts(n, plen, llm.engine.vocab_size, seed=ord(args.workload))
    params = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    spans = Spans(time.thread_time if clock == "cpu" else time.perf_counter)
    instrument(llm, spans)
    llm.engine.kv.pool.reset_prefix_cache()
    t0 = time.perf_counter()
    llm.generate(prompts, params)
    elapsed = time.perf_counter() - t0
    phases = summarize(spans.steps)
    result = {
        "workload": args.workload,
        "dtype": args.dtype,
        "threads": args.threads,
        "clock": clock,
        "out_tok_s": round(n * new / elapsed, 1),
        "decode_steps": len(spans.steps),
        "median_ms": phases,
    }
    print(json.dumps(result), flush=True)

    # The profiler over --steps decode steps of a fresh run (prefill and first steps first).
    llm.engine.kv.pool.reset_prefix_cache()
    eng = llm.engine
    for i, p in enumerate(prompts):
        eng.add_request(
            f"prof-{i}",
            p,
            SamplingParams(temperature=0, max_tokens=args.steps + 8, ignore_eos=True),
        )
    for _ in range(4):
        eng.step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(args.steps):
            eng.step()
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows)
    print(table)
    eng.abort_requests([f"prof-{i}" for i in range(n)])
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        result["profile_table"] = table
        out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
