#!/usr/bin/env bash
# Sets everything up (scripts/setup.sh) and starts pdserve with the default model on
# 127.0.0.1:8000, ready for curl or the openai client. Extra arguments go to `pdserve serve`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
exec .venv/bin/pdserve serve --model smollm2-135m-instruct --host 127.0.0.1 --port 8000 "$@"
