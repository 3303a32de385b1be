// What a decode graph's kernel boundaries cost on this GPU, before
// building for it: a stand-in for one 1B-class Llama decode step at B = 1
// (per layer: norm, qkv GEMV, K/V write, attention, merge, o GEMV, norm,
// gate/up GEMV, down GEMV; 16 layers, then the unembedding), each kernel
// streaming the bytes the real one streams, captured in a CUDA graph four
// ways:
//   plain   kernels back to back (the floor a graph of these kernels has);
//   memory  a stream-ordered alloc before and a free after each kernel, as
//           candle's ops leave in today's graphs (graph memory nodes);
//   pdl     programmatic dependent launch: each kernel lets the next one
//           start at once, and a GEMV loads its first weights before it
//           waits for its input (griddepcontrol);
//   pdl+mem both (whether capture keeps PDL edges across memory nodes).
// Prints microseconds per replay (median of 7 batches of 50 replays).
//
// nvcc -O3 -std=c++17 -arch=sm_90 bench/gpu/pdl_probe.cu -o pdl_probe

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>

#define CHECK(x)                                                                      \
    do {                                                                              \
        cudaError_t e = (x);                                                          \
        if (e != cudaSuccess) {                                                       \
            fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x,                 \
                    cudaGetErrorString(e));                                           \
            exit(1);                                                                  \
        }                                                                             \
    } while (0)

__device__ __forceinline__ void pdl_wait() { asm volatile("griddepcontrol.wait;" ::: "memory"); }
__device__ __forceinline__ void pdl_trigger() {
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
}

__device__ __forceinline__ float dot8(uint4 w, uint4 x) {
    const __nv_bfloat162 *a = reinterpret_cast<const __nv_bfloat162 *>(&w);
    const __nv_bfloat162 *b = reinterpret_cast<const __nv_bfloat162 *>(&x);
    float s = 0.f;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        float2 fa = __bfloat1622float2(a[i]), fb = __bfloat1622float2(b[i]);
        s += fa.x * fb.x + fa.y * fb.y;
    }
    return s;
}

// One warp per output row of w [n, k] (bf16), 8 warps a block; each lane
// keeps UNROLL 16-byte packs in flight. `early`: load the first packs before
// waiting for x (the weights do not depend on the previous kernel).
template <bool PDL>
__global__ void gemv(const uint4 *w, const uint4 *x, __nv_bfloat16 *y, int n, int k8) {
    constexpr int UNROLL = 4;
    if (PDL) pdl_trigger();
    const int lane = threadIdx.x & 31;
    const int row = blockIdx.x * 8 + (threadIdx.x >> 5);
    const uint4 *wr = w + (size_t)min(row, n - 1) * k8;
    uint4 buf[UNROLL];
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
        int i = lane + 32 * u;
        buf[u] = i < k8 ? __ldg(wr + i) : make_uint4(0, 0, 0, 0);
    }
    if (PDL) pdl_wait();
    float acc = 0.f;
    for (int base = 0; base < k8; base += 32 * UNROLL) {
        uint4 next[UNROLL];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            int i = base + 32 * UNROLL + lane + 32 * u;
            next[u] = i < k8 ? __ldg(wr + i) : make_uint4(0, 0, 0, 0);
        }
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            int i = base + lane + 32 * u;
            if (i < k8) acc += dot8(buf[u], x[i]);
        }
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) buf[u] = next[u];
    }
    for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
    if (lane == 0 && row < n) y[row] = __float2bfloat16(acc);
}

// The bandwidth floor of a projection: the whole grid streams w in 16-byte
// packs, UNROLL 8 in flight per thread, grid-stride; one partial per block.
template <bool PDL>
__global__ void stream(const uint4 *w, const uint4 *x, __nv_bfloat16 *y, int n, int k8) {
    constexpr int UNROLL = 8;
    if (PDL) pdl_trigger();
    const size_t total = (size_t)n * k8, step = (size_t)gridDim.x * blockDim.x * UNROLL;
    size_t i0 = (size_t)blockIdx.x * blockDim.x * UNROLL + threadIdx.x;
    uint4 buf[UNROLL];
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
        size_t i = i0 + (size_t)u * blockDim.x;
        buf[u] = i < total ? __ldg(w + i) : make_uint4(0, 0, 0, 0);
    }
    if (PDL) pdl_wait();
    float acc = 0.f;
    for (size_t base = i0; base < total; base += step) {
        uint4 next[UNROLL];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            size_t i = base + step + (size_t)u * blockDim.x;
            next[u] = i < total ? __ldg(w + i) : make_uint4(0, 0, 0, 0);
        }
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) acc += dot8(buf[u], x[(base + u * blockDim.x) % k8]);
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) buf[u] = next[u];
    }
    for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
    if ((threadIdx.x & 31) == 0) y[blockIdx.x * 8 + (threadIdx.x >> 5)] = __float2bfloat16(acc);
}

// A small dependent kernel: reads `n` bf16 of its input, writes n outputs.
template <bool PDL>
__global__ void small(const __nv_bfloat16 *in, __nv_bfloat16 *out, int n) {
    if (PDL) pdl_trigger();
    if (PDL) pdl_wait();
    float s = 0.f;
    for (int i = threadIdx.x; i < n; i += blockDim.x) s += __bfloat162float(in[i]);
    for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = __float2bfloat16(s * 1e-6f + __bfloat162float(in[i]));
}

struct Step {
    int hidden = 2048, q = 2048, kv = 512, inter = 8192, vocab = 128256, layers = 16;
    std::vector<void *> weights;
    __nv_bfloat16 *act[2] = {nullptr, nullptr};
};

template <typename K, typename... A>
static void launch(bool pdl, K kernel, dim3 grid, dim3 block, cudaStream_t s, A... args) {
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = grid;
    cfg.blockDim = block;
    cfg.stream = s;
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[0].val.programmaticStreamSerializationAllowed = 1;
    cfg.attrs = attr;
    cfg.numAttrs = pdl ? 1 : 0;
    CHECK(cudaLaunchKernelEx(&cfg, kernel, args...));
}

// One step's launches on `s`: `pdl` picks the kernels' variant and the
// launch attribute; `memory` wraps every kernel in an alloc and a free.
static bool g_stream = false, g_tiny = true;
static void step(Step &st, cudaStream_t s, bool pdl, bool memory) {
    int wi = 0, flip = 0;
    auto out = [&]() { return st.act[flip ^= 1]; };
    auto in = [&]() { return st.act[flip]; };
    auto scratch = [&]() -> void * {
        void *p = nullptr;
        if (memory) CHECK(cudaMallocAsync(&p, 64 << 10, s));
        return p;
    };
    auto release = [&](void *p) {
        if (memory) CHECK(cudaFreeAsync(p, s));
    };
    auto proj = [&](int n, int k) {
        void *p = scratch();
        const uint4 *w = (const uint4 *)st.weights[wi++];
        __nv_bfloat16 *o = out();
        auto *x = (const uint4 *)st.act[flip ^ 1];
        if (g_stream && pdl)
            launch(true, stream<true>, dim3(132 * 4), dim3(256), s, w, x, o, n, k / 8);
        else if (g_stream)
            launch(false, stream<false>, dim3(132 * 4), dim3(256), s, w, x, o, n, k / 8);
        else if (pdl)
            launch(true, gemv<true>, dim3((n + 7) / 8), dim3(256), s, w, x, o, n, k / 8);
        else
            launch(false, gemv<false>, dim3((n + 7) / 8), dim3(256), s, w, x, o, n, k / 8);
        release(p);
    };
    auto tiny = [&](int blocks, int n) {
        if (!g_tiny) return;
        void *p = scratch();
        const __nv_bfloat16 *i = in();
        __nv_bfloat16 *o = out();
        if (pdl)
            launch(true, small<true>, dim3(blocks), dim3(128), s, i, o, n);
        else
            launch(false, small<false>, dim3(blocks), dim3(128), s, i, o, n);
        release(p);
    };
    for (int l = 0; l < st.layers; ++l) {
        tiny(1, st.hidden);                       // norm
        proj(st.q + 2 * st.kv, st.hidden);        // qkv
        tiny(1, 2 * st.kv);                       // K/V write
        tiny(96, st.q);                           // split attention
        tiny(32, st.q);                           // merge
        proj(st.hidden, st.q);                    // o
        tiny(1, st.hidden);                       // norm
        proj(2 * st.inter, st.hidden);            // gate/up
        proj(st.hidden, st.inter);                // down
    }
    tiny(1, st.hidden);
    proj(st.vocab, st.hidden);
}

static float replay_us(cudaGraphExec_t exec, cudaStream_t s) {
    cudaEvent_t a, b;
    CHECK(cudaEventCreate(&a));
    CHECK(cudaEventCreate(&b));
    std::vector<float> times;
    for (int warm = 0; warm < 20; ++warm) CHECK(cudaGraphLaunch(exec, s));
    for (int r = 0; r < 7; ++r) {
        CHECK(cudaEventRecord(a, s));
        for (int i = 0; i < 50; ++i) CHECK(cudaGraphLaunch(exec, s));
        CHECK(cudaEventRecord(b, s));
        CHECK(cudaEventSynchronize(b));
        float ms = 0;
        CHECK(cudaEventElapsedTime(&ms, a, b));
        times.push_back(ms * 1000.f / 50);
    }
    std::sort(times.begin(), times.end());
    CHECK(cudaEventDestroy(a));
    CHECK(cudaEventDestroy(b));
    return times[times.size() / 2];
}

int main() {
    Step st;
    size_t total = 0;
    auto add = [&](size_t n, size_t k) {
        void *p;
        CHECK(cudaMalloc(&p, n * k * 2));
        CHECK(cudaMemset(p, 0, n * k * 2));
        st.weights.push_back(p);
        total += n * k * 2;
    };
    for (int l = 0; l < st.layers; ++l) {
        add(st.q + 2 * st.kv, st.hidden);
        add(st.hidden, st.q);
        add(2 * st.inter, st.hidden);
        add(st.hidden, st.inter);
    }
    add(st.vocab, st.hidden);
    for (auto &a : st.act) {
        CHECK(cudaMalloc(&a, (size_t)st.vocab * 2));
        CHECK(cudaMemset(a, 0, (size_t)st.vocab * 2));
    }
    cudaStream_t s;
    CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    printf("weights %.2f GB; at 4.8 TB/s a step streams them in %.0f us\n", total / 1e9,
           total / 4.8e12 * 1e6);
    const char *names[] = {"plain", "memory", "pdl", "pdl+mem"};
    const char *kinds[] = {"gemv+small", "gemv", "stream+small", "stream"};
    for (int round = 0; round < 2; ++round) {
      for (int kind = 0; kind < 4; ++kind) {
        g_stream = kind >= 2;
        g_tiny = !(kind & 1);
        for (int v = 0; v < 4; ++v) {
            bool pdl = v >= 2, memory = v & 1;
            cudaGraph_t g;
            CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeRelaxed));
            step(st, s, pdl, memory);
            CHECK(cudaStreamEndCapture(s, &g));
            size_t nodes = 0;
            CHECK(cudaGraphGetNodes(g, nullptr, &nodes));
            cudaGraphExec_t exec;
            CHECK(cudaGraphInstantiate(&exec, g, cudaGraphInstantiateFlagAutoFreeOnLaunch));
            float us = replay_us(exec, s);
            printf("round %d %-12s %-8s nodes %4zu  %8.1f us per step  %6.0f tok/s\n", round,
                   kinds[kind], names[v], nodes, us, 1e6 / us);
            CHECK(cudaGraphExecDestroy(exec));
            CHECK(cudaGraphDestroy(g));
        }
      }
    }
    g_stream = false;
    g_tiny = true;
    // Eager, for reference.
    for (int v = 0; v < 4; v += 2) {
        cudaEvent_t a, b;
        CHECK(cudaEventCreate(&a));
        CHECK(cudaEventCreate(&b));
        step(st, s, v >= 2, false);
        CHECK(cudaEventRecord(a, s));
        for (int i = 0; i < 50; ++i) step(st, s, v >= 2, false);
        CHECK(cudaEventRecord(b, s));
        CHECK(cudaEventSynchronize(b));
        float ms;
        CHECK(cudaEventElapsedTime(&ms, a, b));
        printf("eager %-8s %8.1f us per step\n", names[v], ms * 1000 / 50);
    }
    return 0;
}
