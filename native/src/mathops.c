/* Numeric kernels: f16/bf16 conversion, the deterministic dot product and the
 * batched matmul built on it, and the thread pool that splits matmul outputs.
 * See mathops.h for the determinism contract. Compiled as ISO C11, so the
 * compiler never contracts a*b+c into an FMA behind our back: the only fused
 * operations are the explicit ones of the AVX2 path. */

#include "mathops.h"
#include "internal.h"

#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* ---- f16 / bf16 ----------------------------------------------------------- */

uint16_t rt_f32_to_f16(float f) {
    uint32_t x;
    memcpy(&x, &f, sizeof x);
    uint16_t sign = (uint16_t)((x >> 16) & 0x8000u);
    uint32_t abs = x & 0x7fffffffu;
    if (abs >= 0x7f800000u) { /* inf, or NaN kept quiet with its top payload bits */
        if (abs == 0x7f800000u) return (uint16_t)(sign | 0x7c00u);
        return (uint16_t)(sign | 0x7e00u | ((abs & 0x7fffffu) >> 13));
    }
    if (abs >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u); /* >= 65520 rounds to inf */
    if (abs >= 0x38800000u) {                                  /* normal half */
        /* Rebias 127 -> 15 and round the 13 dropped bits to nearest even; a
         * mantissa carry correctly bumps the exponent. */
        uint32_t r = abs + 0xfffu + ((abs >> 13) & 1u);
        r -= 112u << 23;
        return (uint16_t)(sign | (r >> 13));
    }
    /* Subnormal half (or zero): adding 0.5f leaves an ulp of 2^-24, so the FPU's
     * round-to-nearest-even does the rounding; the low bits are the mantissa. */
    float a;
    memcpy(&a, &abs, sizeof a);
    float v = a + 0.5f;
    uint32_t vb;
    memcpy(&vb, &v, sizeof vb);
    return (uint16_t)(sign | (vb - 0x3f000000u));
}

float rt_f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu;
    uint32_t mant = h & 0x3ffu;
    uint32_t bits;
    if (exp == 0) {
        float v = (float)mant * 5.9604644775390625e-8f; /* mant * 2^-24, exact */
        memcpy(&bits, &v, sizeof bits);
        bits |= sign;
    } else if (exp == 0x1f) {
        bits = sign | 0x7f800000u | (mant << 13);
    } else {
        bits = sign | ((exp + 112u) << 23) | (mant << 13);
    }
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

float rt_bf16_to_f32(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* ---- dot-product kernels ------------------------------------------------------
 * The dot product is defined as: one 8-lane accumulator over the first
 * n & ~7 elements in order, a fixed-order horizontal sum, then the tail
 * elements added one by one in order. A tile kernel computes RT x OT such dot
 * products at once (rows of x against rows of W), each with its own
 * accumulator following exactly that sequence, so a value never depends on
 * the tile shape. Tiles: 3x4 (main), 1x4, 3x1, 1x1. */

enum { TILE_R = 3, TILE_O = 4 };

typedef void (*tile_fn)(const float *x, size_t ldx, const float *w, size_t ldw, float *y, size_t ldy, int n);

typedef struct {
    tile_fn t_ro, t_1o, t_r1, t_11;
    const char *name;
} kernel_set;

/* Portable path: GCC vector extensions (SSE2 on baseline x86-64), multiply
 * then add, two roundings per term. */
typedef float v8f __attribute__((vector_size(32)));

/* Macros, not functions: a 32-byte vector by value changes the psABI without AVX. */
#define V8_LOAD(dst, p) memcpy(&(dst), (p), sizeof(v8f))
#define V8_HSUM(v) ((((v)[0] + (v)[4]) + ((v)[2] + (v)[6])) + (((v)[1] + (v)[5]) + ((v)[3] + (v)[7])))

static inline __attribute__((always_inline)) void tile_generic(const float *x, size_t ldx, const float *w, size_t ldw,
                                                               float *y, size_t ldy, int n, int RT, int OT) {
    v8f acc[TILE_R][TILE_O];
    for (int r = 0; r < RT; r++)
        for (int o = 0; o < OT; o++) acc[r][o] = (v8f){0, 0, 0, 0, 0, 0, 0, 0};
    int n8 = n & ~7;
    for (int i = 0; i < n8; i += 8) {
        v8f xv[TILE_R];
        for (int r = 0; r < RT; r++) V8_LOAD(xv[r], x + r * ldx + i);
        for (int o = 0; o < OT; o++) {
            v8f wv;
            V8_LOAD(wv, w + o * ldw + i);
            for (int r = 0; r < RT; r++) acc[r][o] = acc[r][o] + xv[r] * wv;
        }
    }
    for (int r = 0; r < RT; r++)
        for (int o = 0; o < OT; o++) {
            float s = V8_HSUM(acc[r][o]);
            for (int i = n8; i < n; i++) s = s + x[r * ldx + i] * w[o * ldw + i];
            y[r * ldy + o] = s;
        }
}

#define GENERIC_TILE(RT, OT)                                                                                    \
    static void tile_generic_##RT##x##OT(const float *x, size_t ldx, const float *w, size_t ldw, float *y,      \
                                         size_t ldy, int n) {                                                   \
        tile_generic(x, ldx, w, ldw, y, ldy, n, RT, OT);                                                        \
    }
GENERIC_TILE(3, 4)
GENERIC_TILE(1, 4)
GENERIC_TILE(3, 1)
GENERIC_TILE(1, 1)

static const kernel_set generic_kernels = {tile_generic_3x4, tile_generic_1x4, tile_generic_3x1, tile_generic_1x1,
                                           "generic"};

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#pragma GCC push_options
#pragma GCC target("avx2,fma")

static inline float hsum_avx(__m256 v) {
    /* Same association as V8_HSUM: (l0+l4 + l2+l6) + (l1+l5 + l3+l7). */
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1)); /* a b c d */
    __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));                                   /* a+c b+d */
    return _mm_cvtss_f32(_mm_add_ss(t, _mm_shuffle_ps(t, t, 1)));
}

static inline __attribute__((always_inline)) void tile_avx(const float *x, size_t ldx, const float *w, size_t ldw,
                                                           float *y, size_t ldy, int n, int RT, int OT) {
    __m256 acc[TILE_R][TILE_O];
    for (int r = 0; r < RT; r++)
        for (int o = 0; o < OT; o++) acc[r][o] = _mm256_setzero_ps();
    int n8 = n & ~7;
    for (int i = 0; i < n8; i += 8) {
        __m256 xv[TILE_R];
        for (int r = 0; r < RT; r++) xv[r] = _mm256_loadu_ps(x + r * ldx + i);
        for (int o = 0; o < OT; o++) {
            __m256 wv = _mm256_loadu_ps(w + o * ldw + i);
            for (int r = 0; r < RT; r++) acc[r][o] = _mm256_fmadd_ps(xv[r], wv, acc[r][o]);
        }
    }
    for (int r = 0; r < RT; r++)
        for (int o = 0; o < OT; o++) {
            float s = hsum_avx(acc[r][o]);
            for (int i = n8; i < n; i++) s = fmaf(x[r * ldx + i], w[o * ldw + i], s);
            y[r * ldy + o] = s;
        }
}

#define AVX_TILE(RT, OT)                                                                                        \
    static void tile_avx_##RT##x##OT(const float *x, size_t ldx, const float *w, size_t ldw, float *y,          \
                                     size_t ldy, int n) {                                                       \
        tile_avx(x, ldx, w, ldw, y, ldy, n, RT, OT);                                                            \
    }
AVX_TILE(3, 4)
AVX_TILE(1, 4)
AVX_TILE(3, 1)
AVX_TILE(1, 1)

#pragma GCC pop_options

static const kernel_set avx_kernels = {tile_avx_3x4, tile_avx_1x4, tile_avx_3x1, tile_avx_1x1, "avx2-fma"};
#endif

static const kernel_set *g_kernels;
static pthread_once_t g_kernels_once = PTHREAD_ONCE_INIT;

/* Chosen once per process: results must never change between two calls.
 * BASERT_REF_SIMD=0 forces the portable path (used by the tests). */
static void select_kernels(void) {
    g_kernels = &generic_kernels;
#if defined(__x86_64__) && defined(__GNUC__)
    const char *env = getenv("BASERT_REF_SIMD");
    bool allowed = !(env && env[0] == '0');
    __builtin_cpu_init();
    if (allowed && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) g_kernels = &avx_kernels;
#endif
}

static const kernel_set *kernels(void) {
    pthread_once(&g_kernels_once, select_kernels);
    return g_kernels;
}

const char *rt_mathops_isa(void) { return kernels()->name; }

float rt_dot(const float *a, const float *b, int n) {
    float y;
    kernels()->t_11(a, 0, b, 0, &y, 0, n);
    return y;
}

/* ---- matmul driver ------------------------------------------------------------ */

/* Rows are processed in blocks small enough to stay in L2 while the weights
 * stream past once per block (decode batches are a single block). Outputs are
 * handed to threads in units of OUT_UNIT columns. */
enum { ROW_BLOCK = 64, OUT_UNIT = 16 };

static void matmul_range(const kernel_set *ks, const float *x, size_t ldx, int rows, int in, const rt_mm_target *t,
                         int o0, int o1) {
    size_t ldw = (size_t)in;
    for (int rb = 0; rb < rows; rb += ROW_BLOCK) {
        int rn = rows - rb < ROW_BLOCK ? rows - rb : ROW_BLOCK;
        const float *xb = x + (size_t)rb * ldx;
        float *yb = t->y + (size_t)rb * t->ldy;
        int o = o0;
        for (; o + TILE_O <= o1; o += TILE_O) {
            const float *w = t->w + (size_t)o * ldw;
            int r = 0;
            for (; r + TILE_R <= rn; r += TILE_R) ks->t_ro(xb + r * ldx, ldx, w, ldw, yb + r * t->ldy + o, t->ldy, in);
            for (; r < rn; r++) ks->t_1o(xb + r * ldx, ldx, w, ldw, yb + r * t->ldy + o, t->ldy, in);
        }
        for (; o < o1; o++) {
            const float *w = t->w + (size_t)o * ldw;
            int r = 0;
            for (; r + TILE_R <= rn; r += TILE_R) ks->t_r1(xb + r * ldx, ldx, w, ldw, yb + r * t->ldy + o, t->ldy, in);
            for (; r < rn; r++) ks->t_11(xb + r * ldx, ldx, w, ldw, yb + r * t->ldy + o, t->ldy, in);
        }
    }
}

typedef struct {
    const kernel_set *ks;
    const float *x;
    size_t ldx;
    int rows, in;
    const rt_mm_target *targets;
    int n_targets;
    int total_units;
    atomic_int next_unit;
} matmul_job;

static int units_of(int out) { return (out + OUT_UNIT - 1) / OUT_UNIT; }

static void matmul_task(void *ctx, int tid) {
    (void)tid;
    matmul_job *j = ctx;
    for (;;) {
        int u = atomic_fetch_add_explicit(&j->next_unit, 1, memory_order_relaxed);
        if (u >= j->total_units) return;
        int i = 0;
        while (u >= units_of(j->targets[i].out)) u -= units_of(j->targets[i++].out);
        const rt_mm_target *t = &j->targets[i];
        int o0 = u * OUT_UNIT, o1 = o0 + OUT_UNIT < t->out ? o0 + OUT_UNIT : t->out;
        matmul_range(j->ks, j->x, j->ldx, j->rows, j->in, t, o0, o1);
    }
}

void rt_matmul(rt_threads *th, const float *x, size_t ldx, int rows, int in, const rt_mm_target *targets,
               int n_targets) {
    matmul_job job = {kernels(), x, ldx, rows, in, targets, n_targets, 0, 0};
    double flops = 0;
    for (int i = 0; i < n_targets; i++) {
        job.total_units += units_of(targets[i].out);
        flops += (double)rows * in * targets[i].out;
    }
    /* Below ~64k multiply-adds a wake-up costs more than it saves. */
    int nt = flops < 65536.0 ? 1 : rt_threads_count(th);
    if (nt > job.total_units) nt = job.total_units;
    rt_threads_run(th, matmul_task, &job, nt);
}

/* ---- thread pool ---------------------------------------------------------------
 * Persistent workers parked on a condition variable. A run is open from the
 * moment it is posted until the caller has finished its own share; a worker
 * joins only while it is open (under the mutex), and the caller waits only for
 * the workers that joined. A worker the OS has not scheduled yet therefore
 * never delays a step: it finds the run closed and goes back to sleep. */

struct rt_threads {
    int n; /* threads including the caller */
    pthread_t *th;
    pthread_mutex_t mu;
    pthread_cond_t cv_start, cv_done;
    rt_task_fn fn;
    void *ctx;
    int max_joined; /* workers allowed into the current run */
    unsigned long generation;
    bool open;
    int joined, finished;
    bool stop;
};

typedef struct {
    rt_threads *pool;
    int tid;
} worker_arg;

static void *worker_main(void *arg) {
    worker_arg wa = *(worker_arg *)arg;
    free(arg);
    rt_threads *p = wa.pool;
    unsigned long seen = 0;
    pthread_mutex_lock(&p->mu);
    for (;;) {
        while (p->generation == seen && !p->stop) pthread_cond_wait(&p->cv_start, &p->mu);
        if (p->stop) break;
        seen = p->generation;
        if (!p->open || p->joined >= p->max_joined) continue;
        p->joined++;
        rt_task_fn fn = p->fn;
        void *ctx = p->ctx;
        pthread_mutex_unlock(&p->mu);
        fn(ctx, wa.tid);
        pthread_mutex_lock(&p->mu);
        if (++p->finished == p->joined && !p->open) pthread_cond_signal(&p->cv_done);
    }
    pthread_mutex_unlock(&p->mu);
    return NULL;
}

int rt_default_threads(void) {
    const char *env = getenv("BASERT_REF_THREADS");
    long n = 0;
    if (env && *env) n = strtol(env, NULL, 10);
    if (n <= 0) n = sysconf(_SC_NPROCESSORS_ONLN);
    if (n < 1) n = 1;
    if (n > 8) n = 8;
    return (int)n;
}

rt_threads *rt_threads_create(int n_threads) {
    rt_threads *p = calloc(1, sizeof *p);
    if (!p) return NULL;
    p->n = n_threads < 1 ? 1 : n_threads;
    pthread_mutex_init(&p->mu, NULL);
    pthread_cond_init(&p->cv_start, NULL);
    pthread_cond_init(&p->cv_done, NULL);
    if (p->n > 1) {
        p->th = calloc((size_t)p->n - 1, sizeof *p->th);
        if (!p->th) {
            rt_threads_free(p);
            return NULL;
        }
        for (int i = 1; i < p->n; i++) {
            worker_arg *wa = malloc(sizeof *wa);
            if (wa) {
                wa->pool = p;
                wa->tid = i;
            }
            if (!wa || pthread_create(&p->th[i - 1], NULL, worker_main, wa) != 0) {
                free(wa);
                p->n = i; /* keep the workers that did start; free() joins them */
                rt_threads_free(p);
                return NULL;
            }
        }
    }
    return p;
}

void rt_threads_free(rt_threads *p) {
    if (!p) return;
    if (p->th) {
        pthread_mutex_lock(&p->mu);
        p->stop = true;
        pthread_cond_broadcast(&p->cv_start);
        pthread_mutex_unlock(&p->mu);
        for (int i = 1; i < p->n; i++) pthread_join(p->th[i - 1], NULL);
        free(p->th);
    }
    pthread_mutex_destroy(&p->mu);
    pthread_cond_destroy(&p->cv_start);
    pthread_cond_destroy(&p->cv_done);
    free(p);
}

int rt_threads_count(const rt_threads *p) { return p ? p->n : 1; }

void rt_threads_run(rt_threads *p, rt_task_fn fn, void *ctx, int n_threads) {
    if (!p || p->n <= 1 || n_threads <= 1) {
        fn(ctx, 0);
        return;
    }
    pthread_mutex_lock(&p->mu);
    p->fn = fn;
    p->ctx = ctx;
    p->max_joined = (n_threads < p->n ? n_threads : p->n) - 1;
    p->joined = p->finished = 0;
    p->open = true;
    p->generation++;
    pthread_cond_broadcast(&p->cv_start);
    pthread_mutex_unlock(&p->mu);
    fn(ctx, 0);
    pthread_mutex_lock(&p->mu);
    p->open = false;
    while (p->finished < p->joined) pthread_cond_wait(&p->cv_done, &p->mu);
    pthread_mutex_unlock(&p->mu);
}
