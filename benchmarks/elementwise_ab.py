"""Decode steps with the reference elementwise ops vs the native ones, side by side.

    python benchmarks/elementwise_ab.py --threads 1 --out results/elementwise_ab.json

One engine (SmolLM2-135M, fp32); its layers' kernel set is swapped between rounds:
`reference` = the pure-torch RMSNorm, RoPE, SiLU*mul and KV store with the native paged
decode attention (main before kernels/cpu_elementwise.py), `native` = pdserve.kernels.cpu_ops.
Each round times, per variant: workload A's decode (1 prompt of 32 tokens, prefix-cached,
generate(max_tokens=N+1) minus generate(max_tokens=1), per step) and B's decode step (32
prompts of 128 tokens, the same difference); `--prefill` also times a 4 x 512-token
prompt chunk forward (fresh sequences, fastest of the rounds). With one thread the process CPU time is the
work itself even on a busy machine; the wall time is reported too. Greedy tokens of both
variants must be the same (`same_tokens`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.engine_throughput import make_prompts  # noqa: E402
from pdserve.engine import LLM, SamplingParams  # noqa: E402
from pdserve.engine.warmup import dummy_batch  # noqa: E402
from pdserve.kernels import cpu_ops, reference  # noqa: E402

_ELEMENTWISE = ("rms_norm", "fused_add_rms_norm", "rotary_embedding", "silu_and_mul", "store_kv")


def op_sets() -> dict[str, object]:
    ref = SimpleNamespace(**{n: getattr(cpu_ops, n) for n in cpu_ops.__all__})
    for name in _ELEMENTWISE:
        setattr(ref, name, getattr(reference, name))
    ref.gate_up_silu = ref.norm_linear = None  # unfused: reference norms and SiLU * up
    return {"reference": ref, "native": cpu_ops}


def set_ops(model, ops) -> None:
    model.fused_decode = None  # op by op (the one-call decode forward only chains native ops)
    for layer in model.model.layers:
        for m in (layer.self_attn, layer.self_attn.attn, layer.mlp):
            m.ops = ops
        layer.input_layernorm.ops = layer.post_attention_layernorm.ops = ops
    model.model.norm.ops = ops


def timed(llm: LLM, prompts, n: int) -> tuple[float, float, list]:
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    c0, w0 = time.process_time(), time.perf_counter()
    out = llm.generate(prompts, params)
    return time.process_time() - c0, time.perf_counter() - w0, [o.token_ids for o in out]


def prefill_ab(llm: LLM, sets: dict, rounds: int) -> dict:
    """Fastest CPU and wall seconds of one 4 x 512-token forward per op set (slots -1:
    the cache is not written)."""
    runner = llm.engine.runner
    batch = dummy_batch([512] * 4, 1, runner.kv_cache, runner.block_size)
    best = {name: [float("inf"), float("inf")] for name in sets}
    with torch.inference_mode():
        for _ in range(rounds):
            for name, ops in sets.items():
                set_ops(runner.model, ops)
                c0, w0 = time.process_time(), time.perf_counter()
                runner.model(*batch)
                b = best[name]
                b[0] = min(b[0], time.process_time() - c0)
                b[1] = min(b[1], time.perf_counter() - w0)
    return {n: {"cpu_s": round(c, 3), "wall_s": round(w, 3)} for n, (c, w) in best.items()}


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--prefill", action="store_true", help="also a 4 x 512-token chunk")
    ap.add_argument("--out", default="results/elementwise_ab.json")
    args = ap.parse_args()
    llm = LLM(
        args.model,
        dtype="float32",
        num_threads=args.threads,
        kv_cache_bytes=512 << 20,
        max_num_batched_tokens=4096,
    )
    model = llm.engine.runner.model
    vocab = llm.engine.vocab_size
    workloads = {
        "A": make_prompts(1, 32, vocab, seed=ord("A")),
        "B": make_prompts(32, 128, vocab, seed=ord("B")),
    }
    sets = op_sets()
    for prompts in workloads.values():
        timed(llm, prompts, 1)  # prefill once: later rounds hit the prefix cache
    rows: dict[str, dict[str, list]] = {w: {v: [] for v in sets} for w in workloads}
    tokens: dict[str, dict[str, list]] = {w: {} for w in workloads}
    for _ in range(args.rounds):
        for w, prompts in workloads.items():
            for name, ops in sets.items():
                set_ops(model, ops)
                c1, w1, _ = timed(llm, prompts, 1)
                cn, wn, tokens[w][name] = timed(llm, prompts, args.steps + 1)
                rows[w][name].append(
                    {
                        "cpu_ms_per_step": round((cn - c1) / args.steps * 1e3, 2),
                        "wall_ms_per_step": round((wn - w1) / args.steps * 1e3, 2),
                    }
                )
                print(w, name, json.dumps(rows[w][name][-1]), flush=True)
    summary = {}
    if args.prefill:
        summary["prefill_4x512"] = prefill_ab(llm, sets, args.rounds)
    set_ops(model, cpu_ops)
    for w in workloads:
        med = {
            v: {k: statistics.median(r[k] for r in rows[w][v]) for k in rows[w][v][0]} for v in sets
        }
        summary[w] = {
            "median": med,
            "cpu_speedup": round(
                med["reference"]["cpu_ms_per_step"] / med["native"]["cpu_ms_per_step"], 3
            ),
            "same_tokens": tokens[w]["reference"] == tokens[w]["native"],
        }
    result = {
        "threads": args.threads,
        "summary": summary,
        "rounds": rows,
        "loadavg_at_end": os.getloadavg()[0],
    }
    print(json.dumps(summary))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
