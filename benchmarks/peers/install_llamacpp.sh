#!/usr/bin/env bash
# Install the llama.cpp server (PyPI llama-cpp-python[server], which compiles llama.cpp from
# source) into its own virtual environment, plus what the HF -> GGUF converter needs.
#
#   benchmarks/peers/install_llamacpp.sh            # -> /opt/peers/llamacpp
#   PEERS_DIR=/somewhere benchmarks/peers/install_llamacpp.sh
#
# It compiles llama.cpp (minutes on a small machine): run it under `nice -n 10` on a shared one.
set -euo pipefail

PEERS_DIR=${PEERS_DIR:-/opt/peers}
VENV=${LLAMACPP_VENV:-$PEERS_DIR/llamacpp}
PYTHON=${PYTHON:-python3}
LLAMA_CPP_PYTHON_VERSION=0.3.36
GGUF_VERSION=0.19.0

mkdir -p "$PEERS_DIR"
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip

# LLAVA_BUILD=OFF: the multimodal helper is not needed and only adds compile time.
CMAKE_ARGS="${CMAKE_ARGS:--DLLAVA_BUILD=OFF}" \
CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-2} \
    "$VENV/bin/python" -m pip install "llama-cpp-python[server]==$LLAMA_CPP_PYTHON_VERSION" \
    "gguf==$GGUF_VERSION"

# The converter (convert_hf_to_gguf.py) ships only in the sdist, under vendor/llama.cpp.
SRC="$VENV/src"
if [ ! -f "$SRC/llama.cpp/convert_hf_to_gguf.py" ]; then
    mkdir -p "$SRC"
    tmp=$(mktemp -d)
    "$VENV/bin/python" -m pip download -q --no-deps --no-binary :all: -d "$tmp" \
        "llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION"
    tar -xzf "$tmp"/llama_cpp_python-*.tar.gz -C "$tmp"
    rm -rf "$SRC/llama.cpp"
    mv "$tmp"/llama_cpp_python-*/vendor/llama.cpp "$SRC/llama.cpp"
    rm -rf "$tmp"
fi

# Converter dependencies: torch (the CPU build on disk, if any), transformers, sentencepiece.
"$VENV/bin/python" -m pip install -q "torch==2.13.0" "transformers>=5.16.1,<5.20" sentencepiece \
    safetensors numpy

"$VENV/bin/python" - <<'PY'
import importlib.metadata as md
for name in ("llama_cpp_python", "gguf", "torch", "transformers", "sentencepiece"):
    print(f"{name}=={md.version(name)}")
PY
echo "llama.cpp server installed in $VENV; converter at $SRC/llama.cpp/convert_hf_to_gguf.py"
