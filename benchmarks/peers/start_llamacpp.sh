#!/usr/bin/env bash
# Serve a GGUF file with llama.cpp's server (llama-cpp-python[server], from install_llamacpp.sh).
# Runs in the foreground; OpenAI-compatible API at http://127.0.0.1:PORT/v1.
#
#   benchmarks/peers/start_llamacpp.sh MODEL.gguf [PORT]
#
# Environment (defaults in brackets):
#   LLAMACPP_VENV [/opt/peers/llamacpp]   SERVED_NAME [file name without .gguf]
#   N_CTX [2048]
#   N_THREADS [nproc]                      threads for decode and for prompt processing (the
#                                          server's own default is half the cores)
#   INTERRUPT_REQUESTS [False]             the server's default (True) aborts the streaming
#                                          request whenever a new one arrives: under any
#                                          concurrency most streams would end truncated
#   EXTRA_ARGS                             appended to the server's command line
#
# Notes: it serves one request at a time (no continuous batching), and it drops `ignore_eos`
# silently; send logit_bias -100 on the EOS ids (blade_llm_bench --eos_logit_bias) instead.
set -euo pipefail

GGUF=${1:?usage: start_llamacpp.sh MODEL.gguf [PORT]}
PORT=${2:-8001}
VENV=${LLAMACPP_VENV:-/opt/peers/llamacpp}
SERVED_NAME=${SERVED_NAME:-$(basename "$GGUF" .gguf)}
THREADS=${N_THREADS:-$(nproc)}

# shellcheck disable=SC2086
exec "$VENV/bin/python" -m llama_cpp.server --model "$GGUF" --model_alias "$SERVED_NAME" \
    --host 127.0.0.1 --port "$PORT" --n_ctx "${N_CTX:-2048}" \
    --n_threads "$THREADS" --n_threads_batch "$THREADS" \
    --interrupt_requests "${INTERRUPT_REQUESTS:-False}" ${EXTRA_ARGS:-}
