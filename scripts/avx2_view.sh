#!/usr/bin/env bash
# Runs the CPU-ISA-sensitive tests (`pytest -m isa`: bf16 numerics, oneDNN packing, the native
# kernels, the engine's forward paths) as an AVX2-only machine runs them, on any x86-64 box.
#
# Those tests depend on what the CPU has: torch and oneDNN pick their bf16 kernels by CPUID
# (no native bf16 below AVX-512: oneDNN does not pack bf16, torch runs its own bf16 GEMM),
# and the project's kernels are built for the build machine. Building the project's kernels
# for another CPU (`PDSERVE_KERNEL_MARCH`) cannot show what torch does there, and oneDNN's
# `ONEDNN_MAX_CPU_ISA` / `ATEN_CPU_CAPABILITY` change neither torch's bf16 checks nor
# oneDNN's bf16 choice. So the whole test process runs under qemu-user emulating an AMD EPYC
# Milan (family 25: AVX2 + FMA, no AVX-512, no avx512_bf16), the kind of box CI is sometimes
# given: CPUID, and so torch, oneDNN and the tests see that CPU. The project's kernels and
# torch.compile's C++ are built for Haswell (AVX2) instead of `-march=native` (the compiler
# runs natively and would target this box). Emulation costs ~5-10x: only `-m isa` runs.
#
# On a box without AVX-512 the main suite already runs these tests as such a box does:
# nothing to emulate, exit 0. Installs qemu-user (apt) when missing.
# Usage: scripts/avx2_view.sh [pytest args], e.g. scripts/avx2_view.sh -k bf16 -x
set -euo pipefail
cd "$(dirname "$0")/.."

if [ "$(uname -m)" != "x86_64" ]; then
  echo "[avx2-view] not an x86-64 machine: nothing to emulate"
  exit 0
fi
if ! grep -qw avx512f /proc/cpuinfo; then
  echo "[avx2-view] this CPU has no AVX-512: the main suite runs the isa tests as AVX2 already"
  exit 0
fi
if ! command -v qemu-x86_64 >/dev/null 2>&1; then
  echo "[avx2-view] installing qemu-user"
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq qemu-user >/dev/null
fi

# EPYC-Milan less the CPUID bits qemu's TCG does not implement (it would warn about each)
CPU=EPYC-Milan
for f in pcid invpcid rdseed sha-ni rdpid fsrm fxsr-opt misalignsse 3dnowprefetch osvw topoext \
  perfctr-core clzero xsaveerptr wbnoinvd ibpb ibrs amd-stibp amd-ssbd nrip-save xsavec xsaves; do
  CPU="$CPU,-$f"
done

CACHE=${PDSERVE_AVX2_VIEW_CACHE:-${TMPDIR:-/tmp}/pdserve-avx2-view}
mkdir -p "$CACHE"
export PDSERVE_KERNEL_MARCH=haswell TORCHINDUCTOR_CPP_MARCH=haswell
export PDSERVE_KERNEL_CACHE="$CACHE/kernels" TORCHINDUCTOR_CACHE_DIR="$CACHE/inductor"
export PDSERVE_ISA_VIEW=avx2 PYTHONHASHSEED=0 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export TOKENIZERS_PARALLELISM=false

# what the emulated CPU looks like to torch, before any test
qemu-x86_64 -cpu "$CPU" .venv/bin/python - <<'EOF'
import torch
cap = torch.backends.cpu.get_cpu_capability()
bf16 = torch.ops.mkldnn._is_mkldnn_bf16_supported()
print(f"[avx2-view] emulated CPU: torch capability {cap}, oneDNN native bf16 {bf16}")
assert cap == "AVX2" and not bf16, "the emulated CPU is not seen as AVX2-only"
EOF
exec qemu-x86_64 -cpu "$CPU" .venv/bin/python -m pytest -q -ra -m isa -p no:cacheprovider --durations=15 \
  --timeout 1800 "$@"
