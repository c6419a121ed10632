/* Quantized weights: the load-time repack, activation quantization and the
 * integer dot-product kernels (AVX-512 VNNI, AVX2, portable). Layout and
 * determinism contract: quant.h. */

#include "quant.h"
#include "f16.h"

#include <math.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

enum { QBLK = 32, CHUNK = 4, CHUNK_X = 128 /* activation bytes per chunk */ };
/* How far ahead of the weight rows in use the kernels prefetch (integer address arithmetic: it may point
 * past the matrix, where a prefetch is harmless). */
#ifndef PREFETCH_BYTES
#define PREFETCH_BYTES 8192
#endif

static int nchunks(int nb) { return (nb + CHUNK - 1) / CHUNK; }

/* ---- geometry ------------------------------------------------------------- */

enum { KIND_Q4 = 0, KIND_Q8 = 1, KIND_Q8S = 2 /* symmetric q8: no bias term */ };

typedef struct {
    int nb, kind;
    bool sf32;
    size_t q_bytes, s_size, row_bytes;
} qgeom;

static qgeom geometry(int type, int flags, int in) {
    qgeom g;
    g.nb = in / QBLK;
    g.kind = type == RT_W_Q4 ? KIND_Q4 : (flags & RT_WF_SYMMETRIC) ? KIND_Q8S : KIND_Q8;
    g.sf32 = (flags & RT_WF_SCALES_F32) != 0;
    g.q_bytes = (size_t)g.nb * (g.kind == KIND_Q4 ? 16 : 32);
    g.s_size = g.sf32 ? 4 : 2;
    g.row_bytes = g.q_bytes + (size_t)g.nb * g.s_size * (g.kind == KIND_Q8S ? 1 : 2);
    return g;
}

static float scale_at(const uint8_t *p, size_t i, bool sf32) {
    if (sf32) {
        float f;
        memcpy(&f, p + 4 * i, 4);
        return f;
    }
    uint16_t h;
    memcpy(&h, p + 2 * i, 2);
    return rt_f16_to_f32(h);
}

/* Activation row: q bytes (CHUNK_X per chunk) | xd[4 nch] | xs[4 nch] | corr[16 nch] (int32: lane 4b of
 * chunk holds -128 * sum(q) of its block b, the term turning a dot with u into one with u - 128). */
size_t rt_qx_row_bytes(int in) {
    size_t nch = (size_t)nchunks(in / QBLK);
    return nch * (CHUNK_X + 4 * sizeof(float) * 2 + 16 * sizeof(int32_t));
}

/* ---- repack at load --------------------------------------------------------- */

static float load_scale(const uint8_t *p, size_t i, bool bf16) {
    uint16_t h;
    memcpy(&h, p + 2 * i, 2);
    return bf16 ? rt_bf16_to_f32(h) : rt_f16_to_f32(h);
}

static bool f16_exact(float f) { return rt_f16_to_f32(rt_f32_to_f16(f)) == f || f != f; }

size_t rt_weight_from_groups(rt_weight *out, bool q4, const uint8_t *packed, const uint8_t *scales,
                             const uint8_t *biases, bool bf16_scales, bool symmetric, size_t rows, size_t cols,
                             int gs) {
    size_t nb = cols / QBLK, groups_per_row = cols / (size_t)gs, half = (size_t)gs / 2;
    bool sym8 = symmetric && !q4;
    /* Block scale and bias of block k of row r, as the kernels use them: value = d * u + m. */
#define GROUP_OF(r, k) ((r) * groups_per_row + (k) * QBLK / (size_t)gs)
#define BLOCK_D(r, k) load_scale(scales, GROUP_OF(r, k), bf16_scales)
#define BLOCK_M(r, k)                                                                                  \
    (symmetric ? (q4 ? -8.0f : -128.0f) * BLOCK_D(r, k) : load_scale(biases, GROUP_OF(r, k), bf16_scales))
    bool sf32 = false; /* f16 storage unless some scale or bias would change */
    for (size_t r = 0; r < rows && !sf32; r++)
        for (size_t k = 0; k < nb && !sf32; k++)
            sf32 = !f16_exact(BLOCK_D(r, k)) || (!sym8 && !f16_exact(BLOCK_M(r, k)));
    int flags = (sf32 ? RT_WF_SCALES_F32 : 0) | (sym8 ? RT_WF_SYMMETRIC : 0);
    qgeom g = geometry(q4 ? RT_W_Q4 : RT_W_Q8, flags, (int)cols);
    size_t bytes = rows * g.row_bytes + 64; /* slack: the AVX2 kernels read whole 32-byte halves */
    uint8_t *mem = calloc(1, bytes);
    if (!mem) return 0;
    for (size_t r = 0; r < rows; r++) {
        uint8_t *row = mem + r * g.row_bytes, *dp = row + g.q_bytes, *mp = dp + nb * g.s_size;
        for (size_t k = 0; k < nb; k++) {
            size_t v0 = k * QBLK, in_group = v0 % (size_t)gs, g0 = GROUP_OF(r, k);
            uint8_t u[QBLK];
            if (q4) {
                const uint8_t *gp = packed + g0 * half; /* value v of a group: byte v % (gs/2), nibble v / (gs/2) */
                for (size_t i = 0; i < QBLK; i++) {
                    size_t v = in_group + i;
                    u[i] = v < half ? gp[v] & 0x0F : gp[v - half] >> 4;
                }
                for (int j = 0; j < 16; j++) row[k * 16 + (size_t)j] = (uint8_t)(u[j] | u[j + 16] << 4);
            } else {
                memcpy(u, packed + r * cols + v0, QBLK);
                size_t c = k / CHUNK, b = k % CHUNK, n = nb - c * CHUNK < CHUNK ? nb - c * CHUNK : CHUNK;
                uint8_t *cp = row + c * CHUNK * 32;
                memcpy(cp + 16 * b, u, 16);
                memcpy(cp + 16 * n + 16 * b, u + 16, 16);
            }
            float d = BLOCK_D(r, k), m = BLOCK_M(r, k);
            if (sf32) {
                memcpy(dp + 4 * k, &d, 4);
                if (!sym8) memcpy(mp + 4 * k, &m, 4);
            } else {
                uint16_t hd = rt_f32_to_f16(d), hm = rt_f32_to_f16(m);
                memcpy(dp + 2 * k, &hd, 2);
                if (!sym8) memcpy(mp + 2 * k, &hm, 2);
            }
        }
    }
#undef BLOCK_M
#undef BLOCK_D
#undef GROUP_OF
    *out = (rt_weight){mem, q4 ? RT_W_Q4 : RT_W_Q8, flags};
    return bytes;
}

void rt_qweight_row(const rt_weight *w, size_t row, int n, float *out) {
    qgeom g = geometry(w->type, w->flags, n);
    const uint8_t *rp = (const uint8_t *)w->p + row * g.row_bytes, *dp = rp + g.q_bytes;
    const uint8_t *mp = dp + (size_t)g.nb * g.s_size;
    for (int k = 0; k < g.nb; k++) {
        float d = scale_at(dp, (size_t)k, g.sf32), *o = out + k * QBLK;
        if (g.kind == KIND_Q4) {
            float m = scale_at(mp, (size_t)k, g.sf32);
            for (int j = 0; j < 16; j++) {
                o[j] = d * (float)(rp[k * 16 + j] & 0x0F) + m;
                o[j + 16] = d * (float)(rp[k * 16 + j] >> 4) + m;
            }
            continue;
        }
        int c = k / CHUNK, b = k % CHUNK, nc = g.nb - c * CHUNK < CHUNK ? g.nb - c * CHUNK : CHUNK;
        const uint8_t *cp = rp + (size_t)c * CHUNK * 32;
        for (int i = 0; i < QBLK; i++) {
            int u = i < 16 ? cp[16 * b + i] : cp[16 * nc + 16 * b + i - 16];
            if (g.kind == KIND_Q8S) o[i] = d * (float)(u - 128);
            else o[i] = d * (float)u + scale_at(mp, (size_t)k, g.sf32);
        }
    }
}

/* ---- activations ------------------------------------------------------------- */

/* Per block d = amax / 127, q = round(x / d) (nearbyintf's ties to even), as GGML's Q8 activations. */
void rt_qx_quantize(const float *x, size_t ldx, int rows, int in, uint8_t *xq) {
    int nb = in / QBLK, nch = nchunks(nb);
    size_t rb = rt_qx_row_bytes(in);
    for (int r = 0; r < rows; r++) {
        uint8_t *o = xq + (size_t)r * rb;
        memset(o, 0, rb);
        float *xd = (float *)(void *)(o + (size_t)nch * CHUNK_X), *xs = xd + 4 * nch;
        int32_t *corr = (int32_t *)(void *)(xs + 4 * nch);
        const float *xr = x + (size_t)r * ldx;
        for (int k = 0; k < nb; k++) {
            const float *v = xr + k * QBLK;
            int c = k / CHUNK, b = k % CHUNK;
            int8_t *lo = (int8_t *)(o + (size_t)c * CHUNK_X + 16 * b), *hi = lo + 64;
            float amax = 0.0f;
            for (int i = 0; i < QBLK; i++) {
                float a = fabsf(v[i]);
                amax = a > amax ? a : amax;
            }
            float d = amax / 127.0f, id = d > 0.0f ? 1.0f / d : 0.0f;
            int sum = 0;
            for (int i = 0; i < QBLK; i++) {
                /* |v * id| <= 127.5, far below 2^22: adding and removing 1.5 * 2^23 rounds to nearest even. */
                float t = v[i] * id;
                int q = (int)((t + 12582912.0f) - 12582912.0f);
                q = q > 127 ? 127 : q < -127 ? -127 : q;
                if (i < 16) lo[i] = (int8_t)q;
                else hi[i - 16] = (int8_t)q;
                sum += q;
            }
            xd[k] = d;
            xs[k] = d * (float)sum;
            corr[c * 16 + 4 * b] = -128 * sum;
        }
    }
}

/* Pointers into an activation row. */
#define XQ_D(xr, nch) ((const float *)(const void *)((xr) + (size_t)(nch) * CHUNK_X))
#define XQ_S(xr, nch) (XQ_D(xr, nch) + 4 * (nch))
#define XQ_CORR(xr, nch) ((const int32_t *)(const void *)(XQ_S(xr, nch) + 4 * (nch)))

/* ---- kernels -------------------------------------------------------------------
 * A kernel computes RT activation rows (stride xrow bytes) against WR weight
 * rows (stride wrow bytes) into y[r * ldy + j]. */
typedef void (*qk_fn)(const uint8_t *w, size_t wrow, const uint8_t *x, size_t xrow, float *y, size_t ldy, int nb,
                      int sf32);

/* [kind][RT - 1][0: WR = 1, 1: WR = the set's main width for that RT] */
typedef struct {
    qk_fn k[3][4][2];
    int wr_main[4]; /* by RT - 1 */
    const char *name;
} qkernel_set;

/* Portable path: exact integer block sums, then per block acc += isum * (wd * xd), bias += m * xs. */
static void qk_generic(const uint8_t *w, size_t wrow, const uint8_t *x, size_t xrow, float *y, size_t ldy, int nb,
                       int sf32, int RT, int WR, int kind) {
    int nch = nchunks(nb);
    size_t qb = (size_t)nb * (kind == KIND_Q4 ? 16 : 32), ss = sf32 ? 4 : 2;
    for (int j = 0; j < WR; j++) {
        const uint8_t *row = w + (size_t)j * wrow, *dp = row + qb, *mp = dp + (size_t)nb * ss;
        for (int r = 0; r < RT; r++) {
            const uint8_t *xr = x + (size_t)r * xrow;
            const float *xd = XQ_D(xr, nch), *xs = XQ_S(xr, nch);
            float acc = 0.0f, bias = 0.0f;
            for (int k = 0; k < nb; k++) {
                int c = k / CHUNK, b = k % CHUNK, n = nb - c * CHUNK < CHUNK ? nb - c * CHUNK : CHUNK;
                const int8_t *xlo = (const int8_t *)(xr + (size_t)c * CHUNK_X + 16 * b), *xhi = xlo + 64;
                int isum = 0;
                if (kind == KIND_Q4) {
                    const uint8_t *q = row + (size_t)k * 16;
                    for (int i = 0; i < 16; i++) isum += (q[i] & 0x0F) * xlo[i] + (q[i] >> 4) * xhi[i];
                } else {
                    const uint8_t *cp = row + (size_t)c * CHUNK * 32, *ql = cp + 16 * b, *qh = cp + 16 * n + 16 * b;
                    int off = kind == KIND_Q8S ? 128 : 0;
                    for (int i = 0; i < 16; i++) isum += (ql[i] - off) * xlo[i] + (qh[i] - off) * xhi[i];
                }
                acc += (float)isum * (scale_at(dp, (size_t)k, sf32) * xd[k]);
                if (kind != KIND_Q8S) bias += scale_at(mp, (size_t)k, sf32) * xs[k];
            }
            y[(size_t)r * ldy + j] = acc + bias;
        }
    }
}

#define QK_WRAP(ISA, KIND, RT, WR)                                                                              \
    static void ISA##_##KIND##_##RT##x##WR(const uint8_t *w, size_t wrow, const uint8_t *x, size_t xrow,        \
                                           float *y, size_t ldy, int nb, int sf32) {                            \
        ISA(w, wrow, x, xrow, y, ldy, nb, sf32, RT, WR, KIND);                                                  \
    }
/* The (RT, WR) shapes of a set whose main widths are W1 (one row) and WN (2..4 rows). */
#define QK_KIND(ISA, KIND, W1, WN)                                                                              \
    QK_WRAP(ISA, KIND, 1, 1) QK_WRAP(ISA, KIND, 1, W1) QK_WRAP(ISA, KIND, 2, 1) QK_WRAP(ISA, KIND, 2, WN)        \
    QK_WRAP(ISA, KIND, 3, 1) QK_WRAP(ISA, KIND, 3, WN) QK_WRAP(ISA, KIND, 4, 1) QK_WRAP(ISA, KIND, 4, WN)
#define QK_ALL(ISA, W1, WN) QK_KIND(ISA, KIND_Q4, W1, WN) QK_KIND(ISA, KIND_Q8, W1, WN) QK_KIND(ISA, KIND_Q8S, W1, WN)
#define QK_ROW(ISA, KIND, W1, WN)                                                                               \
    {{ISA##_##KIND##_1x1, ISA##_##KIND##_1x##W1},                                                               \
     {ISA##_##KIND##_2x1, ISA##_##KIND##_2x##WN},                                                               \
     {ISA##_##KIND##_3x1, ISA##_##KIND##_3x##WN},                                                               \
     {ISA##_##KIND##_4x1, ISA##_##KIND##_4x##WN}}
#define QK_SET(ISA, W1, WN, NAME)                                                                               \
    {{QK_ROW(ISA, KIND_Q4, W1, WN), QK_ROW(ISA, KIND_Q8, W1, WN), QK_ROW(ISA, KIND_Q8S, W1, WN)},               \
     {W1, WN, WN, WN},                                                                                          \
     NAME}

QK_ALL(qk_generic, 2, 2)
static const qkernel_set generic_set = QK_SET(qk_generic, 2, 2, "generic");

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>

/* ---- AVX2: maddubs (u8 x s8 -> i16 pairs) per half chunk (2 blocks). q8 goes through the sign trick
 * (|u - 128| x sign(x)), which cannot saturate, so its integer is sum((u - 128) x) and the asymmetric
 * bias becomes m + 128 d. */
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")

static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(t, _mm_shuffle_ps(t, t, 1)));
}

/* 32 bytes at p, or 16 zero-extended when only one block of the half is in the row. */
static inline __m256i load_half(const uint8_t *p, int two) {
    if (two) return _mm256_loadu_si256((const __m256i *)(const void *)p);
    return _mm256_zextsi128_si256(_mm_loadu_si128((const __m128i *)(const void *)p));
}

static inline __m256 pair_scales(float a, float b) { return _mm256_set_m128(_mm_set1_ps(b), _mm_set1_ps(a)); }

static inline __attribute__((always_inline)) void qk_avx2(const uint8_t *w, size_t wrow, const uint8_t *x,
                                                          size_t xrow, float *y, size_t ldy, int nb, int sf32,
                                                          int RT, int WR, int KIND) {
    int nch = nchunks(nb);
    size_t qb = (size_t)nb * (KIND == KIND_Q4 ? 16 : 32), ss = sf32 ? 4 : 2;
    const __m256i low4 = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1), flip = _mm256_set1_epi8((char)0x80);
    __m256 acc[4][4];
    for (int r = 0; r < RT; r++)
        for (int j = 0; j < WR; j++) acc[r][j] = _mm256_setzero_ps();
    for (int c = 0; c < nch; c++) {
        int n = nb - c * CHUNK < CHUNK ? nb - c * CHUNK : CHUNK;
        for (int h = 0; h < 2 && 2 * h < n; h++) {
            int b0 = c * CHUNK + 2 * h, two = n - 2 * h >= 2;
            __m256i wlo[4], whi[4];
            __m256 wd[4];
            for (int j = 0; j < WR; j++) {
                const uint8_t *row = w + (size_t)j * wrow;
                if (KIND == KIND_Q4) {
                    __m256i b = load_half(row + (size_t)c * 64 + 32 * h, two);
                    wlo[j] = _mm256_and_si256(b, low4);
                    whi[j] = _mm256_and_si256(_mm256_srli_epi16(b, 4), low4);
                } else { /* signed u - 128 */
                    const uint8_t *cp = row + (size_t)c * CHUNK * 32;
                    wlo[j] = _mm256_xor_si256(load_half(cp + 32 * h, two), flip);
                    whi[j] = _mm256_xor_si256(load_half(cp + 16 * n + 32 * h, two), flip);
                }
                const uint8_t *dp = row + qb;
                wd[j] = pair_scales(scale_at(dp, (size_t)b0, sf32), two ? scale_at(dp, (size_t)b0 + 1, sf32) : 0.0f);
            }
            for (int r = 0; r < RT; r++) {
                const uint8_t *xr = x + (size_t)r * xrow;
                const float *xd = XQ_D(xr, nch);
                __m256i xlo = _mm256_loadu_si256((const __m256i *)(const void *)(xr + (size_t)c * CHUNK_X + 32 * h));
                __m256i xhi =
                    _mm256_loadu_si256((const __m256i *)(const void *)(xr + (size_t)c * CHUNK_X + 64 + 32 * h));
                __m256 xdv = pair_scales(xd[b0], xd[b0 + 1]);
                for (int j = 0; j < WR; j++) {
                    __m256i s;
                    if (KIND == KIND_Q4) {
                        __m256i p = _mm256_add_epi16(_mm256_maddubs_epi16(wlo[j], xlo), _mm256_maddubs_epi16(whi[j], xhi));
                        s = _mm256_madd_epi16(p, ones);
                    } else {
                        __m256i pl = _mm256_maddubs_epi16(_mm256_sign_epi8(wlo[j], wlo[j]), _mm256_sign_epi8(xlo, wlo[j]));
                        __m256i ph = _mm256_maddubs_epi16(_mm256_sign_epi8(whi[j], whi[j]), _mm256_sign_epi8(xhi, whi[j]));
                        s = _mm256_add_epi32(_mm256_madd_epi16(pl, ones), _mm256_madd_epi16(ph, ones));
                    }
                    acc[r][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_mul_ps(wd[j], xdv), acc[r][j]);
                }
            }
        }
    }
    for (int j = 0; j < WR; j++) {
        const uint8_t *dp = w + (size_t)j * wrow + qb, *mp = dp + (size_t)nb * ss;
        for (int r = 0; r < RT; r++) {
            float bias = 0.0f;
            if (KIND != KIND_Q8S) {
                const float *xs = XQ_S(x + (size_t)r * xrow, nch);
                for (int k = 0; k < nb; k++) {
                    float m = scale_at(mp, (size_t)k, sf32);
                    if (KIND == KIND_Q8) m = fmaf(128.0f, scale_at(dp, (size_t)k, sf32), m);
                    bias = fmaf(m, xs[k], bias);
                }
            }
            y[(size_t)r * ldy + j] = hsum8(acc[r][j]) + bias;
        }
    }
    _mm256_zeroupper();
}

QK_ALL(qk_avx2, 4, 2)
#pragma GCC pop_options
static const qkernel_set avx2_set = QK_SET(qk_avx2, 4, 2, "avx2");

/* ---- AVX-512 VNNI: one dpbusd pair per chunk (4 blocks) and weight row. */
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")

static inline float hsum16(__m512 v) {
    __m256 lo = _mm512_castps512_ps256(v);
    __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
    __m256 s8 = _mm256_add_ps(lo, hi);
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
    __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(t, _mm_shuffle_ps(t, t, 1)));
}

/* n (<= 16) scales from index i, zero past n. */
static inline __m512 load_scales16(const uint8_t *p, int i, int n, int sf32) {
    __mmask16 m = (__mmask16)(n >= 16 ? 0xFFFF : (1u << n) - 1);
    if (sf32) return _mm512_maskz_loadu_ps(m, (const float *)(const void *)p + i);
    return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, (const uint16_t *)(const void *)p + i));
}
static inline __m128 load_scales4(const uint8_t *p, int i, int n, int sf32) {
    __mmask8 m = (__mmask8)((1u << n) - 1);
    if (sf32) return _mm_maskz_loadu_ps(m, (const float *)(const void *)p + i);
    return _mm_cvtph_ps(_mm_maskz_loadu_epi16(m, (const uint16_t *)(const void *)p + i));
}

static inline __attribute__((always_inline)) void qk_vnni(const uint8_t *w, size_t wrow, const uint8_t *x,
                                                          size_t xrow, float *y, size_t ldy, int nb, int sf32,
                                                          int RT, int WR, int KIND) {
    int nch = nchunks(nb);
    size_t qb = (size_t)nb * (KIND == KIND_Q4 ? 16 : 32), ss = sf32 ? 4 : 2;
    const __m512i spread = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
    const __m512i low4 = _mm512_set1_epi8(0x0F);
    __m512 acc[4][4];
    for (int r = 0; r < RT; r++)
        for (int j = 0; j < WR; j++) acc[r][j] = _mm512_setzero_ps();
    /* Decode streams every weight once per step: prefetch the tile PREFETCH_BYTES ahead, a slice per chunk. */
    size_t tile = (size_t)WR * wrow, slice = (tile / (size_t)nch + 63) & ~(size_t)63;
    for (int c = 0; c < nch; c++) {
        int n = nb - c * CHUNK < CHUNK ? nb - c * CHUNK : CHUNK;
        __mmask64 mk = n == CHUNK ? ~(__mmask64)0 : ((__mmask64)1 << (16 * n)) - 1;
        for (size_t off = (size_t)c * slice; off < (size_t)(c + 1) * slice && off < tile; off += 64)
            _mm_prefetch((const char *)((uintptr_t)w + PREFETCH_BYTES + off), _MM_HINT_T0);
        __m512i wlo[4], whi[4];
        __m512 wd[4];
        for (int j = 0; j < WR; j++) {
            const uint8_t *row = w + (size_t)j * wrow;
            if (KIND == KIND_Q4) {
                __m512i b = _mm512_maskz_loadu_epi8(mk, row + (size_t)c * 64);
                wlo[j] = _mm512_and_si512(b, low4);
                whi[j] = _mm512_and_si512(_mm512_srli_epi16(b, 4), low4);
            } else {
                const uint8_t *cp = row + (size_t)c * CHUNK * 32;
                wlo[j] = _mm512_maskz_loadu_epi8(mk, cp);
                whi[j] = _mm512_maskz_loadu_epi8(mk, cp + 16 * n);
            }
            wd[j] = _mm512_permutexvar_ps(spread, _mm512_castps128_ps512(load_scales4(row + qb, c * CHUNK, n, sf32)));
        }
        for (int r = 0; r < RT; r++) {
            const uint8_t *xr = x + (size_t)r * xrow;
            __m512i xlo = _mm512_loadu_si512(xr + (size_t)c * CHUNK_X);
            __m512i xhi = _mm512_loadu_si512(xr + (size_t)c * CHUNK_X + 64);
            __m512 xdv = _mm512_permutexvar_ps(spread, _mm512_castps128_ps512(_mm_loadu_ps(XQ_D(xr, nch) + c * CHUNK)));
            __m512i corr = KIND == KIND_Q8S ? _mm512_loadu_si512(XQ_CORR(xr, nch) + 16 * c) : _mm512_setzero_si512();
            for (int j = 0; j < WR; j++) {
                __m512i s = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wlo[j], xlo);
                s = _mm512_dpbusd_epi32(s, whi[j], xhi);
                if (KIND == KIND_Q8S) s = _mm512_add_epi32(s, corr);
                acc[r][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(wd[j], xdv), acc[r][j]);
            }
        }
    }
    for (int j = 0; j < WR; j++) {
        const uint8_t *mp = w + (size_t)j * wrow + qb + (size_t)nb * ss;
        for (int r = 0; r < RT; r++) {
            float bias = 0.0f;
            if (KIND != KIND_Q8S) {
                const float *xs = XQ_S(x + (size_t)r * xrow, nch);
                __m512 b = _mm512_setzero_ps();
                for (int k = 0; k < nb; k += 16) {
                    int n = nb - k < 16 ? nb - k : 16;
                    __mmask16 m = (__mmask16)(n == 16 ? 0xFFFF : (1u << n) - 1);
                    b = _mm512_fmadd_ps(load_scales16(mp, k, n, sf32), _mm512_maskz_loadu_ps(m, xs + k), b);
                }
                bias = hsum16(b);
            }
            y[(size_t)r * ldy + j] = hsum16(acc[r][j]) + bias;
        }
    }
    _mm256_zeroupper();
}

QK_ALL(qk_vnni, 4, 2)
#pragma GCC pop_options
static const qkernel_set vnni_set = QK_SET(qk_vnni, 4, 2, "avx512-vnni");
#endif

static const qkernel_set *g_qset;
static pthread_once_t g_qset_once = PTHREAD_ONCE_INIT;

/* Once per process, like the float kernels; BASERT_REF_SIMD caps it ("generic" / "0", "avx2"). */
static void select_qset(void) {
    g_qset = &generic_set;
#if defined(__x86_64__) && defined(__GNUC__)
    const char *env = getenv("BASERT_REF_SIMD");
    const char *cap = env && *env ? env : "avx512";
    if (strcmp(cap, "0") == 0 || strcmp(cap, "generic") == 0) return;
    __builtin_cpu_init();
    if (!__builtin_cpu_supports("avx2") || !__builtin_cpu_supports("fma") || !__builtin_cpu_supports("f16c")) return;
    g_qset = &avx2_set;
    if (strcmp(cap, "avx2") != 0 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni"))
        g_qset = &vnni_set;
#endif
}

static const qkernel_set *qset(void) {
    pthread_once(&g_qset_once, select_qset);
    return g_qset;
}

const char *rt_quant_isa(void) { return qset()->name; }

/* Rows in blocks of ROW_BLOCK (their activations stay in L2 while the weight rows pass once); one row
 * (decode) takes the widest weight tile, more rows go 4 at a time. */
enum { ROW_BLOCK = 64 };

void rt_qmatmul_range(const rt_weight *w, int in, const uint8_t *xq, int rows, float *y, size_t ldy, int o0,
                      int o1) {
    const qkernel_set *ks = qset();
    qgeom g = geometry(w->type, w->flags, in);
    size_t xrow = rt_qx_row_bytes(in);
    const uint8_t *wp = w->p;
    for (int rb = 0; rb < rows; rb += ROW_BLOCK) {
        int rn = rows - rb < ROW_BLOCK ? rows - rb : ROW_BLOCK;
        for (int r = 0; r < rn;) {
            int rem = rn - r, rt = rem >= 4 ? 4 : rem;
            if (rem == 5 || rem == 6) rt = 3; /* 3 + 2 / 3 + 3 rather than 4 + 1 / 4 + 2 */
            int wr = ks->wr_main[rt - 1];
            const uint8_t *xr = xq + (size_t)(rb + r) * xrow;
            float *yr = y + (size_t)(rb + r) * ldy;
            int o = o0;
            for (; o + wr <= o1; o += wr)
                ks->k[g.kind][rt - 1][1](wp + (size_t)o * g.row_bytes, g.row_bytes, xr, xrow, yr + o, ldy, g.nb, g.sf32);
            for (; o < o1; o++)
                ks->k[g.kind][rt - 1][0](wp + (size_t)o * g.row_bytes, g.row_bytes, xr, xrow, yr + o, ldy, g.nb, g.sf32);
            r += rt;
        }
    }
}
