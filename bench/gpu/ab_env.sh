#!/usr/bin/env bash
# Same-call A/B of process-wide GPU switches: the forward bench (decode
# tok/s at B = 1 / 16 / 64, CUDA graphs on) once per setting and round,
# settings alternating within each round. A setting is a space-separated
# list of VAR=value, e.g. "TANDEM_GEMV=0" or "TANDEM_ATTENTION_SPLIT_KEYS=32";
# "default" sets nothing. BENCH=path in a setting runs that forward bench
# instead of /tmp/bin/forward-bench, so two builds (say, a commit and its
# parent: carry $BIN/forward-bench-NAME.gz, which run_graphs.sh unpacks to
# /tmp/bin/forward-bench-NAME) alternate the same way, e.g.
# SETTINGS="default;BENCH=/tmp/bin/forward-bench-base".
#
# Expects run_graphs.sh to have run in this call (binaries in /tmp/bin,
# models in /tmp). SETTINGS, MODELS (folders), ROUNDS; logs to $LOGS/ab.log,
# then prints each setting's medians and ratios to the first (ab_medians.py).
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
IFS=';' read -ra settings <<<"${SETTINGS:-default;TANDEM_GEMV=0}"
for round in $(seq 1 "${ROUNDS:-2}"); do
  for m in ${MODELS:-/tmp/llama-1b-random /tmp/smollm2-shape-random}; do
    for s in "${settings[@]}"; do
      vars=(); [ "$s" = default ] || read -ra vars <<<"$s"
      bench=/tmp/bin/forward-bench env=()
      for v in "${vars[@]}"; do
        case "$v" in BENCH=*) bench=${v#BENCH=} ;; *) env+=("$v") ;; esac
      done
      line=$(env "${env[@]}" TANDEM_BENCH_DEVICE=cuda TANDEM_BENCH_MODEL="$m" \
        TANDEM_BENCH_FORMATS=bf16 TANDEM_BENCH_BATCHES=${BATCHES:-1,16,64} \
        TANDEM_BENCH_REPS=${REPS:-3} timeout 200 "$bench" --bench 2>&1 \
        | grep -E "^\| bf16")
      echo "round $round $(basename "$m") [$s] $line" | tee -a "$LOGS/ab.log"
    done
  done
done
# Medians and ratios against the first setting.
python3 "$(dirname "$0")/ab_medians.py" "$LOGS/ab.log" "${settings[0]}"
