#!/usr/bin/env bash
# Issue 22: the B = 1 cells that read below llama.cpp in some rounds of the
# full sittings (isa_sitting.sh), alone: Tandem's forward bench and
# llama-batched-bench alternating per cell (who goes first alternating by
# round), ROUNDS rounds, 2 threads, 128-token prompt, 64 decode steps.
#   ROUNDS=8 CELLS="llama-100m:f32:avx512 smollm2:f16:avx2" FWD=forward BIN=dir bash bench/cpu/b1_cells_sitting.sh
# BIN as isa_sitting.sh's (llama-batched-bench, llama-avx2/, llama-avx512/);
# MODELS holds its files (isa_sitting.sh makes them).
BIN=${BIN:?BIN: the folder of binaries}; FWD=${FWD:?FWD: the forward bench}; MODELS=${MODELS:-/tmp/isa-models}; STEPS=64
export LD_LIBRARY_PATH=$BIN/llama-avx2
tandem() { # shape fmt isa
  local file=$MODELS/$1-f32.gguf formats=$2 e=X=0
  [ $3 = avx2 ] && e=TANDEM_CPU_ISA=avx2
  env $e TANDEM_BENCH_MODEL=$file TANDEM_BENCH_FORMATS=$formats TANDEM_BENCH_BATCHES=1 TANDEM_BENCH_REPS=1 \
    TANDEM_BENCH_STEPS=$STEPS TANDEM_BENCH_THREADS=2 $FWD --bench 2>&1 | grep -E '^\| (f32|f16) ' | awk -F'|' '{gsub(/ /,"",$3); print $3}'
}
llama() {
  local file=$MODELS/$1-f32.gguf libs=$BIN/llama-avx2
  [ $2 = f16 ] && file=$MODELS/$1-F16.gguf
  [ $3 = avx512 ] && libs=$BIN/llama-avx512:$BIN/llama-avx2
  LD_LIBRARY_PATH=$libs $BIN/llama-batched-bench -m $file -npp 128 -ntg $STEPS -npl 1 -t 2 -fa on -c 4096 2>&1 | grep -E '^\|' | tail -1 | awk -F'|' '{gsub(/ /,"",$9); print $9}'
}
echo "# $(date -u '+%F %T') B=1 sitting, $FWD vs llama.cpp ($BIN), cells: $CELLS"
for r in $(seq 1 $ROUNDS); do
  for cell in $CELLS; do
    IFS=: read shape fmt isa <<<"$cell"
    if (( r % 2 )); then t=$(tandem $shape $fmt $isa); l=$(llama $shape $fmt $isa)
    else l=$(llama $shape $fmt $isa); t=$(tandem $shape $fmt $isa); fi
    echo "r$r $shape $fmt $isa tandem $t llama $l ratio $(python3 -c "print(round($t/$l,3))")"
  done
done
