#!/usr/bin/env bash
# Per-launch Nsight Compute metrics of the kernels whose names match
# $KERNELS (an ncu regex), over the forward bench at one batch size with
# graphs off: the first $COUNT matching launches (65 = one decode step's
# projections of the 1B model: 16 layers x 4, and the unembedding, when
# the prompts' passes run other kernels), as CSV with each launch's grid,
# so projections of one kernel are told apart by their grids. Caches and
# clocks are left alone (--cache-control none --clock-control none), so a
# launch sees the caches the previous one left, as in a real step.
#
# Expects what run_graphs.sh expects (it unpacks the binaries) and a model
# folder in $MODEL (made by run_graphs.sh). Writes $LOGS/ncu-launches-b$B.csv.
set -uo pipefail
MODEL=${MODEL:-/tmp/llama-1b-random}
NCU=${NCU:-/usr/local/cuda/bin/ncu}
B=${B:-16}
METRICS=${METRICS:-gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,lts__throughput.avg.pct_of_peak_sustained_elapsed,l1tex__throughput.avg.pct_of_peak_sustained_active,sm__warps_active.avg.pct_of_peak_sustained_active}
source "$(dirname "$0")/device_env.sh"
TANDEM_CUDA_GRAPHS=0 TANDEM_BENCH_DEVICE=cuda TANDEM_BENCH_MODEL="$MODEL" \
  TANDEM_BENCH_FORMATS=bf16 TANDEM_BENCH_BATCHES=$B TANDEM_BENCH_REPS=1 \
  TANDEM_BENCH_STEPS=${STEPS:-2} timeout ${NCU_TIMEOUT:-150} "$NCU" \
  -k "regex:${KERNELS:-mma_gemm}" -c "${COUNT:-65}" --cache-control none --clock-control none \
  --metrics "$METRICS" --csv --page raw /tmp/bin/forward-bench --bench \
  >"$LOGS/ncu-launches-b$B.raw" 2>&1
grep -E '^"' "$LOGS/ncu-launches-b$B.raw" >"$LOGS/ncu-launches-b$B.csv"
echo "=== ncu launches B=$B: $(($(wc -l <"$LOGS/ncu-launches-b$B.csv") - 1)) rows"
