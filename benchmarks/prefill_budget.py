"""Where workload C's prefill step (32 fresh prompts x 128 tokens) spends its CPU, per op:
every kernel-op call and every projection GEMM of the engine's eager model is wrapped
with a process-CPU timer (one thread by default, so the sums are the work itself and
add up to the step). The native ops run through ctypes, which the torch profiler does not
see; this does.

    python benchmarks/prefill_budget.py --dtype bfloat16 --rounds 3

Prints, for the round with the smallest total, each op's CPU ms and call count, and the
rest of the step (Python, embedding, lm_head's gather, ...), and the step's system CPU
(page faults). `--heap default` leaves glibc's malloc thresholds as they are (the engine
raises them on CPU: engine/cpu_heap.py); compare in separate processes.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.engine_throughput import make_prompts  # noqa: E402
from benchmarks.prefill_step_ab import fresh_batch, set_ops  # noqa: E402
from pdserve.engine import LLM  # noqa: E402
from pdserve.engine.models import cpu_linear  # noqa: E402
from pdserve.kernels import cpu_ops  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--heap", choices=["keep", "default"], default="keep")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.heap == "default":
        from pdserve.engine import core as engine_core

        engine_core.keep_freed_memory = lambda: False
    llm = LLM(args.model, dtype=args.dtype, enforce_eager=True, num_blocks=1024,
              num_threads=args.threads)  # fmt: skip
    runner = llm.engine.runner
    model, kv = runner.model, runner.kv_cache
    prompts = make_prompts(32, 128, llm.engine.vocab_size, seed=ord("C"))
    ids, pos, meta = fresh_batch(prompts, runner.block_size)
    last = (torch.arange(32) + 1) * 128 - 1
    cpu, calls = Counter(), Counter()

    def timed(name, fn):
        def call(*a, **kw):
            c0 = time.process_time()
            out = fn(*a, **kw)
            cpu[name(*a) if callable(name) else name] += time.process_time() - c0
            calls[name(*a) if callable(name) else name] += 1
            return out

        return call

    ops = SimpleNamespace(**{n: getattr(cpu_ops, n) for n in cpu_ops.__all__})
    for n in cpu_ops.__all__:  # the ops (the FUSES_MLP_ACTIVATION flag is not one)
        if callable(getattr(ops, n)):
            setattr(ops, n, timed(n, getattr(ops, n)))
    set_ops(model, ops, None)
    gemm = cpu_linear.linear
    cpu_linear.linear = timed(lambda x, w, b: f"GEMM {list(x.shape)} x {list(w.shape)}", gemm)
    glu = cpu_linear.PackedGateUp.silu_mul
    cpu_linear.PackedGateUp.silu_mul = timed("GEMMs gate_up + SiLU * mul (post-ops)", glu)
    best = None
    with torch.inference_mode():
        model.compute_logits(model(ids, pos, kv, meta)[last])  # warm
        for _ in range(args.rounds):
            cpu.clear()
            calls.clear()
            c0, s0 = time.process_time(), os.times().system
            model.compute_logits(model(ids, pos, kv, meta)[last])
            total, system = time.process_time() - c0, os.times().system - s0
            if best is None or total < best[0]:
                best = (total, dict(cpu), dict(calls), system)
    total, per_op, n, system = best
    print(f"{args.dtype}, {args.threads} thread(s), heap {args.heap}: step {total * 1e3:.0f} "
          f"CPU ms, of which system {system * 1e3:.0f}")  # fmt: skip
    for name, s in sorted(per_op.items(), key=lambda kv: -kv[1]):
        print(f"{s * 1e3:9.1f} ms {n[name]:5d}  {name}")
    print(f"{(total - sum(per_op.values())) * 1e3:9.1f} ms        the rest")


if __name__ == "__main__":
    main()
