// Small-batch projections for Tandem's GPU decode (see src/model/gemv.rs):
// y[t, j] = sum_i x[t, i] * w[j, i] for the M <= 9 rows of a decode step
// (or, batch-invariant mode, any rows in chunks of M), with w
// the [n, k] row-major weights. A decode step reads every weight
// once and does almost no arithmetic with it, so what counts is bytes in
// flight: each output row belongs to `split` warps of one block (the
// host's choice from n and k, so small matrices still fill the GPU), each
// warp a contiguous span of the row, each lane 16-byte packs of it, UNROLL
// packs loaded before any is used. All M rows of x are applied to a pack
// while it is in registers (x is a few KiB, served by L1/L2).
//
// Sums are f32, in a fixed order per output: each lane's packs in order, a
// warp tree, then the row's warps in order. Nothing in it depends on M, so
// a row's output is the same bits whichever other rows share the launch
// (batch invariance up to 9 rows). The output is rounded to T once.
//
// Norm prologue (norm_w set): the input rows are rms_norm(x + addend) *
// norm_w (addend optional), which each block computes into shared memory
// (the host checks they fit) with its first weight packs already loading,
// so the prologue hides behind the latency of those loads; block 0 also
// writes the residual sum x + addend. So the residual add and RMSNorm
// before a projection need no launch of their own. The arithmetic is the
// add_rms_norm kernel's (fused.cu: the sum rounded to T, an f32 sum of
// squares, scale * x * w rounded to T) with the squares summed in another
// order; the host folds a projection's norm for every row count or for
// none, so a row's bits still never depend on its batch.
//
// SWIGLU: w is the fused gate/up projection [2n, k] (gate rows, then up
// rows) and output j sums both row j and row n + j, then writes silu(gate)
// * up with each rounded to T first, as the separate silu_mul kernel
// computes it from the projection's rows: the MLP's activation needs no
// launch of its own.

#include <stdint.h>

#include "dtype.cuh"

#define UNROLL 4
#define WARPS 8

// Writes the M normed input rows rms_norm(x + addend) * norm_w, rounded to
// T, to xs ([M, k] in shared memory, then norm_w's k); block 0 also writes
// the sums to `residual` when there is an addend. One pass loads x, addend
// and norm_w in 16-byte packs (one round trip to L2), keeps the sums
// rounded to T and the norm weights in shared memory and sums the squares
// (f32: each thread's packs in order, a warp tree, the warps in order;
// nothing depends on M, so every row's bits are the same in any batch); a
// second pass, in shared memory only, scales them.
template <typename T, uint32_t M>
__device__ void normed_rows(const T *x, const T *addend, T *residual, const T *norm_w,
                            uint32_t k, float eps, T *xs) {
    constexpr uint32_t N = Pack<T>::N;
    __shared__ float squares[WARPS][M];
    __shared__ float scale[M];
    const uint32_t lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    T *nws = xs + (size_t)M * k;
    float ss[M];
#pragma unroll
    for (uint32_t t = 0; t < M; ++t) ss[t] = 0.f;
    for (uint32_t i = threadIdx.x * N; i < k; i += blockDim.x * N) {
        *(uint4 *)(nws + i) = Pack<T>::raw(norm_w + i);
#pragma unroll
        for (uint32_t t = 0; t < M; ++t) {
            const size_t at = (size_t)t * k + i;
            float v[N];
            Pack<T>::load(x + at, v);
            if (addend) {
                float a[N];
                Pack<T>::load(addend + at, a);
#pragma unroll
                for (uint32_t e = 0; e < N; ++e) v[e] = to_f32(from_f32<T>(v[e] + a[e]));
            }
            T sum[N];
#pragma unroll
            for (uint32_t e = 0; e < N; ++e) {
                sum[e] = from_f32<T>(v[e]);
                ss[t] += v[e] * v[e];
            }
            *(uint4 *)(xs + at) = *(const uint4 *)sum;
            if (addend && blockIdx.x == 0) *(uint4 *)(residual + at) = *(const uint4 *)sum;
        }
    }
#pragma unroll
    for (uint32_t t = 0; t < M; ++t) {
        for (int o = 16; o > 0; o >>= 1) ss[t] += __shfl_xor_sync(0xffffffffu, ss[t], o);
        if (lane == 0) squares[warp][t] = ss[t];
    }
    __syncthreads();
    if (threadIdx.x < M) {
        float total = 0.f;
        for (uint32_t w = 0; w < WARPS; ++w) total += squares[w][threadIdx.x];
        scale[threadIdx.x] = rsqrtf(total / (float)k + eps);
    }
    __syncthreads();
    for (uint32_t i = threadIdx.x * N; i < k; i += blockDim.x * N) {
        float nw[N];
        Pack<T>::load(nws + i, nw);
#pragma unroll
        for (uint32_t t = 0; t < M; ++t) {
            float v[N];
            Pack<T>::load(xs + (size_t)t * k + i, v);
            T out[N];
#pragma unroll
            for (uint32_t e = 0; e < N; ++e) out[e] = from_f32<T>(scale[t] * v[e] * nw[e]);
            *(uint4 *)(xs + (size_t)t * k + i) = *(const uint4 *)out;
        }
    }
    __syncthreads();
}

// Loads this lane's UNROLL packs of weight rows j (and n + j with R = 2)
// from element `base` of the warp's span [.., end).
template <typename T, uint32_t R>
__device__ __forceinline__ void load_packs(const T *w, uint32_t n, uint32_t k, uint32_t j,
                                           uint32_t base, uint32_t end, uint4 (&raw)[UNROLL][R]) {
    constexpr uint32_t N = Pack<T>::N;
#pragma unroll
    for (uint32_t u = 0; u < UNROLL; ++u) {
        const uint32_t i = base + u * 32 * N;
#pragma unroll
        for (uint32_t r = 0; r < R; ++r) {
            if (i < end) raw[u][r] = Pack<T>::raw(w + ((size_t)r * n + j) * k + i);
        }
    }
}

template <typename T, uint32_t M, bool SWIGLU>
__device__ void gemv(const T *x, const T *w, T *y, uint32_t n, uint32_t k, uint32_t split,
                     const T *addend, const T *norm_w, float eps, T *residual) {
    constexpr uint32_t N = Pack<T>::N;
    constexpr uint32_t R = SWIGLU ? 2 : 1;  // weight rows per output
    __shared__ float part[WARPS][R][M];
    extern __shared__ __align__(16) unsigned char normed[];  // [M, k] T with a norm
    const uint32_t lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const uint32_t piece = warp % split;
    // This warp's span of a row: whole passes of 32 packs.
    const uint32_t passes = (k + 32 * N - 1) / (32 * N);
    const uint32_t per_warp = (passes + split - 1) / split;
    const uint32_t begin = piece * per_warp * 32 * N, end = min(k, begin + per_warp * 32 * N);
    // Blocks stride over groups of WARPS / split rows (a block computes
    // its normed rows once, however many groups it takes).
    const uint32_t groups = (n + WARPS / split - 1) / (WARPS / split);
    // The first packs of the block's first group are in flight before the
    // norm prologue: they do not depend on it, and a launch's weight
    // stream then starts as early as it would without a norm.
    uint4 raw[UNROLL][R];
    bool loaded = false;
    if (blockIdx.x < groups) {
        const uint32_t j = blockIdx.x * (WARPS / split) + warp / split;
        if (j < n && begin + lane * N < end) {
            load_packs<T, R>(w, n, k, j, begin + lane * N, end, raw);
            loaded = true;
        }
    }
    if (norm_w) {
        normed_rows<T, M>(x, addend, residual, norm_w, k, eps, (T *)normed);
        x = (const T *)normed;
    }
    for (uint32_t group = blockIdx.x; group < groups; group += gridDim.x) {
        const uint32_t j = group * (WARPS / split) + warp / split;
        float acc[R][M];
#pragma unroll
        for (uint32_t r = 0; r < R; ++r) {
#pragma unroll
            for (uint32_t t = 0; t < M; ++t) acc[r][t] = 0.f;
        }
        if (j < n) {
            for (uint32_t base = begin + lane * N; base < end; base += UNROLL * 32 * N) {
                if (!loaded) load_packs<T, R>(w, n, k, j, base, end, raw);
                loaded = false;
#pragma unroll
                for (uint32_t u = 0; u < UNROLL; ++u) {
                    const uint32_t i = base + u * 32 * N;
                    if (i >= end) break;
                    float wv[R][N];
#pragma unroll
                    for (uint32_t r = 0; r < R; ++r) Pack<T>::unpack(raw[u][r], wv[r]);
#pragma unroll
                    for (uint32_t t = 0; t < M; ++t) {
                        float xv[N];
                        Pack<T>::load(x + (size_t)t * k + i, xv);
#pragma unroll
                        for (uint32_t r = 0; r < R; ++r) {
#pragma unroll
                            for (uint32_t e = 0; e < N; ++e) {
                                acc[r][t] = fmaf(wv[r][e], xv[e], acc[r][t]);
                            }
                        }
                    }
                }
            }
        }
#pragma unroll
        for (uint32_t r = 0; r < R; ++r) {
#pragma unroll
            for (uint32_t t = 0; t < M; ++t) {
                for (int o = 16; o > 0; o >>= 1) {
                    acc[r][t] += __shfl_xor_sync(0xffffffffu, acc[r][t], o);
                }
                if (lane == 0) part[warp][r][t] = acc[r][t];
            }
        }
        __syncthreads();
        // Thread t of the row's first warp sums the row's pieces in order.
        if (piece == 0 && lane < M && j < n) {
            float out[R];
#pragma unroll
            for (uint32_t r = 0; r < R; ++r) {
                out[r] = 0.f;
                for (uint32_t p = 0; p < split; ++p) out[r] += part[warp + p][r][lane];
            }
            float v = out[0];
            if (SWIGLU) {
                const float g = to_f32(from_f32<T>(out[0]));
                const float u = to_f32(from_f32<T>(out[R - 1]));
                v = g / (1.f + expf(-g)) * u;
            }
            y[(size_t)lane * n + j] = from_f32<T>(v);
        }
        __syncthreads();  // `part` is read before the next group writes it
    }
}

// Chunk blockIdx.y of a launch takes rows row0 + M * blockIdx.y onwards
// (its x, y, addend and residual rows), so one launch covers any multiple
// of M rows (batch-invariant mode), each chunk summed as a launch of M
// rows alone would.
template <typename T, uint32_t M, bool SWIGLU>
__device__ void gemv_chunk(const T *x, const T *w, T *y, uint32_t n, uint32_t k, uint32_t split,
                           const T *addend, const T *norm_w, float eps, T *residual,
                           uint32_t row0) {
    const size_t first = (size_t)row0 + (size_t)M * blockIdx.y;
    gemv<T, M, SWIGLU>(x + first * k, w, y + first * n, n, k, split,
                       addend ? addend + first * k : addend, norm_w, eps,
                       residual ? residual + first * k : residual);
}

#define GEMV_KERNEL(SUFFIX, T, M)                                                              \
    extern "C" __global__ void gemv_##SUFFIX##_m##M(                                          \
        const T *x, const T *w, T *y, uint32_t n, uint32_t k, uint32_t split,                  \
        const T *addend, const T *norm_w, float eps, T *residual, uint32_t row0) {             \
        gemv_chunk<T, M, false>(x, w, y, n, k, split, addend, norm_w, eps, residual, row0);    \
    }                                                                                          \
    extern "C" __global__ void gemv_swiglu_##SUFFIX##_m##M(                                   \
        const T *x, const T *w, T *y, uint32_t n, uint32_t k, uint32_t split,                  \
        const T *addend, const T *norm_w, float eps, T *residual, uint32_t row0) {             \
        gemv_chunk<T, M, true>(x, w, y, n, k, split, addend, norm_w, eps, residual, row0);     \
    }

#define GEMV_KERNELS(SUFFIX, T)                                                                \
    GEMV_KERNEL(SUFFIX, T, 1)                                                                  \
    GEMV_KERNEL(SUFFIX, T, 2)                                                                  \
    GEMV_KERNEL(SUFFIX, T, 3)                                                                  \
    GEMV_KERNEL(SUFFIX, T, 4)                                                                  \
    GEMV_KERNEL(SUFFIX, T, 5)                                                                  \
    GEMV_KERNEL(SUFFIX, T, 6)                                                                  \
    GEMV_KERNEL(SUFFIX, T, 7)                                                                  \
    GEMV_KERNEL(SUFFIX, T, 8)                                                                  \
    GEMV_KERNEL(SUFFIX, T, 9)

GEMV_KERNELS(f32, float)
GEMV_KERNELS(f16, __half)
GEMV_KERNELS(bf16, __nv_bfloat16)
