// The host's arithmetic peaks, for reading kernel rates against them
// (BENCHMARKS.md, issue 18, session 56): 512-bit FMAs on one and two
// threads (12 independent chains each), and vpdpbusd on 256- and 512-bit
// registers on one thread.
//   gcc -O3 -march=x86-64-v4 -mavx512vnni -pthread bench/cpu/arith_peak_probe.c -o /tmp/peak && /tmp/peak
#include <immintrin.h>
#include <pthread.h>
#include <stdio.h>
#include <time.h>

#define N 2400000000L

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

static void *fma_chains(void *out) {
  __m512 a[12];
  for (int i = 0; i < 12; i++) a[i] = _mm512_set1_ps(i * 0.001f);
  __m512 b = _mm512_set1_ps(0.9999f), c = _mm512_set1_ps(0.0001f);
  for (long n = 0; n < N / 12; n++)
    for (int i = 0; i < 12; i++) a[i] = _mm512_fmadd_ps(a[i], b, c);
  float s = 0;
  for (int i = 0; i < 12; i++) s += _mm512_reduce_add_ps(a[i]);
  *(float *)out = s;
  return 0;
}

int main(void) {
  for (int threads = 1; threads <= 2; threads++) {
    pthread_t t[2];
    float r[2];
    double t0 = now();
    for (int i = 0; i < threads; i++) pthread_create(&t[i], 0, fma_chains, &r[i]);
    for (int i = 0; i < threads; i++) pthread_join(t[i], 0);
    double dt = now() - t0;
    printf("512-bit FMA, %d thread(s): %.2f G/s, %.1f multiply-adds a ns\n", threads,
           threads * (double)N / dt / 1e9, threads * (double)N * 16 / dt / 1e9);
  }
  // One thread, 12 independent vpdpbusd chains of WIDTH-bit vectors.
#define DPBUSD_RATE(WIDTH, T, SET1, SET1_8, DPBUSD, ADD8, LANE0)                          \
  {                                                                                       \
    long m = 1200000000L;                                                                 \
    T a[12];                                                                              \
    for (int i = 0; i < 12; i++) a[i] = SET1(i);                                          \
    T b = SET1_8(3), c = SET1_8(5);                                                       \
    double t0 = now();                                                                    \
    for (long n = 0; n < m / 12; n++) {                                                   \
      for (int i = 0; i < 12; i++) a[i] = DPBUSD(a[i], b, c);                             \
      b = ADD8(b, c);                                                                     \
    }                                                                                     \
    double dt = now() - t0;                                                               \
    long s = 0;                                                                           \
    for (int i = 0; i < 12; i++) s += LANE0(a[i]);                                        \
    printf("%d-bit vpdpbusd, 1 thread: %.2f G/s, %.0f byte products a ns (%ld)\n", WIDTH, \
           m / dt / 1e9, m * (WIDTH / 8.0) / dt / 1e9, s);                                \
  }
#define LANE0_256(v) _mm256_extract_epi32(v, 0)
#define LANE0_512(v) _mm_extract_epi32(_mm512_castsi512_si128(v), 0)
  DPBUSD_RATE(256, __m256i, _mm256_set1_epi32, _mm256_set1_epi8, _mm256_dpbusd_epi32,
              _mm256_add_epi8, LANE0_256)
  DPBUSD_RATE(512, __m512i, _mm512_set1_epi32, _mm512_set1_epi8, _mm512_dpbusd_epi32,
              _mm512_add_epi8, LANE0_512)
  return 0;
}
