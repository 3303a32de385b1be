#!/usr/bin/env bash
# One build of the load example under several environment settings,
# alternating per row on the GPU (issue 18): after the two stage calls of
# h200_head.sh, with $BIN holding multi_client_load.gz:
#   BIN=.devbin-x SETTINGS="TANDEM_CAPTURE_VERIFY_AFTER=3;TANDEM_CAPTURE_VERIFY_AFTER=1" ROUNDS=3 \
#     ROWS_AB="--clients 128 --max-seqs 16 --prompt-lookup;--clients 256 --max-seqs 64 --prompt-lookup" \
#     bash bench/spec/env_rows_ab.sh
# Each row as in rows_ab.sh (chat prompts, 96 tokens, session 34's head,
# warm engines, no prefix cache, `--mtp-compare --repeat 3`). Log $OUT/ab.log.
set -uo pipefail
BIN=${BIN:-.devbin-x}
OUT=${OUT:-/tmp/tandem-out}
PHASE=bench SKIP_TRAIN=1 ROWS=none BIN=$BIN bash bench/spec/h200_head.sh >/dev/null 2>&1
exec > >(tee -a "$OUT/ab.log") 2>&1
export LD_LIBRARY_PATH=$(dirname "$(find / -name 'libcublasLt.so.13' 2>/dev/null | head -1)")
IFS=';' read -ra rows <<<"${ROWS_AB:---clients 16 --max-seqs 1}"
IFS=';' read -ra settings <<<"${SETTINGS:-}"
for round in $(seq "${ROUNDS:-2}"); do
  for row in "${rows[@]}"; do
    for setting in "${settings[@]}"; do
      echo "=== [$setting] round $round: $row"
      # shellcheck disable=SC2086
      env $setting timeout 150 /tmp/bin/multi_client_load --device cuda --dtype bf16 \
        --model /tmp/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf --show-answers 0 \
        --prompts bench/spec/chat_prompts.txt --max-tokens 96 --mtp head:/tmp/smollm2-head \
        --warm --no-prefix-cache --mtp-compare --repeat 3 $row 2>&1 | grep -E 'MTP|medians|aggregate|engine time'
    done
  done
done
echo "=== done"
