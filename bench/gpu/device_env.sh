# Sourced by the device scripts (ab_env.sh, ncu_kernels.sh,
# ncu_attention.sh): $LOGS made, the CUDA 13 runtime of the device's pip
# wheel (or wherever libcublasLt.so.13 lies) on the library path, and
# TANDEM_SHARED_DIR at the carried shared folder ($BIN/shared, BIN
# defaulting to .devbin).
LOGS=${LOGS:-/tmp/tandem-logs}
mkdir -p "$LOGS"
CU13=$(python3 -c 'import nvidia.cu13 as m; print(m.__path__[0])' 2>/dev/null)/lib
[ -f "$CU13/libcublasLt.so.13" ] || CU13=$(dirname "$(find / -name 'libcublasLt.so.13' 2>/dev/null | head -1)")
export LD_LIBRARY_PATH="$CU13:${LD_LIBRARY_PATH:-}"
export TANDEM_SHARED_DIR=$(realpath "${BIN:-.devbin}/shared")
