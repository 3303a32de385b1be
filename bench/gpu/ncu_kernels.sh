#!/usr/bin/env bash
# Per-kernel GPU times of a few eager decode steps (graphs off), by Nsight
# Compute: `ncu --metrics $METRICS --print-summary per-kernel` over the
# forward bench, one batch size per run (METRICS: the kernel time and the
# share of DRAM bandwidth it reached, unless given). ncu times each kernel
# alone with cold caches, so the figures are upper bounds; the invocation
# counts tell which kernels are decode and which prompt processing.
# NCU_ARGS adds ncu options (e.g. "--cache-control none --clock-control
# none": caches kept warm between kernels, the GPU's own clocks).
#
# Expects what run_graphs.sh expects (it unpacks the binaries), and a model
# folder in $MODEL (made by run_graphs.sh). Writes $LOGS/ncu-b$B.txt.
set -uo pipefail
MODEL=${MODEL:-/tmp/llama-1b-random}
NCU=${NCU:-/usr/local/cuda/bin/ncu}
METRICS=${METRICS:-gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed}
source "$(dirname "$0")/device_env.sh"
for b in ${BATCHES:-1 64}; do
  TANDEM_CUDA_GRAPHS=0 TANDEM_BENCH_DEVICE=cuda TANDEM_BENCH_MODEL="$MODEL" \
    TANDEM_BENCH_FORMATS=bf16 TANDEM_BENCH_BATCHES=$b TANDEM_BENCH_REPS=1 \
    TANDEM_BENCH_STEPS=${STEPS:-4} timeout ${NCU_TIMEOUT:-150} "$NCU" \
    --metrics "$METRICS" --print-summary per-kernel ${NCU_ARGS:-} \
    /tmp/bin/forward-bench --bench >"$LOGS/ncu-b$b.raw" 2>&1
  grep -E "Invocations|gpu__time_duration|dram__" "$LOGS/ncu-b$b.raw" >"$LOGS/ncu-b$b.txt"
  echo "=== ncu B=$b: $(grep -c Invocations "$LOGS/ncu-b$b.txt") kernels"
done
