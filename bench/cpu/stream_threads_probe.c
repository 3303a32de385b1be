// One and two threads summing a 1 GiB f32 buffer (AVX-512), alternating, 8 rounds: what one core and
// both cores of this host stream from memory (session 40). gcc -O2 -mavx512f -pthread stream_threads_probe.c
#include <stdio.h>
#include <stdlib.h>
#include <pthread.h>
#include <time.h>
#include <immintrin.h>
#define N (256UL<<20)
static float *buf;
typedef struct { size_t a, b; double s; } job;
static void *run(void *p){ job *j=p; __m512 acc0=_mm512_setzero_ps(),acc1=acc0,acc2=acc0,acc3=acc0;
  for(size_t i=j->a;i<j->b;i+=64){ acc0=_mm512_add_ps(acc0,_mm512_load_ps(buf+i)); acc1=_mm512_add_ps(acc1,_mm512_load_ps(buf+i+16)); acc2=_mm512_add_ps(acc2,_mm512_load_ps(buf+i+32)); acc3=_mm512_add_ps(acc3,_mm512_load_ps(buf+i+48)); }
  j->s=_mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(acc0,acc1),_mm512_add_ps(acc2,acc3))); return 0; }
static double now(){ struct timespec t; clock_gettime(CLOCK_MONOTONIC,&t); return t.tv_sec+t.tv_nsec*1e-9; }
int main(){ buf=aligned_alloc(2<<20, N*4); for(size_t i=0;i<N;i++) buf[i]=i&7;
  for(int r=0;r<8;r++){ for(int th=1;th<=2;th++){ pthread_t t[2]; job j[2]; double t0=now();
      for(int k=0;k<th;k++){ j[k].a=N/th*k; j[k].b=N/th*(k+1); pthread_create(&t[k],0,run,&j[k]); }
      for(int k=0;k<th;k++) pthread_join(t[k],0);
      double dt=now()-t0; printf("threads %d: %.1f GB/s\n", th, N*4/dt/1e9); } }
}
