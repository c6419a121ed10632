/* Numeric kernels: f16/bf16 conversion, the deterministic dot product and the
 * batched matmul built on it, and the thread pool that splits matmul outputs.
 * See mathops.h for the determinism contract. Compiled as ISO C11, so the
 * compiler never contracts a*b+c into an FMA behind our back: the only fused
 * operations are the explicit ones of the AVX2 and AVX-512 kernels. */

#include "mathops.h"
#include "cpu.h"
#include "f16.h"
#include "quant.h"
#include "baseRT/reference.h"

#include <math.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

size_t rt_weight_elem_size(int type) { return type == RT_W_F16 ? 2 : 4; }

void rt_weight_row(const rt_weight *w, size_t row, int n, float *out) {
    if (RT_W_IS_QUANT(w->type)) {
        rt_qweight_row(w, row, n, out);
        return;
    }
    if (w->type == RT_W_F16) {
        const uint16_t *h = (const uint16_t *)w->p + row * (size_t)n;
        for (int i = 0; i < n; i++) out[i] = rt_f16_to_f32(h[i]);
    } else {
        memcpy(out, (const float *)w->p + row * (size_t)n, (size_t)n * sizeof(float));
    }
}

/* ---- dot-product kernels ------------------------------------------------------
 * The dot product is defined as: one V-lane accumulator over the first
 * n - n % V elements in order, a fixed-order horizontal sum, then the tail
 * elements added one by one in order. V = 16 with fused multiply-adds for the
 * AVX-512 and AVX2 sets (AVX2 runs the 16 lanes as two 8-lane halves): the two
 * compute the same bits, as the integer kernels do; V = 8, multiply then add,
 * for the portable set. A tile
 * kernel computes RT x OT such dot products at once (RT rows of x against OT
 * rows of W), each with its own accumulator following exactly that sequence,
 * so a value never depends on the tile it lands in. Every set provides tiles
 * RMxOM, 2xOM, 1xOM, RMx1 and 1x1 (RM, OM = its main tile shape), for f32
 * weights and for f16 weights.
 *
 * f16 weights stay f16 in memory (half the bytes to stream per decode step)
 * and are widened in registers (F16C / AVX-512 vcvtph2ps, or one element at
 * a time on the portable path). Widening f16 to f32 is exact, so an f16 tile
 * performs exactly the operations the f32 tile performs on the f32 copy the
 * loader used to make: outputs are bit-identical to the widened-at-load ones.
 *
 * While a tile streams its OT weight rows it prefetches, into L2, the rows
 * PREFETCH_TILES tiles ahead (the matmul walks weight rows in order): decode
 * reads every weight once per step from DRAM, and this overlaps that stream
 * with the arithmetic. Prefetching never changes a value. */

enum { TILE_OMAX = 6, TILE_RMAX = 4, PREFETCH_TILES = 2 };

typedef void (*tile_fn)(const float *x, size_t ldx, const void *w, size_t ldw, float *y, size_t ldy, int n);
/* y[k] += sum over t < n, in order, of p[t] * v[t * ldv + k], for k < d. */
typedef void (*axpy_fn)(const float *p, int n, const void *v, size_t ldv, float *y, int d);

typedef struct {
    tile_fn t_main, t_2, t_1, t_main1, t_11;
} tile_set;

typedef struct {
    int rows_main, cols_main;
    tile_set f32, f16; /* by weight type */
    axpy_fn axpy, axpy_h; /* f32 / f16 values */
    const char *name;
} kernel_set;

/* Tiles keep their accumulators in registers only once the r/o loops are
 * fully unrolled; ask for it explicitly so -O2 builds get it too. */
#define UNROLL _Pragma("GCC unroll 8")

/* Address of element i of weight row o + PREFETCH_TILES * OT, computed as an
 * integer: it may lie past the matrix (a prefetch there is harmless, forming
 * such a pointer by pointer arithmetic would not be). ES: element size. */
#define AHEAD(w, ldw, o, OT, i, ES)                                                                             \
    ((const char *)((uintptr_t)(w) + (((size_t)(OT) * PREFETCH_TILES + (size_t)(o)) * (ldw) + (size_t)(i)) *   \
                                         (size_t)(ES)))

/* Scalar weight element k of a row (tails), f32 or f16 (exact widening). */
#define WSCALAR(w, F16, k) ((F16) ? rt_f16_to_f32(((const uint16_t *)(w))[k]) : ((const float *)(w))[k])

#define DEFINE_TILE(PREFIX, RT, OT)                                                                             \
    static void PREFIX##_##RT##x##OT(const float *x, size_t ldx, const void *w, size_t ldw, float *y,           \
                                     size_t ldy, int n) {                                                       \
        PREFIX(x, ldx, w, ldw, y, ldy, n, RT, OT, 0);                                                           \
    }                                                                                                           \
    static void PREFIX##_##RT##x##OT##_h(const float *x, size_t ldx, const void *w, size_t ldw, float *y,       \
                                         size_t ldy, int n) {                                                   \
        PREFIX(x, ldx, w, ldw, y, ldy, n, RT, OT, 1);                                                           \
    }

#define TILE_SET(PREFIX, RM, OM, SUF)                                                                           \
    {                                                                                                           \
        PREFIX##_##RM##x##OM##SUF, PREFIX##_2x##OM##SUF, PREFIX##_1x##OM##SUF, PREFIX##_##RM##x1##SUF,         \
            PREFIX##_1x1##SUF                                                                                   \
    }

/* Portable path: GCC vector extensions (SSE2 on baseline x86-64), multiply
 * then add, two roundings per term. */
typedef float v8f __attribute__((vector_size(32)));

/* Macros, not functions: a 32-byte vector by value changes the psABI without AVX. */
#define V8_LOAD(dst, p) memcpy(&(dst), (p), sizeof(v8f))
#define V8_HSUM(v) ((((v)[0] + (v)[4]) + ((v)[2] + (v)[6])) + (((v)[1] + (v)[5]) + ((v)[3] + (v)[7])))
#define V8_LOAD_W(dst, w, F16, off)                                                                             \
    do {                                                                                                        \
        if (F16) {                                                                                              \
            const uint16_t *h_ = (const uint16_t *)(w) + (off);                                                 \
            for (int k_ = 0; k_ < 8; k_++) (dst)[k_] = rt_f16_to_f32(h_[k_]);                                   \
        } else {                                                                                                \
            V8_LOAD(dst, (const float *)(w) + (off));                                                           \
        }                                                                                                       \
    } while (0)

static inline __attribute__((always_inline)) void tile_generic(const float *x, size_t ldx, const void *w, size_t ldw,
                                                               float *y, size_t ldy, int n, int RT, int OT, int F16) {
    v8f acc[TILE_RMAX][TILE_OMAX];
    size_t es = F16 ? 2 : 4;
    UNROLL
    for (int r = 0; r < RT; r++)
        UNROLL
        for (int o = 0; o < OT; o++) acc[r][o] = (v8f){0, 0, 0, 0, 0, 0, 0, 0};
    int nv = n & ~7;
    for (int i = 0; i < nv; i += 8) {
        v8f xv[TILE_RMAX];
        UNROLL
        for (int r = 0; r < RT; r++) V8_LOAD(xv[r], x + r * ldx + i);
        UNROLL
        for (int o = 0; o < OT; o++) {
            v8f wv;
            V8_LOAD_W(wv, w, F16, o * ldw + i);
            __builtin_prefetch(AHEAD(w, ldw, o, OT, i, es), 0, 2);
            UNROLL
            for (int r = 0; r < RT; r++) acc[r][o] = acc[r][o] + xv[r] * wv;
        }
    }
    UNROLL
    for (int r = 0; r < RT; r++)
        UNROLL
        for (int o = 0; o < OT; o++) {
            float s = V8_HSUM(acc[r][o]);
            for (int i = nv; i < n; i++) s = s + x[r * ldx + i] * WSCALAR(w, F16, o * ldw + i);
            y[r * ldy + o] = s;
        }
}

DEFINE_TILE(tile_generic, 3, 4)
DEFINE_TILE(tile_generic, 2, 4)
DEFINE_TILE(tile_generic, 1, 4)
DEFINE_TILE(tile_generic, 3, 1)
DEFINE_TILE(tile_generic, 1, 1)

static inline __attribute__((always_inline)) void axpy_generic_t(const float *p, int n, const void *v, size_t ldv,
                                                                 float *y, int d, int F16) {
    int k = 0;
    for (; k + 8 <= d; k += 8) {
        v8f acc, vv;
        V8_LOAD(acc, y + k);
        for (int t = 0; t < n; t++) {
            V8_LOAD_W(vv, v, F16, t * ldv + k);
            acc = acc + p[t] * vv;
        }
        memcpy(y + k, &acc, sizeof acc);
    }
    for (; k < d; k++)
        for (int t = 0; t < n; t++) y[k] = y[k] + p[t] * WSCALAR(v, F16, t * ldv + k);
}

static void axpy_generic(const float *p, int n, const void *v, size_t ldv, float *y, int d) {
    axpy_generic_t(p, n, v, ldv, y, d, 0);
}
static void axpy_generic_h(const float *p, int n, const void *v, size_t ldv, float *y, int d) {
    axpy_generic_t(p, n, v, ldv, y, d, 1);
}

static const kernel_set generic_kernels = {3, 4, TILE_SET(tile_generic, 3, 4, ), TILE_SET(tile_generic, 3, 4, _h),
                                           axpy_generic, axpy_generic_h,
                                           "generic"};

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>

/* Clear the upper vector halves before returning to SSE code: the compiler
 * only does it for us when optimising (-O2), and without it every later SSE
 * instruction (the portable code around the kernels, libm) pays a transition
 * penalty -- a 7x slowdown of -O1 / sanitizer builds. */
#define LEAVE_AVX() _mm256_zeroupper()

/* AVX2 + FMA (+ F16C for f16 weights): the AVX-512 kernels' dot product, 8 lanes at a time. Lanes 0-7
 * of AVX-512's 16-lane accumulator take elements 16k..16k+7, lanes 8-15 elements 16k+8..16k+15; here two
 * 8-lane accumulators per dot product do, added before the same horizontal sum, then the same tail:
 * every value is bit for bit the one the AVX-512 set computes, so an AVX2 machine follows the same greedy
 * path as an AVX-512 one (quantized activations turn a last-bit difference upstream into a different Q8
 * rounding, and at a near-tie a different token). A 3x4 tile's 24 accumulators do not fit 16
 * registers: each chunk of AVX2_CHUNK elements is passed twice, low lanes then high lanes (the chunk's
 * rows still in L1), 12 accumulators in registers at a time. */
enum { AVX2_CHUNK = 256 };
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")

static inline float hsum_avx(__m256 v) {
    /* Same association as V8_HSUM: (l0+l4 + l2+l6) + (l1+l5 + l3+l7). */
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1)); /* a b c d */
    __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));                                   /* a+c b+d */
    return _mm_cvtss_f32(_mm_add_ss(t, _mm_shuffle_ps(t, t, 1)));
}

static inline __attribute__((always_inline)) __m256 load8_w(const void *w, size_t off, int F16) {
    if (F16) return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)w + off)));
    return _mm256_loadu_ps((const float *)w + off);
}

static inline __attribute__((always_inline)) void tile_avx2(const float *x, size_t ldx, const void *w, size_t ldw,
                                                            float *y, size_t ldy, int n, int RT, int OT, int F16) {
    /* [half of the 16-lane step][row][output]: kept in memory between passes, 12 in registers at a time */
    __m256 hold[2][TILE_RMAX][TILE_OMAX];
    size_t es = F16 ? 2 : 4;
    UNROLL
    for (int h = 0; h < 2; h++)
        UNROLL
        for (int r = 0; r < RT; r++)
            UNROLL
            for (int o = 0; o < OT; o++) hold[h][r][o] = _mm256_setzero_ps();
    int nv = n & ~15;
    for (int c0 = 0; c0 < nv; c0 += AVX2_CHUNK) {
        int c1 = nv - c0 < AVX2_CHUNK ? nv : c0 + AVX2_CHUNK;
        UNROLL
        for (int h = 0; h < 2; h++) { /* the chunk's low lanes, then (from L1) its high ones */
            __m256 acc[TILE_RMAX][TILE_OMAX];
            UNROLL
            for (int r = 0; r < RT; r++)
                UNROLL
                for (int o = 0; o < OT; o++) acc[r][o] = hold[h][r][o];
            for (int i = c0 + 8 * h; i < c1; i += 16) {
                __m256 xv[TILE_RMAX];
                UNROLL
                for (int r = 0; r < RT; r++) xv[r] = _mm256_loadu_ps(x + r * ldx + i);
                UNROLL
                for (int o = 0; o < OT; o++) {
                    __m256 wv = load8_w(w, o * ldw + i, F16);
                    if (h == 0) _mm_prefetch(AHEAD(w, ldw, o, OT, i, es), _MM_HINT_T1);
                    UNROLL
                    for (int r = 0; r < RT; r++) acc[r][o] = _mm256_fmadd_ps(xv[r], wv, acc[r][o]);
                }
            }
            UNROLL
            for (int r = 0; r < RT; r++)
                UNROLL
                for (int o = 0; o < OT; o++) hold[h][r][o] = acc[r][o];
        }
    }
    UNROLL
    for (int r = 0; r < RT; r++)
        UNROLL
        for (int o = 0; o < OT; o++) {
            float s = hsum_avx(_mm256_add_ps(hold[0][r][o], hold[1][r][o])); /* hsum_avx512's order */
            for (int i = nv; i < n; i++) s = fmaf(x[r * ldx + i], WSCALAR(w, F16, o * ldw + i), s);
            y[r * ldy + o] = s;
        }
    LEAVE_AVX();
}

DEFINE_TILE(tile_avx2, 3, 4)
DEFINE_TILE(tile_avx2, 2, 4)
DEFINE_TILE(tile_avx2, 1, 4)
DEFINE_TILE(tile_avx2, 3, 1)
DEFINE_TILE(tile_avx2, 1, 1)

static inline __attribute__((always_inline)) void axpy_avx2_t(const float *p, int n, const void *v, size_t ldv,
                                                              float *y, int d, int F16) {
    int k = 0;
    for (; k + 16 <= d; k += 16) {
        __m256 a0 = _mm256_loadu_ps(y + k), a1 = _mm256_loadu_ps(y + k + 8);
        for (int t = 0; t < n; t++) {
            __m256 pt = _mm256_set1_ps(p[t]);
            a0 = _mm256_fmadd_ps(pt, load8_w(v, t * ldv + k, F16), a0);
            a1 = _mm256_fmadd_ps(pt, load8_w(v, t * ldv + k + 8, F16), a1);
        }
        _mm256_storeu_ps(y + k, a0);
        _mm256_storeu_ps(y + k + 8, a1);
    }
    for (; k < d; k++)
        for (int t = 0; t < n; t++) y[k] = fmaf(p[t], WSCALAR(v, F16, t * ldv + k), y[k]);
    LEAVE_AVX();
}

static void axpy_avx2(const float *p, int n, const void *v, size_t ldv, float *y, int d) {
    axpy_avx2_t(p, n, v, ldv, y, d, 0);
}
static void axpy_avx2_h(const float *p, int n, const void *v, size_t ldv, float *y, int d) {
    axpy_avx2_t(p, n, v, ldv, y, d, 1);
}

#pragma GCC pop_options

/* AVX-512: 16 lanes, 4x6 main tile (24 accumulators of 32 registers). */
#pragma GCC push_options
#pragma GCC target("avx512f,avx2,fma,f16c")

static inline float hsum_avx512(__m512 v) {
    __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
    return hsum_avx(_mm256_add_ps(_mm512_castps512_ps256(v), hi));
}

static inline __attribute__((always_inline)) __m512 load16_w(const void *w, size_t off, int F16) {
    if (F16) return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)w + off)));
    return _mm512_loadu_ps((const float *)w + off);
}

static inline __attribute__((always_inline)) void tile_avx512(const float *x, size_t ldx, const void *w,
                                                              size_t ldw, float *y, size_t ldy, int n, int RT,
                                                              int OT, int F16) {
    __m512 acc[TILE_RMAX][TILE_OMAX];
    size_t es = F16 ? 2 : 4;
    UNROLL
    for (int r = 0; r < RT; r++)
        UNROLL
        for (int o = 0; o < OT; o++) acc[r][o] = _mm512_setzero_ps();
    int nv = n & ~15;
    for (int i = 0; i < nv; i += 16) {
        __m512 xv[TILE_RMAX];
        UNROLL
        for (int r = 0; r < RT; r++) xv[r] = _mm512_loadu_ps(x + r * ldx + i);
        UNROLL
        for (int o = 0; o < OT; o++) {
            __m512 wv = load16_w(w, o * ldw + i, F16);
            _mm_prefetch(AHEAD(w, ldw, o, OT, i, es), _MM_HINT_T1);
            UNROLL
            for (int r = 0; r < RT; r++) acc[r][o] = _mm512_fmadd_ps(xv[r], wv, acc[r][o]);
        }
    }
    UNROLL
    for (int r = 0; r < RT; r++)
        UNROLL
        for (int o = 0; o < OT; o++) {
            float s = hsum_avx512(acc[r][o]);
            for (int i = nv; i < n; i++) s = fmaf(x[r * ldx + i], WSCALAR(w, F16, o * ldw + i), s);
            y[r * ldy + o] = s;
        }
    LEAVE_AVX();
}

DEFINE_TILE(tile_avx512, 4, 6)
DEFINE_TILE(tile_avx512, 2, 6)
DEFINE_TILE(tile_avx512, 1, 6)
DEFINE_TILE(tile_avx512, 4, 1)
DEFINE_TILE(tile_avx512, 1, 1)

static inline __attribute__((always_inline)) void axpy_avx512_t(const float *p, int n, const void *v, size_t ldv,
                                                                float *y, int d, int F16) {
    int k = 0;
    for (; k + 32 <= d; k += 32) {
        __m512 a0 = _mm512_loadu_ps(y + k), a1 = _mm512_loadu_ps(y + k + 16);
        for (int t = 0; t < n; t++) {
            __m512 pt = _mm512_set1_ps(p[t]);
            a0 = _mm512_fmadd_ps(pt, load16_w(v, t * ldv + k, F16), a0);
            a1 = _mm512_fmadd_ps(pt, load16_w(v, t * ldv + k + 16, F16), a1);
        }
        _mm512_storeu_ps(y + k, a0);
        _mm512_storeu_ps(y + k + 16, a1);
    }
    for (; k < d; k++)
        for (int t = 0; t < n; t++) y[k] = fmaf(p[t], WSCALAR(v, F16, t * ldv + k), y[k]);
    LEAVE_AVX();
}

static void axpy_avx512(const float *p, int n, const void *v, size_t ldv, float *y, int d) {
    axpy_avx512_t(p, n, v, ldv, y, d, 0);
}
static void axpy_avx512_h(const float *p, int n, const void *v, size_t ldv, float *y, int d) {
    axpy_avx512_t(p, n, v, ldv, y, d, 1);
}

#pragma GCC pop_options

static const kernel_set avx2_kernels = {3, 4, TILE_SET(tile_avx2, 3, 4, ), TILE_SET(tile_avx2, 3, 4, _h),
                                        axpy_avx2, axpy_avx2_h, "avx2-fma"};
static const kernel_set avx512_kernels = {4, 6, TILE_SET(tile_avx512, 4, 6, ), TILE_SET(tile_avx512, 4, 6, _h),
                                          axpy_avx512, axpy_avx512_h, "avx512"};
#endif

static const kernel_set *g_kernels;
static pthread_once_t g_kernels_once = PTHREAD_ONCE_INIT;

/* Chosen once per process: results must never change between two calls.
 * BASERT_REF_SIMD caps the choice (tests): "generic" (or "0"), "avx2". */
static void select_kernels(void) {
    int level = rt_simd_level(NULL);
    g_kernels = &generic_kernels;
#if defined(__x86_64__) && defined(__GNUC__)
    if (level >= RT_SIMD_AVX2) g_kernels = &avx2_kernels;
    if (level >= RT_SIMD_AVX512) g_kernels = &avx512_kernels;
#endif
}

static const kernel_set *kernels(void) {
    pthread_once(&g_kernels_once, select_kernels);
    return g_kernels;
}

const char *rt_mathops_isa(void) { return kernels()->name; }

static char g_kernels_text[64];
static void describe_kernels(void) {
    snprintf(g_kernels_text, sizeof g_kernels_text, "float=%s quant=%s", rt_mathops_isa(), rt_quant_isa());
}

const char *baseRT_ref_kernels(void) {
    static pthread_once_t once = PTHREAD_ONCE_INIT;
    pthread_once(&once, describe_kernels);
    return g_kernels_text;
}

/* ---- matmul driver ------------------------------------------------------------ */

/* Rows are processed in blocks small enough to stay in L2 while the weights
 * stream past once per block (decode batches are a single block). Outputs are
 * handed to threads in units of OUT_UNIT columns. */
enum { ROW_BLOCK = 64, OUT_UNIT = 48 }; /* a multiple of every set's cols_main and of quant.c's 16-row panels */

static void matmul_range(const kernel_set *ks, const float *x, size_t ldx, int rows, int in, size_t ldw,
                         const rt_mm_target *t, int o0, int o1) {
    size_t ldy = t->ldy;
    int rm = ks->rows_main, om = ks->cols_main;
    const tile_set *ts = t->w.type == RT_W_F16 ? &ks->f16 : &ks->f32;
    size_t es = t->w.type == RT_W_F16 ? 2 : 4;
    const char *wbase = t->w.p;
    for (int rb = 0; rb < rows; rb += ROW_BLOCK) {
        int rn = rows - rb < ROW_BLOCK ? rows - rb : ROW_BLOCK;
        const float *xb = x + (size_t)rb * ldx;
        float *yb = t->y + (size_t)rb * ldy;
        int o = o0;
        for (; o + om <= o1; o += om) {
            const void *w = wbase + (size_t)o * ldw * es;
            int r = 0;
            /* Main tiles, then pairs (a 3-row set splits a remainder of 4 in
             * two pairs rather than 3 + a lone row), then a lone row. */
            for (; rn - r >= rm && !(rm == 3 && rn - r == 4); r += rm)
                ts->t_main(xb + r * ldx, ldx, w, ldw, yb + r * ldy + o, ldy, in);
            for (; rn - r >= 2; r += 2) ts->t_2(xb + r * ldx, ldx, w, ldw, yb + r * ldy + o, ldy, in);
            if (r < rn) ts->t_1(xb + r * ldx, ldx, w, ldw, yb + r * ldy + o, ldy, in);
        }
        for (; o < o1; o++) {
            const void *w = wbase + (size_t)o * ldw * es;
            int r = 0;
            for (; rn - r >= rm; r += rm) ts->t_main1(xb + r * ldx, ldx, w, ldw, yb + r * ldy + o, ldy, in);
            for (; r < rn; r++) ts->t_11(xb + r * ldx, ldx, w, ldw, yb + r * ldy + o, ldy, in);
        }
    }
}

enum { MM_MAX_RANGES = 64 };

typedef struct {
    const kernel_set *ks;
    const float *x;
    const uint8_t *xq; /* x quantized per block of 32 (when a target is quantized): quant.h */
    size_t ldx;
    int rows, in;
    const rt_mm_target *targets;
    int n_targets;
    int total_units;
    /* Units are split into n_ranges contiguous ranges, one per thread, each claimed in order through
     * its counter: a thread streams one ascending stretch of the weights (what the hardware prefetcher
     * follows best), and one that is descheduled has its range finished by the others. */
    int n_ranges;
    atomic_int claimed[MM_MAX_RANGES];
} matmul_job;

static int units_of(int out) { return (out + OUT_UNIT - 1) / OUT_UNIT; }

static void matmul_unit(const matmul_job *j, int u) {
    int i = 0;
    while (u >= units_of(j->targets[i].out)) u -= units_of(j->targets[i++].out);
    const rt_mm_target *t = &j->targets[i];
    int o0 = u * OUT_UNIT, o1 = o0 + OUT_UNIT < t->out ? o0 + OUT_UNIT : t->out;
    if (RT_W_IS_QUANT(t->w.type))
        rt_qmatmul_range(&t->w, j->in, j->xq, j->rows, t->y, t->ldy, o0, o1);
    else
        matmul_range(j->ks, j->x, j->ldx, j->rows, j->in, (size_t)j->in, t, o0, o1);
}

static void matmul_task(void *ctx, int tid) {
    matmul_job *j = ctx;
    int nr = j->n_ranges;
    for (int k = 0; k < nr; k++) { /* the home range first, then help with the others */
        int r = (tid + k) % nr;
        int first = (int)((long long)j->total_units * r / nr), last = (int)((long long)j->total_units * (r + 1) / nr);
        for (;;) {
            int u = first + atomic_fetch_add_explicit(&j->claimed[r], 1, memory_order_relaxed);
            if (u >= last) break;
            matmul_unit(j, u);
        }
    }
}

/* The least work worth a thread of its own: a wake-up and a join cost about a
 * microsecond, in which a core streams ~8-16 KB of weights or does ~100k
 * multiply-adds; a share of several times that keeps the overhead small. A
 * decode step's smallest matrices (SmolLM2's 576 x 576 in q4: 207 KB) thus
 * run on ~6 threads, its FFN and head on all of them. */
static const double MIN_BYTES_PER_THREAD = 32.0 * 1024, MIN_MACS_PER_THREAD = 256.0 * 1024;

static double weight_bytes(const rt_weight *w, int in, int out) {
    double row = RT_W_IS_QUANT(w->type) ? (double)rt_qweight_row_bytes(w, in) : (double)in * rt_weight_elem_size(w->type);
    return row * out;
}

void rt_matmul(rt_threads *th, const float *x, size_t ldx, int rows, int in, const rt_mm_target *targets,
               int n_targets, void *xq) {
    matmul_job job = {.ks = kernels(), .x = x, .ldx = ldx, .rows = rows, .in = in, .targets = targets,
                      .n_targets = n_targets};
    double macs = 0, bytes = 0;
    bool quant = false;
    for (int i = 0; i < n_targets; i++) {
        job.total_units += units_of(targets[i].out);
        macs += (double)rows * in * targets[i].out;
        bytes += weight_bytes(&targets[i].w, in, targets[i].out);
        quant |= RT_W_IS_QUANT(targets[i].w.type);
    }
    if (quant) { /* the loader guarantees in % 32 == 0 for quantized weights */
        rt_qx_quantize(x, ldx, rows, in, xq);
        job.xq = xq;
    }
    /* Threads by whichever bounds the op: the weights it streams (decode) or its arithmetic (prefill). */
    double by_bytes = bytes / MIN_BYTES_PER_THREAD, by_macs = macs / MIN_MACS_PER_THREAD;
    int nt = rt_threads_for_work(th, by_bytes > by_macs ? by_bytes : by_macs, 1.0, job.total_units);
    job.n_ranges = nt < MM_MAX_RANGES ? nt : MM_MAX_RANGES;
    for (int r = 0; r < job.n_ranges; r++) atomic_init(&job.claimed[r], 0);
    rt_threads_run(th, matmul_task, &job, nt);
}

size_t rt_matmul_scratch_bytes(int rows, int in) { return (size_t)rows * rt_qx_row_bytes(in); }

void rt_axpy_rows(const float *p, int n, const rt_weight *v, size_t ldv, float *y, int d) {
    if (v->type == RT_W_F16) kernels()->axpy_h(p, n, v->p, ldv, y, d);
    else kernels()->axpy(p, n, v->p, ldv, y, d);
}

void rt_dots(const float *x, size_t ldx, int rows, const rt_weight *w, size_t ldw, int out, float *y, size_t ldy,
             int n) {
    rt_mm_target t = {*w, y, out, ldy};
    matmul_range(kernels(), x, ldx, rows, n, ldw, &t, 0, out);
}
