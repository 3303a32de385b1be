# Sourced by the two-build A/B scripts (head_round_ab.sh, rows_ab.sh) after
# they set BIN's default: runs h200_head.sh's bench phase without its own
# rows (GPU tests, model and head unpacked, the new build in /tmp/bin),
# sends everything after to $OUT/ab.log as well, finds the CUDA libraries,
# and unpacks the other build as /tmp/bin/before.
set -uo pipefail
OUT=${OUT:-/tmp/tandem-out}
PHASE=bench SKIP_TRAIN=1 ROWS=none BIN=$BIN bash bench/spec/h200_head.sh
exec > >(tee -a "$OUT/ab.log") 2>&1
export LD_LIBRARY_PATH=$(dirname "$(find / -name 'libcublasLt.so.13' 2>/dev/null | head -1)")
gunzip -c "$BIN/multi_client_load-before.gz" >/tmp/bin/before && chmod +x /tmp/bin/before
