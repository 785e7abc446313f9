#!/usr/bin/env bash
# Load loop against one blade_llm_server: closed-loop concurrency 1, 8 and 32 (rate inf with a
# concurrency cap), random prompts, ignore_eos. Reports throughput, TTFT and TBT percentiles.
#
#   benchmarks/server_load.sh MODEL_DIR [OUT_DIR]
#
# Environment: CONCURRENCY ["1 8 32"], NUM_PROMPTS [64], INPUT_LEN [128,128], OUTPUT_LEN [64,64],
#   DTYPE [bfloat16], PORT [18081], BLADE_ARGS [] (extra server flags)
set -euo pipefail
MODEL_DIR=$(cd "${1:?usage: server_load.sh MODEL_DIR [OUT_DIR]}" && pwd)
OUT=${2:-bench_results/server-load-$(date -u +%Y%m%dT%H%M%SZ)}
PORT=${PORT:-18081}
mkdir -p "$OUT"
# shellcheck disable=SC2086
setsid python -m bladellm.entrypoints.cli.server --model "$MODEL_DIR" --port "$PORT" \
    --dtype "${DTYPE:-bfloat16}" ${BLADE_ARGS:-} > "$OUT/server.log" 2>&1 &
pid=$!
trap 'kill -TERM -- -$pid 2>/dev/null || true; wait $pid 2>/dev/null || true' EXIT
for _ in $(seq 600); do
    curl -sf "http://127.0.0.1:$PORT/v1/models" >/dev/null 2>&1 && break
    kill -0 "$pid" 2>/dev/null || { echo "server died; see $OUT/server.log" >&2; exit 1; }
    sleep 0.5
done
for c in ${CONCURRENCY:-1 8 32}; do
    python -m bladellm.entrypoints.cli.bench --base_url "http://127.0.0.1:$PORT" \
        --tokenizer "$MODEL_DIR" --dataset random --input_len_range "${INPUT_LEN:-128,128}" \
        --output_len_range "${OUTPUT_LEN:-64,64}" --num_prompts "${NUM_PROMPTS:-64}" \
        --request_rate inf --max_concurrency "$c" --ignore_eos --num_warmup 2 \
        --output_dir "$OUT" --label "concurrency$c" --disable_tqdm
done
