#!/usr/bin/env bash
# vLLM 1P1D (two `vllm serve` with NixlConnector behind benchmarks/_vllm_pd_proxy.py) and
# pdserve 1P1D (a prefill and a decode node over NIXL), back to back, each process pinned to
# one core, under the same `pdserve bench serve` load; then `pdserve bench compare`.
# Optional, never run by CI; needs scripts/setup_vllm_peer.sh (which installs nixl in VENV).
#   bash scripts/bench_pd_vs_vllm.sh [VENV] [OUT_DIR]    (defaults /work/vllm-venv, results)
# Env: RATES (default "inf 0.5"), NUM_PROMPTS (64), INPUT_LEN / OUTPUT_LEN (128 / 128),
# NICE (0), PDSERVE_PYTHON.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${1:-/work/vllm-venv}
OUT=${2:-results}
PY=${PDSERVE_PYTHON:-.venv/bin/python}
RATES=${RATES:-inf 0.5}
NICE=${NICE:-0}
export PYTHONPATH=$PWD HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
mkdir -p "$OUT"
MODEL_DIR=$("$PY" -c 'from pdserve.common.model_files import resolve_model; print(resolve_model("smollm2-135m-instruct"))')
PIDS=()
cleanup() { for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; }
trap cleanup EXIT

wait_ready() {  # URL LOGFILE PID
    for _ in $(seq 900); do
        curl -sf "$1/v1/models" >/dev/null && return 0
        kill -0 "$3" 2>/dev/null || { tail -n 30 "$2"; echo "server exited" >&2; return 1; }
        sleep 1
    done
    echo "server at $1 not ready after 900 s" >&2
    return 1
}

bench() {  # URL LABEL METRICS_URLS...
    local url=$1 label=$2
    shift 2
    # shellcheck disable=SC2086
    nice -n "$NICE" "$PY" -m pdserve bench serve --base-url "$url" --tokenizer smollm2-135m-instruct \
        --model smollm2-135m-instruct --dataset random --input-len "${INPUT_LEN:-128}" \
        --output-len "${OUTPUT_LEN:-128}" --num-prompts "${NUM_PROMPTS:-64}" \
        --request-rate $RATES --no-progress --label "$label" --out "$OUT/serve_$label.json" "$@"
}

vllm_node() {  # CORE PORT SIDE_CHANNEL_PORT LOG
    # taskset: every process of the instance on its core, as each pdserve node below
    # (VLLM_CPU_OMP_THREADS_BIND alone leaves its front end free on the other core)
    taskset -c "$1" env -u PYTHONPATH VLLM_CPU_NUM_OF_RESERVED_CPU=0 VLLM_CPU_OMP_THREADS_BIND="$1" \
        VLLM_CPU_KVCACHE_SPACE=1 VLLM_NO_USAGE_STATS=1 VLLM_NIXL_SIDE_CHANNEL_PORT="$3" \
        nice -n "$NICE" "$VENV/bin/vllm" serve "$MODEL_DIR" --served-model-name smollm2-135m-instruct \
        --dtype float32 --host 127.0.0.1 --port "$2" --max-model-len 2048 --enforce-eager \
        --kv-transfer-config '{"kv_connector":"NixlConnector","kv_role":"kv_both","kv_buffer_device":"cpu"}' \
        >"$4" 2>&1 &
    PIDS+=($!)
}

echo "== vLLM 1P1D (NixlConnector, each instance on one core)"
vllm_node 0 18011 15611 "$OUT/vllm_prefill.log"
P1=${PIDS[-1]}
vllm_node 1 18012 15612 "$OUT/vllm_decode.log"
P2=${PIDS[-1]}
wait_ready http://127.0.0.1:18011 "$OUT/vllm_prefill.log" "$P1"
wait_ready http://127.0.0.1:18012 "$OUT/vllm_decode.log" "$P2"
"$PY" -m benchmarks._vllm_pd_proxy --prefill http://127.0.0.1:18011 --decode http://127.0.0.1:18012 \
    --port 18010 >"$OUT/vllm_proxy.log" 2>&1 &
PIDS+=($!)
wait_ready http://127.0.0.1:18010 "$OUT/vllm_proxy.log" "${PIDS[-1]}"
bench http://127.0.0.1:18010 vllm_1p1d --metrics-url http://127.0.0.1:18012/metrics
cleanup
PIDS=()

echo "== pdserve 1P1D (NIXL, each node on one core)"
taskset -c 0 nice -n "$NICE" "$PY" -m pdserve serve --model smollm2-135m-instruct --dtype float32 \
    --port 18021 --num-threads 1 --role prefill --kv-control tcp://127.0.0.1:18030 \
    >"$OUT/pdserve_prefill.log" 2>&1 &
PIDS+=($!)
taskset -c 1 nice -n "$NICE" "$PY" -m pdserve serve --model smollm2-135m-instruct --dtype float32 \
    --port 18022 --num-threads 1 --role decode --prefill-node tcp://127.0.0.1:18030 \
    --kv-peer-timeout 120 >"$OUT/pdserve_decode.log" 2>&1 &
PIDS+=($!)
wait_ready http://127.0.0.1:18021 "$OUT/pdserve_prefill.log" "${PIDS[0]}"
wait_ready http://127.0.0.1:18022 "$OUT/pdserve_decode.log" "${PIDS[1]}"
bench http://127.0.0.1:18022 pdserve_1p1d --metrics-url http://127.0.0.1:18022/metrics \
    --metrics-url http://127.0.0.1:18021/metrics
cleanup
PIDS=()

"$PY" -m pdserve bench compare "$OUT/serve_vllm_1p1d.json" "$OUT/serve_pdserve_1p1d.json" \
    | tee "$OUT/serve_compare_1p1d.md"
