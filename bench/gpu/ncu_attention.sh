#!/usr/bin/env bash
# Nsight Compute over the pooled attention kernel alone (eager passes,
# graphs off): duration, registers, occupancy and warp stall figures of
# COUNT launches after SKIP, for each build in BUILDS (forward-bench-NAME;
# "main" is /tmp/bin/forward-bench), each model in MODELS and batch in
# BATCHES. The bench's prompt passes come first: SKIP must pass them to
# reach decode passes (a 16-layer model at B = 1: ~95; one of 30 layers
# needs more). Expects run_graphs.sh to have run in this call. Writes
# $LOGS/ncu-MODEL-bB-BUILD.txt and prints the key lines.
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
NCU=${NCU:-$(command -v ncu || echo /usr/local/cuda/bin/ncu)}
for m in ${MODELS:-/tmp/llama-1b-random}; do
  for b in ${BATCHES:-1 64}; do
    for build in ${BUILDS:-main head}; do
      bench=/tmp/bin/forward-bench
      [ "$build" = main ] || bench=$bench-$build
      log=$LOGS/ncu-$(basename "$m")-b$b-$build.txt
      TANDEM_CUDA_GRAPHS=0 TANDEM_BENCH_DEVICE=cuda TANDEM_BENCH_MODEL=$m \
        TANDEM_BENCH_FORMATS=bf16 TANDEM_BENCH_BATCHES=$b TANDEM_BENCH_REPS=1 \
        TANDEM_BENCH_STEPS=4 timeout 100 "$NCU" --kernel-name regex:pooled_attention \
        --launch-skip "${SKIP:-95}" --launch-count "${COUNT:-3}" --cache-control none \
        --clock-control none --section SpeedOfLight --section WarpStateStats \
        --section LaunchStats --section Occupancy "$bench" --bench >"$log" 2>&1
      echo "== $(basename "$m") B=$b $build"
      grep -E "^  pooled|Duration|Registers Per|Achieved Occupancy|Warp Cycles Per Issued|Grid Size" "$log" | head -7
    done
  done
done
