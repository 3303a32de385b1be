// Attention over the pooled KV cache for Tandem's GPU step (see
// src/model/pooled_attention.rs).
//
// Each query token reads its own sequence's keys straight from the pool:
// rows base + first ..= base + last of the layer's K and V buffers
// ([rows, kv_heads, head_dim], token-major), where `last` is the token's
// own position (causal) and `first` the start of its sliding window. No
// gather, no padding, no mask: the batch may be any mix of decodes, draft
// verifications and prefill chunks. Scores live in shared memory (the
// caller keeps keys within its budget); q arrives scaled.

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

template <typename T> __device__ __forceinline__ float to_f32(T x);
template <> __device__ __forceinline__ float to_f32<float>(float x) { return x; }
template <> __device__ __forceinline__ float to_f32<__half>(__half x) { return __half2float(x); }
template <> __device__ __forceinline__ float to_f32<__nv_bfloat16>(__nv_bfloat16 x) {
    return __bfloat162float(x);
}

template <typename T> __device__ __forceinline__ T from_f32(float x);
template <> __device__ __forceinline__ float from_f32<float>(float x) { return x; }
template <> __device__ __forceinline__ __half from_f32<__half>(float x) { return __float2half(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_f32<__nv_bfloat16>(float x) {
    return __float2bfloat16(x);
}

__device__ __forceinline__ float warp_max(float x) {
    for (int o = 16; o > 0; o >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
    return x;
}

__device__ __forceinline__ float warp_sum(float x) {
    for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
    return x;
}

// Reduces over the block (blockDim.x a multiple of 32); every thread gets
// the result. `red` holds at least 32 floats.
template <bool MAX>
__device__ float block_reduce(float x, float *red) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const float identity = MAX ? -INFINITY : 0.f;
    x = MAX ? warp_max(x) : warp_sum(x);
    if (lane == 0) red[warp] = x;
    __syncthreads();
    x = (threadIdx.x < (blockDim.x >> 5)) ? red[threadIdx.x] : identity;
    if (warp == 0) x = MAX ? warp_max(x) : warp_sum(x);
    if (threadIdx.x == 0) red[0] = x;
    __syncthreads();
    const float r = red[0];
    __syncthreads();
    return r;
}

// One block per (query token, query head). q, out: [n, heads, head_dim];
// k, v: [rows, kv_heads, head_dim]; meta: [3, n] u32 = (pool row of the
// sequence's position 0, first visible position, last visible position)
// per query token.
//
// Scores: one thread per key (the keys of a block are independent, so
// their loads overlap). Softmax over the block. Output: one thread per
// dimension, coalesced across the V row.
template <typename T>
__device__ void pooled_attention(const T *q, const T *k, const T *v, const uint32_t *meta,
                                 T *out, uint32_t n, uint32_t heads, uint32_t kv_heads,
                                 uint32_t head_dim) {
    extern __shared__ float smem[];
    const uint32_t tok = blockIdx.x, h = blockIdx.y;
    const uint32_t kvh = h / (heads / kv_heads);
    const uint32_t base = meta[tok], first = meta[n + tok], last = meta[2 * n + tok];
    const uint32_t keys = last + 1 - first;
    float *qs = smem;              // head_dim
    float *red = qs + head_dim;    // 32
    float *scores = red + 32;      // keys

    const T *qrow = q + ((size_t)tok * heads + h) * head_dim;
    for (uint32_t d = threadIdx.x; d < head_dim; d += blockDim.x) qs[d] = to_f32(qrow[d]);
    __syncthreads();

    const size_t stride = (size_t)kv_heads * head_dim;
    const T *kbase = k + (size_t)(base + first) * stride + (size_t)kvh * head_dim;
    const T *vbase = v + (size_t)(base + first) * stride + (size_t)kvh * head_dim;
    float local = -INFINITY;
    for (uint32_t c = threadIdx.x; c < keys; c += blockDim.x) {
        const T *krow = kbase + (size_t)c * stride;
        float acc = 0.f;
        for (uint32_t d = 0; d < head_dim; ++d) acc += qs[d] * to_f32(krow[d]);
        scores[c] = acc;
        local = fmaxf(local, acc);
    }
    const float m = block_reduce<true>(local, red);
    local = 0.f;
    for (uint32_t c = threadIdx.x; c < keys; c += blockDim.x) {
        const float e = __expf(scores[c] - m);
        scores[c] = e;
        local += e;
    }
    const float inv = 1.f / block_reduce<false>(local, red);

    T *orow = out + ((size_t)tok * heads + h) * head_dim;
    for (uint32_t d = threadIdx.x; d < head_dim; d += blockDim.x) {
        float acc = 0.f;
        for (uint32_t c = 0; c < keys; ++c) acc += scores[c] * to_f32(vbase[(size_t)c * stride + d]);
        orow[d] = from_f32<T>(acc * inv);
    }
}

// Writes the batch's new K (or V) rows `src` ([n, width]) into the pool
// ([rows, width]) at row base + position of each token (meta as above).
template <typename T>
__device__ void pooled_write(T *pool, const T *src, const uint32_t *meta, uint32_t n,
                             uint32_t width) {
    const size_t total = (size_t)n * width;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < total;
         i += (size_t)blockDim.x * gridDim.x) {
        const size_t t = i / width, e = i % width;
        const size_t row = (size_t)meta[t] + meta[2 * n + t];
        pool[row * width + e] = src[i];
    }
}

#define POOLED_KERNELS(SUFFIX, T)                                                             \
    extern "C" __global__ void pooled_attention_##SUFFIX(                                     \
        const T *q, const T *k, const T *v, const uint32_t *meta, T *out, uint32_t n,         \
        uint32_t heads, uint32_t kv_heads, uint32_t head_dim) {                               \
        pooled_attention<T>(q, k, v, meta, out, n, heads, kv_heads, head_dim);                \
    }                                                                                         \
    extern "C" __global__ void pooled_write_##SUFFIX(T *pool, const T *src, const uint32_t *meta, \
                                                     uint32_t n, uint32_t width) {            \
        pooled_write<T>(pool, src, meta, n, width);                                           \
    }

POOLED_KERNELS(f32, float)
POOLED_KERNELS(f16, __half)
POOLED_KERNELS(bf16, __nv_bfloat16)
