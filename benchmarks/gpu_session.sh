#!/usr/bin/env bash
# One device-machine call that proves the engine on a lent NVIDIA GPU (docs/gpu.md). Before it,
# here: `bash benchmarks/prepare_gpu_wheels.sh` (the packages the GPU machine lacks, into .whl/);
# then ONE call of the device tool, naming .whl in carry, with timeout_s about 540 (the parts'
# timeouts add up to about 8.2 minutes with set-up; a session's device budget leaves no rerun):
#     bash benchmarks/gpu_session.sh
# Parts, in this order so that a run cut off still reports the most, each under its own timeout
# (the defaults add up to about 8 minutes: 475 s, eager_steps and the graph tests adding 40 s):
#   1. the Triton kernel tests on CUDA           5. the server on --device cuda vs the openai client
#   2. the gpu-marked tests                      6. Llama-3.1-8B shape, bf16, random weights:
#   3. greedy parity vs transformers (fp32, bf16)    copy bandwidth, batch-1 decode vs the HBM
#   4. (the server, see 5)                           roofline, batch 64 x 1k prompts vs transformers
#                                                    (CUDA graphs on), then both again on one
#                                                    engine with --disable_cuda_graph
# Writes under $OUT (or ./gpu-out), 7 files: env.txt, session.log (everything), summary.jsonl
# (one row per part: rc, seconds), parity.json, server.json, server_log.txt, llama8b.jsonl.
# `--with-quant-gemm` adds benchmarks/triton_quant_gemm.py (its flags in $BENCH_ARGS) at the end.
set -u
# The repository first, then OUT (a relative OUT is taken from the repository root), made
# absolute so that every part writes to the same place.
cd "$(dirname "$0")/.." || exit 1
OUT=${OUT:-gpu-out}; mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd) || exit 1
LOG="$OUT/session.log"
SESSION_START=$(date +%s)
export PYTHONPATH=$PWD
if ls .whl/*.whl >/dev/null 2>&1; then
  # A failed install is reported as a summary row, and the parts still run (the Triton tests
  # need none of these wheels).
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl >> "$LOG" 2>&1
  rc=$?
  [ $rc -eq 0 ] && export PYTHONPATH=/tmp/site:$PWD
else
  echo "no .whl/: run benchmarks/prepare_gpu_wheels.sh here first and carry .whl" | tee -a "$LOG" >&2
  rc=2
fi
printf '{"part": "pip_install", "rc": %d, "timed_out": false, "seconds": %d}\n' "$rc" \
  "$(( $(date +%s) - SESSION_START ))" >> "$OUT/summary.jsonl"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
{ date -u; nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv
  python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name())"
  python3 -c "import bladellm, fastapi, zmq, msgspec, llguidance, openai; print('imports ok')"
} 2>&1 | tee "$OUT/env.txt" | tee -a "$LOG"

# part NAME SECONDS CMD...: run CMD under a timeout, its output to the log (and its last lines to
# the terminal), and one summary row.
part() {
  local name=$1 limit=$2; shift 2
  local t0=$(date +%s)
  echo "=== $name (timeout ${limit}s, at +$((t0 - SESSION_START))s) ===" | tee -a "$LOG"
  timeout -k 2 "$limit" "$@" > "$OUT/.part.log" 2>&1
  local rc=$?
  cat "$OUT/.part.log" >> "$LOG"
  grep -E "^(parity|server|llama8b) |passed|failed|error|Error" "$OUT/.part.log" | tail -15
  rm -f "$OUT/.part.log"
  printf '{"part": "%s", "rc": %d, "timed_out": %s, "seconds": %d}\n' "$name" "$rc" \
    "$([ $rc -eq 124 ] || [ $rc -eq 137 ] && echo true || echo false)" "$(( $(date +%s) - t0 ))" \
    >> "$OUT/summary.jsonl"
}

PYTEST="python3 -m pytest -q -p no:cacheprovider -rfE"
# The kernels every step runs first; the quantized GEMMs (slowest to compile) last.
part triton_tests 90 $PYTEST tests/kernels/test_triton_attention.py \
  tests/kernels/test_triton_elementwise.py tests/kernels/test_triton_sampling.py \
  tests/kernels/test_triton_quant.py
part gpu_tests 65 $PYTEST -m gpu tests/unit/platforms/test_platform.py tests/unit/worker \
  tests/unit/check/test_check.py tests/e2e/test_cuda_graphs_e2e.py
part parity 60 python3 benchmarks/gpu_parity.py --device cuda --out "$OUT/parity.json"
part server 50 python3 benchmarks/gpu_server_check.py --device cuda --out "$OUT/server.json" \
  --log "$OUT/server_log.txt"
L8="python3 benchmarks/gpu_llama8b.py --device cuda --out $OUT/llama8b.jsonl"
part bandwidth 15 $L8 --part bandwidth
BW=$(python3 -c "import json,sys; rows=[json.loads(l) for l in open(sys.argv[1])]; print(next((r['copy_GBps'] for r in rows if r['part']=='bandwidth'), ''))" "$OUT/llama8b.jsonl" 2>/dev/null)
part decode1 55 $L8 --part decode1 --prompt_len 128 --output_len 128 ${BW:+--bandwidth_gbs $BW}
part batch64 65 $L8 --part batch --batch 64 --prompt_len 1024 --output_len 128
part hf_batch64 40 $L8 --part hf --batch 64 --prompt_len 1024 --output_len 128
# The same two workloads eagerly (--disable_cuda_graph), on one engine: the graphs' effect on
# decode_step_ms (batch 64) and step_ms (batch 1).
part eager_steps 35 $L8 --part steps --disable_cuda_graph --batch 64 --prompt_len 1024 \
  --output_len 128
if [ "${1:-}" = "--with-quant-gemm" ]; then
  part quant_gemm 100 python3 benchmarks/triton_quant_gemm.py --out "$OUT/quant_gemm.jsonl" ${BENCH_ARGS:-}
fi
echo "=== summary (total $(( $(date +%s) - SESSION_START ))s) ===" | tee -a "$LOG"
cat "$OUT/summary.jsonl" | tee -a "$LOG"
cat "$OUT/llama8b.jsonl" 2>/dev/null
