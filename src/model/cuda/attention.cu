// Attention over the pooled KV cache for Tandem's GPU step (see
// src/model/pooled_attention.rs).
//
// Each query token reads its own sequence's keys straight from the pool:
// positions first ..= last of the layer's K and V buffers ([rows, kv_heads,
// head_dim], token-major), where `last` is the token's own position
// (causal) and `first` the start of its sliding window, through the
// sequence's block table (position p is row table[p >> shift] << shift |
// p & (2^shift - 1): block sizes are powers of two here). In a small
// decode or verifying launch (`stage`: the host decides), a block first
// copies its keys' and values' rows into shared memory, all in flight at
// once; else it copies the table entries its keys span, so the row of a
// key costs no dependent global load. No gather, no padding, no mask: the
// batch may be any mix of decodes, draft verifications and prefill chunks.
// A query's keys are split across blocks (split-K, below), and the last
// of them to finish merges the splits; a split's scores live in shared
// memory (the caller keeps a split's keys within its budget).
//
// q, k and v come straight from the fused projection's rows `qkv`
// ([n, (heads + 2 kv_heads) * head_dim]: q heads, then k heads, then v
// heads): K is rotated (RoPE, half-split layout, tables [positions,
// head_dim / 2]) on its way into the pool, and the attention rotates and
// scales q as it loads it, so no split, copy or separate RoPE launch exists.
// In a pass where every sequence has at most `own_rows` rows (a decode
// pass: one; a draft verification: its decode token and drafts), the new
// keys and values a query reads are its own and those of its sequence's
// rows before it in the pass: it reads them from their projection rows,
// rotated and rounded as the pool holds them (staged in shared memory),
// and the attention launch writes each row's K and V into the pool
// itself. Other passes (prompt chunks) write them with pooled_write first.

#include <stdint.h>

#include "dtype.cuh"

__device__ __forceinline__ float warp_max(float x) {
    for (int o = 16; o > 0; o >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
    return x;
}

__device__ __forceinline__ float warp_sum(float x) {
    for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
    return x;
}

// 16-byte packs of a head one lane covers: head_dim <= 32 * N * this,
// where N is Pack<T>::N (the host checks).
#define MAX_PACKS_PER_LANE 2
// Largest head dimension (the host checks).
#define MAX_HEAD_DIM 256

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

// Rotates the pair (x1, x2) = (x[d], x[d + head_dim / 2]) of a row at
// position `pos` by the RoPE tables.
template <typename T>
__device__ __forceinline__ void rope_pair(const T *x, const T *cos, const T *sin, uint32_t pos,
                                          uint32_t half, uint32_t d, float *o1, float *o2) {
    const float x1 = to_f32(x[d]), x2 = to_f32(x[d + half]);
    const float c = to_f32(cos[(size_t)pos * half + d]), s = to_f32(sin[(size_t)pos * half + d]);
    *o1 = x1 * c - x2 * s;
    *o2 = x1 * s + x2 * c;
}

// Element d of the K head `k` (a projection row's, before RoPE) rotated to
// position `pos` and rounded to T: what the pool holds for it. Products and
// sums are rounded explicitly, so that no caller's inlining contracts them
// into a different fused multiply-add: both kernels below compute it, and
// a key's bits must not depend on which did.
template <typename T>
__device__ __forceinline__ T rotated_key(const T *k, const T *cos, const T *sin, uint32_t pos,
                                         uint32_t half, uint32_t d) {
    const uint32_t i = d < half ? d : d - half;
    const float x1 = to_f32(k[i]), x2 = to_f32(k[i + half]);
    const float c = to_f32(cos[(size_t)pos * half + i]), s = to_f32(sin[(size_t)pos * half + i]);
    return from_f32<T>(d < half ? __fsub_rn(__fmul_rn(x1, c), __fmul_rn(x2, s))
                                : __fadd_rn(__fmul_rn(x1, s), __fmul_rn(x2, c)));
}

__device__ __forceinline__ void prefetch_l2(const void *p) {
    asm volatile("prefetch.global.L2 [%0];" ::"l"(p));
}

// A 16-byte copy from global to shared memory that holds no register
// while in flight (cp.async, sm_80 on; a plain copy before), and the wait
// for every such copy the thread issued.
__device__ __forceinline__ void copy_async16(void *dst_shared, const void *src_global) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    const uint32_t dst = (uint32_t)__cvta_generic_to_shared(dst_shared);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(src_global));
#else
    *(uint4 *)dst_shared = *(const uint4 *)src_global;
#endif
}

__device__ __forceinline__ void copy_async_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile("cp.async.wait_all;" ::: "memory");
#endif
}

// Closes the thread's copies issued since the last call into a group, and
// waits until at most `PENDING` groups are still in flight.
__device__ __forceinline__ void copy_async_commit() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile("cp.async.commit_group;" ::: "memory");
#endif
}

template <int PENDING>
__device__ __forceinline__ void copy_async_wait_groups() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile("cp.async.wait_group %0;" ::"n"(PENDING) : "memory");
#endif
}

// Adds one to a split count at GPU scope with release and acquire
// semantics; returns the count before.
__device__ __forceinline__ uint32_t arrive(uint32_t *count) {
    uint32_t before;
    asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], 1;"
                 : "=r"(before)
                 : "l"(count)
                 : "memory");
    return before;
}

// The pool row of position `pos` through a block table of 2^shift-token
// blocks.
__device__ __forceinline__ size_t pool_row(const uint32_t *table, uint32_t pos, uint32_t shift) {
    return ((size_t)table[pos >> shift] << shift) | (pos & ((1u << shift) - 1));
}

#define MAX_SPLITS 16

// Merges the splits of one query head from `rows` (one row per split of
// head_dim + 2 floats: the split's output sum, max score, exp sum; the
// first `splits` written, `width` floats apart) into its output row `orow`
// (head_dim), splits in order; the block's threads take the dimensions.
// One wait on memory: every thread's split values are in flight while
// warp 0 weighs the splits (lane s: split s) into `weights` (shared,
// MAX_SPLITS + 1 floats: each split's weight, then 1 / the weighted exp
// sum). From global memory (SHARED false) the loads bypass L1: the rows
// come from other blocks of the same launch. Rows in shared memory (a
// block that ran every split itself) give the same bits.
template <typename T, bool SHARED>
__device__ void merge_rows(const float *rows, T *orow, uint32_t head_dim, uint32_t splits,
                           float *weights) {
    const size_t width = head_dim + 2;
    const auto at = [&](size_t i) {
        if constexpr (SHARED) {
            return rows[i];
        } else {
            return __ldcg(rows + i);
        }
    };
    float values[MAX_SPLITS];
    const auto load = [&](uint32_t d) {
#pragma unroll
        for (uint32_t s = 0; s < MAX_SPLITS; ++s) {
            values[s] = (s < splits && d < head_dim) ? at(s * width + d) : 0.f;
        }
    };
    load(threadIdx.x);
    if (threadIdx.x < 32) {
        const uint32_t s = threadIdx.x;
        const float split_max = s < splits ? at(s * width + head_dim) : -INFINITY;
        const float split_sum = s < splits ? at(s * width + head_dim + 1) : 0.f;
        const float m = warp_max(split_max);
        const float w = s < splits ? __expf(split_max - m) : 0.f;
        const float l = warp_sum(split_sum * w);
        if (s < MAX_SPLITS) weights[s] = w;
        if (s == 0) weights[MAX_SPLITS] = 1.f / l;
    }
    __syncthreads();
    for (uint32_t d = threadIdx.x; d < head_dim; d += blockDim.x) {
        if (d != threadIdx.x) load(d);
        float sum = 0.f;
#pragma unroll
        for (uint32_t s = 0; s < MAX_SPLITS; ++s) sum += values[s] * weights[s];
        orow[d] = from_f32<T>(sum * weights[MAX_SPLITS]);
    }
}

// Split-K ("flash-decoding") attention: one block per (query token, query
// head, split of its keys), so a single decoding sequence still fills the
// GPU. A query that sees `keys` keys splits them into
// splits(keys) = min(ceil(keys / split_keys), MAX_SPLITS) runs of
// ceil(keys / splits) keys (`split_keys` is a launch argument, the same for
// every launch of a process). The split depends on nothing but the query's
// own key count, so its sums run in the same order whichever other
// sequences share the batch: a decode, a draft verification row and a
// prefill row at the same position give the same bits. The host uses the
// same rule (src/model/pooled_attention.rs).

__device__ __forceinline__ uint32_t key_splits(uint32_t keys, uint32_t split_keys) {
    return min((keys + split_keys - 1) / split_keys, (uint32_t)MAX_SPLITS);
}

// G: query heads one block attends with the keys of their shared KV head
// (grouped-query attention then reads each key and its row address once
// for all of them); a KV head with more query heads gives them
// ceil(heads per KV head / G) blocks. P: the 16-byte packs of a head one
// lane holds (head_dim <= 32 * P * Pack<T>::N). Every head's sums run in
// the same order whatever G and P are (its own accumulators, the same
// loops), so the grouped kernel (G = 4, P = 1, for launches of many
// blocks, where one block a head leaves the SMs busy with the same
// addressing and loads per head) gives the bits of the ungrouped one.
//
// SERIAL: one block runs every split of its query heads, one after the
// other, each with the loops and sums of a split's own block, keeps the
// splits' partial rows in shared memory and merges them with
// merge_rows' arithmetic: the bits of the split grid (gridDim.z is 1),
// without its per-split setup, global partial rows and arrival round
// trip. With `stage`, split s + 1's key and value rows are copied into
// shared memory while split s computes (two buffers); without, with
// `prefetch`, every split's rows are asked of L2 first thing. The host
// runs it grouped, for launches whose (query, head group) blocks alone
// fill the GPU (H100, 1B shape at B = 64: 1.10x; one block a head over
// SmolLM2's shape read 0.97x, so that instantiation does not exist).

template <typename T, uint32_t G, uint32_t P, bool SERIAL>
__device__ void pooled_attention(const T *qkv, T *k, T *v, const uint32_t *meta, const T *cos,
                                 const T *sin, float *partial, uint32_t n, uint32_t heads,
                                 uint32_t kv_heads, uint32_t head_dim, float q_scale,
                                 uint32_t shift, uint32_t split_keys, uint32_t lanes,
                                 uint32_t own_rows, uint32_t prefetch, uint32_t stage,
                                 uint32_t *arrivals, T *out) {
    constexpr uint32_t N = Pack<T>::N;
    constexpr uint32_t D = P * N;  // dimensions a lane holds
    extern __shared__ float smem[];
    const uint32_t tok = blockIdx.x, split0 = SERIAL ? 0 : blockIdx.z;
    const uint32_t per_kv = heads / kv_heads;
    const uint32_t chunks = (per_kv + G - 1) / G;
    const uint32_t kvh = blockIdx.y / chunks;
    const uint32_t h0 = kvh * per_kv + (blockIdx.y % chunks) * G;
    const uint32_t hb = min(G, (kvh + 1) * per_kv - h0);  // heads here
    const uint32_t *table = meta + meta[tok];
    const uint32_t first_visible = meta[n + tok], last = meta[2 * n + tok];
    const uint32_t all_keys = last + 1 - first_visible;
    const uint32_t splits = key_splits(all_keys, split_keys);
    if (split0 >= splits) return;
    const uint32_t chunk = (all_keys + splits - 1) / splits;
    // chunk * (splits - 1) < all_keys: every split holds a key.
    const auto split_first = [&](uint32_t s) { return first_visible + s * chunk; };
    const auto split_size = [&](uint32_t s) { return min(chunk, last + 1 - split_first(s)); };
    // The keys this block attends: one split's, or (SERIAL) all of them.
    const uint32_t span_keys = SERIAL ? all_keys : split_size(split0);
    const uint32_t key_cap = SERIAL ? chunk : span_keys;  // one split's at most
    const uint32_t first_block = split_first(split0) >> shift;
    const uint32_t last_key = split_first(split0) + span_keys - 1;
    const uint32_t table_words = (span_keys >> shift) + 2;

    const uint32_t warps = blockDim.x >> 5;
    float *qs = smem;                                  // G * head_dim
    float *red = qs + G * head_dim;                    // 32
    float *wpart = red + 32;                           // warps * G * head_dim
    float *scores = wpart + warps * G * head_dim;      // G * key_cap
    // The table entries of blocks first_block ..= last_key >> shift.
    uint32_t *blocks = (uint32_t *)(scores + G * key_cap);
    // SERIAL: each head's split rows (splits of head_dim + 2 floats).
    float *split_rows = (float *)(blocks + table_words);
    // Then, 16-byte aligned, the pass's rows of this query's sequence up to
    // its own (keys, then values: own_rows rows each at most).
    // (An offset from `smem`, so the compiler keeps shared-space pointers.)
    const uint32_t rows_floats = SERIAL ? G * splits * (head_dim + 2) : 0;
    const uint32_t span_at =
        ((uint32_t)((G * head_dim + 32 + warps * G * head_dim + G * key_cap + rows_floats) *
                        sizeof(float) +
                    table_words * sizeof(uint32_t)) +
         15u) & ~15u;
    T *span_k = (T *)((char *)smem + span_at);
    T *span_v = span_k + own_rows * head_dim;
    // With `stage`, then a split's key rows the pool holds, then its value
    // rows (key_cap rows each at most); SERIAL: two such buffers.
    T *const stage_at = span_v + own_rows * head_dim;
    const auto stage_k_of = [&](uint32_t s) {
        return stage_at + (SERIAL ? (s & 1) * 2 * key_cap * head_dim : 0);
    };
    // With own_rows, the pass's rows of this sequence before this one
    // (consecutive rows of the same table at consecutive positions, at
    // most own_rows - 1) and its own hold the keys from `span_first` on:
    // staged from their projection rows where a split reads them, and
    // the row's own written into the pool by the first block of each
    // (row, KV head). Without, the pool holds every key already.
    uint32_t before = 0;
    if (own_rows) {
        while (before + 1 < own_rows && before < tok && meta[tok - before - 1] == meta[tok] &&
               meta[2 * n + tok - before - 1] + before + 1 == last) {
            ++before;
        }
    }
    const uint32_t span_first = last - before;
    const bool writes = own_rows && split0 == 0 && blockIdx.y % chunks == 0;
    // Positions from `staged_from` on come from the staged rows; a split
    // reads `pool_keys` of its keys from the pool.
    const auto staged_from = [&](uint32_t s) {
        const bool reads_span = own_rows && split_first(s) + split_size(s) > span_first;
        return reads_span ? span_first : 0xffffffffu;
    };
    const auto pool_keys_of = [&](uint32_t s) {
        const uint32_t f = split_first(s);
        return min(split_size(s), max(staged_from(s), f) - f);
    };
    // Copies split s's pool rows into its stage buffer (cp.async).
    const auto stage_split = [&](uint32_t s) {
        const uint32_t packs = head_dim / N, f = split_first(s);
        T *stage_k = stage_k_of(s), *stage_v = stage_k + key_cap * head_dim;
        for (uint32_t i = threadIdx.x; i < pool_keys_of(s) * packs; i += blockDim.x) {
            const uint32_t c = i / packs, at_row = (i % packs) * N;
            const size_t at =
                (pool_row(table, f + c, shift) * kv_heads + kvh) * head_dim + at_row;
            copy_async16(stage_k + c * head_dim + at_row, k + at);
            copy_async16(stage_v + c * head_dim + at_row, v + at);
        }
    };
    // The block's rows the pool holds (those before the staged span),
    // asked for first thing, through the global table: with `stage`, the
    // (first) split's all copied into shared memory at once (one wait on
    // memory for every key and value; the loops below then read shared
    // memory only); else, with `prefetch`, asked of L2 (the key loop reads
    // two rounds of keys at a time and the value loop starts only after
    // the softmax, so otherwise a split waits on memory once per pair of
    // rounds of keys and again per pair of rounds of values). No result
    // depends on either.
    if (stage) {
        stage_split(split0);
        if (SERIAL) copy_async_commit();
    } else if (prefetch) {
        const uint32_t f = split_first(split0);
        const uint32_t to =
            SERIAL ? min(last + 1, staged_from(splits - 1)) : f + pool_keys_of(split0);
        for (uint32_t c = f + threadIdx.x; c < to; c += blockDim.x) {
            const size_t at = (pool_row(table, c, shift) * kv_heads + kvh) * head_dim;
            for (uint32_t b = 0; b < head_dim * sizeof(T); b += 128) {
                prefetch_l2((const char *)(k + at) + b);
                prefetch_l2((const char *)(v + at) + b);
            }
        }
    }
    if (!stage || SERIAL) {
        for (uint32_t b = threadIdx.x; b <= (last_key >> shift) - first_block; b += blockDim.x) {
            blocks[b] = table[first_block + b];
        }
    }

    const size_t width = (size_t)(heads + 2 * kv_heads) * head_dim;
    const T *qrow = qkv + (size_t)tok * width + (size_t)h0 * head_dim;
    const uint32_t half = head_dim / 2;
    for (uint32_t i = threadIdx.x; i < hb * half; i += blockDim.x) {
        const uint32_t g = i / half, d = i % half;
        float o1, o2;
        rope_pair(qrow + g * head_dim, cos, sin, last, half, d, &o1, &o2);
        qs[g * head_dim + d] = o1 * q_scale;
        qs[g * head_dim + d + half] = o2 * q_scale;
    }
    if (staged_from(SERIAL ? splits - 1 : split0) != 0xffffffffu || writes) {
        for (uint32_t i = threadIdx.x; i <= before * head_dim + head_dim - 1; i += blockDim.x) {
            const uint32_t j = i / head_dim, d = i % head_dim;
            const T *krow =
                qkv + (size_t)(tok - before + j) * width + (size_t)(heads + kvh) * head_dim;
            span_k[i] = rotated_key(krow, cos, sin, span_first + j, half, d);
            span_v[i] = krow[(size_t)kv_heads * head_dim + d];
        }
    }
    if (stage && !SERIAL) copy_async_wait();
    __syncthreads();
    if (writes) {
        const size_t at = pool_row(table, last, shift) * kv_heads * head_dim + (size_t)kvh * head_dim;
        const T *own_k = span_k + (size_t)before * head_dim, *own_v = span_v + (size_t)before * head_dim;
        for (uint32_t d = threadIdx.x; d < head_dim; d += blockDim.x) {
            k[at + d] = own_k[d];
            v[at + d] = own_v[d];
        }
    }

    const size_t stride = (size_t)kv_heads * head_dim;
    const T *kbase = k + (size_t)kvh * head_dim;
    const T *vbase = v + (size_t)kvh * head_dim;
    const uint32_t group = threadIdx.x / lanes, sub = threadIdx.x % lanes;
    const uint32_t groups = blockDim.x / lanes;
    // This lane's dimensions: packs sub, sub + lanes, ... of the head.
    float q[G][D];
#pragma unroll
    for (uint32_t g = 0; g < G; ++g) {
#pragma unroll
        for (uint32_t j = 0; j < P; ++j) {
            const uint32_t d = (j * lanes + sub) * N;
#pragma unroll
            for (uint32_t e = 0; e < N; ++e) {
                q[g][j * N + e] = (g < hb && d < head_dim) ? qs[g * head_dim + d + e] : 0.f;
            }
        }
    }
    const bool alone = splits == 1;
    // The split's keys, set before the loop: the split grid's block runs
    // its one split (the loop ends at the bottom) with nothing carried.
    uint32_t first = split_first(split0), keys = key_cap;
    uint32_t from_span = staged_from(split0), pool_keys = pool_keys_of(split0);
    const T *stage_k = stage_at, *stage_v = stage_at + key_cap * head_dim;
    for (uint32_t split = split0;; ++split) {
        if (SERIAL) {
            first = split_first(split);
            keys = split_size(split);
            from_span = staged_from(split);
            pool_keys = pool_keys_of(split);
            stage_k = stage_k_of(split);
            stage_v = stage_k + key_cap * head_dim;
        }
        if (SERIAL && stage) {
            // The next split's copies go out before this one's are awaited.
            if (split + 1 < splits) {
                stage_split(split + 1);
                copy_async_commit();
                copy_async_wait_groups<1>();
            } else {
                copy_async_wait_groups<0>();
            }
            __syncthreads();
        }

        float local[G];
#pragma unroll
        for (uint32_t g = 0; g < G; ++g) local[g] = -INFINITY;
#pragma unroll 2
        for (uint32_t round = 0; round < keys; round += groups) {
            const uint32_t c = round + group;
            float acc[G];
#pragma unroll
            for (uint32_t g = 0; g < G; ++g) acc[g] = 0.f;
            if (c < keys) {
                // Shared rows and pool rows apart, so that each load keeps its
                // own state space (a generic load cost 1-2 % at B = 16-64).
                const bool shared = c >= pool_keys || stage;
                const T *srow = c >= pool_keys ? span_k + (first + c - from_span) * head_dim
                                               : stage_k + c * head_dim;
                const T *krow =
                    kbase + pool_row(blocks, first + c - (first_block << shift), shift) * stride;
#pragma unroll
                for (uint32_t j = 0; j < P; ++j) {
                    const uint32_t d = (j * lanes + sub) * N;
                    if (d < head_dim) {
                        float x[N];
                        if (shared) {
                            Pack<T>::load(srow + d, x);
                        } else {
                            Pack<T>::load(krow + d, x);
                        }
#pragma unroll
                        for (uint32_t g = 0; g < G; ++g) {
#pragma unroll
                            for (uint32_t e = 0; e < N; ++e) acc[g] += q[g][j * N + e] * x[e];
                        }
                    }
                }
            }
#pragma unroll
            for (uint32_t g = 0; g < G; ++g) {
                if (g >= hb) continue;  // uniform across the block
                for (uint32_t o = lanes >> 1; o > 0; o >>= 1) {
                    acc[g] += __shfl_xor_sync(0xffffffffu, acc[g], o);
                }
                if (c < keys && g < hb) {
                    if (sub == 0) scores[g * key_cap + c] = acc[g];
                    local[g] = fmaxf(local[g], acc[g]);
                }
            }
        }
        __syncthreads();
        float m[G], l[G];
#pragma unroll
        for (uint32_t g = 0; g < G; ++g) {
            if (g < hb) m[g] = block_reduce<true>(local[g], red);
        }
#pragma unroll
        for (uint32_t g = 0; g < G; ++g) {
            if (g >= hb) continue;
            float sum = 0.f;
            for (uint32_t c = threadIdx.x; c < keys; c += blockDim.x) {
                const float e = __expf(scores[g * key_cap + c] - m[g]);
                scores[g * key_cap + c] = e;
                sum += e;
            }
            l[g] = block_reduce<false>(sum, red);
        }

        float acc[G][D];
#pragma unroll
        for (uint32_t g = 0; g < G; ++g) {
#pragma unroll
            for (uint32_t i = 0; i < D; ++i) acc[g][i] = 0.f;
        }
#pragma unroll 2
        for (uint32_t c = group; c < keys; c += groups) {
            const bool shared = c >= pool_keys || stage;
            const T *srow = c >= pool_keys ? span_v + (first + c - from_span) * head_dim
                                           : stage_v + c * head_dim;
            const T *vrow =
                vbase + pool_row(blocks, first + c - (first_block << shift), shift) * stride;
            float p[G];
#pragma unroll
            for (uint32_t g = 0; g < G; ++g) p[g] = g < hb ? scores[g * key_cap + c] : 0.f;
#pragma unroll
            for (uint32_t j = 0; j < P; ++j) {
                const uint32_t d = (j * lanes + sub) * N;
                if (d < head_dim) {
                    float x[N];
                    if (shared) {
                        Pack<T>::load(srow + d, x);
                    } else {
                        Pack<T>::load(vrow + d, x);
                    }
#pragma unroll
                    for (uint32_t g = 0; g < G; ++g) {
#pragma unroll
                        for (uint32_t e = 0; e < N; ++e) acc[g][j * N + e] += p[g] * x[e];
                    }
                }
            }
        }
        // Across the warp's lane groups (lanes differing above the group bits).
#pragma unroll
        for (uint32_t g = 0; g < G; ++g) {
            if (g >= hb) continue;  // uniform across the block
#pragma unroll
            for (uint32_t i = 0; i < D; ++i) {
                for (uint32_t o = 16; o >= lanes; o >>= 1) {
                    acc[g][i] += __shfl_xor_sync(0xffffffffu, acc[g][i], o);
                }
            }
        }
        const uint32_t warp = threadIdx.x >> 5;
        if ((threadIdx.x & 31) < lanes) {
#pragma unroll
            for (uint32_t g = 0; g < G; ++g) {
#pragma unroll
                for (uint32_t j = 0; j < P; ++j) {
                    const uint32_t d = (j * lanes + sub) * N;
#pragma unroll
                    for (uint32_t e = 0; e < N; ++e) {
                        if (g < hb && d < head_dim) {
                            wpart[(warp * G + g) * head_dim + d + e] = acc[g][j * N + e];
                        }
                    }
                }
            }
        }
        __syncthreads();
        // A query of one split writes its output here, with merge_rows'
        // arithmetic for one split.
        for (uint32_t i = threadIdx.x; i < hb * head_dim; i += blockDim.x) {
            const uint32_t g = i / head_dim, d = i % head_dim;
            float sum = 0.f;
            for (uint32_t w = 0; w < warps; ++w) sum += wpart[(w * G + g) * head_dim + d];
            if (alone) {
                // m[g] and l[g] by unrolled selection: an index that varies
                // per thread would put the arrays in local memory.
                float mg = m[0], lg = l[0];
#pragma unroll
                for (uint32_t x = 1; x < G; ++x) {
                    if (g == x) {
                        mg = m[x];
                        lg = l[x];
                    }
                }
                const float scale = __expf(mg - mg);
                float total = 0.f, weighted = 0.f;
                total += lg * scale;
                weighted += sum * scale;
                const float inv = 1.f / total;
                out[((size_t)tok * heads + h0 + g) * head_dim + d] = from_f32<T>(weighted * inv);
                continue;
            }
            if (SERIAL) {
                split_rows[(g * splits + split) * (head_dim + 2) + d] = sum;
            } else {
                const size_t at = ((size_t)tok * heads + h0 + g) * gridDim.z + split;
                partial[at * (head_dim + 2) + d] = sum;
            }
        }
        if (alone) return;
        if (threadIdx.x == 0) {
#pragma unroll
            for (uint32_t g = 0; g < G; ++g) {
                if (g >= hb) continue;
                float *row = SERIAL ? split_rows + (g * splits + split) * (head_dim + 2)
                                    : partial + (((size_t)tok * heads + h0 + g) * gridDim.z +
                                                 split) * (head_dim + 2);
                row[head_dim] = m[g];
                row[head_dim + 1] = l[g];
            }
        }
        if (!SERIAL || split + 1 == splits) break;
        // The next split reuses the scores, the partial rows per warp and
        // (staged) the buffer of the split after it.
        __syncthreads();
    }
    if (SERIAL) {
#pragma unroll
        for (uint32_t g = 0; g < G; ++g) {
            if (g < hb) {
                // The previous head's merge reads its weights until here.
                if (g > 0) __syncthreads();
                T *orow = out + ((size_t)tok * heads + h0 + g) * head_dim;
                merge_rows<T, true>(split_rows + g * splits * (head_dim + 2), orow, head_dim,
                                    splits, red);
            }
        }
        return;
    }
    // The last of a query's splits to finish merges them (and resets the
    // query's arrival count to zero for the next launch): no merge launch.
    // The barrier orders the block's partial rows before thread 0's
    // arrival, whose release publishes them and whose acquire, in the last
    // split, makes the others' visible to its block after the next barrier
    // (CUTLASS's semaphore pattern): no fence of every thread.
    __shared__ bool merges;
    __syncthreads();
    if (threadIdx.x == 0) {
        uint32_t *count = arrivals + (size_t)tok * heads + h0;
        merges = arrive(count) == splits - 1;
        if (merges) *count = 0;
    }
    __syncthreads();
    if (!merges) return;
#pragma unroll
    for (uint32_t g = 0; g < G; ++g) {
        if (g < hb) {
            // The previous head's merge reads its weights until here.
            if (g > 0) __syncthreads();
            const float *rows = partial + ((size_t)tok * heads + h0 + g) * gridDim.z * (head_dim + 2);
            T *orow = out + ((size_t)tok * heads + h0 + g) * head_dim;
            merge_rows<T, false>(rows, orow, head_dim, splits, red);
        }
    }
}

// Writes the batch's new K (rotated) and V rows into their pools ([rows,
// kv_heads, head_dim] each) at the row of each token's position (meta as
// above), from the K and V heads of each qkv row: one launch, one thread
// per pair of dimensions. A decode or verifying pass does not need it
// (own_rows).
template <typename T>
__device__ void pooled_write(T *k_pool, T *v_pool, const T *qkv, const uint32_t *meta,
                             const T *cos, const T *sin, uint32_t n, uint32_t heads,
                             uint32_t kv_heads, uint32_t head_dim, uint32_t shift) {
    const uint32_t half = head_dim / 2;
    const size_t total = (size_t)n * 2 * kv_heads * half;
    const size_t qkv_stride = (size_t)(heads + 2 * kv_heads) * head_dim;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < total;
         i += (size_t)blockDim.x * gridDim.x) {
        const uint32_t d = i % half;
        const uint32_t head = (i / half) % (2 * kv_heads);  // K heads, then V heads
        const size_t t = i / ((size_t)half * 2 * kv_heads);
        const bool is_k = head < kv_heads;
        const uint32_t kvh = is_k ? head : head - kv_heads;
        const uint32_t pos = meta[2 * n + t];
        const T *src = qkv + t * qkv_stride + (size_t)(heads + head) * head_dim;
        T *dst = (is_k ? k_pool : v_pool) +
                 pool_row(meta + meta[t], pos, shift) * kv_heads * head_dim +
                 (size_t)kvh * head_dim;
        if (is_k) {
            dst[d] = rotated_key(src, cos, sin, pos, half, d);
            dst[d + half] = rotated_key(src, cos, sin, pos, half, d + half);
        } else {
            dst[d] = src[d];
            dst[d + half] = src[d + half];
        }
    }
}

// Writes a pass's hidden rows ([n, width]) into the KV cache's hidden
// buffer ([pool rows, width]) at the pool row of each token's position
// (meta as above): what the engine's own scatter writes, inside a decode
// graph (no host work a step).
template <typename T>
__device__ void hidden_write(T *buffer, const T *hidden, const uint32_t *meta, uint32_t n,
                             uint32_t width, uint32_t shift) {
    const size_t total = (size_t)n * width;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < total;
         i += (size_t)blockDim.x * gridDim.x) {
        const size_t t = i / width;
        const uint32_t d = i % width;
        buffer[pool_row(meta + meta[t], meta[2 * n + t], shift) * width + d] = hidden[i];
    }
}

// The host launches 128-thread attention blocks (pooled_attention.rs'
// WARPS); at 10 blocks an SM the registers stay at the 48 the kernel needed
// before it kept its own K and V (no spills), since ptxas would otherwise
// take 55 and fit only 9. The grouped kernel holds four heads' q and
// accumulators: GROUPED_BLOCKS blocks an SM leave it the registers for them.
// The serial grouped kernel's loop holds more: at GROUPED_SERIAL_BLOCKS it
// takes 127 registers without spills (at 5, 96 with spills).
#define GROUPED_BLOCKS 5
#define GROUPED_SERIAL_BLOCKS 4
#define POOLED_ATTENTION_KERNEL(NAME, T, G, P, SERIAL, BLOCKS)                                \
    extern "C" __global__ void __launch_bounds__(128, BLOCKS) NAME(                           \
        const T *qkv, T *k, T *v, const uint32_t *meta, const T *cos, const T *sin,           \
        float *partial, uint32_t n, uint32_t heads, uint32_t kv_heads, uint32_t head_dim,     \
        float q_scale, uint32_t shift, uint32_t split_keys, uint32_t lanes,                   \
        uint32_t own_rows, uint32_t prefetch, uint32_t stage, uint32_t *arrivals, T *out) {   \
        pooled_attention<T, G, P, SERIAL>(qkv, k, v, meta, cos, sin, partial, n, heads,       \
                                          kv_heads, head_dim, q_scale, shift, split_keys,     \
                                          lanes, own_rows, prefetch, stage, arrivals, out);   \
    }
#define POOLED_KERNELS(SUFFIX, T)                                                             \
    POOLED_ATTENTION_KERNEL(pooled_attention_##SUFFIX, T, 1, MAX_PACKS_PER_LANE, false, 10)   \
    POOLED_ATTENTION_KERNEL(pooled_attention_grouped_##SUFFIX, T, 4, 1, false,                \
                            GROUPED_BLOCKS)                                                   \
    POOLED_ATTENTION_KERNEL(pooled_attention_grouped_serial_##SUFFIX, T, 4, 1, true,          \
                            GROUPED_SERIAL_BLOCKS)                                            \
    extern "C" __global__ void pooled_write_##SUFFIX(                                         \
        T *k_pool, T *v_pool, const T *qkv, const uint32_t *meta, const T *cos, const T *sin, \
        uint32_t n, uint32_t heads, uint32_t kv_heads, uint32_t head_dim, uint32_t shift) {   \
        pooled_write<T>(k_pool, v_pool, qkv, meta, cos, sin, n, heads, kv_heads, head_dim,    \
                        shift);                                                               \
    }                                                                                         \
    extern "C" __global__ void hidden_write_##SUFFIX(T *buffer, const T *hidden,              \
                                                     const uint32_t *meta, uint32_t n,        \
                                                     uint32_t width, uint32_t shift) {        \
        hidden_write<T>(buffer, hidden, meta, n, width, shift);                               \
    }

POOLED_KERNELS(f32, float)
POOLED_KERNELS(f16, __half)
POOLED_KERNELS(bf16, __nv_bfloat16)
