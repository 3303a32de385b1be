// Read bandwidth of N threads (OMP_NUM_THREADS): an AVX-512 streaming sum over
// 512 MB. Prints every pass, then the best and the median of them. The
// single-stream roofline figures of BENCHMARKS.md divide the bytes a decode
// step reads by this, measured right next to the decode run.
//   gcc -O2 -mavx512f -fopenmp bench/cpu/read_bandwidth.c -o /tmp/bw
//   OMP_NUM_THREADS=2 /tmp/bw [passes, default 7]
// HUGE=1 asks for 2 MiB pages (MADV_HUGEPAGE) as Tandem does for its CPU
// weights.
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <omp.h>
#include <immintrin.h>

static int cmp(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

int main(int argc, char **argv) {
    int passes = argc > 1 ? atoi(argv[1]) : 7;
    if (passes < 1 || passes > 1000) passes = 7;
    size_t n = (size_t)1 << 27; /* 512 MB of floats */
    float *a = aligned_alloc(1 << 21, n * 4);
    if (getenv("HUGE")) madvise(a, n * 4, MADV_HUGEPAGE);
    double *gbs = malloc(sizeof(double) * passes);
#pragma omp parallel for
    for (size_t i = 0; i < n; i++) a[i] = 1.0f;
    for (int r = 0; r < passes; r++) {
        double t = omp_get_wtime();
        __m512 s0 = _mm512_setzero_ps();
#pragma omp parallel
        {
            __m512 s = _mm512_setzero_ps();
#pragma omp for
            for (size_t i = 0; i < n; i += 64) {
                s = _mm512_add_ps(s, _mm512_load_ps(a + i));
                s = _mm512_add_ps(s, _mm512_load_ps(a + i + 16));
                s = _mm512_add_ps(s, _mm512_load_ps(a + i + 32));
                s = _mm512_add_ps(s, _mm512_load_ps(a + i + 48));
            }
#pragma omp critical
            s0 = _mm512_add_ps(s0, s);
        }
        t = omp_get_wtime() - t;
        gbs[r] = n * 4 / t / 1e9;
        printf("%.1f GB/s (%f)\n", gbs[r], _mm512_reduce_add_ps(s0));
    }
    qsort(gbs, passes, sizeof(double), cmp);
    printf("best %.1f GB/s, median %.1f GB/s\n", gbs[passes - 1], gbs[passes / 2]);
    return 0;
}
