/* A STREAM-style read loop (bench/thread_scaling.py --bandwidth compiles and runs it): `threads` threads
 * each read their slice of a `mib` MiB buffer (several times the last-level cache) with 32-byte loads,
 * OR-reducing so nothing is optimised away; prints the best of `repeat` passes in bytes per second, then
 * the best in bytes per CPU-second of each thread times the threads (what the loop reads while its
 * threads run: on a shared machine a descheduled reader lowers the first, not the second).
 *   cc -O2 -mavx2 -pthread read_bandwidth.c -o read_bandwidth && ./read_bandwidth MIB THREADS [REPEAT] */
#define _GNU_SOURCE
#include <immintrin.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

typedef struct {
    const uint8_t *p;
    size_t n;
    pthread_barrier_t *start;
    uint64_t sink;
    double cpu; /* the thread's CPU seconds in its loop */
} slice;

static double cpu_now(void) {
    struct timespec t;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

static void *reader(void *arg) {
    slice *s = arg;
    pthread_barrier_wait(s->start);
    double c0 = cpu_now();
    __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;
    for (size_t i = 0; i + 128 <= s->n; i += 128) {
        _mm_prefetch((const char *)(s->p + i + 2048), _MM_HINT_T0); /* as the kernels do: more misses in flight */
        _mm_prefetch((const char *)(s->p + i + 2048 + 64), _MM_HINT_T0);
        a0 = _mm256_or_si256(a0, _mm256_load_si256((const __m256i *)(s->p + i)));
        a1 = _mm256_or_si256(a1, _mm256_load_si256((const __m256i *)(s->p + i + 32)));
        a2 = _mm256_or_si256(a2, _mm256_load_si256((const __m256i *)(s->p + i + 64)));
        a3 = _mm256_or_si256(a3, _mm256_load_si256((const __m256i *)(s->p + i + 96)));
    }
    __m256i a = _mm256_or_si256(_mm256_or_si256(a0, a1), _mm256_or_si256(a2, a3));
    s->sink = (uint64_t)_mm256_extract_epi64(a, 0) | (uint64_t)_mm256_extract_epi64(a, 3);
    s->cpu = cpu_now() - c0;
    return NULL;
}

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

int main(int argc, char **argv) {
    if (argc < 3) return 2;
    size_t bytes = (size_t)atol(argv[1]) << 20;
    int threads = atoi(argv[2]), repeat = argc > 3 ? atoi(argv[3]) : 5;
    if (threads < 1 || threads > 1024 || bytes == 0) return 2;
    uint8_t *buf = aligned_alloc(4096, bytes);
    if (!buf) return 1;
    memset(buf, 1, bytes); /* touch every page before timing */
    double best = 0, best_cpu = 0;
    uint64_t sink = 0;
    for (int r = 0; r < repeat; r++) {
        pthread_barrier_t start;
        pthread_barrier_init(&start, NULL, (unsigned)threads + 1);
        pthread_t *th = calloc((size_t)threads, sizeof *th);
        slice *sl = calloc((size_t)threads, sizeof *sl);
        size_t per = bytes / (size_t)threads / 128 * 128;
        for (int t = 0; t < threads; t++) {
            sl[t] = (slice){buf + (size_t)t * per, per, &start, 0, 0};
            pthread_create(&th[t], NULL, reader, &sl[t]);
        }
        pthread_barrier_wait(&start);
        double t0 = now();
        for (int t = 0; t < threads; t++) pthread_join(th[t], NULL);
        double bps = (double)per * threads / (now() - t0);
        if (bps > best) best = bps;
        double cpu_bps = 0;
        for (int t = 0; t < threads; t++) cpu_bps += sl[t].cpu > 0 ? (double)per / sl[t].cpu : 0;
        if (cpu_bps > best_cpu) best_cpu = cpu_bps;
        for (int t = 0; t < threads; t++) sink |= sl[t].sink;
        free(th);
        free(sl);
        pthread_barrier_destroy(&start);
    }
    printf("%.0f %llu %.0f\n", best, (unsigned long long)(sink & 1), best_cpu);
    free(buf);
    return 0;
}
