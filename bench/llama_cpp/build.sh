#!/usr/bin/env bash
# Builds llama.cpp's CPU tools from the tree vendored in the PyPI sdist of
# llama-cpp-python (the only source of llama.cpp this machine's registries
# reach), for the same-sitting comparisons in BENCHMARKS.md. Nothing of it
# is committed; it lands in $LLAMA_DIR (default /work/llama.cpp).
#
#   bash bench/llama_cpp/build.sh            # then $LLAMA_DIR/bin/llama-batched-bench …
#   ISA=avx2 LLAMA_DIR=/work/llama-avx2 bash bench/llama_cpp/build.sh
#
# ISA picks the CPU code ggml is built for: `native` (the default:
# GGML_NATIVE, everything this CPU has, AMX included), `avx2` (AVX2 + FMA +
# F16C, nothing wider) or `avx512` (AVX-512 F/BW/VL/VNNI over that, no
# AMX): the last two pair with Tandem's `TANDEM_CPU_ISA=avx2` and its
# AVX-512 tiers on one host (issue 22).
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
  # The sdist's own link from PyPI's simple index: `pip download` of an
  # sdist would build its build backend (cmake from source) to read its
  # metadata.
  SDIST=${SDIST:-sdist/llama_cpp_python-$VERSION.tar.gz}
  if [ ! -f "$SDIST" ]; then
    mkdir -p sdist
    python3 - "$VERSION" "$SDIST" <<'PY'
import re, sys, urllib.request
version, out = sys.argv[1], sys.argv[2]
index = urllib.request.urlopen("https://pypi.org/simple/llama-cpp-python/").read().decode()
url = re.search(r'href="([^"]*llama_cpp_python-%s\.tar\.gz[^"]*)"' % re.escape(version), index)
urllib.request.urlretrieve(url.group(1).replace("&amp;", "&"), out)
PY
  fi
  tar -xzf "$SDIST"
  mv llama_cpp_python-"$VERSION"/vendor/llama.cpp src
fi
case ${ISA:-native} in
  native) isa_flags=(-DGGML_NATIVE=ON) ;;
  avx2) isa_flags=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON
    -DGGML_AVX512=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AVX_VNNI=OFF) ;;
  avx512) isa_flags=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON
    -DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF) ;;
  *) echo "ISA: native, avx2 or avx512" >&2; exit 2 ;;
esac
cmake -S src -B build -DCMAKE_BUILD_TYPE=Release "${isa_flags[@]}" -DLLAMA_CURL=OFF \
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=ON -DLLAMA_BUILD_SERVER=ON >/dev/null
cmake --build build -j "$JOBS" --target llama-batched-bench llama-quantize llama-server
mkdir -p bin && cp build/bin/llama-batched-bench build/bin/llama-quantize build/bin/llama-server bin/
echo "llama.cpp $(cd src && git describe --always 2>/dev/null || echo "from llama-cpp-python $VERSION") in $LLAMA_DIR/bin"
