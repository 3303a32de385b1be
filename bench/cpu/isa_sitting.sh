#!/usr/bin/env bash
# Issue 22's sitting: Tandem's forward bench against llama-batched-bench on
# one AVX-512 host, each engine both with its AVX2 code and with its
# AVX-512 code, on the llama-100m shape and SmolLM2-135M's shape (random
# weights: speed does not depend on their values, and the real file need
# not be on the host), in f32, f16, Q8_0, Q4_1 and Q4_K_M. 2 threads per
# run; B sequences x 128-token prompts, STEPS decode steps.
#
# Lanes: every (shape, ISA, set of formats) runs side by side with the
# others, pinned to its own two cores (LANES: one `a,b` core pair per lane,
# 8 pairs for 2 shapes x 2 ISAs x 2 FORMAT_SETS), and within a lane the
# formats run one after another, the two engines alternating (which engine
# goes first alternates by format). Side-by-side lanes share the memory
# bus and L3, so absolute figures are below a quiet host's; the ratios
# pair runs made under the same load. Tandem's thread pool is sized and
# pinned by CANDLE_CPU_MASK (candle sizes it from the host's cores, not
# from taskset's mask: 16 spinning threads on 2 cores).
#
#   BIN=dir bash bench/cpu/isa_sitting.sh OUT_DIR
#   SHAPES=smollm2 ISAS=avx512 FORMAT_SETS=Q8_0,Q4_1 LANES=0,1 BIN=dir bash …   # one lane
#
# BIN holds: forward (Tandem's forward bench, release), llama-batched-bench
# and llama-quantize with their shared libraries in llama-avx2/ (built
# GGML_NATIVE on an AVX2-only CPU: AVX2, FMA, F16C) and llama-avx512/
# (libggml-cpu only, built GGML_NATIVE=OFF GGML_AVX512=ON
# GGML_AVX512_VNNI=ON), and gguf-py/ (llama.cpp's, for make_gguf.py).
set -euo pipefail
OUT=$1
BIN=${BIN:?BIN: the folder of binaries}
STEPS=${STEPS:-64}
LANES=${LANES:-"0,1 2,3 4,5 6,7 8,9 10,11 12,13 14,15"}
FORMAT_SETS=${FORMAT_SETS:-"f32,Q4_1 f16,Q8_0,Q4_K_M"}
SHAPES=${SHAPES:-"llama-100m smollm2"}
ISAS=${ISAS:-"avx2 avx512"}
HERE=$(cd "$(dirname "$0")" && pwd)
MODELS=${MODELS:-/tmp/isa-models}
mkdir -p "$OUT" "$MODELS"
export LD_LIBRARY_PATH="$BIN/llama-avx2${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"

grep -m1 "model name" /proc/cpuinfo
grep -m1 flags /proc/cpuinfo | tr ' ' '\n' |
  grep -E '^(avx2|avx512f|avx512bw|avx512vl|avx512_vnni|avx512_bf16|amx_tile|fma|f16c)$' | tr '\n' ' '
echo

# The files: f32 from make_gguf.py, the rest through llama-quantize.
for shape in $SHAPES; do
  f32="$MODELS/$shape-f32.gguf"
  [ -f "$f32" ] || PYTHONPATH="$BIN/gguf-py" python3 "$HERE/make_gguf.py" "$f32" "$shape" >/dev/null
  for fmt in F16 Q8_0 Q4_1 Q4_K_M; do
    f="$MODELS/$shape-$fmt.gguf"
    [ -f "$f" ] || "$BIN/llama-quantize" "$f32" "$f" "$fmt" 8 >/dev/null 2>&1
  done
done
echo "models: $(ls "$MODELS" | tr '\n' ' ')"

FWD=${FWD:-$BIN/forward}
# shellcheck source=engines.sh
. "$HERE/engines.sh"

lane() { # shape isa cores formats
  local i=0
  for fmt in ${4//,/ }; do
    if [ $((i % 2)) = 0 ]; then
      echo "=== $1 $2 $fmt: Tandem"; tandem "$1" "$fmt" "$2" "$3" 1,4,16,64
      echo "=== $1 $2 $fmt: llama.cpp"; llama "$1" "$fmt" "$2" "$3" 1,4,16,64 12288
    else
      echo "=== $1 $2 $fmt: llama.cpp"; llama "$1" "$fmt" "$2" "$3" 1,4,16,64 12288
      echo "=== $1 $2 $fmt: Tandem"; tandem "$1" "$fmt" "$2" "$3" 1,4,16,64
    fi
    i=$((i + 1))
  done
}

read -r -a cores <<<"$LANES"
n=0
for shape in $SHAPES; do
  for isa in $ISAS; do
    for set in $FORMAT_SETS; do
      lane "$shape" "$isa" "${cores[$n]}" "$set" >"$OUT/$shape-$isa-${set//,/_}.log" 2>&1 &
      n=$((n + 1))
    done
  done
done
wait
for f in "$OUT"/*.log; do echo "##### $f"; cat "$f"; done
