// Tandem's on-device sampler: the transform chain of `src/sampler/transform.rs`
// for one row per block, so that on a GPU only token ids (and requested
// logprobs) cross to the host.
//
// Semantics (the host sampler's, see `src/sampler/mod.rs`):
//   logit bias added (capped at FLT_MAX) and grammar mask applied (disallowed
//   tokens to -inf) -> penalties (repeat and presence once per distinct window token, frequency
//   once per occurrence) -> top-p with positional top-k folded in, or top-k
//   alone; ranks by (score descending, id ascending), so exactly K survive and
//   ties go to the lower ids -> min-p against the row maximum -> greedy (first
//   maximum) or temperature and an inverse-CDF draw in id order from the
//   uniform the host drew from the slot's RNG.
//
// No sort: the cut-off of the kept prefix is found by an 8-ary search over
// the order-preserving bit pattern of the scores (11 passes over the row,
// each counting the tokens above 7 thresholds and their mass), then the tie
// group at the cut-off is split by id with a block prefix count. Row loops
// are unrolled so that each thread keeps several independent loads in
// flight: one block walks a whole row, so latency, not bandwidth, bounds a
// pass. Every reduction is a fixed tree (warp shuffles, then one warp over
// the warp results): the result never depends on scheduling, so a seeded
// request draws the same token on every run.
//
// Layouts (all row-major):
//   logits  [B, V] f32       raw scores
//   scratch [B, V] f32       penalised scores, then draw weights
//   params  [B, PARAM_WIDTH] u32, fields below (floats as bits), then the
//           adjusted rows' mask words (ceil(V / 32) each; bit t % 32 of word
//           t / 32 allows token t) and bias pairs (id, bias bits; ids
//           ascending, unique), at the offsets the rows' fields give
//   history [rows, W] u32    the sampler's penalty rings (pool row per slot)
//   out     [B, 4 + 2 * top_logprobs] u32:
//           token, status, detail, logprob bits, then (id, logprob bits) pairs

#include <stdint.h>
#include <float.h>

#define THREADS 1024
#define MAX_WARPS (THREADS / 32)

// Parameter fields; keep in sync with `src/sampler/device.rs`.
#define P_POOL_ROW 0
#define P_FILLED 1
#define P_WRITE_POS 2
#define P_TOP_K 3
#define P_FLAGS 4
#define P_INV_T 5
#define P_TOP_P 6
#define P_LN_MIN_P 7
#define P_REPEAT 8
#define P_PRESENCE 9
#define P_FREQUENCY 10
#define P_U_LO 11
#define P_U_HI 12
#define P_MASK_OFF 13
#define P_BIAS_OFF 14
#define P_BIAS_LEN 15
#define PARAM_WIDTH 16

#define F_GREEDY 1u
#define F_HISTORY 2u
#define F_LOGPROBS 4u
#define F_MASK 8u

#define S_OK 0u
#define S_NON_FINITE 1u
#define S_NO_FINITE_LOGIT 2u
#define S_TOKEN_OUT_OF_VOCAB 3u

// Larger = better; -0.0 folds into +0.0 so the two tie, as `==` says.
__device__ __forceinline__ uint32_t ord_of(float x) {
    uint32_t b = __float_as_uint(x == 0.0f ? 0.0f : x);
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

__device__ __forceinline__ float float_of_ord(uint32_t o) {
    return __uint_as_float((o & 0x80000000u) ? (o & 0x7fffffffu) : ~o);
}

// Shared scratch of the block reductions: one slot per warp plus a result.
struct Reduce {
    union {
        float f[MAX_WARPS + 1];
        uint32_t u[MAX_WARPS + 1];
        unsigned long long u64[MAX_WARPS + 1];
        double d[MAX_WARPS + 1];
    };
};

struct OpMax { __device__ float operator()(float a, float b) const { return fmaxf(a, b); } };
struct OpSumF { __device__ float operator()(float a, float b) const { return a + b; } };
struct OpSumU { __device__ uint32_t operator()(uint32_t a, uint32_t b) const { return a + b; } };
struct OpMaxU { __device__ uint32_t operator()(uint32_t a, uint32_t b) const { return a > b ? a : b; } };
struct OpMinU { __device__ uint32_t operator()(uint32_t a, uint32_t b) const { return a < b ? a : b; } };
struct OpMinU64 {
    __device__ unsigned long long operator()(unsigned long long a, unsigned long long b) const {
        return a < b ? a : b;
    }
};
struct OpMaxU64 {
    __device__ unsigned long long operator()(unsigned long long a, unsigned long long b) const {
        return a > b ? a : b;
    }
};

template <typename T> __device__ __forceinline__ T& slot(Reduce& r, int i);
template <> __device__ __forceinline__ float& slot<float>(Reduce& r, int i) { return r.f[i]; }
template <> __device__ __forceinline__ uint32_t& slot<uint32_t>(Reduce& r, int i) { return r.u[i]; }
template <> __device__ __forceinline__ unsigned long long& slot<unsigned long long>(Reduce& r, int i) {
    return r.u64[i];
}
template <> __device__ __forceinline__ double& slot<double>(Reduce& r, int i) { return r.d[i]; }

// Every thread gets the reduction of `v` over the block (fixed tree order).
template <typename T, typename Op>
__device__ T block_reduce(T v, Op op, T identity, Reduce& red) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int warps = blockDim.x >> 5;
    for (int off = 16; off > 0; off >>= 1) v = op(v, __shfl_down_sync(0xffffffffu, v, off));
    __syncthreads();  // the previous reduction's result has been read
    if (lane == 0) slot<T>(red, warp) = v;
    __syncthreads();
    if (warp == 0) {
        v = lane < warps ? slot<T>(red, lane) : identity;
        for (int off = 16; off > 0; off >>= 1) v = op(v, __shfl_down_sync(0xffffffffu, v, off));
        if (lane == 0) slot<T>(red, MAX_WARPS) = v;
    }
    __syncthreads();
    return slot<T>(red, MAX_WARPS);
}

// Exclusive prefix sum of `v` over threads in index order; `total` gets the sum.
template <typename T>
__device__ T block_exclusive_scan(T v, T* total, Reduce& red) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int warps = blockDim.x >> 5;
    T incl = v;
    for (int off = 1; off < 32; off <<= 1) {
        T n = __shfl_up_sync(0xffffffffu, incl, off);
        if (lane >= off) incl += n;
    }
    __syncthreads();
    if (lane == 31) slot<T>(red, warp) = incl;
    __syncthreads();
    if (warp == 0) {
        T w = lane < warps ? slot<T>(red, lane) : T(0);
        T wi = w;
        for (int off = 1; off < 32; off <<= 1) {
            T n = __shfl_up_sync(0xffffffffu, wi, off);
            if (lane >= off) wi += n;
        }
        if (lane < warps) slot<T>(red, lane) = wi - w;  // exclusive warp offsets
        if (lane == 31) slot<T>(red, MAX_WARPS) = wi;
    }
    __syncthreads();
    *total = slot<T>(red, MAX_WARPS);
    return slot<T>(red, warp) + incl - v;
}

// Totals of the search's ARITY - 1 (count, mass) pairs.
#define ARITY 8
struct Multi {
    uint32_t part_count[MAX_WARPS][ARITY - 1];
    float part_mass[MAX_WARPS][ARITY - 1];
    uint32_t count[ARITY - 1];
    float mass[ARITY - 1];
};

// Every thread gets the block sums of each pair in `multi.count/mass`
// (fixed order: warp trees, then warps in index order).
__device__ void block_reduce_many(uint32_t (&count)[ARITY - 1], float (&mass)[ARITY - 1],
                                  Multi& multi) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int warps = blockDim.x >> 5;
#pragma unroll
    for (int j = 0; j < ARITY - 1; ++j) {
        for (int off = 16; off > 0; off >>= 1) {
            count[j] += __shfl_down_sync(0xffffffffu, count[j], off);
            mass[j] += __shfl_down_sync(0xffffffffu, mass[j], off);
        }
    }
    __syncthreads();  // the previous totals have been read
    if (lane == 0) {
#pragma unroll
        for (int j = 0; j < ARITY - 1; ++j) {
            multi.part_count[warp][j] = count[j];
            multi.part_mass[warp][j] = mass[j];
        }
    }
    __syncthreads();
    if (threadIdx.x < ARITY - 1) {
        uint32_t c = 0;
        float m = 0.0f;
        for (int w = 0; w < warps; ++w) {
            c += multi.part_count[w][threadIdx.x];
            m += multi.part_mass[w][threadIdx.x];
        }
        multi.count[threadIdx.x] = c;
        multi.mass[threadIdx.x] = m;
    }
    __syncthreads();
}

extern "C" __global__ void __launch_bounds__(THREADS) sample_rows(
    const float* __restrict__ logits,
    float* __restrict__ scratch,
    const uint32_t* __restrict__ params,
    const uint32_t* __restrict__ history,
    uint32_t* __restrict__ out,
    uint32_t vocab,
    uint32_t history_width,
    uint32_t top_logprobs) {
    __shared__ Reduce red;
    __shared__ Multi multi;
    __shared__ uint32_t shared_u;

    const uint32_t row = blockIdx.x, tid = threadIdx.x, nt = blockDim.x;
    const float* raw = logits + (size_t)row * vocab;
    float* s = scratch + (size_t)row * vocab;
    const uint32_t* p = params + (size_t)row * PARAM_WIDTH;
    uint32_t* o = out + (size_t)row * (4 + 2 * top_logprobs);
    const uint32_t flags = p[P_FLAGS];

    // Raw maximum, NaN / +inf check, working copy with the mask applied
    // (which a plain greedy row does not need: it reads the raw row).
    const uint32_t filled = p[P_FILLED];
    const bool penalised = (flags & F_HISTORY) && filled > 0;
    const bool masked = (flags & F_MASK) != 0;
    const uint32_t* mask = params + p[P_MASK_OFF];
    const uint32_t bias_len = p[P_BIAS_LEN];
    const uint32_t* bias = params + p[P_BIAS_OFF];
    const bool adjusted = masked || bias_len > 0;
    const bool copy = penalised || adjusted || !(flags & F_GREEDY);
    float local_max = -INFINITY;
    uint32_t bad = 0;
#pragma unroll 8
    for (uint32_t i = tid; i < vocab; i += nt) {
        float x = raw[i];
        bad |= (isnan(x) || x == INFINITY) ? 1u : 0u;
        local_max = fmaxf(local_max, x);
        if (copy) s[i] = (masked && !((mask[i >> 5] >> (i & 31)) & 1u)) ? -INFINITY : x;
    }
    bad = block_reduce(bad, OpMaxU(), 0u, red);
    const float raw_max = block_reduce(local_max, OpMax(), -INFINITY, red);
    if (bad) {
        if (tid == 0) o[1] = S_NON_FINITE;
        return;
    }

    float m = raw_max;
    if (adjusted) {
        if (bias_len > 0) {
            // The host reports the first biased id outside the row.
            uint32_t outside = 0xffffffffu;
            for (uint32_t j = tid; j < bias_len; j += nt) {
                const uint32_t t = bias[2 * j];
                if (t >= vocab) outside = min(outside, t);
            }
            outside = block_reduce(outside, OpMinU(), 0xffffffffu, red);
            if (outside != 0xffffffffu) {
                if (tid == 0) {
                    o[1] = S_TOKEN_OUT_OF_VOCAB;
                    o[2] = outside;
                }
                return;
            }
            // Adding before masking (the host's order) leaves a masked
            // token at -inf, so only allowed ones take their bias. Ids are
            // unique: no two threads write one score.
            for (uint32_t j = tid; j < bias_len; j += nt) {
                const uint32_t t = bias[2 * j];
                if (!masked || ((mask[t >> 5] >> (t & 31)) & 1u)) {
                    s[t] = fminf(s[t] + __uint_as_float(bias[2 * j + 1]), FLT_MAX);
                }
            }
            __syncthreads();
        }
        local_max = -INFINITY;
#pragma unroll 8
        for (uint32_t i = tid; i < vocab; i += nt) local_max = fmaxf(local_max, s[i]);
        m = block_reduce(local_max, OpMax(), -INFINITY, red);
    }

    // Penalties over the filled part of the slot's ring.
    if (penalised) {
        const uint32_t* h = history + (size_t)p[P_POOL_ROW] * history_width;
        unsigned long long worst = 0;
        for (uint32_t j = tid; j < filled; j += nt) {
            uint32_t t = h[j];
            if (t >= vocab) worst = max(worst, (1ull << 32) | t);
        }
        worst = block_reduce(worst, OpMaxU64(), 0ull, red);
        if (worst) {
            if (tid == 0) {
                o[1] = S_TOKEN_OUT_OF_VOCAB;
                o[2] = (uint32_t)worst;
            }
            return;
        }
        const float repeat = __uint_as_float(p[P_REPEAT]);
        const float presence = __uint_as_float(p[P_PRESENCE]);
        const float frequency = __uint_as_float(p[P_FREQUENCY]);
        // The thread holding a token's first occurrence penalises it once.
        for (uint32_t j = tid; j < filled; j += nt) {
            const uint32_t t = h[j];
            bool first = true;
            for (uint32_t k = 0; k < j; ++k) {
                if (h[k] == t) {
                    first = false;
                    break;
                }
            }
            if (!first) continue;
            uint32_t n = 0;
            for (uint32_t k = j; k < filled; ++k) n += h[k] == t ? 1u : 0u;
            float v = s[t];
            if (repeat != 1.0f) v = v < 0.0f ? v * repeat : v / repeat;
            v -= presence;
            v -= frequency * (float)n;
            s[t] = fminf(v, FLT_MAX);
        }
        __syncthreads();
        local_max = -INFINITY;
#pragma unroll 8
        for (uint32_t i = tid; i < vocab; i += nt) local_max = fmaxf(local_max, s[i]);
        m = block_reduce(local_max, OpMax(), -INFINITY, red);
    }
    if (m == -INFINITY) {
        if (tid == 0) o[1] = S_NO_FINITE_LOGIT;
        return;
    }

    uint32_t token;
    if (flags & F_GREEDY) {
        const float* scores = copy ? s : raw;
        uint32_t first = 0xffffffffu;
#pragma unroll 8
        for (uint32_t i = tid; i < vocab; i += nt) {
            if (scores[i] == m && i < first) first = i;
        }
        token = block_reduce(first, OpMinU(), 0xffffffffu, red);
    } else {
        const float inv_t = __uint_as_float(p[P_INV_T]);
        const float top_p = __uint_as_float(p[P_TOP_P]);
        const float floor = m + __uint_as_float(p[P_LN_MIN_P]);
        const uint32_t top_k = (p[P_TOP_K] > 0 && p[P_TOP_K] < vocab) ? p[P_TOP_K] : vocab;
        const bool use_top_p = top_p < 1.0f;
        // Kept by rank: ord > cut, or ord == cut and id < id_limit.
        uint32_t cut = 0, id_limit = vocab;
        if (use_top_p || top_k < vocab) {
            float local_z = 0.0f;
#pragma unroll 8
            for (uint32_t i = tid; i < vocab; i += nt) local_z += __expf(s[i] - m);
            const float inv_z = 1.0f / block_reduce(local_z, OpSumF(), 0.0f, red);
            // The smallest threshold t whose best token at or below t still
            // starts within the kept prefix: fewer than top_k tokens rank
            // above it and their mass is below top_p. The predicate only
            // changes at scores present in the row.
            // Each pass tests ARITY - 1 thresholds splitting [lo, hi] evenly
            // (an ARITY-ary search: 11 passes over the row, not 32).
            uint32_t lo = 0, hi = ord_of(m);
            while (lo < hi) {
                uint32_t t[ARITY - 1], count[ARITY - 1];
                float mass[ARITY - 1];
#pragma unroll
                for (int j = 0; j < ARITY - 1; ++j) {
                    t[j] = lo + (uint32_t)(((uint64_t)(hi - lo) * (uint64_t)(j + 1)) / ARITY);
                    count[j] = 0;
                    mass[j] = 0.0f;
                }
#pragma unroll 4
                for (uint32_t i = tid; i < vocab; i += nt) {
                    const float x = s[i];
                    const uint32_t k = ord_of(x);
                    const float e = __expf(x - m);
#pragma unroll
                    for (int j = 0; j < ARITY - 1; ++j) {
                        if (k > t[j]) {
                            count[j] += 1;
                            mass[j] += e;
                        }
                    }
                }
                block_reduce_many(count, mass, multi);
                // cond(t) is monotone (true at hi): keep the first true.
                uint32_t next_lo = lo, next_hi = hi;
#pragma unroll
                for (int j = 0; j < ARITY - 1; ++j) {
                    if (next_hi != hi) continue;
                    const float above = multi.mass[j] * inv_z;
                    if (multi.count[j] < top_k && (!use_top_p || above < top_p)) {
                        next_hi = t[j];
                    } else {
                        next_lo = t[j] + 1;
                    }
                }
                lo = next_lo;
                hi = next_hi;
            }
            // The last kept score: the smallest present at or above `lo`.
            uint32_t local_cut = 0xffffffffu;
#pragma unroll 8
            for (uint32_t i = tid; i < vocab; i += nt) {
                const uint32_t k = ord_of(s[i]);
                if (k >= lo && k < local_cut) local_cut = k;
            }
            cut = block_reduce(local_cut, OpMinU(), 0xffffffffu, red);
            uint32_t above = 0, ties = 0;
            float mass = 0.0f;
#pragma unroll 8
            for (uint32_t i = tid; i < vocab; i += nt) {
                const float x = s[i];
                const uint32_t k = ord_of(x);
                if (k > cut) {
                    above += 1;
                    mass += __expf(x - m);
                } else if (k == cut) {
                    ties += 1;
                }
            }
            above = block_reduce(above, OpSumU(), 0u, red);
            ties = block_reduce(ties, OpSumU(), 0u, red);
            mass = block_reduce(mass, OpSumF(), 0.0f, red) * inv_z;
            if (tid == 0) {
                // How many of the tie group (ids ascending) stay: position
                // above + i needs i < top_k - above and an exclusive mass
                // below top_p.
                // The first tie is kept by construction (the search's
                // predicate held at `cut`).
                uint32_t keep = min(ties, top_k - above);
                if (use_top_p) {
                    const float each = __expf(float_of_ord(cut) - m) * inv_z;
                    float cum = mass + each;
                    uint32_t i = 1;
                    while (i < keep && cum < top_p) {
                        i += 1;
                        cum += each;
                    }
                    keep = i;
                }
                shared_u = keep;
            }
            __syncthreads();
            const uint32_t keep = shared_u;
            if (keep < ties) {
                // The id of the first tie left out: a prefix count over
                // contiguous chunks of ids.
                const uint32_t chunk = (vocab + nt - 1) / nt;
                const uint32_t begin = min(vocab, tid * chunk), end = min(vocab, begin + chunk);
                uint32_t mine = 0;
#pragma unroll 8
                for (uint32_t i = begin; i < end; ++i) mine += ord_of(s[i]) == cut ? 1u : 0u;
                uint32_t total;
                const uint32_t before = block_exclusive_scan(mine, &total, red);
                if (keep >= before && keep < before + mine) {
                    uint32_t r = keep - before;
                    for (uint32_t i = begin; i < end; ++i) {
                        if (ord_of(s[i]) == cut) {
                            if (r == 0) {
                                shared_u = i;
                                break;
                            }
                            r -= 1;
                        }
                    }
                }
                __syncthreads();
                id_limit = shared_u;
            }
        }
        __syncthreads();
        // Draw weights, in place.
#pragma unroll 8
        for (uint32_t i = tid; i < vocab; i += nt) {
            const float x = s[i];
            const uint32_t k = ord_of(x);
            const bool kept = (k > cut || (k == cut && i < id_limit)) && x >= floor;
            s[i] = kept ? __expf((x - m) * inv_t) : 0.0f;
        }
        __syncthreads();
        // Inverse CDF in id order over contiguous chunks.
        const uint32_t chunk = (vocab + nt - 1) / nt;
        const uint32_t begin = min(vocab, tid * chunk), end = min(vocab, begin + chunk);
        double mine = 0.0;
        uint32_t last_with_mass = 0;
        bool any = false;
#pragma unroll 8
        for (uint32_t i = begin; i < end; ++i) {
            if (s[i] > 0.0f) {
                mine += (double)s[i];
                last_with_mass = i;
                any = true;
            }
        }
        double total;
        const double before = block_exclusive_scan(mine, &total, red);
        const double u = __hiloint2double((int)p[P_U_HI], (int)p[P_U_LO]);
        const double target = u * total;
        const uint32_t claim = (mine > 0.0 && before + mine > target) ? tid : 0xffffffffu;
        const uint32_t owner = block_reduce(claim, OpMinU(), 0xffffffffu, red);
        if (owner == 0xffffffffu) {
            // Rounding put the target past every chunk: the last token with mass.
            token = block_reduce(any ? last_with_mass : 0u, OpMaxU(), 0u, red);
        } else {
            if (tid == owner) {
                double cum = before;
                uint32_t pick = last_with_mass;
                for (uint32_t i = begin; i < end; ++i) {
                    const float w = s[i];
                    if (w > 0.0f && cum + (double)w > target) {
                        pick = i;
                        break;
                    }
                    cum += (double)w;
                }
                shared_u = pick;
            }
            __syncthreads();
            token = shared_u;
        }
    }

    if (flags & F_LOGPROBS) {
        // Stable log-softmax of the raw row.
        float local_sum = 0.0f;
#pragma unroll 8
        for (uint32_t i = tid; i < vocab; i += nt) local_sum += expf(raw[i] - raw_max);
        const float lse = logf(block_reduce(local_sum, OpSumF(), 0.0f, red));
        if (tid == 0) o[3] = __float_as_uint((raw[token] - raw_max) - lse);
        // The best keys one at a time: (ord descending, id ascending).
        unsigned long long prev = 0;
        for (uint32_t k = 0; k < top_logprobs; ++k) {
            unsigned long long best = ~0ull;
#pragma unroll 8
            for (uint32_t i = tid; i < vocab; i += nt) {
                const unsigned long long key =
                    ((unsigned long long)(~ord_of(raw[i])) << 32) | i;
                if ((k == 0 || key > prev) && key < best) best = key;
            }
            best = block_reduce(best, OpMinU64(), ~0ull, red);
            if (tid == 0) {
                const uint32_t id = (uint32_t)best;
                o[4 + 2 * k] = id;
                o[5 + 2 * k] = __float_as_uint((raw[id] - raw_max) - lse);
            }
            prev = best;
        }
    }
    if (tid == 0) {
        o[0] = token;
        o[1] = S_OK;
    }
}

// Appends each row's token to its slot's ring (rows with a penalty window);
// launched only after the host has checked every row's status.
extern "C" __global__ void history_write(
    uint32_t* __restrict__ history,
    const uint32_t* __restrict__ out,
    const uint32_t* __restrict__ params,
    uint32_t rows,
    uint32_t history_width,
    uint32_t out_width) {
    const uint32_t i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= rows) return;
    const uint32_t* p = params + (size_t)i * PARAM_WIDTH;
    if (!(p[P_FLAGS] & F_HISTORY)) return;
    history[(size_t)p[P_POOL_ROW] * history_width + p[P_WRITE_POS]] = out[(size_t)i * out_width];
}

// The first maximum of each row of f32 logits [rows, vocab], for calls whose
// every row is plain greedy: blockIdx.x is the row, blockIdx.y a run of
// `per_block` columns, so a single row still spreads over many SMs (the
// sampling kernel above gives a row one block). Each value becomes a key
// (order-preserving bits of the value, then the bitwise complement of its
// id), so the largest key is the largest value at its lowest id; NaN never
// wins. Blocks combine by atomicMax on `best` (zeroed by the caller: 0 means
// the row had no number).
extern "C" __global__ void argmax_rows_f32(const float *logits, uint32_t vocab,
                                           uint32_t per_block, unsigned long long *best) {
    const uint32_t row = blockIdx.x;
    const uint32_t start = blockIdx.y * per_block;
    const uint32_t end = min(vocab, start + per_block);
    const float *r = logits + (size_t)row * vocab;
    unsigned long long key = 0;
    for (uint32_t i = start + threadIdx.x; i < end; i += blockDim.x) {
        const float v = r[i];
        if (v != v) continue;
        uint32_t u = __float_as_uint(v);
        u ^= (u >> 31) ? 0xffffffffu : 0x80000000u;
        const unsigned long long k = ((unsigned long long)u << 32) | (0xffffffffu - i);
        key = k > key ? k : key;
    }
    for (int o = 16; o > 0; o >>= 1) {
        const unsigned long long other = __shfl_xor_sync(0xffffffffu, key, o);
        key = other > key ? other : key;
    }
    __shared__ unsigned long long warp_best[32];
    const uint32_t lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) warp_best[warp] = key;
    __syncthreads();
    if (warp == 0) {
        key = lane < (blockDim.x >> 5) ? warp_best[lane] : 0;
        for (int o = 16; o > 0; o >>= 1) {
            const unsigned long long other = __shfl_xor_sync(0xffffffffu, key, o);
            key = other > key ? other : key;
        }
        if (lane == 0 && key != 0) atomicMax(best + row, key);
    }
}
