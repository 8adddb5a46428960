"""The native prefill attention kernel of this tree against the one of another git
revision, side by side in one process: one layer of workload C (32 fresh prompts x 128
tokens, SmolLM2's 9 query / 3 kv heads, D 64), fp32 and bf16, one thread by default.

    python benchmarks/prefill_attention_ab.py --rev d9b5eda

Each source is compiled with the flags kernels/native.py uses; the libraries alternate,
each keeps its fastest of `--rounds` x `--reps` calls (process CPU). Error: mean and max
|out - fp32 SDPA| over the layer's outputs.
"""

from __future__ import annotations

import argparse
import ctypes
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from pdserve.kernels import cpu_prefill, native  # noqa: E402

SRC = "kernels/csrc/prefill_attention.cpp"


def build(source: Path, out: Path):
    """The compiled kernel, and whether it takes kv_begins / q_offsets (main since 1af3235)."""
    cmd = ["g++", *native.flags("prefill_attention"), f"-I{ROOT / 'kernels/csrc'}", str(source)]
    subprocess.run([*cmd, "-o", str(out)], check=True)
    fn = ctypes.CDLL(str(out)).pdserve_prefill_attention
    offsets = "q_offsets" in source.read_text()
    fn.argtypes = cpu_prefill._ARGS if offsets else cpu_prefill._ARGS[:12] + cpu_prefill._ARGS[14:]
    fn.restype = ctypes.c_int
    return fn, offsets


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rev", required=True, help="git revision whose kernel to compare")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    tmp = Path(tempfile.mkdtemp())
    old_src = tmp / "old.cpp"
    old_src.write_text(subprocess.run(["git", "show", f"{args.rev}:{SRC}"], cwd=ROOT, check=True,
                                      capture_output=True, text=True).stdout)  # fmt: skip
    kernels = {
        args.rev: build(old_src, tmp / "old.so"),
        "this tree": build(ROOT / SRC, tmp / "new.so"),
    }
    t, h, hkv, d, n, plen = 4096, 9, 3, 64, 32, 128
    begins = torch.arange(n) * plen
    ends = begins + plen
    for dtype in (torch.bfloat16, torch.float32):
        qkv = torch.randn(t, (h + 2 * hkv) * d, generator=torch.Generator().manual_seed(0))
        q, k, v = qkv.to(dtype).split([h * d, hkv * d, hkv * d], -1)
        q, k, v = q.view(t, h, d), k.view(t, hkv, d), v.view(t, hkv, d)

        def call(kernel, out, q=q, k=k, v=v, dtype=dtype):
            fn, offsets = kernel
            rc = fn(
                q.data_ptr(), q.stride(0), q.stride(1), k.data_ptr(), k.stride(0), k.stride(1),
                v.data_ptr(), v.stride(0), v.stride(1), out.data_ptr(), begins.data_ptr(),
                ends.data_ptr(), *([None, None] if offsets else []), n, h, hkv, d, d**-0.5,
                0 if dtype == torch.float32 else 1, args.threads,
            )  # fmt: skip
            assert rc == 0

        def heads(x, nh):
            return x.float().reshape(n, plen, nh, d).transpose(1, 2)

        ref = F.scaled_dot_product_attention(heads(q, h), heads(k, hkv), heads(v, hkv),
                                             is_causal=True, enable_gqa=True)  # fmt: skip
        ref = ref.transpose(1, 2).reshape(t, h, d)
        best = dict.fromkeys(kernels, float("inf"))
        outs = {}
        for _ in range(args.rounds):
            for name, kernel in kernels.items():
                out = torch.empty(t, h, d, dtype=dtype)
                c0 = time.process_time()
                for _ in range(args.reps):
                    call(kernel, out)
                best[name] = min(best[name], (time.process_time() - c0) / args.reps)
                outs[name] = out
        for name in kernels:
            err = (outs[name].float() - ref).abs()
            print(f"{str(dtype):15s} {name:12s} {best[name] * 1e3:6.2f} ms  "
                  f"err mean {err.mean():.2e} max {err.max():.2e}")  # fmt: skip


if __name__ == "__main__":
    main()
