"""Engine decode step with the reference (gather + SDPA) vs the native CPU attention, and
on a layer-major vs a block-major KV cache (`cache.kv_layout`).

    python benchmarks/decode_step_ab.py --out results/decode_step_ab.json
    python benchmarks/decode_step_ab.py --variants native/layer_major,native/block_major \
        --out results/decode_step_layout.json

Both engines in one process (SmolLM2-135M, fp32, one thread each so the process CPU time
is the work itself even on a busy machine). 32 prompts of 128 tokens are prefilled once
(prefix cache); each round then times generate(max_tokens=1) and generate(max_tokens=33)
per engine, alternating engines: (33 - 1) / 32 is one 32-row decode step at context
~130-160. Also checks all engines produce the same tokens. A variant is KERNEL/LAYOUT.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pdserve.engine import LLM, SamplingParams  # noqa: E402
from pdserve.kernels.ops import CPU_ATTENTION_ENV  # noqa: E402

DEFAULT_VARIANTS = "reference/layer_major,native/layer_major"


def timed(llm: LLM, prompts: list[list[int]], n: int) -> tuple[float, float, list]:
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    c0, w0 = time.process_time(), time.perf_counter()
    out = llm.generate(prompts, params)
    return time.process_time() - c0, time.perf_counter() - w0, [o.token_ids for o in out]


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--variants", default=DEFAULT_VARIANTS, help="KERNEL/LAYOUT, comma-separated")
    ap.add_argument("--out", default="results/decode_step_ab.json")
    args = ap.parse_args()
    variants = args.variants.split(",")
    torch.set_num_threads(1)
    rng = random.Random(66)
    prompts = [[rng.randrange(100, 49000) for _ in range(128)] for _ in range(32)]
    llms = {}
    for variant in variants:  # the env var is read when the model is built
        kernel, layout = variant.split("/")
        os.environ[CPU_ATTENTION_ENV] = kernel
        llms[variant] = LLM(
            args.model,
            dtype="float32",
            num_threads=1,
            kv_cache_bytes=256 << 20,
            max_num_batched_tokens=4096,
            kv_layout=layout,
        )
        timed(llms[variant], prompts, 1)  # prefill once: later rounds hit the prefix cache
    rows: dict[str, list[dict]] = {v: [] for v in variants}
    tokens = {}
    for _ in range(args.rounds):
        for mode, llm in llms.items():
            c1, w1, _ = timed(llm, prompts, 1)
            cn, wn, tokens[mode] = timed(llm, prompts, args.steps + 1)
            rows[mode].append(
                {
                    "cpu_ms_per_step": round((cn - c1) / args.steps * 1e3, 1),
                    "wall_ms_per_step": round((wn - w1) / args.steps * 1e3, 1),
                }
            )
            print(mode, json.dumps(rows[mode][-1]), flush=True)
    result = {
        "same_tokens": all(tokens[v] == tokens[variants[0]] for v in variants),
        "results": rows,
        "loadavg_at_end": os.getloadavg()[0],
    }
    print(json.dumps(result))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
