"""Time to first token of a fresh process: eager, compiled with a cold compile cache, and
compiled with the cache the cold run left (what a restarted node sees).

    python benchmarks/compile_startup.py --out results/compile_startup.json

Each case is a new Python process that imports the engine, builds `LLM` (load, prepack,
compile or load the compiled code) and generates one token of a 16-token prompt; the time
is from just before the process starts to that token. The model files are converted
beforehand (not part of the figure).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CHILD = """
import sys, time
from pdserve.engine import LLM, SamplingParams
llm = LLM(sys.argv[1], dtype=sys.argv[2], enforce_eager=sys.argv[3] == "eager",
          compile_cache_dir=sys.argv[4], kv_cache_bytes=64 << 20)
llm.generate([list(range(100, 116))], SamplingParams(temperature=0, max_tokens=1))
"""


def first_token_s(model: str, dtype: str, mode: str, cache_dir: str) -> float:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    t0 = time.perf_counter()
    subprocess.run(
        [sys.executable, "-c", CHILD, model, dtype, mode, cache_dir], env=env, check=True, cwd=ROOT
    )
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--out", default="results/compile_startup.json")
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    from pdserve.common.model_files import resolve_model

    resolve_model(args.model)  # converted once, outside the timings
    with tempfile.TemporaryDirectory() as cache:
        row = {
            "model": args.model,
            "dtype": args.dtype,
            "eager_s": first_token_s(args.model, args.dtype, "eager", cache),
            "compiled_cold_cache_s": first_token_s(args.model, args.dtype, "compiled", cache),
            "compiled_warm_cache_s": first_token_s(args.model, args.dtype, "compiled", cache),
        }
    row = {k: round(v, 1) if isinstance(v, float) else v for k, v in row.items()}
    print(json.dumps(row), flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(row, indent=2))


if __name__ == "__main__":
    main()
