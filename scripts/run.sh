#!/usr/bin/env bash
# Sets everything up (scripts/setup.sh), then launches a cluster config, by default
# configs/local.yaml: an embedded Redis, a prefill node, a decode node and the router,
# whose OpenAI API is on http://127.0.0.1:8000. Ctrl-C drains and stops every process.
#   scripts/run.sh                                    # configs/local.yaml
#   scripts/run.sh configs/local-2p2d.yaml --set router.port=9000
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
CONFIG=configs/local.yaml
if [ $# -gt 0 ] && [ "${1#--}" = "$1" ]; then CONFIG=$1; shift; fi
exec .venv/bin/pdserve launch "$CONFIG" "$@"
