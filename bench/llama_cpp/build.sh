#!/usr/bin/env bash
# Builds llama.cpp's CPU tools from the tree vendored in the PyPI sdist of
# llama-cpp-python (the only source of llama.cpp this machine's registries
# reach), for the same-sitting comparisons in BENCHMARKS.md. Nothing of it
# is committed; it lands in $LLAMA_DIR (default /work/llama.cpp).
#
#   bash bench/llama_cpp/build.sh            # then $LLAMA_DIR/bin/llama-batched-bench …
#
# Tools built: llama-batched-bench (decode / prompt speed), llama-quantize
# (F32 / Q8_0 GGUFs from the shipped Q4_1), llama-server (greedy ids and
# logprobs over HTTP), and gguf-py (for bench/cpu/make_gguf.py).
set -euo pipefail
VERSION=${LLAMA_CPP_PYTHON_VERSION:-0.3.36}
LLAMA_DIR=${LLAMA_DIR:-/work/llama.cpp}
JOBS=${JOBS:-2}
command -v cmake >/dev/null || { apt-get update -qq && apt-get install -y -qq cmake; }
mkdir -p "$LLAMA_DIR"
cd "$LLAMA_DIR"
if [ ! -d src ]; then
  python3 -m pip download --quiet --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d sdist
  tar -xzf sdist/llama_cpp_python-"$VERSION".tar.gz
  mv llama_cpp_python-"$VERSION"/vendor/llama.cpp src
fi
cmake -S src -B build -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF \
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=ON -DLLAMA_BUILD_SERVER=ON >/dev/null
cmake --build build -j "$JOBS" --target llama-batched-bench llama-quantize llama-server
mkdir -p bin && cp build/bin/llama-batched-bench build/bin/llama-quantize build/bin/llama-server bin/
echo "llama.cpp $(cd src && git describe --always 2>/dev/null || echo "from llama-cpp-python $VERSION") in $LLAMA_DIR/bin"
