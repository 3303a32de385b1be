#!/usr/bin/env bash
# Issue 18 on a GPU: do greedy answers with speculation on equal those
# with it off? The GEMV kernel's batch-invariant mode
# (`TANDEM_GEMV=invariant`: up to 9 rows against any weights) against the
# default (up to 8 rows against weights under 4 MiB, 2 over; cuBLAS
# beyond), alternating, ROUNDS rounds: SmolLM2 in bf16, one stream, the
# long edits with prompt lookup, warm engines (session 52 found 11 of 13
# default on-runs answering with other token counts than the off runs).
# The mode is not in the tree: a build with
# bench/gpu/gemv_invariant_rows_2026-12-07.patch applied (`git apply`; it
# instantiates the kernel for 9 rows and adds the mode) makes the
# multi_client_load this runs. Built in session 52, not run: the device's
# time was spent before a machine came. After the two stage calls of
# bench/spec/h200_head.sh (the GGUF's parts in .devdata/a, then
# .devdata/b beside .devbin/multi_client_load.gz):
#   bash bench/spec/gpu_invariant_ab.sh
set -uo pipefail
PHASE=bench SKIP_TRAIN=1 ROWS=none bash bench/spec/h200_head.sh >/dev/null 2>&1
CU13=$(python3 -c 'import nvidia.cu13 as m; print(m.__path__[0])' 2>/dev/null)/lib
export LD_LIBRARY_PATH="$CU13:${LD_LIBRARY_PATH:-}"
M=${MODEL:-/tmp/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf}
nvidia-smi -L
for round in $(seq 1 "${ROUNDS:-2}"); do
  modes="invariant default"
  [ $((round % 2)) = 0 ] && modes="default invariant"
  for mode in $modes; do
    echo "=== round $round, TANDEM_GEMV=$mode"
    TANDEM_GEMV=$mode timeout 120 /tmp/bin/multi_client_load --device cuda --dtype bf16 --model "$M" \
      --show-answers 0 --prompts bench/spec/edit_long_prompts.txt --clients 8 --max-seqs 1 \
      --max-tokens 320 --prompt-lookup --mtp-compare --repeat 5 --warm --no-prefix-cache 2>&1 \
      | grep -E 'aggregate|MTP:|medians|on / off'
  done
done
