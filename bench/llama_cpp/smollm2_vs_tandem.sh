#!/usr/bin/env bash
# Decode and prompt-processing speed of Tandem and llama.cpp on the SmolLM2
# GGUFs, same sitting, alternating engine by engine and file by file, 2
# threads each: B sequences x 128-token prompts, STEPS decode steps.
#
#   bash bench/llama_cpp/build.sh                       # llama.cpp into $LLAMA_DIR/bin
#   $LLAMA_DIR/bin/llama-quantize --allow-requantize Q4_1.gguf f32.gguf F32   # once
#   $LLAMA_DIR/bin/llama-quantize --allow-requantize Q4_1.gguf q8_0.gguf Q8_0 # once
#   cargo build --release --bench forward
#   bash bench/llama_cpp/smollm2_vs_tandem.sh Q4_1.gguf q8_0.gguf f32.gguf > log
#
# Env: LLAMA_DIR (default /work/llama.cpp), ROUNDS (2), STEPS (64),
# FORWARD (the forward bench binary; default: the newest in target/release/deps).
# Tandem runs each file as stored (`as-stored`: quantised blocks through its
# own kernels, F32 as f32); the first round adds its bandwidth roofline.
set -euo pipefail
LLAMA_DIR=${LLAMA_DIR:-/work/llama.cpp}
ROUNDS=${ROUNDS:-2}
STEPS=${STEPS:-64}
FORWARD=${FORWARD:-$(ls -t target/release/deps/forward-* | grep -v '\.d$' | head -1)}
grep -m1 "model name" /proc/cpuinfo
grep -m1 flags /proc/cpuinfo | tr ' ' '\n' | grep -E '^(avx2|avx512f|avx512_vnni|avx_vnni|fma|f16c)$' | tr '\n' ' '; echo
for round in $(seq "$ROUNDS"); do
  for file in "$@"; do
    echo "=== round $round: Tandem $file"
    roofline=$([ "$round" = 1 ] && echo 1 || echo 0)
    TANDEM_BENCH_MODEL="$file" TANDEM_BENCH_FORMATS=as-stored TANDEM_BENCH_BATCHES=1,4,16,64 \
      TANDEM_BENCH_REPS=1 TANDEM_BENCH_STEPS="$STEPS" TANDEM_BENCH_ROOFLINE=$roofline \
      "$FORWARD" --bench 2>&1 | grep -vE '^\s*$'
    echo "=== round $round: llama.cpp $file"
    "$LLAMA_DIR/bin/llama-batched-bench" -m "$file" -npp 128 -ntg "$STEPS" -npl 1,4,16,64 \
      -t 2 -fa on -c 12288 2>&1 | grep -E '^\|'
  done
done
