// Read bandwidth of N threads (OMP_NUM_THREADS): an AVX-512 streaming sum over
// 512 MB, best of 7 passes. The single-stream roofline figures of BENCHMARKS.md
// divide the bytes a decode step reads by this.
//   gcc -O2 -mavx512f -fopenmp bench/cpu/read_bandwidth.c -o /tmp/bw && OMP_NUM_THREADS=2 /tmp/bw
#include <stdio.h>
#include <stdlib.h>
#include <omp.h>
#include <immintrin.h>
int main(){ size_t n = (size_t)1<<27; /* 512 MB of floats */ float *a = aligned_alloc(64, n*4);
#pragma omp parallel for
 for (size_t i=0;i<n;i++) a[i]=1.0f;
 double best=0; for(int r=0;r<7;r++){ double t=omp_get_wtime(); __m512 s0=_mm512_setzero_ps();
#pragma omp parallel
 { __m512 s=_mm512_setzero_ps();
#pragma omp for
   for(size_t i=0;i<n;i+=64){ s=_mm512_add_ps(s,_mm512_load_ps(a+i)); s=_mm512_add_ps(s,_mm512_load_ps(a+i+16)); s=_mm512_add_ps(s,_mm512_load_ps(a+i+32)); s=_mm512_add_ps(s,_mm512_load_ps(a+i+48)); }
#pragma omp critical
   s0=_mm512_add_ps(s0,s); }
 t=omp_get_wtime()-t; double gbs=n*4/t/1e9; if(gbs>best)best=gbs; printf("%.1f GB/s (%f)\n", gbs, _mm512_reduce_add_ps(s0)); }
 printf("best %.1f GB/s\n", best); }
