"""Where a real 32-row decode step (workload B) goes, per part, and kernels A/B in one process.

    python benchmarks/decode_parts.py --dtype bfloat16 --out results/decode_parts_bf16.json
    python benchmarks/decode_parts.py --dtype bfloat16 --baseline-ref main \
        --out results/decode_parts_bf16_vs_main.json

Runs workload B's 32 prompts (128 tokens) through `LLM.generate` for `--context` tokens,
captures the inputs of the last 32-row decode step (context ~128 + `--context`), then
replays that step's forward + logits + argmax `--rounds` times, one thread by default, timing
each part in thread CPU time (a busy box's waiting for a core left out; with `--threads 2`
wall time, meaningful on a quiet box only): the projections' GEMMs,
lm_head, the paged decode attention (KV store apart), each native elementwise op, the greedy
argmax (kernels/argmax.py, as the sampler runs it),
and the rest of the forward (Python, embedding, views). The replay writes the same KV slots
every time, so the cache, weights and inputs are those of a real step.

`--baseline-ref REF` also builds the native kernels (kernels/csrc) as they are at git REF
(or from the sources in directory REF) and alternates the two kernel sets round by round (same weights, same inputs): the rows
`current` and `baseline`, and whether their greedy tokens agree (`same_argmax`).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import pdserve.engine.models.cpu_linear as cpu_linear  # noqa: E402
import pdserve.engine.models.fused_decode as fused_decode  # noqa: E402
import pdserve.engine.models.llama as llama  # noqa: E402
from benchmarks.engine_throughput import make_prompts  # noqa: E402
from pdserve.engine import LLM, SamplingParams  # noqa: E402
from pdserve.kernels import cpu_ops, native  # noqa: E402
from pdserve.kernels.argmax import argmax_rows  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
# the fused per-layer decode loop (engine/models/fused_decode.py): SiLU * up inside the
# gate_up GEMMs, and RoPE + KV store + attention as one native call per layer
FUSED_PARTS = ("gate_up_silu_gemm", "rope_kv_attention")
TIMED_OPS = (
    "paged_decode_attention",
    "store_kv",
    "fused_add_rms_norm",
    "rms_norm",
    "rotary_embedding",
    "silu_and_mul",
)


class Parts:
    """Seconds per part, accumulated by wrappers around the real functions."""

    def __init__(self, clock) -> None:
        self.acc: dict[str, float] = defaultdict(float)
        self.clock = clock

    def wrap(self, owner, name: str, part: str) -> None:
        fn = getattr(owner, name)
        acc, clock = self.acc, self.clock

        def wrapped(*a, **kw):
            t0 = clock()
            try:
                return fn(*a, **kw)
            finally:
                acc[part] += clock() - t0

        setattr(owner, name, wrapped)


def build_at_ref(
    ref: str, cache: Path, names: tuple[str, ...] = ("paged_decode", "elementwise")
) -> dict[str, ctypes.CDLL]:
    """The native kernel libraries built from kernels/csrc as it is at git `ref`."""
    src = cache / "csrc"
    src.mkdir(parents=True, exist_ok=True)
    if Path(ref).is_dir():  # a directory of sources instead of a git ref
        for f in Path(ref).iterdir():
            (src / f.name).write_bytes(f.read_bytes())
        return build_from(src, cache, names)
    files = subprocess.run(
        ["git", "-C", str(ROOT), "ls-tree", "--name-only", f"{ref}:kernels/csrc"],
        capture_output=True, text=True, check=True,
    ).stdout.split()  # fmt: skip
    for name in files:
        blob = subprocess.run(
            ["git", "-C", str(ROOT), "show", f"{ref}:kernels/csrc/{name}"],
            capture_output=True, check=True,
        ).stdout  # fmt: skip
        (src / name).write_bytes(blob)
    return build_from(src, cache, names)


def build_from(
    src: Path, cache: Path, names: tuple[str, ...] = ("paged_decode", "elementwise")
) -> dict[str, ctypes.CDLL]:
    saved = native.CSRC
    native.CSRC = src
    try:
        os.environ["PDSERVE_KERNEL_CACHE"] = str(cache / "lib")
        libs = {n: native.bind(ctypes.CDLL(str(native.build(n))), n) for n in names}
    finally:
        native.CSRC = saved
        os.environ.pop("PDSERVE_KERNEL_CACHE")
    return libs


_LOAD = native.load_library  # the wrappers load through native.load_library


def kernel_sets(baseline: dict[str, ctypes.CDLL] | None) -> dict[str, dict]:
    """name -> {library name: library} to install before a round."""
    sets = {"current": {n: _LOAD(n) for n in ("paged_decode", "elementwise")}}
    if baseline:
        sets["baseline"] = baseline
    return sets


def install(libs: dict[str, ctypes.CDLL]) -> None:
    native.load_library = lambda name: libs.get(name) or _LOAD(name)


def capture_decode_step(llm: LLM, rows: int, context: int) -> tuple:
    """(input_ids, positions, kv_cache, meta) of the last `rows`-row decode step of workload
    B's prompts (`rows` of them, 128 tokens) run for `context` new tokens."""
    model = llm.engine.runner.model
    captured = []
    forward = model.forward

    def capture(input_ids, positions, kv_cache, meta, *plan):  # plan: engine/step_plan.py
        if meta.num_prefills == 0 and input_ids.shape[0] == rows:
            captured[:] = [(input_ids.clone(), positions.clone(), kv_cache, meta)]
        return forward(input_ids, positions, kv_cache, meta, *plan)

    model.forward = capture
    try:
        prompts = make_prompts(rows, 128, llm.engine.vocab_size, seed=ord("B"))
        llm.generate(prompts, SamplingParams(temperature=0, max_tokens=context, ignore_eos=True))
    finally:
        model.forward = forward
    return captured[0]


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--context", type=int, default=24, help="decode steps before the capture")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument(
        "--baseline-ref",
        default=None,
        help="git ref (or a source directory) of the baseline kernels",
    )
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    baseline = None
    if args.baseline_ref:
        baseline = build_at_ref(args.baseline_ref, Path(tempfile.mkdtemp(prefix="pdserve-ab-")))
    llm = LLM(
        args.model,
        dtype=args.dtype,
        num_threads=args.threads,
        max_num_seqs=64,
        max_num_batched_tokens=4096,
    )
    clock = time.thread_time if args.threads == 1 else time.perf_counter
    model = llm.engine.runner.model
    step = capture_decode_step(llm, 32, args.context)
    context = int(step[3].decode_context_lens.max())

    parts = Parts(clock)
    for name in TIMED_OPS:
        parts.wrap(cpu_ops, name, name)
    parts.wrap(llama, "linear", "lm_head")  # compute_logits' call; projections below
    parts.wrap(cpu_linear, "linear", "gemm")  # PackedLinear.forward's module-global call
    fused = getattr(model, "fused_decode", None)
    if fused is not None:  # > 8 rows: the fused per-layer loop's own calls (engine default)
        parts.wrap(fused_decode, "linear", "gemm")
        parts.wrap(cpu_linear.PackedGateUp, "silu_mul", "gate_up_silu_gemm")
        parts.wrap(fused, "_attend", "rope_kv_attention")
    sets = kernel_sets(baseline)
    rows: dict[str, list[dict[str, float]]] = {name: [] for name in sets}
    argmax: dict[str, torch.Tensor] = {}
    with torch.inference_mode():
        for _ in range(args.rounds):
            for name, kernels in sets.items():
                install(kernels)
                parts.acc.clear()
                t0 = clock()
                hidden = model(*step)
                t1 = clock()
                logits = model.compute_logits(hidden)
                t2 = clock()
                argmax[name] = argmax_rows(logits)  # the sampler's greedy pick
                t3 = clock()
                row = dict(parts.acc)
                row["forward"], row["logits"], row["argmax"] = t1 - t0, t2 - t1, t3 - t2
                row["step"] = t3 - t0
                rows[name].append(row)
    install(sets["current"])
    summary = {}
    for name, rs in rows.items():
        med = {k: round(statistics.median(r.get(k, 0.0) for r in rs) * 1e3, 2) for k in rs[0]}
        named = sum(med.get(k, 0.0) for k in ("gemm", *FUSED_PARTS, *TIMED_OPS))
        med["forward_rest"] = round(med["forward"] - named, 2)
        summary[name] = med
    result = {
        "dtype": args.dtype,
        "rows": 32,
        "context": context,
        "threads": args.threads,
        "clock": "thread_time" if args.threads == 1 else "wall",
        "median_ms": summary,
    }
    if baseline:
        result["same_argmax"] = bool(torch.equal(argmax["current"], argmax["baseline"]))
        result["step_speedup"] = round(summary["baseline"]["step"] / summary["current"]["step"], 3)
    print(json.dumps(result, indent=1))
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
