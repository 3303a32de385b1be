#!/usr/bin/env bash
# Alternating forward-bench binaries at long prompts (same host, same
# sitting): prompt processing and decode at one stream, per ISA tier.
#   BINS="base=/tmp/forward-a new=/tmp/forward-b" ROUNDS=5 PROMPT=2048 \
#   ISAS="native avx2" FORMATS=q8_0,as-stored bash bench/cpu/long_prompt_ab.sh
# Binaries: `cargo bench --bench forward --no-run`, copied aside per build.
# The order of the binaries is reversed every other round. Table columns:
# format, decode at each of BATCHES (default 1), prompt B=1, prompt max
# (tok/s).
set -euo pipefail
MODEL=${MODEL:-../shared/models/smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf}
ROUNDS=${ROUNDS:-5}
PROMPT=${PROMPT:-2048}
STEPS=${STEPS:-16}
ISAS=${ISAS:-"native avx2"}
FORMATS=${FORMATS:-q8_0,as-stored}
BATCHES=${BATCHES:-1}
read -r -a bins <<<"$BINS"
echo "# $(date -u '+%Y-%m-%d %H:%M UTC') $(git rev-parse --short HEAD 2>/dev/null) $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2)"
echo "# BINS=\"$BINS\" ROUNDS=$ROUNDS PROMPT=$PROMPT STEPS=$STEPS ISAS=\"$ISAS\" FORMATS=$FORMATS BATCHES=$BATCHES MODEL=$MODEL"
for r in $(seq 1 "$ROUNDS"); do
  order=("${bins[@]}")
  if (( r % 2 == 0 )); then
    order=(); for ((i=${#bins[@]}-1; i>=0; i--)); do order+=("${bins[i]}"); done
  fi
  for isa in $ISAS; do
    for b in "${order[@]}"; do
      echo "=== round $r ${b%%=*} $isa prompt $PROMPT"
      isa_env=(); [ "$isa" = native ] || isa_env=(TANDEM_CPU_ISA="$isa")
      env "${isa_env[@]}" \
        TANDEM_BENCH_MODEL=$MODEL TANDEM_BENCH_FORMATS=$FORMATS TANDEM_BENCH_BATCHES=$BATCHES \
        TANDEM_BENCH_PROMPT=$PROMPT TANDEM_BENCH_REPS=1 TANDEM_BENCH_STEPS=$STEPS \
        "${b#*=}" --bench 2>&1 | grep -E '^\| (q|f|as)'
    done
  done
done
