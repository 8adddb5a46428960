#!/usr/bin/env bash
# Downloads the wheels benchmarks/gpu_check.py needs on a GPU machine that has CUDA torch,
# Triton and transformers but no package registry: msgspec, pyzmq and NIXL (the build for
# the GPU's CUDA major). About 60 MB, into gpu_wheels/ (git-ignored); then, there:
#   python benchmarks/gpu_check.py --wheels gpu_wheels
# Usage: scripts/gpu_wheels.sh [PYTHON_VERSION=3.12] [CUDA_MAJOR=13]
# Versions are the ones installed in this checkout's .venv (or /work/main/.venv).
set -euo pipefail
cd "$(dirname "$0")/.."
PYV=${1:-3.12}
CUDA=${2:-13}
PY=${PDSERVE_PY:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
version() { "$PY" -c "import importlib.metadata as m; print(m.version('$1'))"; }
NIXL=$(version nixl)
rm -rf gpu_wheels && mkdir -p gpu_wheels
"$PY" -m pip download -q --no-deps --only-binary=:all: -d gpu_wheels \
  --python-version "$PYV" --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
  --platform manylinux_2_26_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 \
  "msgspec==$(version msgspec)" "pyzmq==$(version pyzmq)" \
  "nixl==$NIXL" "nixl-cu$CUDA==$NIXL"
du -sh gpu_wheels && ls gpu_wheels
