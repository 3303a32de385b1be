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

#define FUSED_KERNELS(SUFFIX, T)                                                               \
    extern "C" __global__ void add_rms_norm_##SUFFIX(const T *x, const T *y, const T *w,       \
                                                     T *out, uint32_t n, uint32_t d,           \
                                                     float eps) {                              \
        add_rms_norm<T>(x, y, w, out, n, d, eps);                                              \
    }                                                                                          \
    extern "C" __global__ void silu_mul_##SUFFIX(const T *gu, T *out, uint32_t n,              \
                                                 uint32_t inter) {                             \
        silu_mul<T>(gu, out, n, inter);                                                        \
    }

FUSED_KERNELS(f32, float)
FUSED_KERNELS(f16, __half)
FUSED_KERNELS(bf16, __nv_bfloat16)
