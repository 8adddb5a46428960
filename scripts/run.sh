#!/usr/bin/env bash
# Sets everything up (scripts/setup.sh), then runs the default model as a 1P1D pair:
# a prefill node and a decode node (which serves the OpenAI API on 127.0.0.1:8000) joined by
# NIXL. Ctrl-C stops both. `scripts/run.sh --colocated` runs one colocated node instead.
# Extra arguments go to both `pdserve serve` commands (e.g. --dtype bfloat16).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
PORT=${PDSERVE_PORT:-8000}
MODEL=${PDSERVE_MODEL:-smollm2-135m-instruct}

if [ "${1:-}" = "--colocated" ]; then
  shift
  exec .venv/bin/pdserve serve --model "$MODEL" --host 127.0.0.1 --port "$PORT" "$@"
fi

CONTROL="tcp://127.0.0.1:$((PORT + 100))"
.venv/bin/pdserve serve --model "$MODEL" --role prefill --kv-control "$CONTROL" \
  --host 127.0.0.1 --port "$((PORT + 1))" --num-threads 1 "$@" &
PREFILL=$!
trap 'kill $PREFILL 2>/dev/null; wait $PREFILL 2>/dev/null' EXIT INT TERM
echo "[run] prefill node on 127.0.0.1:$((PORT + 1)) (control $CONTROL); decode node serves 127.0.0.1:$PORT"
.venv/bin/pdserve serve --model "$MODEL" --role decode --prefill-node "$CONTROL" \
  --host 127.0.0.1 --port "$PORT" --num-threads 1 "$@"
