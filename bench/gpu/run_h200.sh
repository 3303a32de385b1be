#!/usr/bin/env bash
# Issue 8's device run, in one call (see README "GPU"): the GPU tests, the
# engine bench, the load example at 1/16/64 clients and the PyTorch anchor,
# on the same card, with a random 1B-class Llama (bf16) made there.
#
# Expects the release binaries built with `--features cuda` in $BIN
# (device-tests, forward-bench, multi_client_load) and stories260k in
# $BIN/shared/models. Logs go to $LOGS.
set -uo pipefail
BIN=${BIN:-.devbin}
LOGS=${LOGS:-/tmp/tandem-logs}
MODEL=${MODEL:-/tmp/llama-1b-random}
mkdir -p "$LOGS"
exec > >(tee -a "$LOGS/run.log") 2>&1

# CUDA 13 libraries (cuBLAS, cuRAND, NVRTC, runtime) from PyTorch's wheels.
CU13=$(python3 -c 'import nvidia.cu13 as m; print(m.__path__[0])' 2>/dev/null)/lib
[ -f "$CU13/libcublasLt.so.13" ] || CU13=$(dirname "$(find / -name 'libcublasLt.so.13' 2>/dev/null | head -1)")
echo "CUDA libraries: $CU13"
export LD_LIBRARY_PATH="$CU13:${LD_LIBRARY_PATH:-}"
nvidia-smi -L
ldd "$BIN/multi_client_load" | grep -E 'not found|cuda|cublas|nvrtc|curand' || true

# The tests read ../shared beside the checkout they were built in.
mkdir -p /work && ln -sfn "$(realpath "$BIN/shared")" /work/shared

echo "=== (a) GPU tests"
RUST_BACKTRACE=0 TANDEM_REQUIRE_GPU=1 "$BIN/device-tests" --test-threads 1 --nocapture 2>&1 | grep -v "^ *[0-9]*: \\(<unknown>\\|at \\)" | tail -60

echo "=== model"
[ -f "$MODEL/config.json" ] || python3 bench/gpu/hf_anchor.py make "$MODEL"

echo "=== (b) engine bench"
TANDEM_BENCH_DEVICE=cuda TANDEM_BENCH_MODEL="$MODEL" TANDEM_BENCH_FORMATS=bf16 \
  TANDEM_BENCH_BATCHES=1,16,64 TANDEM_BENCH_REPS=3 TANDEM_BENCH_PROFILE=1 "$BIN/forward-bench" --bench

echo "=== (c) load example"
# 128 new tokens is the bench's workload; 512 makes runs long enough (a few
# seconds) for the actor / engine ratio to settle.
for tokens in 128 512; do
  for c in 1 16 64; do
    "$BIN/multi_client_load" --device cuda --dtype bf16 --model "$MODEL" --clients "$c" \
      --uniform --prompt-tokens 128 --max-tokens "$tokens" --max-seqs 64 --engine-baseline 2>&1 \
      | grep -v '^\s*$' | tail -25
  done
done

# Mixed clients (greedy, top-p, penalties, logprobs; lengths vary): every
# row sampled on the device.
"$BIN/multi_client_load" --device cuda --dtype bf16 --model "$MODEL" --clients 64 \
  --max-tokens 128 --max-seqs 64 --engine-baseline 2>&1 | grep -v '^\s*$' | tail -25

echo "=== (d) PyTorch anchor"
PYTHONUNBUFFERED=1 python3 bench/gpu/hf_anchor.py bench "$MODEL" --batches 1,16,64
echo "=== done"
