#!/usr/bin/env bash
# Convert a Hugging Face model directory to GGUF for llama.cpp, with the converter from the
# llama-cpp-python 0.3.36 sdist (install_llamacpp.sh puts it under $LLAMACPP_VENV/src/llama.cpp).
#
#   benchmarks/peers/convert_to_gguf.sh HF_DIR OUT.gguf [OUTTYPE]
#
# OUTTYPE: f32, f16, bf16 (default), q8_0. Use the dtype the other engines run in, so a
# comparison measures engines and not precisions.
set -euo pipefail

HF_DIR=${1:?usage: convert_to_gguf.sh HF_DIR OUT.gguf [OUTTYPE]}
OUT=${2:?usage: convert_to_gguf.sh HF_DIR OUT.gguf [OUTTYPE]}
OUTTYPE=${3:-bf16}
VENV=${LLAMACPP_VENV:-/opt/peers/llamacpp}
CONVERTER_DIR=${CONVERTER_DIR:-$VENV/src/llama.cpp}
HERE=$(cd "$(dirname "$0")" && pwd)

[ -f "$CONVERTER_DIR/convert_hf_to_gguf.py" ] || {
    echo "no converter in $CONVERTER_DIR: run install_llamacpp.sh first" >&2; exit 1; }
mkdir -p "$(dirname "$OUT")"
"$VENV/bin/python" "$HERE/gguf_convert.py" "$CONVERTER_DIR" "$HF_DIR" \
    --outfile "$OUT" --outtype "$OUTTYPE"
echo "wrote $OUT"
