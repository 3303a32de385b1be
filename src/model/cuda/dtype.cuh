// Element conversions shared by Tandem's model kernels (attention.cu,
// fused.cu, gemv.cu): every kernel loads f32 / f16 / bf16 and computes in
// f32.
#pragma once

#include <stdint.h>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

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

// A 16-byte load of N contiguous elements (16-byte aligned), as floats;
// `raw` and `unpack` split it, so a kernel can keep loads in flight as
// four registers each and widen them only when it uses them.
template <typename T> struct Pack;
template <> struct Pack<float> {
    static constexpr uint32_t N = 4;
    static __device__ __forceinline__ uint4 raw(const float *p) { return *(const uint4 *)p; }
    static __device__ __forceinline__ void unpack(uint4 r, float *x) {
        x[0] = __uint_as_float(r.x), x[1] = __uint_as_float(r.y);
        x[2] = __uint_as_float(r.z), x[3] = __uint_as_float(r.w);
    }
    static __device__ __forceinline__ void load(const float *p, float *x) { unpack(raw(p), x); }
};
// The 16-bit types: a pack is four pairs, widened pair by pair.
__device__ __forceinline__ float2 widen(__half2 h) { return __half22float2(h); }
__device__ __forceinline__ float2 widen(__nv_bfloat162 h) { return __bfloat1622float2(h); }

template <typename T, typename Pair> struct Pack16 {
    static constexpr uint32_t N = 8;
    static __device__ __forceinline__ uint4 raw(const T *p) { return *(const uint4 *)p; }
    static __device__ __forceinline__ void unpack(uint4 r, float *x) {
        const Pair *h = (const Pair *)&r;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const float2 f = widen(h[i]);
            x[2 * i] = f.x, x[2 * i + 1] = f.y;
        }
    }
    static __device__ __forceinline__ void load(const T *p, float *x) { unpack(raw(p), x); }
};
template <> struct Pack<__half> : Pack16<__half, __half2> {};
template <> struct Pack<__nv_bfloat16> : Pack16<__nv_bfloat16, __nv_bfloat162> {};

