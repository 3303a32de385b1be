// Session 50: does a plain streaming sum read memory faster with 256-bit
// loads than with 512-bit ones on this host (2-core AMD EPYC, Zen 4)?
// 150 MB, two threads (one half each), 12 rounds, the widths alternating.
//   gcc -O2 -o ss bench/cpu/stream_width_probe.c -lpthread && ./ss
// Output: bench/cpu/stream_width_probe_2026-12-07.log
#include <immintrin.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <pthread.h>
#include <time.h>
#include <sys/mman.h>
static float *buf; static size_t N; static int mode;
typedef struct {size_t lo,hi; float r;} arg_t;
__attribute__((target("avx512f"))) static float s512(const float*p,size_t n){__m512 a=_mm512_setzero_ps(),b=a,c=a,d=a;for(size_t i=0;i+64<=n;i+=64){a=_mm512_add_ps(a,_mm512_loadu_ps(p+i));b=_mm512_add_ps(b,_mm512_loadu_ps(p+i+16));c=_mm512_add_ps(c,_mm512_loadu_ps(p+i+32));d=_mm512_add_ps(d,_mm512_loadu_ps(p+i+48));}return _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a,b),_mm512_add_ps(c,d)));}
__attribute__((target("avx2"))) static float s256(const float*p,size_t n){__m256 a=_mm256_setzero_ps(),b=a,c=a,d=a,e=a,f=a,g=a,h=a;for(size_t i=0;i+64<=n;i+=64){a=_mm256_add_ps(a,_mm256_loadu_ps(p+i));b=_mm256_add_ps(b,_mm256_loadu_ps(p+i+8));c=_mm256_add_ps(c,_mm256_loadu_ps(p+i+16));d=_mm256_add_ps(d,_mm256_loadu_ps(p+i+24));e=_mm256_add_ps(e,_mm256_loadu_ps(p+i+32));f=_mm256_add_ps(f,_mm256_loadu_ps(p+i+40));g=_mm256_add_ps(g,_mm256_loadu_ps(p+i+48));h=_mm256_add_ps(h,_mm256_loadu_ps(p+i+56));}
 __m256 s=_mm256_add_ps(_mm256_add_ps(_mm256_add_ps(a,b),_mm256_add_ps(c,d)),_mm256_add_ps(_mm256_add_ps(e,f),_mm256_add_ps(g,h))); float t[8]; _mm256_storeu_ps(t,s); return t[0]+t[1]+t[2]+t[3]+t[4]+t[5]+t[6]+t[7];}
static void*run(void*x){arg_t*a=x;a->r=mode?s512(buf+a->lo,a->hi-a->lo):s256(buf+a->lo,a->hi-a->lo);return 0;}
static double now(){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
int main(){N=(size_t)150<<20>>2; buf=aligned_alloc(1<<21,N*4); madvise(buf,N*4,MADV_HUGEPAGE); for(size_t i=0;i<N;i++)buf[i]=1.0f;
 for(int r=0;r<12;r++){for(int m=0;m<2;m++){mode=(r%2)?1-m:m; pthread_t t[2]; arg_t a[2]={{0,N/2},{N/2,N}}; double t0=now(); for(int i=0;i<2;i++)pthread_create(&t[i],0,run,&a[i]); for(int i=0;i<2;i++)pthread_join(t[i],0); double dt=now()-t0; printf("r%d %s %.1f GB/s\n",r,mode?"512":"256",N*4/dt/1e9);}}
}
