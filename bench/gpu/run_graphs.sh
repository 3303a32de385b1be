#!/usr/bin/env bash
# Issue 21's device run, in one call: the GPU tests (CUDA graph replays ==
# eager passes among them), the engine bench with graphs on and off
# (alternating: step time, host time per step, kernels per graph), and the
# CUDA-graph PyTorch anchor (`graph_anchor.py`), on a random 1B-class Llama
# and on a random model of SmolLM2-135M's shape, both bf16.
#
# Expects the release binaries built with `--features cuda`, stripped and
# gzipped, in $BIN (device-tests.gz, forward-bench.gz), and stories260k and
# SmolLM2's config.json in $BIN/shared/models. Logs go to $LOGS. WHICH
# picks the models (`big smol` by default; one call fits one with the tests);
# ANCHOR=0 skips the anchor.
set -uo pipefail
BIN=${BIN:-.devbin}
LOGS=${LOGS:-/tmp/tandem-logs}
BIG=${BIG:-/tmp/llama-1b-random}
SMOL=${SMOL:-/tmp/smollm2-shape-random}
REPS=${REPS:-3}
mkdir -p "$LOGS"
exec > >(tee -a "$LOGS/run.log") 2>&1

CU13=$(python3 -c 'import nvidia.cu13 as m; print(m.__path__[0])' 2>/dev/null)/lib
[ -f "$CU13/libcublasLt.so.13" ] || CU13=$(dirname "$(find / -name 'libcublasLt.so.13' 2>/dev/null | head -1)")
export LD_LIBRARY_PATH="$CU13:${LD_LIBRARY_PATH:-}"
nvidia-smi -L
mkdir -p /tmp/bin
# Extra forward benches (forward-bench-NAME.gz) are other builds for ab_env.sh.
for f in "$BIN"/device-tests.gz "$BIN"/forward-bench*.gz; do
  [ -f "$f" ] || continue
  b=$(basename "$f" .gz)
  gunzip -c "$f" >/tmp/bin/$b && chmod +x /tmp/bin/$b
done
export TANDEM_SHARED_DIR=$(realpath "$BIN/shared")

if [ "${SKIP_TESTS:-0}" != 1 ]; then
  # Twice: the default rows, then batch-invariant mode (every pass exact).
  for invariant in 0 1; do
    echo "=== (a) GPU tests, TANDEM_BATCH_INVARIANT=$invariant"
    RUST_BACKTRACE=1 TANDEM_REQUIRE_GPU=1 TANDEM_BATCH_INVARIANT=$invariant timeout 240 \
      /tmp/bin/device-tests --test-threads 1 --nocapture 2>&1 \
      | grep -v "^ *[0-9]*: \\(<unknown>\\|at \\)" | tail -40
  done
fi

for which in ${WHICH:-big smol}; do
  if [ "$which" = big ]; then
    m=$BIG
    [ -f "$m/config.json" ] || python3 bench/gpu/hf_anchor.py make "$m"
  else
    m=$SMOL
    [ -f "$m/config.json" ] || python3 bench/gpu/graph_anchor.py make "$m" \
      --config "$BIN/shared/models/smollm2-135m-instruct/config.json"
  fi
  echo "=== (b) engine bench, $m"
  TANDEM_BENCH_DEVICE=cuda TANDEM_BENCH_MODEL="$m" TANDEM_BENCH_FORMATS=bf16 \
    TANDEM_BENCH_BATCHES=${BATCHES:-1,16,64} TANDEM_BENCH_REPS=$REPS timeout 200 /tmp/bin/forward-bench --bench
  [ "${ANCHOR:-1}" = 1 ] || continue
  echo "=== (c) PyTorch anchor (torch.compile, CUDA graphs), $m"
  PYTHONUNBUFFERED=1 timeout 240 python3 bench/gpu/graph_anchor.py bench "$m" \
    --batches ${BATCHES:-1,16,64} --reps "$REPS"
done
echo "=== done"
