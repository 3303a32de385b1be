// Two threads pinned to CPUs 0 and 1 pass a cache line back and forth 200 000 times: the
// cores' round-trip latency (session 40). gcc -O2 -pthread core_round_trip_probe.c; run beside stream_threads_probe.c.
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <pthread.h>
#include <stdatomic.h>
#include <time.h>
#include <sched.h>
static _Alignas(64) atomic_int flag;
static double now(){ struct timespec t; clock_gettime(CLOCK_MONOTONIC,&t); return t.tv_sec+t.tv_nsec*1e-9; }
#define R 200000
static void *pong(void *p){ cpu_set_t s; CPU_ZERO(&s); CPU_SET(1,&s); sched_setaffinity(0,sizeof s,&s);
  for(int i=0;i<R;i++){ while(atomic_load_explicit(&flag,memory_order_acquire)!=2*i+1); atomic_store_explicit(&flag,2*i+2,memory_order_release);} return 0; }
int main(){ cpu_set_t s; CPU_ZERO(&s); CPU_SET(0,&s); sched_setaffinity(0,sizeof s,&s);
  pthread_t t; atomic_store(&flag,0); pthread_create(&t,0,pong,0);
  double t0=now(); for(int i=0;i<R;i++){ atomic_store_explicit(&flag,2*i+1,memory_order_release); while(atomic_load_explicit(&flag,memory_order_acquire)!=2*i+2); }
  double dt=now()-t0; pthread_join(t,0); printf("round trip %.0f ns\n", dt/R*1e9); }
