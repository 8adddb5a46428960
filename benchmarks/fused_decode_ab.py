"""Decode steps op by op vs through engine/models/fused_decode.py, side by side in one engine.

    python benchmarks/fused_decode_ab.py --threads 1 --rounds 5 --out results/fused_decode_ab.json

One engine per dtype (SmolLM2-135M). Two workloads, each variant run in turn every round:
- A: 1 prompt x 32 tokens -> 128 new (benchmarks/engine_throughput.py's A, prefix cache
  reset so each run prefills): process CPU ms per output token;
- B decode: 32 prompts x 128 tokens prefilled once (later runs hit the prefix cache), then
  per run generate(max_tokens=1) and generate(max_tokens=1 + --steps): the difference over
  --steps is one 32-row decode step (context ~130-160), process CPU ms.
Variants: `per_op` (the model's forward op by op: main before fused_decode), `fused` (<= 8
rows: the whole forward in one native call; more: one native attention call a layer);
with `--gemv-baseline-ref REF` also `fused_gemv@REF`: the same with kernels/csrc/gemv.cpp
as it is at git REF (or from the sources in directory REF), for the fused forward's GEMVs
and the lm_head's (`--variants` picks some).
Reports the median per variant and whether both gave the same tokens.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.decode_parts import build_at_ref  # noqa: E402
from benchmarks.engine_throughput import WORKLOADS, make_prompts  # noqa: E402
from pdserve.engine import LLM, SamplingParams  # noqa: E402
from pdserve.kernels import cpu_gemv  # noqa: E402


def install_gemv(fused, fns) -> None:
    """Use the GEMV entry points `fns` = (pdserve_gemv, pdserve_norm_gemv) everywhere."""
    cpu_gemv._fn, cpu_gemv._norm_fn = fns
    addr = [ctypes.cast(f, ctypes.c_void_p).value for f in fns]
    fused._model.gemv, fused._model.norm_gemv = addr


def timed(llm: LLM, prompts, n: int, reset: bool) -> tuple[float, list]:
    if reset:
        llm.engine.kv.pool.reset_prefix_cache()
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    c0 = time.process_time()
    out = llm.generate(prompts, params)
    return time.process_time() - c0, [o.token_ids for o in out]


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=8, help="B: decode steps timed per run")
    ap.add_argument("--workloads", default="A,B")
    ap.add_argument("--gemv-baseline-ref", default=None)
    ap.add_argument("--variants", default=None, help="default: all")
    ap.add_argument("--out", default="results/fused_decode_ab.json")
    args = ap.parse_args()
    cpu_gemv.available()
    current = (cpu_gemv._fn, cpu_gemv._norm_fn)
    baseline = None
    if args.gemv_baseline_ref:
        tmp = Path(tempfile.mkdtemp(prefix="pdserve-ab-"))
        lib = build_at_ref(args.gemv_baseline_ref, tmp, ("gemv",))["gemv"]
        baseline = (lib.pdserve_gemv, lib.pdserve_norm_gemv)
        baseline[0].argtypes, baseline[0].restype = cpu_gemv._ARGTYPES, ctypes.c_int
        baseline[1].argtypes, baseline[1].restype = cpu_gemv._NORM_ARGTYPES, ctypes.c_int
    results = []
    for dtype in args.dtypes.split(","):
        llm = LLM(
            args.model,
            dtype=dtype,
            num_threads=args.threads,
            kv_cache_bytes=1 << 30,
            max_num_batched_tokens=4096,
        )
        model = llm.engine.runner.model
        fused = model.fused_decode
        assert fused is not None, "no fused decode on this machine"
        vocab = llm.engine.vocab_size
        n, prompt_len, new = WORKLOADS["A"]
        work = {"A": make_prompts(n, prompt_len, vocab), "B": make_prompts(32, 128, vocab)}
        work = {w: work[w] for w in args.workloads.split(",")}
        timed(llm, work.get("A", [[1, 2, 3]]), 4, True)  # warm-up
        variants = {"per_op": None, "fused": fused}
        if args.gemv_baseline_ref:
            variants[f"fused_gemv@{args.gemv_baseline_ref}"] = fused
        if args.variants:
            variants = {v: variants[v] for v in args.variants.split(",")}
        gemvs = {v: current for v in variants}
        if args.gemv_baseline_ref:
            gemvs[f"fused_gemv@{args.gemv_baseline_ref}"] = baseline
        rows = {w: {v: [] for v in variants} for w in work}
        tokens = {w: {} for w in work}
        for _ in range(args.rounds):
            for w, prompts in work.items():
                for name, fd in variants.items():
                    model.fused_decode = fd
                    install_gemv(fused, gemvs[name])
                    if w == "A":
                        c, tokens[w][name] = timed(llm, prompts, new, True)
                        rows[w][name].append(round(c / (n * new) * 1e3, 2))
                    else:  # (A's runs reset the prefix cache: fill it again first)
                        timed(llm, prompts, 1, False)
                        c1, _ = timed(llm, prompts, 1, False)
                        cn, tokens[w][name] = timed(llm, prompts, 1 + args.steps, False)
                        rows[w][name].append(round((cn - c1) / args.steps * 1e3, 2))
                    print(dtype, w, name, rows[w][name][-1], flush=True)
        model.fused_decode = fused
        install_gemv(fused, current)
        first, last = list(variants)[0], list(variants)[-1]
        for w in work:
            med = {v: statistics.median(rows[w][v]) for v in variants}
            summary = {
                "dtype": dtype,
                "workload": w,
                "unit": "cpu ms per output token" if w == "A" else "cpu ms per decode step",
                "threads": args.threads,
                "median": med,
                "speedup": {v: round(med[first] / med[v], 3) for v in variants},
                "same_tokens": all(tokens[w][v] == tokens[w][last] for v in variants),
                "rounds": rows[w],
                "loadavg_at_end": os.getloadavg()[0],
            }
            print(json.dumps({k: v for k, v in summary.items() if k != "rounds"}), flush=True)
            results.append(summary)
        del llm
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
