# How issue 22's sittings run one cell on each engine; sourced by
# isa_sitting.sh and b1_cells_sitting.sh. Needs FWD (Tandem's forward
# bench, release), BIN (llama-batched-bench with its shared libraries in
# llama-avx2/ and llama-avx512/), MODELS (the GGUFs isa_sitting.sh makes)
# and STEPS. Both engines run 2 threads pinned to CORES, B sequences x
# 128-token prompts, STEPS decode steps.

# tandem SHAPE FORMAT ISA CORES BATCHES: the forward bench's output.
tandem() {
  local file="$MODELS/$1-$2.gguf" formats=as-stored isa_env=()
  case $2 in
    f32) file="$MODELS/$1-f32.gguf" ;;
    f16) file="$MODELS/$1-f32.gguf" formats=f16 ;;
  esac
  [ "$3" = avx2 ] && isa_env=(TANDEM_CPU_ISA=avx2)
  case $2 in Q8_0 | Q4_1) isa_env+=(TANDEM_BENCH_ROOFLINE=1) ;; esac
  env "${isa_env[@]}" TANDEM_BENCH_MODEL="$file" TANDEM_BENCH_FORMATS=$formats \
    TANDEM_BENCH_BATCHES="$5" TANDEM_BENCH_REPS=1 TANDEM_BENCH_STEPS="$STEPS" \
    TANDEM_BENCH_THREADS=2 CANDLE_CPU_MASK="$4" RAYON_NUM_THREADS=2 taskset -c "$4" \
    "$FWD" --bench 2>&1 | grep -vE '^\s*$'
}

# llama SHAPE FORMAT ISA CORES NPL CONTEXT: llama-batched-bench's table.
llama() {
  local file="$MODELS/$1-$2.gguf" libs="$BIN/llama-avx2"
  [ "$2" = f16 ] && file="$MODELS/$1-F16.gguf"
  [ "$3" = avx512 ] && libs="$BIN/llama-avx512:$BIN/llama-avx2"
  LD_LIBRARY_PATH="$libs" taskset -c "$4" "$BIN/llama-batched-bench" -m "$file" -npp 128 \
    -ntg "$STEPS" -npl "$5" -t 2 -fa on -c "$6" 2>&1 | grep -E '^\|'
}
