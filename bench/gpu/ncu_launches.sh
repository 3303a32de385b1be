#!/usr/bin/env bash
# Per-launch Nsight Compute metrics of the kernels whose names match
# $KERNELS (an ncu regex, required: e.g. "gemv|nvjet" for the projections,
# "pooled_attention" for attention), over the forward bench at batch size
# $B with graphs off: $COUNT matching launches after the first $SKIP (ncu's
# -c and -s; the prompts' passes come first), as CSV with each launch's
# grid, so projections of one kernel are told apart by their grids. Caches
# and clocks are left alone (--cache-control none --clock-control none), so
# a launch sees the caches the previous one left, as in a real step.
#
# Expects what run_graphs.sh expects (it unpacks the binaries) and a model
# folder in $MODEL (made by run_graphs.sh). Writes $LOGS/ncu-launches-b$B.csv.
set -uo pipefail
MODEL=${MODEL:-/tmp/llama-1b-random}
NCU=${NCU:-/usr/local/cuda/bin/ncu}
B=${B:-16}
: "${KERNELS:?set KERNELS to an ncu kernel-name regex}"
METRICS=${METRICS:-gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,lts__throughput.avg.pct_of_peak_sustained_elapsed,l1tex__throughput.avg.pct_of_peak_sustained_active,sm__warps_active.avg.pct_of_peak_sustained_active}
source "$(dirname "$0")/device_env.sh"
TANDEM_CUDA_GRAPHS=0 TANDEM_BENCH_DEVICE=cuda TANDEM_BENCH_MODEL="$MODEL" \
  TANDEM_BENCH_FORMATS=bf16 TANDEM_BENCH_BATCHES=$B TANDEM_BENCH_REPS=1 \
  TANDEM_BENCH_STEPS=${STEPS:-2} timeout ${NCU_TIMEOUT:-150} "$NCU" \
  -k "regex:$KERNELS" -s "${SKIP:-0}" -c "${COUNT:-65}" --cache-control none --clock-control none \
  --metrics "$METRICS" --csv --page raw /tmp/bin/forward-bench --bench \
  >"$LOGS/ncu-launches-b$B.raw" 2>&1
grep -E '^"' "$LOGS/ncu-launches-b$B.raw" >"$LOGS/ncu-launches-b$B.csv"
echo "=== ncu launches B=$B: $(($(wc -l <"$LOGS/ncu-launches-b$B.csv") - 1)) rows"
