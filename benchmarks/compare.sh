#!/usr/bin/env bash
# Run the same blade_llm_bench sweep against BladeLLM and its peers on one model directory, one
# server at a time, and draw the TTFT-vs-QPS and TBT-vs-QPS curves of all of them.
#
#   benchmarks/compare.sh MODEL_DIR [OUT_DIR]
#
# Each server is started, waited for (/v1/models), measured, and stopped before the next one
# starts, so they never share the CPU. OUT_DIR (default bench_results/compare-<time>) gets
# <server>.json/.csv, <server>.log (server output), startup.tsv, env.txt, the two plots and
# comparison.md (one Markdown table of all servers, as pasted into docs/benchmarks.md).
#
# Environment (defaults in brackets):
#   SERVERS ["bladellm vllm llamacpp"]   which servers, in order
#   RATES [1,2,4,8,inf]  NUM_PROMPTS [64]  INPUT_LEN [128,128]  OUTPUT_LEN [64,64]
#   ENDPOINT [completions]  DATASET [random]  SLO [ttft:1000,tpot:200]  NUM_WARMUP [4]
#   MAX_CONCURRENCY []  SEED [0]  BENCH_ARGS []   extra blade_llm_bench flags
#   PORT [18080]  STARTUP_TIMEOUT [600] s  DTYPE [bfloat16]  MAX_MODEL_LEN [2048]
#   BLADE_ARGS []   extra blade_llm_server flags
#   GGUF []         GGUF file for llama.cpp (default: converted once into OUT_DIR at DTYPE)
#   VLLM_BIND_ALL [0], N_THREADS, VLLM_CPU_KVCACHE_SPACE: see benchmarks/peers/start_*.sh
# Every server gets --ignore_eos; llama.cpp drops it, so it also gets logit_bias -100 on the
# end-of-generation ids (configs' eos ids and EOG special tokens), so all produce full lengths.
set -euo pipefail

MODEL_DIR=$(cd "${1:?usage: compare.sh MODEL_DIR [OUT_DIR]}" && pwd)
OUT=${2:-bench_results/compare-$(date -u +%Y%m%dT%H%M%SZ)}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PEERS="$ROOT/benchmarks/peers"
SERVERS=${SERVERS:-bladellm vllm llamacpp}
PORT=${PORT:-18080}
STARTUP_TIMEOUT=${STARTUP_TIMEOUT:-600}
DTYPE=${DTYPE:-bfloat16}
export MAX_MODEL_LEN=${MAX_MODEL_LEN:-2048} N_CTX=${N_CTX:-${MAX_MODEL_LEN:-2048}} DTYPE
PYTHON=${PYTHON:-python}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"

# End-of-generation ids: the configs' eos ids plus the tokenizer's special tokens that llama.cpp
# also treats as end-of-generation (<|endoftext|>, <|im_end|>, <|eot_id|>, </s>, ...).
EOS_IDS=$("$PYTHON" - "$MODEL_DIR" <<'PY'
import json, os, sys
d = sys.argv[1]
def load(name):
    p = os.path.join(d, name)
    return json.load(open(p, encoding="utf-8")) if os.path.exists(p) else {}
ids = set()
for cfg in (load("generation_config.json"), load("config.json")):
    eos = cfg.get("eos_token_id")
    ids.update(eos if isinstance(eos, list) else [] if eos is None else [eos])
eog = {"<|endoftext|>", "<|im_end|>", "<|eot_id|>", "<|end_of_text|>", "</s>", "<|end|>",
       "<end_of_turn>", "<|eom_id|>", "<eos>"}
for tok in load("tokenizer.json").get("added_tokens", []):
    if tok.get("content") in eog:
        ids.add(tok["id"])
print(",".join(str(i) for i in sorted(ids)))
PY
)

{
    echo "date: $(date -u +%FT%TZ)"; echo "host: $(uname -srm), $(nproc) cpus"
    grep -m1 "model name" /proc/cpuinfo || true
    echo "model: $MODEL_DIR"; echo "eos ids: ${EOS_IDS:-none}"
    echo "bladellm: $(cd "$ROOT" && git rev-parse --short HEAD 2>/dev/null || echo '?')"
    [ -x /opt/peers/vllm/bin/python ] && /opt/peers/vllm/bin/python -c \
        "import importlib.metadata as m; print('vllm-cpu', m.version('vllm-cpu'), 'torch', m.version('torch'))" || true
    [ -x /opt/peers/llamacpp/bin/python ] && /opt/peers/llamacpp/bin/python -c \
        "import importlib.metadata as m; print('llama-cpp-python', m.version('llama_cpp_python'))" || true
    echo "env: VLLM_BIND_ALL=${VLLM_BIND_ALL:-0} N_THREADS=${N_THREADS:-$(nproc)} DTYPE=$DTYPE"
} > "$OUT/env.txt"
printf "server\tstartup_s\n" > "$OUT/startup.tsv"

start_server() {  # name; run in the background: execs the server as the leader of a new
                  # session (process group), so $! is the group that stop_server ends
    local name=$1
    case $name in
        bladellm)
            if command -v blade_llm_server >/dev/null; then
                set -- blade_llm_server
            else
                set -- "$PYTHON" -c \
                    "import sys; from bladellm.entrypoints.cli.server import main; sys.exit(main())"
            fi
            # shellcheck disable=SC2086
            exec setsid "$@" --model "$MODEL_DIR" --port "$PORT" --dtype "$DTYPE" \
                --max_model_len "$MAX_MODEL_LEN" ${BLADE_ARGS:-} ;;
        vllm) exec setsid bash "$PEERS/start_vllm_cpu.sh" "$MODEL_DIR" "$PORT" ;;
        llamacpp)
            exec setsid bash "$PEERS/start_llamacpp.sh" "$GGUF" "$PORT" ;;
        *) echo "unknown server $name" >&2; return 1 ;;
    esac
}

wait_ready() {  # pid -> 0 once /v1/models answers, 1 if the server died or timed out
    local pid=$1 deadline=$((SECONDS + STARTUP_TIMEOUT))
    while ((SECONDS < deadline)); do
        kill -0 "$pid" 2>/dev/null || return 1
        curl -sf "http://127.0.0.1:$PORT/v1/models" >/dev/null 2>&1 && return 0
        sleep 0.5
    done
    return 1
}

stop_server() {  # pid: TERM its process group, KILL after 30 s
    local pid=$1
    kill -TERM -- "-$pid" 2>/dev/null || true
    for _ in $(seq 60); do kill -0 "$pid" 2>/dev/null || return 0; sleep 0.5; done
    kill -KILL -- "-$pid" 2>/dev/null || true
}

if [[ " $SERVERS " == *" llamacpp "* ]] && [ -z "${GGUF:-}" ]; then
    # Converted once, outside the start-up timing.
    GGUF=$OUT/model.$DTYPE.gguf
    outtype=f32
    case $DTYPE in bfloat16) outtype=bf16 ;; float16) outtype=f16 ;; esac
    bash "$PEERS/convert_to_gguf.sh" "$MODEL_DIR" "$GGUF" "$outtype" > "$OUT/convert.log" 2>&1
fi

results=()
for name in $SERVERS; do
    echo "=== $name ==="
    t0=$(date +%s.%N)
    start_server "$name" >> "$OUT/$name.log" 2>&1 &
    pid=$!
    trap 'stop_server $pid' EXIT
    if ! wait_ready "$pid"; then
        echo "$name did not come up within ${STARTUP_TIMEOUT}s; see $OUT/$name.log" >&2
        printf "%s\tfailed\n" "$name" >> "$OUT/startup.tsv"
        stop_server "$pid"; trap - EXIT; continue
    fi
    startup=$(echo "$(date +%s.%N) - $t0" | bc)
    printf "%s\t%.1f\n" "$name" "$startup" >> "$OUT/startup.tsv"
    echo "$name up after ${startup}s"
    extra=()
    [ "$name" = llamacpp ] && [ -n "$EOS_IDS" ] && extra+=(--eos_logit_bias "$EOS_IDS")
    [ -n "${MAX_CONCURRENCY:-}" ] && extra+=(--max_concurrency "$MAX_CONCURRENCY")
    # shellcheck disable=SC2086
    "$PYTHON" -m bladellm.entrypoints.cli.bench --base_url "http://127.0.0.1:$PORT" \
        --tokenizer "$MODEL_DIR" --endpoint "${ENDPOINT:-completions}" \
        --dataset "${DATASET:-random}" --request_rate "${RATES:-1,2,4,8,inf}" \
        --num_prompts "${NUM_PROMPTS:-64}" --input_len_range "${INPUT_LEN:-128,128}" \
        --output_len_range "${OUTPUT_LEN:-64,64}" --slo "${SLO:-ttft:1000,tpot:200}" \
        --num_warmup "${NUM_WARMUP:-4}" --seed "${SEED:-0}" --ignore_eos \
        --output_dir "$OUT" --label "$name" "${extra[@]}" ${BENCH_ARGS:-} \
        || echo "bench against $name failed" >&2
    stop_server "$pid"; trap - EXIT
    [ -f "$OUT/$name.json" ] && results+=("$OUT/$name.json")
done

if ((${#results[@]})); then
    "$PYTHON" -m bladellm.entrypoints.cli.bench plot "${results[@]}" --output_dir "$OUT"
fi
echo "results in $OUT"; cat "$OUT/startup.tsv"
