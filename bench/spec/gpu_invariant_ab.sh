#!/usr/bin/env bash
# Issue 18 on a GPU: do greedy answers with speculation on equal those
# with it off? The GEMV kernel's default rows (up to 9 against any
# weights: batch-invariant passes of up to 9 rows) against
# `TANDEM_GEMV=fast` (up to 8 rows against weights under 4 MiB, 2 over;
# cuBLAS beyond), alternating, ROUNDS rounds: SmolLM2 in bf16, one
# stream, the long edits with prompt lookup, warm engines. Session 52
# found 11 of 13 on-runs of the old rule answering with other token
# counts than the off runs; session 53 ran this script on the patch that
# became the default (its arms then `invariant` and `default`, log
# bench/spec/h100_gemv_invariant_ab_s53_2026-12-07.log). After the two
# stage calls of bench/spec/h200_head.sh (the GGUF's parts in
# .devdata/a, then .devdata/b beside .devbin/multi_client_load.gz):
#   bash bench/spec/gpu_invariant_ab.sh
set -uo pipefail
PHASE=bench SKIP_TRAIN=1 ROWS=none bash bench/spec/h200_head.sh >/dev/null 2>&1
# shellcheck source=../gpu/device_env.sh
source "$(dirname "$0")/../gpu/device_env.sh" 2>/dev/null
M=${MODEL:-/tmp/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf}
nvidia-smi -L
for round in $(seq 1 "${ROUNDS:-2}"); do
  modes="default fast"
  [ $((round % 2)) = 0 ] && modes="fast default"
  for mode in $modes; do
    echo "=== round $round, rows: $mode"
    TANDEM_GEMV=$([ "$mode" = fast ] && echo fast) timeout 120 /tmp/bin/multi_client_load --device cuda --dtype bf16 --model "$M" \
      --show-answers 0 --prompts bench/spec/edit_long_prompts.txt --clients 8 --max-seqs 1 \
      --max-tokens 320 --prompt-lookup --mtp-compare --repeat 5 --warm --no-prefix-cache 2>&1 \
      | grep -E 'aggregate|MTP:|medians|on / off'
  done
done
