#!/usr/bin/env bash
# Issue 18 on the H200: train SmolLM2's MTP head with
# `tandem train-mtp --device cuda`, then measure speculation on the GPU
# (bf16) with that head and with prompt lookup, on and off alternating.
#
# Expects, built here with `--features cuda` (README "GPU"), gzipped in
# $BIN: tandem.gz and multi_client_load.gz; and SmolLM2's GGUF at $MODEL.
# The shared Q4_1 file is over one call's carry limit (64 MiB), so it
# travels in parts over two calls made within the machine's warm window:
#   here:  split -b 58M SmolLM2-135M-Instruct.Q4_1.gguf part.  (part.aa in
#          .devdata/a, part.ab in .devdata/b, both git-ignored)
#   call 1 (carry .devdata/a):  PHASE=stage bash bench/spec/h200_head.sh
#   call 2 (carry .devdata/b .devbin):  PHASE=train bash bench/spec/h200_head.sh
#   call 3:  PHASE=bench bash bench/spec/h200_head.sh
# `stage` keeps the parts in /tmp; `train` joins them (checked against
# $MODEL_SHA256), starts train-mtp detached (setsid: it outlives the
# call, so training may run past one command's 10 minutes) and waits up to
# $WAIT seconds; `bench` waits for it to finish, saves the head (gzipped:
# the output limit is 16 MiB a file) and its report to $OUT, then runs the
# speculation rows. With SKIP_TRAIN=1 the bench unpacks
# $BIN/mtp.safetensors.gz (a head trained in an earlier session); or the
# head travels with the parts, as .devdata/head/mtp.safetensors.gz, and
# `stage` unpacks it (a bench-only run: stage, stage, then bench with
# SKIP_TRAIN=1 and only multi_client_load.gz in $BIN). With
# $BIN/device-tests.gz (`cargo test --release --features cuda --test
# device --no-run`) and stories260k in $BIN/shared/models, the bench runs
# the GPU tests first. REPEAT sets each row's alternating runs (3);
# WARM=1 runs the rows on warm engines, WARM=both fresh then warm (below);
# ROWS=short runs four rows (below), ROWS=long the long-edit rows, ROWS=none none;
# ROWS=head runs only the head A/B at the end (HEAD_GRAPHS_AB=1 runs it
# after the other rows).
# TRAIN2_ARGS trains a second head beside the first (into $HEAD2, on the
# same data), saved and evaluated with it; the rows use $HEAD.
# TRAIN_ARGS adds train-mtp options (session 27: `--self-prompts 4096
# --heldout-prompts bench/spec/chat_prompts.txt --heldout-seqs 16`); the
# train phase then also runs `tandem eval-mtp` on the chat and edit prompts
# with the new head and, when .devdata/head brought one, the old head.
# PHASE=trace (after the stage calls) traces every decode pass of the 16-
# and 64-stream rows instead (bench/spec/pass_trace.py); GRAPHS_OFF=1
# reruns them with CUDA graphs off.
# Session 11's figures in BENCHMARKS.md came from this script at dd63118
# (one call, 5 120 sequences, 3 000 steps, and two rows dropped here).
set -uo pipefail
BIN=${BIN:-.devbin}
MODEL=${MODEL:-/tmp/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf}
MODEL_SHA256=${MODEL_SHA256:-b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53}
OUT=${OUT:-/tmp/tandem-out}
HEAD=${HEAD:-/tmp/smollm2-head}
HEAD2=${HEAD2:-/tmp/smollm2-head2}
STEPS=${STEPS:-2500}
TRAIN_SEQS=${TRAIN_SEQS:-10240}
WAIT=${WAIT:-540}
PHASE=${PHASE:-all}
mkdir -p "$OUT" /tmp/bin /tmp/smollm2
exec > >(tee -a "$OUT/run.log") 2>&1

if [ "$PHASE" = stage ]; then
  cp .devdata/*/part.* /tmp/smollm2/ 2>/dev/null
  if [ -f .devdata/head/mtp.safetensors.gz ]; then
    # Kept as /tmp/old-head too: a train phase replaces $HEAD.
    for d in "$HEAD" /tmp/old-head; do
      mkdir -p "$d" && gunzip -c .devdata/head/mtp.safetensors.gz >"$d/mtp.safetensors"
    done
  fi
  ls -l /tmp/smollm2 "$HEAD" 2>/dev/null; nvidia-smi -L
  grep -m1 'model name' /proc/cpuinfo; nproc; grep -o -m1 -w 'avx512_vnni\|avx512f\|avx2' /proc/cpuinfo | sort -u
  exit
fi
if [ ! -f "$MODEL" ]; then
  cp .devdata/b/part.* /tmp/smollm2/ 2>/dev/null
  cat /tmp/smollm2/part.* >"$MODEL"
fi
echo "$MODEL_SHA256  $MODEL" | sha256sum -c - || exit 1
CU13=$(python3 -c 'import nvidia.cu13 as m; print(m.__path__[0])' 2>/dev/null)/lib
[ -f "$CU13/libcublasLt.so.13" ] || CU13=$(dirname "$(find / -name 'libcublasLt.so.13' 2>/dev/null | head -1)")
export LD_LIBRARY_PATH="$CU13:${LD_LIBRARY_PATH:-}"
for b in tandem multi_client_load device-tests; do
  [ -f "$BIN/$b.gz" ] && [ ! -x /tmp/bin/$b ] && gunzip -c "$BIN/$b.gz" >/tmp/bin/$b && chmod +x /tmp/bin/$b
done
nvidia-smi -L

# Waits for the detached trainings (logs /tmp/train*.log, /tmp/train*.rc
# at the end), up to $1 seconds; true when all have ended.
TRAININGS=(train)
[ -n "${TRAIN2_ARGS:-}" ] && TRAININGS+=(train2)
trainings_done() {
  local t
  for t in "${TRAININGS[@]}"; do [ -f /tmp/$t.rc ] || return 1; done
}
wait_training() {
  local waited=0 t
  while ! trainings_done && [ "$waited" -lt "$1" ]; do sleep 10; waited=$((waited + 10)); done
  for t in "${TRAININGS[@]}"; do
    echo "--- $t"
    grep -v '^\s*$' /tmp/$t.log | tail -40
    [ -f /tmp/$t.rc ] && echo "train-mtp exit status $(cat /tmp/$t.rc)"
  done
  trainings_done
}
# Saves each head (gzipped: the output limit is 16 MiB a file) and report to $OUT.
save_heads() {
  gzip -c "$HEAD/mtp.safetensors" >"$OUT/mtp.safetensors.gz"
  cp "$HEAD"/mtp_training.json /tmp/train.log "$OUT/" 2>/dev/null
  if [ -n "${TRAIN2_ARGS:-}" ]; then
    mkdir -p "$OUT/head2"
    gzip -c "$HEAD2/mtp.safetensors" >"$OUT/head2/mtp.safetensors.gz"
    cp "$HEAD2"/mtp_training.json /tmp/train2.log "$OUT/head2/" 2>/dev/null
  fi
}

# Held-out acceptance of the new head and, when .devdata/head brought one,
# the old head, on the chat and edit prompts; once a machine (the train
# call's, when training ended in it, or the bench call's).
eval_heads() {
  [ -f /tmp/heads-evaluated ] && return
  touch /tmp/heads-evaluated
  for head in "$HEAD" "$HEAD2" /tmp/old-head; do
    [ -f "$head/mtp.safetensors" ] || continue
    for p in chat edit; do
      echo "=== eval-mtp $head on ${p}_prompts.txt"
      /tmp/bin/tandem eval-mtp --device cuda --model "$MODEL" --head "$head" \
        --prompts bench/spec/${p}_prompts.txt --seq-len 256 2>&1 | grep -v INFO
    done
  done
}

# start_training NAME DIR ARGS: train-mtp detached (setsid: it outlives
# the call), log /tmp/NAME.log, exit status /tmp/NAME.rc.
start_training() {
  rm -f /tmp/$1.rc
  setsid bash -c "{ time /tmp/bin/tandem train-mtp --device cuda --model '$MODEL' \
    --out '$2' --steps $STEPS --batch 32 --seq-len 256 --train-seqs $TRAIN_SEQS \
    --heldout-seqs ${HELDOUT_SEQS:-64} --temperature 0.8 --draft-vocab 8192 --eval-every 250 \
    --checkpoint-every 250 --draft-positions 6 --seed 0 $3; } </dev/null >/tmp/$1.log 2>&1; echo \$? >/tmp/$1.rc" </dev/null >/dev/null 2>&1 &
}

if [ "$PHASE" = train ] || [ "$PHASE" = all ]; then
  echo "=== train-mtp on cuda: $STEPS steps, $TRAIN_SEQS sequences (detached)"
  start_training train "$HEAD" "${TRAIN_ARGS:-}"
  # TRAIN2_ARGS: a second head trained at the same time on the same data
  # (same prompts and seed), e.g. the same recipe with another option.
  [ -n "${TRAIN2_ARGS:-}" ] && start_training train2 "$HEAD2" "$TRAIN2_ARGS"
  if [ "$PHASE" = train ]; then
    # Save the heads now: the bench call may come after the machine is gone.
    # A training still running at $WAIT still leaves its last checkpoint.
    if wait_training "$WAIT"; then save_heads && eval_heads
    elif [ -f "$HEAD/mtp.safetensors" ]; then save_heads; fi
    exit 0
  fi
fi

if [ "${SKIP_TRAIN:-0}" != 1 ]; then
  wait_training "$WAIT" || { echo "training still running"; exit 1; }
  save_heads
  # A training that outlived the train call is measured here.
  eval_heads
elif [ ! -f "$HEAD/mtp.safetensors" ] && [ -f "$BIN/mtp.safetensors.gz" ]; then
  mkdir -p "$HEAD" && gunzip -c "$BIN/mtp.safetensors.gz" >"$HEAD/mtp.safetensors"
fi

L=/tmp/bin/multi_client_load
R=${REPEAT:-3}
CHAT="--prompts bench/spec/chat_prompts.txt --max-tokens 96"
if [ "$PHASE" = trace ]; then
  # Where speculation's time goes at 16 and 64 streams: every step and
  # decode pass traced (bench/spec/pass_trace.py); with GRAPHS_OFF=1 the
  # same rows again with CUDA graphs off.
  n=0
  trace() {
    echo "=== trace: $*"
    n=$((n + 1))
    RUST_LOG=tandem::engine::executor=debug,tandem::engine::policy=debug timeout 150 "$L" \
      --device cuda --dtype bf16 --model "$MODEL" --show-answers 0 "$@" 2>&1 \
      | tee >(gzip >"$OUT/trace-$n.log.gz") | python3 bench/spec/pass_trace.py
  }
  if [ -n "${TRACE_ROW:-}" ]; then
    # One row only, e.g. TRACE_ROW="--clients 256 --max-seqs 64".
    trace $CHAT $TRACE_ROW --mtp "head:$HEAD" --prompt-lookup --mtp-compare --repeat ${REPEAT:-1}
    exit 0
  fi
  trace $CHAT --clients 16 --max-seqs 16 --mtp "head:$HEAD" --prompt-lookup --mtp-compare --repeat 1
  trace $CHAT --clients 16 --max-seqs 16 --prompt-lookup --mtp-compare --repeat 1
  trace $CHAT --clients 16 --max-seqs 16 --mtp "head:$HEAD" --mtp-compare --repeat 1
  trace $CHAT --clients 64 --max-seqs 64 --mtp "head:$HEAD" --prompt-lookup --mtp-compare --repeat 1
  if [ "${GRAPHS_OFF:-0}" = 1 ]; then
    for rows in "--clients 16 --max-seqs 16" "--clients 64 --max-seqs 64"; do
      echo "=== graphs off: $rows"
      TANDEM_CUDA_GRAPHS=0 timeout 150 "$L" --device cuda --dtype bf16 --model "$MODEL" --show-answers 0 \
        $CHAT $rows --mtp "head:$HEAD" --prompt-lookup --mtp-compare --repeat $R 2>&1 | grep -E 'MTP:|medians|on / off'
    done
  fi
  exit 0
fi

if [ -x /tmp/bin/device-tests ]; then
  echo "=== GPU tests"
  TANDEM_SHARED_DIR=$(realpath "$BIN/shared") TANDEM_REQUIRE_GPU=1 timeout 300 \
    /tmp/bin/device-tests --test-threads 1 --nocapture 2>&1 | grep -E '^test |test result|graphs|panicked|assert'
fi

# With $BIN/multi_client_load-before.gz (an earlier build), every row runs
# with it and then with this one: an A/B alternating per row.
LOADS=$L
if [ -f "$BIN/multi_client_load-before.gz" ]; then
  gunzip -c "$BIN/multi_client_load-before.gz" >/tmp/bin/before && chmod +x /tmp/bin/before
  LOADS="/tmp/bin/before $L"
fi
run() {
  for l in $LOADS; do
    echo "=== [$(basename "$l")] $* $WARM_ARGS"
    timeout 150 "$l" --device cuda --dtype bf16 --model "$MODEL" --show-answers 0 "$@" $WARM_ARGS 2>&1 | grep -E 'MTP|medians|aggregate|engine time|ceiling'
  done
}
# WARM=1: the rows with warm engines (the load example's --warm: one engine
# per configuration for all runs, the workload once untimed first, prefix
# cache off since the prompts repeat); WARM=both: every row fresh, then warm.
rows() {
  run $CHAT --clients 16 --max-seqs 1 --mtp "head:$HEAD" --mtp-compare --repeat $R
  run $CHAT --clients 16 --max-seqs 1 --mtp early-exit:1 --mtp-compare --repeat $R
  run $CHAT --clients 16 --max-seqs 16 --mtp "head:$HEAD" --mtp-compare --repeat $R
  run --prompts bench/spec/edit_prompts.txt --clients 8 --max-seqs 1 --max-tokens 96 --prompt-lookup --mtp-compare --repeat $R
  run --prompts bench/spec/edit_prompts.txt --clients 8 --max-seqs 1 --max-tokens 96 --mtp "head:$HEAD" --prompt-lookup --mtp-compare --repeat $R
  run $CHAT --clients 16 --max-seqs 16 --mtp "head:$HEAD" --prompt-lookup --mtp-compare --repeat $R
  run $CHAT --clients 64 --max-seqs 64 --mtp "head:$HEAD" --prompt-lookup --mtp-compare --repeat $R
  # Longer runs (eight and four waves): one-time costs (graph captures, a
  # first eager verification) weigh less than in 0.2 s runs.
  run $CHAT --clients 128 --max-seqs 16 --mtp "head:$HEAD" --prompt-lookup --mtp-compare --repeat $R
  run $CHAT --clients 256 --max-seqs 64 --mtp "head:$HEAD" --prompt-lookup --mtp-compare --repeat $R
}
# ROWS=short: the issue's four rows only (one stream chat and edit, 16
# and 64 streams), for a call that also waits for a training.
short_rows() {
  run $CHAT --clients 16 --max-seqs 1 --mtp "head:$HEAD" --mtp-compare --repeat $R
  run --prompts bench/spec/edit_prompts.txt --clients 8 --max-seqs 1 --max-tokens 96 --mtp "head:$HEAD" --prompt-lookup --mtp-compare --repeat $R
  run $CHAT --clients 16 --max-seqs 16 --mtp "head:$HEAD" --prompt-lookup --mtp-compare --repeat $R
  run $CHAT --clients 64 --max-seqs 64 --mtp "head:$HEAD" --prompt-lookup --mtp-compare --repeat $R
}
# ROWS=long: one stream on the long code edits (20-line files returned
# whole: prompt lookup's workload) with lookup alone; where a head is at
# $HEAD, the same with it and the chat row with it.
LONG="--prompts bench/spec/edit_long_prompts.txt --clients 8 --max-seqs 1 --max-tokens 320"
long_rows() {
  run $LONG --prompt-lookup --mtp-compare --repeat $R
  [ -f "$HEAD/mtp.safetensors" ] || return 0
  run $LONG --mtp "head:$HEAD" --prompt-lookup --mtp-compare --repeat $R
  run $CHAT --clients 16 --max-seqs 1 --mtp "head:$HEAD" --mtp-compare --repeat $R
}
case "${ROWS:-all}" in
  all) ROW_SET=rows ;; short) ROW_SET=short_rows ;; long) ROW_SET=long_rows ;; *) ROW_SET="" ;;
esac
if [ -n "$ROW_SET" ]; then
  case "${WARM:-0}" in
    0) WARM_ARGS="" $ROW_SET ;;
    1) WARM_ARGS="--warm --no-prefix-cache" $ROW_SET ;;
    both) WARM_ARGS="" $ROW_SET; WARM_ARGS="--warm --no-prefix-cache" $ROW_SET ;;
  esac
fi
WARM_ARGS=""
# HEAD_GRAPHS_AB=1: the head rows again with the head's rounds captured
# (TANDEM_HEAD_GRAPHS=1) and eager (0), alternating, two rounds.
if [ "${HEAD_GRAPHS_AB:-0}" = 1 ] || [ "${ROWS:-all}" = head ]; then
  for round in 1 2; do
    for g in 1 0; do
      export TANDEM_HEAD_GRAPHS=$g
      echo "=== head graphs $g, round $round"
      run $CHAT --clients 16 --max-seqs 1 --mtp "head:$HEAD" --mtp-compare --repeat $R
      run --prompts bench/spec/edit_prompts.txt --clients 8 --max-seqs 1 --max-tokens 96 --mtp "head:$HEAD" --prompt-lookup --mtp-compare --repeat $R
      run $CHAT --clients 16 --max-seqs 16 --mtp "head:$HEAD" --mtp-compare --repeat $R
    done
  done
  unset TANDEM_HEAD_GRAPHS
fi
echo "=== done"
