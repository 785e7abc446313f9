#!/usr/bin/env bash
# One device-machine session (a lent GPU, see docs/benchmarks.md "GPU"): the Triton kernels'
# tests on the GPU, then the quantized-GEMM timings. Writes logs under $OUT (or ./gpu-out).
# Missing Python packages travel as wheels in .whl/ (msgspec: imported by bladellm).
set -u
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:.
else
  export PYTHONPATH=.
fi
export PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv
  python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__, torch.cuda.get_device_name())"
} 2>&1 | tee "$OUT/env.txt"
timeout ${TEST_TIMEOUT:-240} python3 -m pytest -q -p no:cacheprovider -rf \
  tests/kernels/test_triton_quant.py tests/kernels/test_triton_attention.py \
  tests/kernels/test_triton_elementwise.py tests/kernels/test_triton_sampling.py 2>&1 \
  | tee "$OUT/tests.log" | tail -25
timeout 60 python3 -m pytest -q -p no:cacheprovider -m gpu tests/unit/check/test_check.py 2>&1 | tail -3 | tee "$OUT/gpu_marked.log"
timeout ${BENCH_TIMEOUT:-200} python3 benchmarks/triton_quant_gemm.py --out "$OUT/quant_gemm.jsonl" ${BENCH_ARGS:-} 2>&1 \
  | tee "$OUT/bench.log" | cut -c1-400
