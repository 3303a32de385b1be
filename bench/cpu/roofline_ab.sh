#!/usr/bin/env bash
# Alternating single-stream roofline runs of several forward-bench binaries
# (same host, same sitting), then their medians (bench/cpu/roofline_ab.py).
#   BINS="base=/tmp/forward-a new=/tmp/forward-b" ROUNDS=20 \
#   FORMATS="q8_0 as-stored" MODEL=<gguf> bash bench/cpu/roofline_ab.sh
# Binaries: `cargo bench --bench forward --no-run`, copied aside per build.
# The order of the binaries is reversed every other round.
set -euo pipefail
MODEL=${MODEL:-../shared/models/smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf}
ROUNDS=${ROUNDS:-20}
FORMATS=${FORMATS:-"q8_0 as-stored"}
read -r -a bins <<<"$BINS"
echo "# $(date -u '+%Y-%m-%d %H:%M UTC') $(git rev-parse --short HEAD 2>/dev/null) $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2)"
echo "# BINS=\"$BINS\" ROUNDS=$ROUNDS FORMATS=\"$FORMATS\" MODEL=$MODEL"
for r in $(seq 1 "$ROUNDS"); do
  order=("${bins[@]}")
  if (( r % 2 == 0 )); then
    order=(); for ((i=${#bins[@]}-1; i>=0; i--)); do order+=("${bins[i]}"); done
  fi
  for b in "${order[@]}"; do
    for f in $FORMATS; do
      echo "=== round $r ${b%%=*} $f"
      TANDEM_BENCH_MODEL=$MODEL TANDEM_BENCH_FORMATS=$f TANDEM_BENCH_BATCHES=1 \
        TANDEM_BENCH_ROOFLINE=1 TANDEM_BENCH_REPS=1 TANDEM_BENCH_STEPS=64 \
        "${b#*=}" --bench 2>&1 | grep -E 'roofline \(|attention|of which'
    done
  done
done
