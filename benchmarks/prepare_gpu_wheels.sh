#!/usr/bin/env bash
# Fetch into .whl/ the wheels of every package bladellm (and benchmarks/gpu_session.sh) imports
# that the lent GPU machine lacks (its package list: the device tool's KINDS.md; it has torch,
# triton, transformers, tokenizers, safetensors, numpy, aiohttp, httpx, anyio, h11, click,
# jinja2, prometheus-client, pyyaml, requests, tqdm, pytest, but no internet). Run it here, in
# the repository root, before the GPU call; the call names .whl in `carry` and
# gpu_session.sh installs them into /tmp/site. Versions are the ones this repo is tested with.
# .whl/ is gitignored: wheels travel with the call, never in a commit (64 MiB per call in all).
set -euo pipefail
PY=${GPU_PYTHON_VERSION:-3.12}  # python3 on the GPU machine (KINDS.md)
DEST=${1:-.whl}
mkdir -p "$DEST"
PKGS=(
  # the engine: IPC, API server, structured output, GGUF reader
  msgspec==0.22.0 pyzmq==27.3.0 llguidance==1.9.1 gguf==0.19.0
  fastapi==0.165.0 starlette==1.10.0 uvicorn==0.54.0 opentelemetry-api==1.45.2
  pydantic==2.13.4 pydantic-core==2.46.4 annotated-types==0.7.0 typing-inspection==0.4.2
  typing-extensions==4.16.0
  # the test oracle for the server check (the official openai client) and its needs
  openai==3.57.0 httpx2==2.16.2 httpcore2==2.16.2 truststore==0.10.5 jiter==0.19.0
  sniffio==1.3.1
  # tests/ run under asyncio_mode=auto
  pytest-asyncio==1.5.0
)
PLATS=()
for n in 17 24 27 28 31 34 35; do PLATS+=(--platform "manylinux_2_${n}_x86_64"); done
PLATS+=(--platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any)
for p in "${PKGS[@]}"; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$PY" \
    --implementation cp "${PLATS[@]}" -d "$DEST" "$p"
done
ls -1 "$DEST"
du -sh "$DEST"
total=$(du -sb "$DEST" | cut -f1)
if [ "$total" -gt $((60 * 1024 * 1024)) ]; then
  echo "prepare_gpu_wheels: $DEST is $total bytes; the working tree that travels must stay under 64 MiB" >&2
  exit 1
fi
