#!/usr/bin/env bash
# Two builds of the load example alternating on the GPU over chosen rows
# (issue 18): after the two stage calls of h200_head.sh, with $BIN holding
# multi_client_load-before.gz and multi_client_load.gz (and device-tests.gz
# with stories260k in $BIN/shared/models to run the GPU tests first):
#   BIN=.devbin-h ROUNDS=2 ROWS_AB="--clients 128 --max-seqs 16 --prompt-lookup;--clients 16 --max-seqs 1" \
#     bash bench/spec/rows_ab.sh
# Each row: chat prompts, 96 tokens, session 34's head, warm engines, no
# prefix cache, `--mtp-compare --repeat 3`. Log $OUT/ab.log.
BIN=${BIN:-.devbin-h}
source bench/spec/ab_setup.sh
IFS=';' read -ra rows <<<"${ROWS_AB:---clients 16 --max-seqs 1}"
for round in $(seq "${ROUNDS:-2}"); do
  for row in "${rows[@]}"; do
    for b in before multi_client_load; do
      echo "=== [$b] round $round: $row"
      # shellcheck disable=SC2086
      timeout 150 /tmp/bin/$b --device cuda --dtype bf16 --model /tmp/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf \
        --show-answers 0 --prompts bench/spec/chat_prompts.txt --max-tokens 96 --mtp head:/tmp/smollm2-head \
        --warm --no-prefix-cache --mtp-compare --repeat 3 $row 2>&1 | grep -E 'MTP|medians|aggregate|engine time'
    done
  done
done
echo "=== done"
