#!/usr/bin/env bash
# Sets everything up (scripts/setup.sh) and runs the whole test suite.
# Extra arguments go to pytest, e.g. scripts/test.sh -k engine -x
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export PYTHONHASHSEED=0 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
PY_DIRS="pdserve bench api node router cluster engine prefill decode kv_transfer kernels benchmarks tests"
.venv/bin/ruff check $PY_DIRS
.venv/bin/ruff format --check $PY_DIRS
exec .venv/bin/python -m pytest -q -ra --durations=15 "$@"
