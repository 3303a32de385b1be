#!/usr/bin/env bash
# Issue 22: the B = 1 cells that read below llama.cpp in some rounds of the
# full sittings (isa_sitting.sh), alone: Tandem's forward bench and
# llama-batched-bench alternating per cell (who goes first alternating by
# round), ROUNDS rounds, 2 threads on CORES (0,1), 128-token prompt, 64
# decode steps; the engines run as isa_sitting.sh runs them (engines.sh).
#   ROUNDS=8 CELLS="llama-100m:f32:avx512 smollm2:f16:avx2" FWD=forward BIN=dir bash bench/cpu/b1_cells_sitting.sh
# BIN as isa_sitting.sh's (llama-batched-bench, llama-avx2/, llama-avx512/);
# MODELS holds its files (isa_sitting.sh makes them).
BIN=${BIN:?BIN: the folder of binaries}; FWD=${FWD:?FWD: the forward bench}
MODELS=${MODELS:-/tmp/isa-models}; STEPS=64; CORES=${CORES:-0,1}
# shellcheck source=engines.sh
. "$(dirname "$0")/engines.sh"
# The decode tok/s at B = 1 of each engine's output.
tandem_b1() { tandem "$@" "$CORES" 1 | grep -E '^\| (f32|f16) ' | awk -F'|' '{gsub(/ /,"",$3); print $3}'; }
llama_b1() { llama "$@" "$CORES" 1 4096 | tail -1 | awk -F'|' '{gsub(/ /,"",$9); print $9}'; }
echo "# $(date -u '+%F %T') B=1 sitting, $FWD vs llama.cpp ($BIN), cells: $CELLS"
for r in $(seq 1 $ROUNDS); do
  for cell in $CELLS; do
    IFS=: read shape fmt isa <<<"$cell"
    if (( r % 2 )); then t=$(tandem_b1 $shape $fmt $isa); l=$(llama_b1 $shape $fmt $isa)
    else l=$(llama_b1 $shape $fmt $isa); t=$(tandem_b1 $shape $fmt $isa); fi
    echo "r$r $shape $fmt $isa tandem $t llama $l ratio $(python3 -c "print(round($t/$l,3))")"
  done
done
