#!/usr/bin/env bash
# A draft round's price on the GPU, two builds alternating (issue 18): after
# the two stage calls of h200_head.sh (the model's parts and .devdata/head),
# with $BIN holding multi_client_load-before.gz, multi_client_load.gz,
# device-tests.gz and stories260k in $BIN/shared/models:
#   BIN=.devbin-ab ROUNDS=3 bash bench/spec/head_round_ab.sh
# runs the GPU tests, then per round the one-stream chat and edit rows with
# each build (`--mtp-compare --repeat 3`, warm), then traces the new build's
# rounds (RUST_LOG debug events, summarised by round_trace.py). Log
# $OUT/ab.log, traces $OUT/trace-*.log.gz.
BIN=${BIN:-.devbin-ab}
source bench/spec/ab_setup.sh
MODEL=/tmp/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
HEAD=/tmp/smollm2-head
load() {
  local bin=$1
  shift
  timeout 150 "$bin" --device cuda --dtype bf16 --model $MODEL --show-answers 0 --max-tokens 96 \
    --max-seqs 1 --mtp head:$HEAD --warm --no-prefix-cache "$@"
}
for round in $(seq "${ROUNDS:-3}"); do
  for b in before multi_client_load; do
    echo "=== [$b] round $round: chat"
    load /tmp/bin/$b --prompts bench/spec/chat_prompts.txt --clients 16 --mtp-compare --repeat 3 2>&1 \
      | grep -E 'MTP|medians|aggregate|engine time'
    echo "=== [$b] round $round: edit"
    load /tmp/bin/$b --prompts bench/spec/edit_prompts.txt --clients 8 --prompt-lookup --mtp-compare --repeat 3 2>&1 \
      | grep -E 'MTP|medians|aggregate|engine time'
  done
done
for b in before multi_client_load; do
  echo "=== [$b] traced rounds (chat, one run each way)"
  RUST_LOG=tandem::engine::drafting=debug,tandem::model=debug load /tmp/bin/$b \
    --prompts bench/spec/chat_prompts.txt --clients 16 --mtp-compare --repeat 1 2>&1 \
    | tee >(gzip >"$OUT/trace-$b.log.gz") | python3 bench/spec/round_trace.py | grep -E 'rows=[123] |round=[01] rows=[123] '
done
echo "=== done"
