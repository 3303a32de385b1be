#!/usr/bin/env bash
# Issue 18 on the H200, in one device call: train SmolLM2's MTP head with
# `tandem train-mtp --device cuda`, then measure speculation on the GPU
# (bf16) with that head and with prompt lookup, on and off alternating.
#
# Expects, built here with `--features cuda` (README "GPU"), gzipped in
# $BIN: tandem.gz and multi_client_load.gz; and SmolLM2's GGUF at $MODEL
# (the shared Q4_1 file is over one call's carry limit, so it travels in
# parts: `split -b 60M` here, `cat` there, checked against $MODEL_SHA256).
# The head (gzipped: the output limit is 16 MiB a file), its report and
# the logs go to $OUT. With SKIP_TRAIN=1 the bench reuses $HEAD, or unpacks
# $BIN/mtp.safetensors.gz there (a head trained in an earlier call).
set -uo pipefail
BIN=${BIN:-.devbin}
MODEL=${MODEL:-/tmp/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf}
OUT=${OUT:-/tmp/tandem-out}
HEAD=${HEAD:-/tmp/smollm2-head}
STEPS=${STEPS:-3000}
TRAIN_SEQS=${TRAIN_SEQS:-5120}
TRAIN_LIMIT=${TRAIN_LIMIT:-420}
mkdir -p "$OUT" /tmp/bin
exec > >(tee -a "$OUT/run.log") 2>&1

if [ -n "${MODEL_SHA256:-}" ]; then
  echo "$MODEL_SHA256  $MODEL" | sha256sum -c - || exit 1
fi
CU13=$(python3 -c 'import nvidia.cu13 as m; print(m.__path__[0])' 2>/dev/null)/lib
[ -f "$CU13/libcublasLt.so.13" ] || CU13=$(dirname "$(find / -name 'libcublasLt.so.13' 2>/dev/null | head -1)")
export LD_LIBRARY_PATH="$CU13:${LD_LIBRARY_PATH:-}"
for b in tandem multi_client_load; do
  [ -f "$BIN/$b.gz" ] && gunzip -c "$BIN/$b.gz" >/tmp/bin/$b && chmod +x /tmp/bin/$b
done
nvidia-smi -L

if [ "${SKIP_TRAIN:-0}" != 1 ]; then
  echo "=== train-mtp on cuda: $STEPS steps, $TRAIN_SEQS sequences (stopped after ${TRAIN_LIMIT}s)"
  # A run stopped by the limit leaves its last checkpoint's head.
  time timeout "$TRAIN_LIMIT" /tmp/bin/tandem train-mtp --device cuda --model "$MODEL" \
    --out "$HEAD" --steps "$STEPS" --batch 32 --seq-len 256 --train-seqs "$TRAIN_SEQS" \
    --heldout-seqs 64 --temperature 0.8 --draft-vocab 8192 --eval-every 250 \
    --checkpoint-every 250 --draft-positions 6 --seed 0 2>&1 | grep -v '^\s*$'
  gzip -c "$HEAD/mtp.safetensors" >"$OUT/mtp.safetensors.gz"
  cp "$HEAD"/mtp_training.json "$HEAD"/train_state.json "$OUT/" 2>/dev/null
fi

[ "${SKIP_BENCH:-0}" = 1 ] && exit 0
L=/tmp/bin/multi_client_load
if [ ! -f "$HEAD/mtp.safetensors" ] && [ -f "$BIN/mtp.safetensors.gz" ]; then
  mkdir -p "$HEAD" && gunzip -c "$BIN/mtp.safetensors.gz" >"$HEAD/mtp.safetensors"
fi
run() { echo "=== $*"; timeout 150 "$L" --device cuda --dtype bf16 --model "$MODEL" --show-answers 0 "$@" 2>&1 | grep -E 'MTP|medians|aggregate|engine time' ; }
CHAT="--prompts bench/spec/chat_prompts.txt --max-tokens 96"
run $CHAT --clients 16 --max-seqs 1 --mtp "head:$HEAD" --draft-max 2 --constant-drafts
run $CHAT --clients 16 --max-seqs 1 --mtp "head:$HEAD" --mtp-compare --repeat 3
run $CHAT --clients 16 --max-seqs 1 --mtp early-exit:1 --mtp-compare --repeat 3
run $CHAT --clients 16 --max-seqs 16 --mtp "head:$HEAD" --mtp-compare --repeat 3
run $CHAT --clients 16 --max-seqs 1 --mtp "head:$HEAD" --prompt-lookup --mtp-compare --repeat 3
run --prompts bench/spec/edit_prompts.txt --clients 8 --max-seqs 1 --max-tokens 96 --prompt-lookup --mtp-compare --repeat 3
run --prompts examples/prompts.txt --clients 12 --max-seqs 1 --max-tokens 64 --mtp "head:$HEAD" --mtp-compare --repeat 3
run $CHAT --clients 16 --max-seqs 16 --mtp "head:$HEAD" --prompt-lookup --mtp-compare --repeat 3
echo "=== done"
