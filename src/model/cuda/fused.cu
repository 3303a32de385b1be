// Fused element-wise steps of Tandem's GPU forward pass (see
// src/model/fused.rs): each replaces two candle launches by one, and rounds
// once where the two ops rounded twice.

#include <stdint.h>

#include "dtype.cuh"

// Sum over the block (blockDim.x a multiple of 32); every thread gets it.
__device__ float block_sum(float x, float *red) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
    if (lane == 0) red[warp] = x;
    __syncthreads();
    x = (threadIdx.x < (blockDim.x >> 5)) ? red[threadIdx.x] : 0.f;
    if (warp == 0) {
        for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
        if (lane == 0) red[0] = x;
    }
    __syncthreads();
    return red[0];
}

// Elements of a row one thread keeps in registers (d <= blockDim * this;
// the host checks).
#define ITEMS 16

// One block per row: out[0] = x + y (the residual stream, rounded to T),
// out[1] = RMSNorm(out[0]) * w, with candle's rms_norm arithmetic (f32 sum
// of squares, scale * x * w). Each thread loads its elements of x, y and w
// at once and keeps the sums in registers, so a row costs one round trip
// to memory and one reduction.
template <typename T>
__device__ void add_rms_norm(const T *x, const T *y, const T *w, T *out, uint32_t n, uint32_t d,
                             float eps) {
    __shared__ float red[32];
    const size_t row = blockIdx.x;
    const T *xr = x + row * d, *yr = y + row * d;
    T *sum = out + row * d, *normed = out + (size_t)n * d + row * d;
    float s[ITEMS], wv[ITEMS];
    float local = 0.f;
#pragma unroll
    for (uint32_t j = 0; j < ITEMS; ++j) {
        const uint32_t i = threadIdx.x + j * blockDim.x;
        if (i < d) {
            const T r = from_f32<T>(to_f32(xr[i]) + to_f32(yr[i]));
            wv[j] = to_f32(w[i]);
            sum[i] = r;
            s[j] = to_f32(r);
            local += s[j] * s[j];
        }
    }
    const float scale = rsqrtf(block_sum(local, red) / (float)d + eps);
#pragma unroll
    for (uint32_t j = 0; j < ITEMS; ++j) {
        const uint32_t i = threadIdx.x + j * blockDim.x;
        if (i < d) normed[i] = from_f32<T>(scale * s[j] * wv[j]);
    }
}

// out[t, j] = silu(gu[t, j]) * gu[t, inter + j] for the fused gate/up rows.
template <typename T>
__device__ void silu_mul(const T *gu, T *out, uint32_t n, uint32_t inter) {
    const size_t total = (size_t)n * inter;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < total;
         i += (size_t)blockDim.x * gridDim.x) {
        const size_t t = i / inter, j = i % inter;
        const float g = to_f32(gu[t * 2 * inter + j]);
        const float u = to_f32(gu[t * 2 * inter + inter + j]);
        out[i] = from_f32<T>(g / (1.f + expf(-g)) * u);
    }
}

// One block per row: an MTP head's input row [rms_norm(embed[ids[row]]) *
// enorm, rms_norm(hidden[row]) * hnorm] (2d wide), with candle's rms_norm
// arithmetic as add_rms_norm has it: the gather, both norms and the
// concatenation in one launch instead of five.
template <typename T>
__device__ void mtp_input(const uint32_t *ids, const T *embed, const T *hidden, const T *enorm,
                          const T *hnorm, T *out, uint32_t d, float eps) {
    __shared__ float red_e[32], red_h[32];
    const size_t row = blockIdx.x;
    const T *er = embed + (size_t)ids[row] * d, *hr = hidden + row * d;
    T *o = out + row * 2 * (size_t)d;
    float e[ITEMS], h[ITEMS];
    float se = 0.f, sh = 0.f;
#pragma unroll
    for (uint32_t j = 0; j < ITEMS; ++j) {
        const uint32_t i = threadIdx.x + j * blockDim.x;
        if (i < d) {
            e[j] = to_f32(er[i]);
            h[j] = to_f32(hr[i]);
            se += e[j] * e[j];
            sh += h[j] * h[j];
        }
    }
    const float scale_e = rsqrtf(block_sum(se, red_e) / (float)d + eps);
    const float scale_h = rsqrtf(block_sum(sh, red_h) / (float)d + eps);
#pragma unroll
    for (uint32_t j = 0; j < ITEMS; ++j) {
        const uint32_t i = threadIdx.x + j * blockDim.x;
        if (i < d) {
            o[i] = from_f32<T>(scale_e * e[j] * to_f32(enorm[i]));
            o[d + i] = from_f32<T>(scale_h * h[j] * to_f32(hnorm[i]));
        }
    }
}

#define FUSED_KERNELS(SUFFIX, T)                                                               \
    extern "C" __global__ void add_rms_norm_##SUFFIX(const T *x, const T *y, const T *w,       \
                                                     T *out, uint32_t n, uint32_t d,           \
                                                     float eps) {                              \
        add_rms_norm<T>(x, y, w, out, n, d, eps);                                              \
    }                                                                                          \
    extern "C" __global__ void silu_mul_##SUFFIX(const T *gu, T *out, uint32_t n,              \
                                                 uint32_t inter) {                             \
        silu_mul<T>(gu, out, n, inter);                                                        \
    }                                                                                          \
    extern "C" __global__ void mtp_input_##SUFFIX(const uint32_t *ids, const T *embed,         \
                                                  const T *hidden, const T *enorm,             \
                                                  const T *hnorm, T *out, uint32_t d,          \
                                                  float eps) {                                 \
        mtp_input<T>(ids, embed, hidden, enorm, hnorm, out, d, eps);                           \
    }

FUSED_KERNELS(f32, float)
FUSED_KERNELS(f16, __half)
FUSED_KERNELS(bf16, __nv_bfloat16)
