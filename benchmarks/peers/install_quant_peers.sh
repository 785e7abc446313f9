#!/usr/bin/env bash
# The quantizers BladeLLM is compared against (benchmarks/quant_peer_accuracy.py) and loads in
# tests/e2e/test_peer_quantizers.py, in a venv beside the system torch 2.13.0+cpu and
# transformers 5.19.0, neither of which may be replaced (a peer's own pins would pull a CUDA
# torch or another transformers). Every package is installed with --no-deps; its missing pure-
# Python dependencies are named one by one.
#
#   bash benchmarks/peers/install_quant_peers.sh [VENV]      # default /tmp/qpeers
#
# Versions used for docs/quantization.md: llmcompressor 0.14.0.1 (pins transformers<=5.17.0,
# works with 5.19.0 for everything used here), compressed-tensors 0.19.0 (llmcompressor's exact
# pin), GPTQModel 7.7.0 (pins torch>=2.14.1 and transformers>=5.20.2, but imports, quantizes and
# saves on CPU with torch 2.13.0 / transformers 5.19.0; its sdist is pure Python — the C++ / CUDA
# kernels are JIT-built on first use only, so no BUILD_CUDA_EXT switch is needed).
# Helper versions that came with it (2026-11-26): loguru 0.7.3, nvidia-ml-py 13.615.71, datasets
# 5.2.0 (+ pyarrow 26.0.1, pandas 3.1.1, dill 0.4.1, multiprocess 0.70.19, xxhash 4.1.0),
# threadpoolctl 3.8.0, device-smi 0.5.7, protobuf 7.36.2, pypcre 0.6.4, tokenicer 0.0.14,
# logbar 0.4.15, defuser 0.0.28. auto-round (an llmcompressor dependency) is left out: only its
# AutoRoundModifier imports it.
set -euo pipefail
VENV=${1:-/tmp/qpeers}
python -m venv --system-site-packages "$VENV"
PIP="$VENV/bin/pip"
CONSTRAINTS=$(mktemp)
printf 'torch==2.13.0\ntransformers==5.19.0\n' > "$CONSTRAINTS"

"$PIP" install --no-deps llmcompressor==0.14.0.1 compressed-tensors==0.19.0 loguru nvidia-ml-py
# datasets (llm-compressor's calibration input) with its own dependencies, none of them torch
"$PIP" install -c "$CONSTRAINTS" datasets psutil
"$PIP" install --no-deps gptqmodel==7.7.0
"$PIP" install -c "$CONSTRAINTS" --no-deps threadpoolctl device-smi protobuf pypcre tokenicer \
    logbar defuser

"$PIP" list 2>/dev/null |
    grep -iE '^(torch|transformers|llmcompressor|compressed-tensors|gptqmodel) '
"$VENV/bin/python" - <<'PY'
import torch, transformers
assert torch.__version__ == "2.13.0+cpu", torch.__version__
assert transformers.__version__ == "5.19.0", transformers.__version__
import llmcompressor, gptqmodel  # noqa: F401
print("ok: peers beside torch", torch.__version__, "transformers", transformers.__version__)
PY
