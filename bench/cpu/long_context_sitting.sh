#!/usr/bin/env bash
# Decode and prompt speed at a long context, Tandem against llama.cpp, same
# host, alternating: SmolLM2's Q4_1 GGUF as stored and as Q8_0 (Tandem
# quantises at load; llama.cpp gets llama-quantize --allow-requantize's
# Q8_0), B sequences x NPP-token prompts, STEPS decode steps, 2 threads,
# f16 KV on both sides (llama.cpp with flash attention, as
# bench/cpu/isa_sitting.sh runs it).
#
#   FORWARD=target/release/deps/forward-… LLAMA=/work/llama.cpp/bin \
#   ROUNDS=3 NPP=2048 BATCHES=1,4 bash bench/cpu/long_context_sitting.sh
# (llama.cpp from bench/llama_cpp/build.sh; the forward bench from
# `cargo bench --bench forward --no-run`.) The AVX2 pairing: TANDEM_CPU_ISA=avx2
# and LLAMA= a build of `ISA=avx2 bench/llama_cpp/build.sh`.
set -euo pipefail
: "${FORWARD:?the forward bench binary}" "${LLAMA:?the bin folder of a llama.cpp build}"
GGUF=${GGUF:-../shared/models/smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf}
Q8=${Q8:-/tmp/smollm2-Q8_0.gguf}
NPP=${NPP:-2048}
STEPS=${STEPS:-64}
BATCHES=${BATCHES:-1,4}
ROUNDS=${ROUNDS:-3}
export LD_LIBRARY_PATH="$LLAMA${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
[ -f "$Q8" ] || "$LLAMA/llama-quantize" --allow-requantize "$GGUF" "$Q8" Q8_0 2 >/dev/null 2>&1
maxb=$(tr ',' '\n' <<<"$BATCHES" | sort -n | tail -1)
echo "# $(date -u '+%Y-%m-%d %H:%M UTC') $(git rev-parse --short HEAD) $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2)"
echo "# NPP=$NPP STEPS=$STEPS BATCHES=$BATCHES ROUNDS=$ROUNDS"
tandem() { # format
  TANDEM_BENCH_MODEL="$GGUF" TANDEM_BENCH_FORMATS=$1 TANDEM_BENCH_BATCHES=$BATCHES \
    TANDEM_BENCH_PROMPT=$NPP TANDEM_BENCH_STEPS=$STEPS TANDEM_BENCH_REPS=1 \
    "$FORWARD" --bench 2>&1 | grep -E '^\||ISA'
}
llama() { # file
  "$LLAMA/llama-batched-bench" -m "$1" -npp "$NPP" -ntg "$STEPS" -npl "$BATCHES" -t 2 \
    -fa on -c $(( maxb * (NPP + STEPS) + 64 )) 2>&1 | grep -E '^\|'
}
for r in $(seq 1 "$ROUNDS"); do
  for fmt in as-stored q8_0; do
    file=$GGUF; [ $fmt = q8_0 ] && file=$Q8
    if (( r % 2 )); then
      echo "=== round $r $fmt Tandem"; tandem $fmt
      echo "=== round $r $fmt llama.cpp"; llama "$file"
    else
      echo "=== round $r $fmt llama.cpp"; llama "$file"
      echo "=== round $r $fmt Tandem"; tandem $fmt
    fi
  done
done
