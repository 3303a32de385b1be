#!/usr/bin/env bash
# Issue 17's H200 half of "block-table attention costs <= 3 % of decode":
# the forward bench of the tree before the paged KV merge (`447294f^1`) and
# of the current tree, both release builds with `--features cuda`, run
# alternately on the same GPU (3 rounds, the first binary swapped each
# round; ROUNDS=N for more), f32 and bf16, llama-100m shape, random weights, B = 1 and 64.
#
# Expects $BIN/forward-old and $BIN/forward-new (see README "GPU" for the
# build; `git worktree add --detach ../old 447294f^1` for the old tree).
set -uo pipefail
BIN=${BIN:-.devbin}
CU13=$(python3 -c 'import nvidia.cu13 as m; print(m.__path__[0])' 2>/dev/null)/lib
[ -f "$CU13/libcublasLt.so.13" ] || CU13=$(dirname "$(find / -name 'libcublasLt.so.13' 2>/dev/null | head -1)")
export LD_LIBRARY_PATH="$CU13:${LD_LIBRARY_PATH:-}"
nvidia-smi -L
run() {
  TANDEM_BENCH_DEVICE=cuda TANDEM_BENCH_FORMATS=${FORMATS:-f32,bf16} TANDEM_BENCH_BATCHES=1,64 \
    TANDEM_BENCH_REPS=1 TANDEM_BENCH_STEPS=${STEPS:-128} "$BIN/forward-$1" --bench 2>&1 \
    | grep -v "^ *$" | sed "s/^/[$1] /"
}
for round in $(seq 1 "${ROUNDS:-3}"); do
  echo "=== round $round"
  if [ $((round % 2)) = 1 ]; then run old; run new; else run new; run old; fi
done
