"""The CUDA path end to end on one GPU: one script, non-zero exit on any failure.

On a GPU machine, from the repository root (no registry needed: missing wheels travel in
a folder that `scripts/gpu_wheels.sh` fills, about 60 MB for Python 3.12 / CUDA 13):

    python benchmarks/gpu_check.py --wheels gpu_wheels --out results/gpu_check.json

Sections (each one's result lands in the JSON as soon as it ends, so a run cut short
still says what passed; `status` is passed, failed or skipped, and a skip says why):
  engine_fp32_*   tiny random Llamas built on the spot (head_dim 128 GQA 8:2, head_dim 64
                  GQA 9:3), fp32, TF32 off, Triton kernels: greedy tokens equal to
                  transformers' for prompts of 1, 15, 16, 17, 300 and 1500 tokens, with
                  chunked prefill, mixed steps, a prefix hit and split-K decode
  engine_bf16     Triton vs torch kernels on the first step's logits, bf16
  engine_seeded   temperature > 0 with a seed on CUDA: reproducible, seed-dependent
  engine_memory   peak GPU memory while loading bf16 weights vs their size
  engine_tp2      one node of two ranks (cuda:0 + cuda:1 over NCCL; needs 2 GPUs, else
                  skipped): greedy tokens equal to transformers' and to TP 1, decode tok/s
  pytest          tests/test_kernels.py, tests/test_engine_triton.py and
                  tests/test_cuda_path.py with the kernels compiled
  pd_nixl         prefill and decode as two processes on the GPU over NIXL: output equal
                  to colocated, KV registered as VRAM, bytes counted
  nixl_raw        a raw 256 MiB `write_blocks` between two processes, checked with
                  torch.equal, GB/s, and the transport UCX chose (UCX_PROTO_INFO lines)
  kernels_*       decode attention bandwidth vs HBM peak (goal >= 70 %), prefill
                  attention timing, and a cache of more than 2^31 elements per plane with
                  block ids near the top, against the torch reference

`--dry-run` runs the same code on CPU (Triton interpreter, tiny shapes, NIXL on DRAM) to
check the script itself; the test suite runs it (tests/test_cuda_path.py).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
if "--dry-run" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"  # before anything imports triton
from benchmarks._gpu_common import Skip  # noqa: E402

logger = logging.getLogger("gpu_check")

# Packages the GPU image may lack, by import name -> wheel name prefix.
SHIPPED = {"msgspec": "msgspec", "zmq": "pyzmq", "nixl": "nixl"}


class Report:
    """The JSON result, rewritten (atomically) after every section."""

    def __init__(self, path: Path, env: dict):
        self.path = path
        self.data: dict = {"finished": False, "ok": True, "failures": [], "skipped": {}}
        self.data["env"] = env
        self.data["sections"] = {}
        self.write()

    def section(self, name: str, status: str, result: dict, seconds: float) -> None:
        self.data["sections"][name] = {"status": status, "seconds": round(seconds, 1), **result}
        if status == "failed":
            self.data["ok"] = False
            self.data["failures"].append(name)
        elif status == "skipped":
            self.data["skipped"][name] = result["reason"]
        self.write()

    def write(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=2, default=str) + "\n")
        tmp.replace(self.path)


def install_wheels(wheel_dir: Path | None) -> dict:
    """Import each shipped package; install the missing ones from `wheel_dir` (no index)."""
    missing = [mod for mod in SHIPPED if importlib.util.find_spec(mod) is None]
    result: dict = {"missing": missing, "installed": []}
    if not missing or wheel_dir is None:
        return result
    wheels = sorted(str(w) for w in wheel_dir.glob("*.whl"))
    if not wheels:
        result["error"] = f"no wheels in {wheel_dir}"
        return result
    target = Path(tempfile.gettempdir()) / "pdserve_site"
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
           "--no-compile", "--upgrade", "--target", str(target), *wheels]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        result["error"] = proc.stderr[-2000:]
        return result
    sys.path.insert(0, str(target))
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(target), str(ROOT), os.environ.get("PYTHONPATH")) if p
    )
    importlib.invalidate_caches()
    result["installed"] = [Path(w).name for w in wheels]
    result["still_missing"] = [m for m in missing if importlib.util.find_spec(m) is None]
    return result


def run_sections(
    report: Report, sections: list[tuple[str, Callable[[], dict]]], budget_s: float
) -> None:
    start = time.perf_counter()
    for name, fn in sections:
        logger.info("== %s", name)
        t0 = time.perf_counter()
        try:
            if t0 - start > budget_s:
                raise RuntimeError(f"time budget of {budget_s:.0f} s spent before it started")
            result = fn()
            status = "failed" if result.pop("failed", None) else "passed"
        except Skip as e:
            status, result = "skipped", {"reason": str(e)}
        except Exception as e:  # recorded with its traceback; the next section still runs
            status = "failed"
            result = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
        logger.info("%s: %s %s", name, status, json.dumps(result, default=str)[:800])
        report.section(name, status, result, time.perf_counter() - t0)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="results/gpu_check.json")
    ap.add_argument("--dry-run", action="store_true", help="CPU + interpreter, tiny shapes")
    ap.add_argument("--wheels", type=Path, help="folder of wheels for missing packages")
    ap.add_argument("--peak-tbps", type=float, default=4.8, help="HBM peak (H200: 4.8)")
    ap.add_argument("--only", help="comma-separated section name prefixes to run")
    ap.add_argument("--budget-s", type=float, default=480, help="start no section after this")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"  # before triton is first imported
    wheels = install_wheels(args.wheels)
    import torch

    cuda = torch.cuda.is_available() and not args.dry_run
    if not cuda and not args.dry_run:
        logger.error("no CUDA device: run on a GPU machine, or pass --dry-run")
        return 2
    if cuda:
        # fp32 comparisons must not run on TF32 tensor cores.
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    env = {
        "device": torch.cuda.get_device_name() if cuda else "cpu (dry run, Triton interpreter)",
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": sys.version.split()[0],
        "wheels": wheels,
        "dry_run": args.dry_run,
    }
    for mod in ("triton", "transformers", "nixl", "msgspec", "zmq"):
        try:
            env[mod] = getattr(importlib.import_module(mod), "__version__", "present")
        except ImportError as e:
            env[mod] = f"missing: {e}"
    report = Report(Path(args.out), env)

    from benchmarks import _gpu_engine, _gpu_kernels, _gpu_pd, _gpu_tp

    ctx = {"cuda": cuda, "device": "cuda" if cuda else "cpu", "root": ROOT,
           "peak_tbps": args.peak_tbps, "workdir": Path(tempfile.mkdtemp(prefix="gpu_check_"))}  # fmt: skip
    sections = [
        *_gpu_engine.sections(ctx),
        *_gpu_tp.sections(ctx),
        ("pytest", lambda: run_pytest(cuda)),
        *_gpu_pd.sections(ctx),
        *_gpu_kernels.sections(ctx),
    ]
    if args.only:
        prefixes = tuple(args.only.split(","))
        sections = [(n, f) for n, f in sections if n.startswith(prefixes)]
    run_sections(report, sections, args.budget_s)
    report.data["finished"] = True
    report.write()
    print(json.dumps({k: report.data[k] for k in ("ok", "failures", "skipped")}, indent=2))
    return 0 if report.data["ok"] else 1


def run_pytest(cuda: bool) -> dict:
    """The kernel and engine Triton tests, compiled (TRITON_INTERPRET unset)."""
    if not cuda:
        raise Skip("dry run: the test suite runs these tests itself (under the interpreter)")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    files = ["tests/test_kernels.py", "tests/test_engine_triton.py", "tests/test_cuda_path.py"]
    cmd = [sys.executable, "-m", "pytest", *files, "-q", "-p", "no:cacheprovider",
           "--deselect", "tests/test_cuda_path.py::test_gpu_check_dry_run"]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    lines = [ln for ln in proc.stdout.splitlines() if ln.strip()]
    return {
        "failed": proc.returncode != 0,
        "returncode": proc.returncode,
        "summary": lines[-1] if lines else proc.stderr[-500:],
        "output_tail": proc.stdout[-3000:] if proc.returncode else "",
    }


if __name__ == "__main__":
    sys.exit(main())
