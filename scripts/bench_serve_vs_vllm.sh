#!/usr/bin/env bash
# `vllm serve` and one pdserve node, back to back, under the same `pdserve bench serve` load,
# then `pdserve bench compare`. Optional, never run by CI; needs scripts/setup_vllm_peer.sh.
#   bash scripts/bench_serve_vs_vllm.sh [VENV] [OUT_DIR]    (defaults /work/vllm-venv, results)
# Env: THREADS (default: all CPUs), CPUS (default 0..THREADS-1), RATES (default "inf 0.5"),
# NUM_PROMPTS (64), INPUT_LEN / OUTPUT_LEN (128 / 128), NICE (default 0), PDSERVE_PYTHON,
# DTYPE (float32; bfloat16 on a CPU with native bf16).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${1:-/work/vllm-venv}
OUT=${2:-results}
PY=${PDSERVE_PYTHON:-.venv/bin/python}
THREADS=${THREADS:-$(nproc)}
RATES=${RATES:-inf 0.5}
NICE=${NICE:-0}
DTYPE=${DTYPE:-float32}
CPUS=${CPUS:-$(seq -s, 0 $((THREADS - 1)))}  # both servers are pinned to these
VPORT=${VLLM_PORT:-18000}
PPORT=${PDSERVE_PORT:-18100}
export PYTHONPATH=$PWD HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
mkdir -p "$OUT"
MODEL_DIR=$("$PY" -c 'from pdserve.common.model_files import resolve_model; print(resolve_model("smollm2-135m-instruct"))')

wait_ready() {  # URL LOGFILE PID: up to 15 minutes (vLLM's first start compiles)
    for _ in $(seq 900); do
        curl -sf "$1/v1/models" >/dev/null && return 0
        kill -0 "$3" 2>/dev/null || { tail -n 30 "$2"; echo "server exited" >&2; return 1; }
        sleep 1
    done
    echo "server at $1 not ready after 900 s" >&2
    return 1
}

stop() { kill "$1" 2>/dev/null || true; wait "$1" 2>/dev/null || true; }

bench() {  # URL LABEL
    # shellcheck disable=SC2086
    nice -n "$NICE" "$PY" -m pdserve bench serve --base-url "$1" --tokenizer smollm2-135m-instruct \
        --model smollm2-135m-instruct --dataset random --input-len "${INPUT_LEN:-128}" \
        --output-len "${OUTPUT_LEN:-128}" --num-prompts "${NUM_PROMPTS:-64}" \
        --request-rate $RATES --no-progress --label "$2" --out "$OUT/serve_$2.json"
}

echo "== vllm serve ($THREADS threads on CPUs $CPUS)"
# taskset pins all of vLLM's processes (front end, EngineCore, worker) to CPUS, as pdserve's
# node (API process and engine) is pinned below; VLLM_CPU_OMP_THREADS_BIND alone pins only
# the worker's compute threads and leaves its front end free to use the other cores.
# PDSERVE_PEER_PYTHONPATH: scripts/avx2_cap.sh's sitecustomize for vLLM's processes
PEER_PATH=(-u PYTHONPATH)
[ -z "${PDSERVE_PEER_PYTHONPATH:-}" ] || PEER_PATH=(PYTHONPATH="$PDSERVE_PEER_PYTHONPATH")
taskset -c "$CPUS" env "${PEER_PATH[@]}" VLLM_CPU_NUM_OF_RESERVED_CPU=0 VLLM_CPU_OMP_THREADS_BIND="$CPUS" \
    VLLM_CPU_KVCACHE_SPACE=1 VLLM_NO_USAGE_STATS=1 \
    nice -n "$NICE" "$VENV/bin/vllm" serve "$MODEL_DIR" --served-model-name smollm2-135m-instruct \
    --dtype "$DTYPE" --host 127.0.0.1 --port "$VPORT" --max-model-len 2048 \
    >"$OUT/vllm_serve.log" 2>&1 &
VPID=$!
trap 'stop $VPID' EXIT
wait_ready "http://127.0.0.1:$VPORT" "$OUT/vllm_serve.log" "$VPID"
bench "http://127.0.0.1:$VPORT" vllm
stop "$VPID"

echo "== pdserve serve ($THREADS threads)"
taskset -c "$CPUS" nice -n "$NICE" "$PY" -m pdserve serve --model smollm2-135m-instruct --dtype "$DTYPE" \
    --port "$PPORT" --num-threads "$THREADS" >"$OUT/pdserve_serve.log" 2>&1 &
PPID_=$!
trap 'stop $PPID_' EXIT
wait_ready "http://127.0.0.1:$PPORT" "$OUT/pdserve_serve.log" "$PPID_"
bench "http://127.0.0.1:$PPORT" pdserve
stop "$PPID_"

"$PY" -m pdserve bench compare "$OUT/serve_vllm.json" "$OUT/serve_pdserve.json" | tee "$OUT/serve_compare.md"
