/* Quantized weights: the load-time repack into row panels, activation
 * quantization and the integer dot-product kernels (AVX-512 VNNI, AVX2,
 * portable), all computing the same values. Layout and determinism: quant.h. */

#include "quant.h"
#include "cpu.h"
#include "f16.h"

#include <math.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

enum { QBLK = 32, PANEL = 16 };
/* How far ahead of the panel in use the kernels prefetch (integer address arithmetic: it may point past
 * the matrix, where a prefetch is harmless). Decode reads every weight once per step. */
#ifndef PREFETCH_BYTES
#define PREFETCH_BYTES 8192
#endif

/* ---- geometry ------------------------------------------------------------- */

/* The GGML K kinds keep their 256-value super-blocks (quant.h): per panel and super-block a header (the
 * 16 rows' f16 d, and for Q4_K / Q5_K their f16 dmin), then its 8 blocks of 32, each the values and the
 * rows' integer sub-block scales (Q4_K / Q5_K: 6-bit scale and min as bytes; Q6_K: the two 16-value
 * halves' int8 scales). KIND_Q6K is GGML Q6_K: u (0..63) as q4's nibbles plus 2-bit high planes, value =
 * d * sc * (u - 32), no bias term. */
enum {
    KIND_Q4 = 0,
    KIND_Q8 = 1,
    KIND_Q8S = 2 /* symmetric q8: no bias term */,
    KIND_Q5 = 3,
    KIND_Q6K = 4,
    KIND_Q4K = 5,
    KIND_Q5K = 6,
    KIND_Q4S = 7 /* symmetric q4 (GGML Q4_0): m = -8 d, not stored */,
    KIND_Q5S = 8 /* symmetric q5 (GGML Q5_0): m = -16 d, not stored */,
    N_KINDS = 9
};
#define KIND_IS_K(kind) ((kind) == KIND_Q4K || (kind) == KIND_Q5K || (kind) == KIND_Q6K)
#define KIND_NIBBLES(kind)                                                                                      \
    ((kind) == KIND_Q4 || (kind) == KIND_Q5 || (kind) == KIND_Q4K || (kind) == KIND_Q5K || (kind) == KIND_Q4S ||  \
     (kind) == KIND_Q5S)
#define KIND_FIFTH(kind) ((kind) == KIND_Q5 || (kind) == KIND_Q5K || (kind) == KIND_Q5S)
/* Symmetric q4 / q5 store no m: the kernels form m = d * -8 (-16), exact in f32 (a power of two), the very
 * value the asymmetric panel would have stored, and run the asymmetric arithmetic on it (bit-identical). */
#define KIND_SYM_NIBBLES(kind) ((kind) == KIND_Q4S || (kind) == KIND_Q5S)
#define KIND_ZERO(kind) ((kind) == KIND_Q5S ? -16.0f : -8.0f)
#define KIND_NO_M(kind) ((kind) == KIND_Q8S || KIND_SYM_NIBBLES(kind))

typedef struct {
    int nb, kind;
    bool sf32;
    size_t q_bytes;     /* per panel and block: the 16 rows' values */
    size_t s_size;      /* bytes of one scale (base kinds) */
    size_t block_bytes; /* per panel and block: values, then d[16], m[16] (K kinds: sc[16], mn[16]) */
    size_t hdr_bytes;   /* K kinds: per panel and super-block, the rows' f16 d[16] (and dmin[16]) */
    size_t sb_bytes;    /* hdr_bytes + 8 blocks */
    size_t panel_bytes;
} qgeom;

/* q5 = q4's nibbles plus, per block, 8 masks of 64 bits: mask 2s (2s + 1) holds the fifth bit of each byte's
 * low (high) nibble in group s, bit j for byte j of the group. q6 = q4's nibbles plus 2 planes of 64 bytes:
 * plane p byte j holds, 2 bits each from bit 0, the high bits of group 2p's low / high nibble and group
 * 2p + 1's low / high nibble at byte j. */
enum { Q5_MASKS = 64, Q6_PLANES = 128 };

static qgeom geometry_of(int kind, bool sf32, int in) {
    qgeom g;
    g.nb = in / QBLK;
    g.kind = kind;
    g.sf32 = sf32;
    g.q_bytes = (size_t)PANEL * (kind == KIND_Q8 || kind == KIND_Q8S ? 32 : 16) +
                (KIND_FIFTH(kind) ? Q5_MASKS : kind == KIND_Q6K ? Q6_PLANES : 0);
    g.s_size = g.sf32 ? 4 : 2;
    g.block_bytes = g.q_bytes + (KIND_IS_K(kind) ? 2 * PANEL : PANEL * g.s_size * (KIND_NO_M(kind) ? 1 : 2));
    g.hdr_bytes = kind == KIND_Q6K ? 2 * PANEL : KIND_IS_K(kind) ? 4 * PANEL : 0;
    g.sb_bytes = g.hdr_bytes + 8 * g.block_bytes;
    g.panel_bytes = KIND_IS_K(kind) ? g.sb_bytes * (size_t)(g.nb / 8) : g.block_bytes * (size_t)g.nb;
    return g;
}

static qgeom geometry(int type, int flags, int in) {
    bool sym = (flags & RT_WF_SYMMETRIC) != 0;
    int kind = type == RT_W_Q4    ? (sym ? KIND_Q4S : KIND_Q4)
               : type == RT_W_Q5  ? (sym ? KIND_Q5S : KIND_Q5)
               : type == RT_W_Q6K ? KIND_Q6K
               : type == RT_W_Q4K ? KIND_Q4K
               : type == RT_W_Q5K ? KIND_Q5K
               : sym               ? KIND_Q8S
                                   : KIND_Q8;
    return geometry_of(kind, (flags & RT_WF_SCALES_F32) != 0, in);
}

/* Block k of a panel and its super-block's header (K kinds; k >= 0). */
static inline const uint8_t *block_at(const qgeom *g, const uint8_t *panel, int k) {
    if (!KIND_IS_K(g->kind)) return panel + (size_t)k * g->block_bytes; /* the plain form: AVX2 is faster so */
    return panel + ((size_t)k >> 3) * g->sb_bytes + g->hdr_bytes + ((size_t)k & 7) * g->block_bytes;
}
static inline const uint8_t *header_at(const qgeom *g, const uint8_t *panel, int k) {
    return panel + ((size_t)k >> 3) * g->sb_bytes;
}

/* Value i (0..31) of row L in block bp of a panel, as an unsigned integer. */
static int value_at(const uint8_t *bp, int kind, size_t L, int i) {
    if (!KIND_NIBBLES(kind) && kind != KIND_Q6K) return bp[64 * (i / 4) + 4 * L + (size_t)(i % 4)];
    int hi = i >= 16, s = (i % 16) / 4;
    size_t j = 4 * L + (size_t)(i % 4);
    int u = hi ? bp[64 * s + j] >> 4 : bp[64 * s + j] & 0x0F;
    if (KIND_FIFTH(kind)) u |= ((bp[PANEL * 16 + 8 * (2 * s + hi) + j / 8] >> (j % 8)) & 1) << 4;
    if (kind == KIND_Q6K) u |= ((bp[PANEL * 16 + 64 * (s / 2) + j] >> (4 * (s % 2) + 2 * hi)) & 3) << 4;
    return u;
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

/* Row L's d and m of block k (bp = block_at(panel, k)). K kinds compute GGML's own products: d * sc and
 * -(dmin * m) (Q4_K / Q5_K), the halves' d * sc (Q6_K: "m" is the second half's), an f16 times an integer
 * below 64 or an int8, exact in f32 -- the SIMD kernels compute the same product in registers. */
static void block_scales(const qgeom *g, const uint8_t *panel, int k, const uint8_t *bp, size_t L, float *d,
                         float *m) {
    const uint8_t *dp = bp + g->q_bytes;
    if (!KIND_IS_K(g->kind)) {
        *d = scale_at(dp, L, g->sf32);
        *m = g->kind == KIND_Q8S           ? *d
             : KIND_SYM_NIBBLES(g->kind) ? *d * KIND_ZERO(g->kind)
                                         : scale_at(dp + PANEL * g->s_size, L, g->sf32);
        return;
    }
    const uint8_t *hp = header_at(g, panel, k);
    float dd = scale_at(hp, L, false);
    if (g->kind == KIND_Q6K) {
        *d = dd * (float)(int8_t)dp[L];
        *m = dd * (float)(int8_t)dp[PANEL + L];
        return;
    }
    *d = dd * (float)dp[L];
    *m = -(scale_at(hp + 2 * PANEL, L, false) * (float)dp[PANEL + L]);
}

/* Activation row: q[nb * 32] | xd[nb] | xs[nb] | corr[nb] (int32) | half[nb] (int32: sum of the block's
 * first 16 q, for q6's half-block scales), padded to 64 bytes. */
size_t rt_qx_row_bytes(int in) {
    size_t nb = (size_t)(in / QBLK);
    return (nb * (QBLK + 4 * 4) + 63) & ~(size_t)63;
}
#define XQ_D(xr, nb) ((const float *)(const void *)((xr) + (size_t)(nb) * QBLK))
#define XQ_S(xr, nb) (XQ_D(xr, nb) + (nb))
#define XQ_CORR(xr, nb) ((const int32_t *)(const void *)(XQ_S(xr, nb) + (nb)))
#define XQ_HALF(xr, nb) (XQ_CORR(xr, nb) + (nb))

/* ---- repack at load --------------------------------------------------------- */

static float load_scale(const uint8_t *p, size_t i, int scale_type) {
    if (scale_type == RT_SCALE_F32) {
        float f;
        memcpy(&f, p + 4 * i, 4);
        return f;
    }
    uint16_t h;
    memcpy(&h, p + 2 * i, 2);
    return scale_type == RT_SCALE_BF16 ? rt_bf16_to_f32(h) : rt_f16_to_f32(h);
}

static bool f16_exact(float f) { return rt_f16_to_f32(rt_f32_to_f16(f)) == f || f != f; }

/* A source of blocks: block k (32 values) of row r as unsigned values u (fitting the target kind) with
 * value = d * u + m. */
typedef struct {
    const uint8_t *packed, *scales, *biases;
    int scale_type, bits, gs;
    bool symmetric;
    size_t cols;
} block_source;


static void group_block(const block_source *src, size_t r, size_t k, uint8_t *u, float *d, float *m) {
    size_t gs = (size_t)src->gs, half = gs / 2, g0 = r * (src->cols / gs) + k * QBLK / gs, in_group = k * QBLK % gs;
    bool q5 = src->bits == 5;
    if (u && src->bits == 8) {
        memcpy(u, src->packed + r * src->cols + k * QBLK, QBLK);
    } else if (u) {
        /* value v of a group: byte v % (gs/2), nibble v / (gs/2); q5 groups start with gs/8 bytes of fifth
         * bits (bit v % 8 of byte v / 8), as GGML's Q5_0 / Q5_1 blocks */
        const uint8_t *qh = src->packed + g0 * (q5 ? gs / 8 * 5 : half), *gp = q5 ? qh + gs / 8 : qh;
        for (size_t i = 0; i < QBLK; i++) {
            size_t v = in_group + i;
            u[i] = v < half ? gp[v] & 0x0F : gp[v - half] >> 4;
            if (q5) u[i] |= (uint8_t)(((qh[v / 8] >> (v % 8)) & 1) << 4);
        }
    }
    *d = load_scale(src->scales, g0, src->scale_type);
    *m = src->symmetric ? -(float)(1 << (src->bits - 1)) * *d : load_scale(src->biases, g0, src->scale_type);
}

/* GGML's block_q4_K / block_q5_K (ggml-common.h): super-blocks of 256 values, d and dmin f16, 8 sub-blocks
 * of 32 with 6-bit scale and min (get_scale_min_k4); value = d * sc * q - dmin * m. Sub-block j of super-block
 * b: its values u, scale *s and min *mn. */
static void k_block(int ggml, const uint8_t *b, size_t j, uint8_t *u, uint8_t *s, uint8_t *mn) {
    size_t c = j / 2, hi = j % 2;
    const uint8_t *sc = b + 4;
    if (j < 4) {
        *s = sc[j] & 63;
        *mn = sc[j + 4] & 63;
    } else {
        *s = (uint8_t)((sc[j + 4] & 0x0F) | ((sc[j - 4] >> 6) << 4));
        *mn = (uint8_t)((sc[j + 4] >> 4) | ((sc[j] >> 6) << 4));
    }
    const uint8_t *qh = b + 16, *qs = b + (ggml == RT_GGML_Q4_K ? 16 : 48) + 32 * c;
    for (size_t i = 0; i < QBLK; i++) {
        u[i] = (uint8_t)(hi ? qs[i] >> 4 : qs[i] & 0x0F);
        if (ggml == RT_GGML_Q5_K) u[i] |= (uint8_t)(((qh[i] >> j) & 1) << 4);
    }
}

/* GGML's block_q6_K: super-blocks of 256 values, ql[128] qh[64] int8 scales[16] and f16 d; value =
 * d * sc * (q - 32) with one scale per 16 values (dequantize_row_q6_K). Block j is quarter t of half n of
 * its super-block; s[0], s[1]: the scales of its two 16-value halves. */
static void q6_block(const uint8_t *b, size_t j, uint8_t *u, int8_t *s) {
    size_t n = j / 4, t = j % 4;
    memcpy(s, b + 192 + 8 * n + 2 * t, 2);
    const uint8_t *ql = b + 64 * n + 32 * (t % 2), *qh = b + 128 + 32 * n;
    for (size_t i = 0; i < QBLK; i++)
        u[i] = (uint8_t)((t < 2 ? ql[i] & 0x0F : ql[i] >> 4) | ((qh[i] >> (2 * t)) & 3) << 4);
}

/* Row L's 32 values u of a q4 / q5 / q6 block: low nibbles 0..15, high nibbles 16..31, the fifth bits
 * (q5: masks) or high 2 bits (q6: planes), into a zeroed block bp. */
static void put_nibbles(uint8_t *bp, int kind, size_t L, const uint8_t *u) {
    for (size_t s = 0; s < 4; s++)
        for (size_t i = 0; i < 4; i++) {
            size_t j = 4 * L + i;
            bp[64 * s + j] = (uint8_t)((u[4 * s + i] & 0x0F) | (u[16 + 4 * s + i] & 0x0F) << 4);
            for (size_t h = 0; h < 2; h++) {
                uint8_t v = u[16 * h + 4 * s + i];
                if (KIND_FIFTH(kind)) bp[PANEL * 16 + 8 * (2 * s + h) + j / 8] |= (uint8_t)(((v >> 4) & 1) << (j % 8));
                if (kind == KIND_Q6K) bp[PANEL * 16 + 64 * (s / 2) + j] |= (uint8_t)((v >> 4) << (4 * (s % 2) + 2 * h));
            }
        }
}

/* Rows per repack chunk: whole panels, about 2 MB of rows of row_bytes each (`done` may release what was
 * read, so the load peaks at the repacked weights plus about one chunk). */
static size_t chunk_rows(size_t row_bytes) {
    size_t n = (2u << 20) / (row_bytes + 1) / PANEL * PANEL;
    return n < PANEL ? PANEL : n;
}

/* Repack every block of src into the panel layout of `type`, calling done(ctx, rows) after each chunk. */
static size_t repack(rt_weight *out, int type, bool sym, const block_source *src, size_t rows, size_t cols,
                     void (*done)(void *ctx, size_t rows_done), void *ctx) {
    size_t nb = cols / QBLK;
    /* f16 storage unless some scale or stored bias would change (symmetric: no bias is stored; its m = -2^(bits-1)
     * d is formed exactly in f32 from d either way) */
    bool sf32 = false;
    for (size_t r = 0; r < rows && !sf32; r++)
        for (size_t k = 0; k < nb && !sf32; k++) {
            float d, m;
            group_block(src, r, k, NULL, &d, &m);
            sf32 = !f16_exact(d) || (!sym && !f16_exact(m));
        }
    int flags = (sf32 ? RT_WF_SCALES_F32 : 0) | (sym ? RT_WF_SYMMETRIC : 0);
    qgeom g = geometry(type, flags, (int)cols);
    size_t panels = (rows + PANEL - 1) / PANEL, bytes = panels * g.panel_bytes;
    uint8_t *mem = calloc(1, bytes ? bytes : 1); /* rows past the matrix stay zero */
    if (!mem) return 0;
    size_t chunk = chunk_rows(g.panel_bytes / PANEL);
    for (size_t r = 0; r < rows; r++) {
        size_t L = r % PANEL;
        for (size_t k = 0; k < nb; k++) {
            uint8_t *bp = mem + (r / PANEL) * g.panel_bytes + k * g.block_bytes;
            uint8_t u[QBLK];
            float d, m;
            group_block(src, r, k, u, &d, &m);
            if (type != RT_W_Q8) put_nibbles(bp, g.kind, L, u);
            else
                for (size_t s = 0; s < 8; s++) memcpy(bp + 64 * s + 4 * L, u + 4 * s, 4);
            uint8_t *dp = bp + g.q_bytes, *mp = dp + PANEL * g.s_size;
            if (sf32) {
                memcpy(dp + 4 * L, &d, 4);
                if (!sym) memcpy(mp + 4 * L, &m, 4);
            } else {
                uint16_t hd = rt_f32_to_f16(d), hm = rt_f32_to_f16(m);
                memcpy(dp + 2 * L, &hd, 2);
                if (!sym) memcpy(mp + 2 * L, &hm, 2);
            }
        }
        if (done && ((r + 1) % chunk == 0 || r + 1 == rows)) done(ctx, r + 1);
    }
    *out = (rt_weight){mem, type, flags};
    return bytes;
}

size_t rt_weight_from_groups(rt_weight *out, int bits, const uint8_t *packed, const uint8_t *scales,
                             const uint8_t *biases, int scale_type, bool symmetric, size_t rows, size_t cols,
                             int gs, void (*done)(void *ctx, size_t rows_done), void *ctx) {
    block_source src = {packed, scales, biases, scale_type, bits, gs, symmetric, cols};
    return repack(out, bits == 4 ? RT_W_Q4 : bits == 5 ? RT_W_Q5 : RT_W_Q8, symmetric, &src, rows, cols, done, ctx);
}

/* An f16 (little-endian bytes) that is NaN (2) or Inf (1), else 0. */
static int f16_non_finite(const uint8_t *h) {
    unsigned v = (unsigned)h[0] | (unsigned)h[1] << 8;
    return (v & 0x7c00u) != 0x7c00u ? 0 : (v & 0x03ffu) ? 2 : 1;
}

size_t rt_weight_from_ggml(rt_weight *out, int ggml_type, const uint8_t *blocks, size_t rows, size_t cols,
                           void (*done)(void *ctx, size_t rows_done), void *ctx, rt_ggml_bad *bad) {
    int type = ggml_type == RT_GGML_Q4_K ? RT_W_Q4K : ggml_type == RT_GGML_Q5_K ? RT_W_Q5K : RT_W_Q6K;
    if (ggml_type != RT_GGML_Q4_K && ggml_type != RT_GGML_Q5_K && ggml_type != RT_GGML_Q6_K) return 0;
    qgeom g = geometry(type, 0, (int)cols);
    size_t size = ggml_type == RT_GGML_Q4_K ? 144 : ggml_type == RT_GGML_Q5_K ? 176 : 210, nsb = cols / 256;
    size_t panels = (rows + PANEL - 1) / PANEL, bytes = panels * g.panel_bytes;
    uint8_t *mem = calloc(1, bytes ? bytes : 1); /* rows past the matrix stay zero (d = 0) */
    if (!mem) return 0;
    size_t chunk = chunk_rows(nsb * size);
    for (size_t r = 0; r < rows; r++) {
        size_t L = r % PANEL;
        uint8_t *pp = mem + (r / PANEL) * g.panel_bytes;
        for (size_t sb = 0; sb < nsb; sb++) {
            const uint8_t *b = blocks + (r * nsb + sb) * size;
            uint8_t *hp = pp + sb * g.sb_bytes;
            /* a NaN / Inf d or dmin makes its 256 values non-finite: refused, as a base group's scale is
             * (checked here, as each block is read, so the source pages still go chunk by chunk) */
            int dbad = f16_non_finite(ggml_type == RT_GGML_Q6_K ? b + 208 : b);
            int mbad = ggml_type == RT_GGML_Q6_K ? 0 : f16_non_finite(b + 2);
            if (dbad || mbad) {
                if (bad)
                    *bad = (rt_ggml_bad){r * nsb + sb, dbad ? "d" : "dmin", (dbad ? dbad : mbad) == 2 ? "NaN" : "Inf"};
                free(mem);
                return 0;
            }
            memcpy(hp + 2 * L, ggml_type == RT_GGML_Q6_K ? b + 208 : b, 2); /* d */
            if (ggml_type != RT_GGML_Q6_K) memcpy(hp + 2 * PANEL + 2 * L, b + 2, 2); /* dmin */
            for (size_t j = 0; j < 8; j++) {
                uint8_t *bp = hp + g.hdr_bytes + j * g.block_bytes, u[QBLK];
                if (ggml_type == RT_GGML_Q6_K) {
                    int8_t sc[2];
                    q6_block(b, j, u, sc);
                    memcpy(bp + g.q_bytes + L, &sc[0], 1);
                    memcpy(bp + g.q_bytes + PANEL + L, &sc[1], 1);
                } else {
                    k_block(ggml_type, b, j, u, bp + g.q_bytes + L, bp + g.q_bytes + PANEL + L);
                }
                put_nibbles(bp, g.kind, L, u);
            }
        }
        if (done && ((r + 1) % chunk == 0 || r + 1 == rows)) done(ctx, r + 1);
    }
    *out = (rt_weight){mem, type, 0};
    return bytes;
}

void rt_qweight_row(const rt_weight *w, size_t row, int n, float *out) {
    qgeom g = geometry(w->type, w->flags, n);
    size_t L = row % PANEL;
    const uint8_t *pp = (const uint8_t *)w->p + (row / PANEL) * g.panel_bytes;
    for (int k = 0; k < g.nb; k++) {
        const uint8_t *bp = block_at(&g, pp, k);
        float d, m, *o = out + k * QBLK;
        block_scales(&g, pp, k, bp, L, &d, &m);
        for (int i = 0; i < QBLK; i++) {
            int u = value_at(bp, g.kind, L, i);
            if (g.kind == KIND_Q6K) o[i] = (i < 16 ? d : m) * (float)(u - 32);
            else o[i] = g.kind == KIND_Q8S ? d * (float)(u - 128) : d * (float)u + m;
        }
    }
}

/* ---- activations ------------------------------------------------------------- */

/* Per block d = amax / 127, q = round(x / d) (nearbyintf's ties to even), as GGML's Q8 activations.
 * One block of 32; returns sum(q). The AVX2 version below performs the same operations 8 at a time (max
 * ignores NaN alike, no fused multiply-add): both give the same bytes. */
static int quantize_block(const float *v, int8_t *q, float *d_out, int *half) {
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
        float rq = (t + 12582912.0f) - 12582912.0f;
        /* NaN (a NaN input, Inf * id 0) or +-Inf (id = 1 / a subnormal d overflows) must not reach the
         * conversion (UB): -127, as the AVX2 path's cvttps (0x80000000 for those) clamps. */
        int qi = rq >= -2147483648.0f && rq < 2147483648.0f ? (int)rq : -127;
        qi = qi > 127 ? 127 : qi < -127 ? -127 : qi;
        q[i] = (int8_t)qi;
        sum += qi;
        if (i == 15) *half = sum;
    }
    *d_out = d;
    return sum;
}

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>

__attribute__((target("avx2"))) static int quantize_block_avx2(const float *v, int8_t *q, float *d_out, int *half) {
    const __m256 sign = _mm256_set1_ps(-0.0f), magic = _mm256_set1_ps(12582912.0f);
    __m256 x[4], mx = _mm256_setzero_ps();
    for (int j = 0; j < 4; j++) {
        x[j] = _mm256_loadu_ps(v + 8 * j);
        mx = _mm256_max_ps(_mm256_andnot_ps(sign, x[j]), mx); /* a NaN lane keeps mx, as a > amax is false */
    }
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1));
    float amax = _mm_cvtss_f32(m4);
    float d = amax / 127.0f, id = d > 0.0f ? 1.0f / d : 0.0f;
    __m256 vid = _mm256_set1_ps(id);
    __m256i qi[4], sum = _mm256_setzero_si256(), first = _mm256_setzero_si256();
    for (int j = 0; j < 4; j++) {
        __m256 t = _mm256_sub_ps(_mm256_add_ps(_mm256_mul_ps(x[j], vid), magic), magic);
        qi[j] = _mm256_min_epi32(_mm256_max_epi32(_mm256_cvttps_epi32(t), _mm256_set1_epi32(-127)),
                                 _mm256_set1_epi32(127));
        sum = _mm256_add_epi32(sum, qi[j]);
        if (j == 1) first = sum;
    }
    __m256i b = _mm256_packs_epi16(_mm256_packs_epi32(qi[0], qi[1]), _mm256_packs_epi32(qi[2], qi[3]));
    b = _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256((__m256i *)(void *)q, b);
    __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1));
    __m128i h4 = _mm_add_epi32(_mm256_castsi256_si128(first), _mm256_extracti128_si256(first, 1));
    h4 = _mm_add_epi32(h4, _mm_shuffle_epi32(h4, 0x4E));
    h4 = _mm_add_epi32(h4, _mm_shuffle_epi32(h4, 0xB1));
    *half = _mm_cvtsi128_si32(h4);
    _mm256_zeroupper();
    *d_out = d;
    return _mm_cvtsi128_si32(s4);
}
#endif

static bool quantize_simd(void);

void rt_qx_quantize(const float *x, size_t ldx, int rows, int in, uint8_t *xq) {
    int nb = in / QBLK;
    size_t rb = rt_qx_row_bytes(in);
    int (*block)(const float *, int8_t *, float *, int *) = quantize_block;
#if defined(__x86_64__) && defined(__GNUC__)
    if (quantize_simd()) block = quantize_block_avx2;
#endif
    for (int r = 0; r < rows; r++) {
        uint8_t *o = xq + (size_t)r * rb;
        float *xd = (float *)(void *)(o + (size_t)nb * QBLK), *xs = xd + nb;
        int32_t *corr = (int32_t *)(void *)(xs + nb), *halves = corr + nb;
        const float *xr = x + (size_t)r * ldx;
        for (int k = 0; k < nb; k++) {
            float d;
            int half;
            int sum = block(xr + k * QBLK, (int8_t *)(o + (size_t)k * QBLK), &d, &half);
            xd[k] = d;
            xs[k] = d * (float)sum;
            corr[k] = -128 * sum;
            halves[k] = half;
        }
    }
}

/* ---- kernels -------------------------------------------------------------------
 * A kernel computes RT activation rows (stride xrow bytes) against one panel
 * (`valid` of its 16 rows are real) into y[r * ldy + L]. */
typedef void (*qk_fn)(const uint8_t *panel, int nb, int sf32, const uint8_t *x, size_t xrow, float *y, size_t ldy,
                      int valid);

typedef struct {
    qk_fn k[N_KINDS][8]; /* [kind][RT - 1] */
    int rt_max;
    const char *name;
} qkernel_set;

/* Portable path: the same per-(row, weight row) sequence as the SIMD lanes, with fmaf. */
static void qk_generic(const uint8_t *panel, int nb, int sf32, const uint8_t *x, size_t xrow, float *y, size_t ldy,
                       int valid, int RT, int kind) {
    qgeom g = geometry_of(kind, sf32, nb * QBLK);
    for (int r = 0; r < RT; r++) {
        const uint8_t *xr = x + (size_t)r * xrow;
        const int8_t *q = (const int8_t *)xr;
        const float *xd = XQ_D(xr, nb), *xs = XQ_S(xr, nb);
        const int32_t *corr = XQ_CORR(xr, nb), *halves = XQ_HALF(xr, nb);
        for (int L = 0; L < valid; L++) {
            float acc = 0.0f, bias = 0.0f;
            for (int k = 0; k < nb; k++) {
                const uint8_t *bp = block_at(&g, panel, k);
                const int8_t *qk = q + k * QBLK;
                float d, m;
                block_scales(&g, panel, k, bp, (size_t)L, &d, &m);
                if (kind == KIND_Q6K) { /* per half: sum((u - 32) q) times that half's scale */
                    int ia = 0, ib = 0, sa = halves[k], sb = -corr[k] / 128 - sa;
                    for (int i = 0; i < QBLK; i++) {
                        int p = value_at(bp, kind, (size_t)L, i) * qk[i];
                        if (i < 16) ia += p;
                        else ib += p;
                    }
                    acc = fmaf((float)(ia - 32 * sa), d * xd[k], acc);
                    acc = fmaf((float)(ib - 32 * sb), m * xd[k], acc);
                    continue;
                }
                int isum = 0;
                for (int i = 0; i < QBLK; i++) isum += value_at(bp, kind, (size_t)L, i) * qk[i];
                if (kind == KIND_Q8S) isum += corr[k];
                acc = fmaf((float)isum, d * xd[k], acc);
                if (kind != KIND_Q8S) bias = fmaf(m, xs[k], bias);
            }
            y[(size_t)r * ldy + L] = acc + bias;
        }
    }
}

#define QK_WRAP(ISA, KIND, RT)                                                                                  \
    static void ISA##_##KIND##_##RT(const uint8_t *panel, int nb, int sf32, const uint8_t *x, size_t xrow,      \
                                    float *y, size_t ldy, int valid) {                                          \
        ISA(panel, nb, sf32, x, xrow, y, ldy, valid, RT, KIND);                                                 \
    }
#define QK_KIND4(ISA, KIND) QK_WRAP(ISA, KIND, 1) QK_WRAP(ISA, KIND, 2) QK_WRAP(ISA, KIND, 3) QK_WRAP(ISA, KIND, 4)
#define QK_KIND8(ISA, KIND)                                                                                     \
    QK_KIND4(ISA, KIND) QK_WRAP(ISA, KIND, 5) QK_WRAP(ISA, KIND, 6) QK_WRAP(ISA, KIND, 7) QK_WRAP(ISA, KIND, 8)
#define QK_ROW4(ISA, KIND) {ISA##_##KIND##_1, ISA##_##KIND##_2, ISA##_##KIND##_3, ISA##_##KIND##_4}
#define QK_ROW8(ISA, KIND)                                                                                      \
    {ISA##_##KIND##_1, ISA##_##KIND##_2, ISA##_##KIND##_3, ISA##_##KIND##_4,                                    \
     ISA##_##KIND##_5, ISA##_##KIND##_6, ISA##_##KIND##_7, ISA##_##KIND##_8}

QK_KIND4(qk_generic, KIND_Q4) QK_KIND4(qk_generic, KIND_Q8) QK_KIND4(qk_generic, KIND_Q8S)
QK_KIND4(qk_generic, KIND_Q5) QK_KIND4(qk_generic, KIND_Q6K) QK_KIND4(qk_generic, KIND_Q4K)
QK_KIND4(qk_generic, KIND_Q5K) QK_KIND4(qk_generic, KIND_Q4S) QK_KIND4(qk_generic, KIND_Q5S)
static const qkernel_set generic_set = {{QK_ROW4(qk_generic, KIND_Q4), QK_ROW4(qk_generic, KIND_Q8),
                                         QK_ROW4(qk_generic, KIND_Q8S), QK_ROW4(qk_generic, KIND_Q5),
                                         QK_ROW4(qk_generic, KIND_Q6K), QK_ROW4(qk_generic, KIND_Q4K),
                                         QK_ROW4(qk_generic, KIND_Q5K), QK_ROW4(qk_generic, KIND_Q4S),
                                         QK_ROW4(qk_generic, KIND_Q5S)},
                                        4,
                                        "generic"};

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>

/* ---- AVX2: a panel as two halves of 8 rows (the first / second 32 bytes of every 64-byte group).
 * maddubs multiplies u8 by s8 into i16 pairs: q4 nibbles directly (no saturation: 2 * 15 * 127), q8
 * through the sign trick (|u - 128| times x with u - 128's sign), whose integer is sum((u - 128) q),
 * turned into sum(u q) by subtracting corr for asymmetric q8. */
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")

static inline __m256 load_scales8(const uint8_t *p, int sf32) {
    if (sf32) return _mm256_loadu_ps((const float *)(const void *)p);
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(const void *)p));
}
static inline __m256i bcst4(const uint8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
}
/* 32 mask bits at p -> 32 bytes, 0x10 where the bit is set (q5's fifth bit). */
static inline __m256i fifth_bits(const uint8_t *p) {
    const __m256i spread = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2,
                                            3, 3, 3, 3, 3, 3, 3, 3);
    const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
    __m256i v = _mm256_and_si256(_mm256_shuffle_epi8(bcst4(p), spread), bit);
    return _mm256_and_si256(_mm256_cmpeq_epi8(v, bit), _mm256_set1_epi8(0x10));
}

/* Block k of half h (rows 8h..8h+7) of a panel against RT activation rows, into acc / bias. */
static inline __attribute__((always_inline)) void qk_avx2_block(const qgeom *gp, const uint8_t *panel, int k, int h,
                                                                int nb, const uint8_t *x, size_t xrow, int RT,
                                                                int KIND, __m256 *acc, __m256 *bias) {
    const qgeom g = *gp;
    const __m256i low4 = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1), flip = _mm256_set1_epi8((char)0x80);
    const uint8_t *bp = block_at(&g, panel, k);
    __m256i isum[4], isum2[4];
    for (int r = 0; r < RT; r++) isum[r] = isum2[r] = _mm256_setzero_si256();
    if (KIND_NIBBLES(KIND) || KIND == KIND_Q6K) {
        for (int s = 0; s < 4; s++) {
            __m256i w = _mm256_loadu_si256((const __m256i *)(const void *)(bp + 64 * s + 32 * h));
            __m256i lo = _mm256_and_si256(w, low4), hi = _mm256_and_si256(_mm256_srli_epi16(w, 4), low4);
            if (KIND_FIFTH(KIND)) { /* u <= 31: maddubs pairs stay below 2 * 31 * 127 */
                lo = _mm256_or_si256(lo, fifth_bits(bp + PANEL * 16 + 8 * (2 * s) + 4 * h));
                hi = _mm256_or_si256(hi, fifth_bits(bp + PANEL * 16 + 8 * (2 * s + 1) + 4 * h));
            }
            if (KIND == KIND_Q6K) { /* u <= 63: maddubs pairs stay below 2 * 63 * 127 */
                __m256i hb = _mm256_loadu_si256(
                    (const __m256i *)(const void *)(bp + PANEL * 16 + 64 * (s / 2) + 32 * h));
                __m256i top = _mm256_set1_epi8(0x30);
                lo = _mm256_or_si256(lo, _mm256_and_si256(s % 2 ? hb : _mm256_slli_epi16(hb, 4), top));
                hi = _mm256_or_si256(
                    hi, _mm256_and_si256(s % 2 ? _mm256_srli_epi16(hb, 2) : _mm256_slli_epi16(hb, 2), top));
            }
            for (int r = 0; r < RT; r++) {
                const uint8_t *q = x + (size_t)r * xrow + (size_t)k * QBLK;
                __m256i pl = _mm256_maddubs_epi16(lo, bcst4(q + 4 * s)),
                        ph = _mm256_maddubs_epi16(hi, bcst4(q + 16 + 4 * s));
                if (KIND == KIND_Q6K) { /* low nibbles: the first half, high: the second */
                    isum[r] = _mm256_add_epi32(isum[r], _mm256_madd_epi16(pl, ones));
                    isum2[r] = _mm256_add_epi32(isum2[r], _mm256_madd_epi16(ph, ones));
                } else {
                    isum[r] = _mm256_add_epi32(isum[r], _mm256_madd_epi16(_mm256_add_epi16(pl, ph), ones));
                }
            }
        }
    } else {
        for (int s = 0; s < 8; s++) {
            __m256i ws = _mm256_xor_si256(
                _mm256_loadu_si256((const __m256i *)(const void *)(bp + 64 * s + 32 * h)), flip);
            __m256i wa = _mm256_sign_epi8(ws, ws); /* |u - 128| (128 stays 0x80 = 128 unsigned) */
            for (int r = 0; r < RT; r++) {
                const uint8_t *q = x + (size_t)r * xrow + (size_t)k * QBLK;
                __m256i p = _mm256_maddubs_epi16(wa, _mm256_sign_epi8(bcst4(q + 4 * s), ws));
                isum[r] = _mm256_add_epi32(isum[r], _mm256_madd_epi16(p, ones));
            }
        }
    }
    __m256 d, m;
    if (KIND_IS_K(KIND)) { /* GGML's products d * sc, -(dmin * mn) (Q6_K: both halves' d * sc) */
        const uint8_t *hp = header_at(&g, panel, k), *sp = bp + g.q_bytes + 8 * h;
        __m256 dd = load_scales8(hp + 16 * h, 0);
        __m128i sa = _mm_loadl_epi64((const __m128i *)(const void *)sp),
                sb = _mm_loadl_epi64((const __m128i *)(const void *)(sp + PANEL));
        if (KIND == KIND_Q6K) {
            d = _mm256_mul_ps(dd, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sa)));
            m = _mm256_mul_ps(dd, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sb)));
        } else {
            d = _mm256_mul_ps(dd, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(sa)));
            m = _mm256_xor_ps(_mm256_mul_ps(load_scales8(hp + 2 * PANEL + 16 * h, 0),
                                            _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(sb))),
                              _mm256_set1_ps(-0.0f));
        }
    } else {
        d = load_scales8(bp + g.q_bytes + 8 * h * g.s_size, g.sf32);
        m = KIND == KIND_Q8S           ? d
            : KIND_SYM_NIBBLES(KIND) ? _mm256_mul_ps(d, _mm256_set1_ps(KIND_ZERO(KIND)))
                                     : load_scales8(bp + g.q_bytes + PANEL * g.s_size + 8 * h * g.s_size, g.sf32);
    }
    for (int r = 0; r < RT && KIND == KIND_Q6K; r++) {
        const uint8_t *xr = x + (size_t)r * xrow;
        int sa = XQ_HALF(xr, nb)[k], sb = -XQ_CORR(xr, nb)[k] / 128 - sa;
        __m256 xd = _mm256_set1_ps(XQ_D(xr, nb)[k]);
        __m256i ia = _mm256_sub_epi32(isum[r], _mm256_set1_epi32(32 * sa));
        __m256i ib = _mm256_sub_epi32(isum2[r], _mm256_set1_epi32(32 * sb));
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ia), _mm256_mul_ps(d, xd), acc[r]);
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ib), _mm256_mul_ps(m, xd), acc[r]);
    }
    for (int r = 0; r < RT && KIND != KIND_Q6K; r++) {
        const uint8_t *xr = x + (size_t)r * xrow;
        __m256i s = isum[r];
        if (KIND == KIND_Q8) s = _mm256_sub_epi32(s, _mm256_set1_epi32(XQ_CORR(xr, nb)[k]));
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_mul_ps(d, _mm256_set1_ps(XQ_D(xr, nb)[k])),
                                 acc[r]);
        if (KIND != KIND_Q8S) bias[r] = _mm256_fmadd_ps(m, _mm256_set1_ps(XQ_S(xr, nb)[k]), bias[r]);
    }
}

/* Decode (one activation row) takes both halves of each block in one pass over the panel, streamed once
 * with prefetch; wider tiles take the halves one after the other (their accumulators fill the registers).
 * Every lane sees the same operations in the same order either way. */
static inline __attribute__((always_inline)) void qk_avx2(const uint8_t *panel, int nb, int sf32, const uint8_t *x,
                                                          size_t xrow, float *y, size_t ldy, int valid, int RT,
                                                          int KIND) {
    qgeom g = geometry_of(KIND, sf32, nb * QBLK);
    bool both = valid > 8;
    if (RT == 1) { /* accumulators named, not indexed by a run-time half: they stay in registers */
        __m256 a0 = _mm256_setzero_ps(), b0 = a0, a1 = a0, b1 = a0;
        for (int k = 0; k < nb; k++) {
            const uint8_t *bp = block_at(&g, panel, k);
            for (size_t off = 0; off < g.block_bytes; off += 64)
                _mm_prefetch((const char *)((uintptr_t)bp + PREFETCH_BYTES + off), _MM_HINT_T0);
            qk_avx2_block(&g, panel, k, 0, nb, x, xrow, 1, KIND, &a0, &b0);
            if (both) qk_avx2_block(&g, panel, k, 1, nb, x, xrow, 1, KIND, &a1, &b1);
        }
        float out[16];
        _mm256_storeu_ps(out, _mm256_add_ps(a0, b0));
        _mm256_storeu_ps(out + 8, _mm256_add_ps(a1, b1));
        memcpy(y, out, (size_t)valid * sizeof(float));
    } else {
        for (int h = 0; h < (both ? 2 : 1); h++) {
            __m256 acc[4], bias[4];
            for (int r = 0; r < RT; r++) acc[r] = bias[r] = _mm256_setzero_ps();
            for (int k = 0; k < nb; k++) {
                if (h == 0) { /* the first pass streams the panel from memory (the second finds it in L1 / L2) */
                    const uint8_t *bp = block_at(&g, panel, k);
                    for (size_t off = 0; off < g.block_bytes; off += 64)
                        _mm_prefetch((const char *)((uintptr_t)bp + PREFETCH_BYTES + off), _MM_HINT_T0);
                }
                qk_avx2_block(&g, panel, k, h, nb, x, xrow, RT, KIND, acc, bias);
            }
            int n = valid - 8 * h < 8 ? valid - 8 * h : 8;
            for (int r = 0; r < RT; r++) {
                float out[8];
                _mm256_storeu_ps(out, _mm256_add_ps(acc[r], bias[r]));
                memcpy(y + (size_t)r * ldy + 8 * h, out, (size_t)n * sizeof(float));
            }
        }
    }
    _mm256_zeroupper();
}

QK_KIND4(qk_avx2, KIND_Q4) QK_KIND4(qk_avx2, KIND_Q8) QK_KIND4(qk_avx2, KIND_Q8S) QK_KIND4(qk_avx2, KIND_Q5)
QK_KIND4(qk_avx2, KIND_Q6K) QK_KIND4(qk_avx2, KIND_Q4K) QK_KIND4(qk_avx2, KIND_Q5K) QK_KIND4(qk_avx2, KIND_Q4S)
QK_KIND4(qk_avx2, KIND_Q5S)
#pragma GCC pop_options
static const qkernel_set avx2_set = {{QK_ROW4(qk_avx2, KIND_Q4), QK_ROW4(qk_avx2, KIND_Q8), QK_ROW4(qk_avx2, KIND_Q8S),
                                      QK_ROW4(qk_avx2, KIND_Q5), QK_ROW4(qk_avx2, KIND_Q6K), QK_ROW4(qk_avx2, KIND_Q4K),
                                      QK_ROW4(qk_avx2, KIND_Q5K), QK_ROW4(qk_avx2, KIND_Q4S), QK_ROW4(qk_avx2, KIND_Q5S)},
                                     4,
                                     "avx2"};

/* ---- AVX-512 VNNI: one dpbusd per 64-byte group and activation row, the 4 activation bytes broadcast. */
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")

static inline __m512 load_scales16(const uint8_t *p, int sf32) {
    if (sf32) return _mm512_loadu_ps((const float *)(const void *)p);
    return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(const void *)p));
}
static inline __m512i bcst4_512(const uint8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm512_set1_epi32(v);
}

static inline __attribute__((always_inline)) void qk_vnni(const uint8_t *panel, int nb, int sf32, const uint8_t *x,
                                                          size_t xrow, float *y, size_t ldy, int valid, int RT,
                                                          int KIND) {
    qgeom g = geometry_of(KIND, sf32, nb * QBLK);
    const __m512i low4 = _mm512_set1_epi8(0x0F), fifth = _mm512_set1_epi8(0x10);
    __m512 acc[8], bias[8];
    for (int r = 0; r < RT; r++) acc[r] = bias[r] = _mm512_setzero_ps();
    for (int k = 0; k < nb; k++) {
        const uint8_t *bp = block_at(&g, panel, k);
        for (size_t off = 0; off < g.block_bytes; off += 64)
            _mm_prefetch((const char *)((uintptr_t)bp + PREFETCH_BYTES + off), _MM_HINT_T0);
        __m512i isum[8], isum2[8];
        for (int r = 0; r < RT; r++) isum[r] = isum2[r] = _mm512_setzero_si512();
        if (KIND_NIBBLES(KIND) || KIND == KIND_Q6K) {
            for (int s = 0; s < 4; s++) {
                __m512i w = _mm512_loadu_si512(bp + 64 * s);
                __m512i lo = _mm512_and_si512(w, low4), hi = _mm512_and_si512(_mm512_srli_epi16(w, 4), low4);
                if (KIND_FIFTH(KIND)) {
                    uint64_t ml, mh;
                    memcpy(&ml, bp + PANEL * 16 + 8 * (2 * s), 8);
                    memcpy(&mh, bp + PANEL * 16 + 8 * (2 * s + 1), 8);
                    lo = _mm512_or_si512(lo, _mm512_maskz_mov_epi8((__mmask64)ml, fifth));
                    hi = _mm512_or_si512(hi, _mm512_maskz_mov_epi8((__mmask64)mh, fifth));
                }
                if (KIND == KIND_Q6K) { /* the 2-bit planes: bits 4e, 4e + 2 of byte j for group 2p + e */
                    __m512i hb = _mm512_loadu_si512(bp + PANEL * 16 + 64 * (s / 2)), top = _mm512_set1_epi8(0x30);
                    lo = _mm512_or_si512(lo, _mm512_and_si512(s % 2 ? hb : _mm512_slli_epi16(hb, 4), top));
                    hi = _mm512_or_si512(
                        hi, _mm512_and_si512(s % 2 ? _mm512_srli_epi16(hb, 2) : _mm512_slli_epi16(hb, 2), top));
                }
                for (int r = 0; r < RT; r++) {
                    const uint8_t *q = x + (size_t)r * xrow + (size_t)k * QBLK;
                    isum[r] = _mm512_dpbusd_epi32(isum[r], lo, bcst4_512(q + 4 * s));
                    if (KIND == KIND_Q6K) /* high nibbles: the block's second half */
                        isum2[r] = _mm512_dpbusd_epi32(isum2[r], hi, bcst4_512(q + 16 + 4 * s));
                    else
                        isum[r] = _mm512_dpbusd_epi32(isum[r], hi, bcst4_512(q + 16 + 4 * s));
                }
            }
        } else {
            for (int s = 0; s < 8; s++) {
                __m512i w = _mm512_loadu_si512(bp + 64 * s);
                for (int r = 0; r < RT; r++)
                    isum[r] = _mm512_dpbusd_epi32(isum[r], w, bcst4_512(x + (size_t)r * xrow + (size_t)k * QBLK + 4 * s));
            }
        }
        __m512 d, m;
        if (KIND_IS_K(KIND)) { /* GGML's products d * sc, -(dmin * mn) (Q6_K: both halves' d * sc) */
            const uint8_t *hp = header_at(&g, panel, k), *sp = bp + g.q_bytes;
            __m512 dd = load_scales16(hp, 0);
            __m128i sa = _mm_loadu_si128((const __m128i *)(const void *)sp),
                    sb = _mm_loadu_si128((const __m128i *)(const void *)(sp + PANEL));
            if (KIND == KIND_Q6K) {
                d = _mm512_mul_ps(dd, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(sa)));
                m = _mm512_mul_ps(dd, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(sb)));
            } else {
                d = _mm512_mul_ps(dd, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(sa)));
                m = _mm512_castsi512_ps(_mm512_xor_si512(
                    _mm512_castps_si512(_mm512_mul_ps(load_scales16(hp + 2 * PANEL, 0),
                                                      _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(sb)))),
                    _mm512_set1_epi32((int)0x80000000u)));
            }
        } else {
            d = load_scales16(bp + g.q_bytes, sf32);
            m = KIND == KIND_Q8S           ? d
                : KIND_SYM_NIBBLES(KIND) ? _mm512_mul_ps(d, _mm512_set1_ps(KIND_ZERO(KIND)))
                                         : load_scales16(bp + g.q_bytes + PANEL * g.s_size, sf32);
        }
        for (int r = 0; r < RT && KIND == KIND_Q6K; r++) {
            const uint8_t *xr = x + (size_t)r * xrow;
            int sa = XQ_HALF(xr, nb)[k], sb = -XQ_CORR(xr, nb)[k] / 128 - sa;
            __m512 xd = _mm512_set1_ps(XQ_D(xr, nb)[k]);
            __m512i ia = _mm512_sub_epi32(isum[r], _mm512_set1_epi32(32 * sa));
            __m512i ib = _mm512_sub_epi32(isum2[r], _mm512_set1_epi32(32 * sb));
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ia), _mm512_mul_ps(d, xd), acc[r]);
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ib), _mm512_mul_ps(m, xd), acc[r]);
        }
        for (int r = 0; r < RT && KIND != KIND_Q6K; r++) {
            const uint8_t *xr = x + (size_t)r * xrow;
            __m512i s = isum[r];
            if (KIND == KIND_Q8S) s = _mm512_add_epi32(s, _mm512_set1_epi32(XQ_CORR(xr, nb)[k]));
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(d, _mm512_set1_ps(XQ_D(xr, nb)[k])), acc[r]);
            if (KIND != KIND_Q8S) bias[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(XQ_S(xr, nb)[k]), bias[r]);
        }
    }
    __mmask16 keep = (__mmask16)(valid >= 16 ? 0xFFFF : (1u << valid) - 1);
    for (int r = 0; r < RT; r++) _mm512_mask_storeu_ps(y + (size_t)r * ldy, keep, _mm512_add_ps(acc[r], bias[r]));
    _mm256_zeroupper();
}

QK_KIND8(qk_vnni, KIND_Q4) QK_KIND8(qk_vnni, KIND_Q8) QK_KIND8(qk_vnni, KIND_Q8S) QK_KIND8(qk_vnni, KIND_Q5)
QK_KIND8(qk_vnni, KIND_Q6K) QK_KIND8(qk_vnni, KIND_Q4K) QK_KIND8(qk_vnni, KIND_Q5K) QK_KIND8(qk_vnni, KIND_Q4S)
QK_KIND8(qk_vnni, KIND_Q5S)
#pragma GCC pop_options
static const qkernel_set vnni_set = {{QK_ROW8(qk_vnni, KIND_Q4), QK_ROW8(qk_vnni, KIND_Q8), QK_ROW8(qk_vnni, KIND_Q8S),
                                      QK_ROW8(qk_vnni, KIND_Q5), QK_ROW8(qk_vnni, KIND_Q6K), QK_ROW8(qk_vnni, KIND_Q4K),
                                      QK_ROW8(qk_vnni, KIND_Q5K), QK_ROW8(qk_vnni, KIND_Q4S), QK_ROW8(qk_vnni, KIND_Q5S)},
                                     8,
                                     "avx512-vnni"};
#endif

static const qkernel_set *g_qset;
static pthread_once_t g_qset_once = PTHREAD_ONCE_INIT;

/* Once per process, like the float kernels; BASERT_REF_SIMD caps it ("generic" / "0", "avx2"), and
 * BASERT_REF_QUANT_SIMD caps this set alone (tests: the sets compute identical values, the choice is
 * speed only, which a test can show only with the float kernels fixed). */
static void select_qset(void) {
    int level = rt_simd_level("BASERT_REF_QUANT_SIMD");
    g_qset = &generic_set;
#if defined(__x86_64__) && defined(__GNUC__)
    if (level >= RT_SIMD_AVX2) g_qset = &avx2_set;
    if (level >= RT_SIMD_AVX512_VNNI) g_qset = &vnni_set;
#endif
}

static const qkernel_set *qset(void) {
    pthread_once(&g_qset_once, select_qset);
    return g_qset;
}

const char *rt_quant_isa(void) { return qset()->name; }

size_t rt_qweight_row_bytes(const rt_weight *w, int in) { return geometry(w->type, w->flags, in).panel_bytes / PANEL; }

/* The activations are quantized with AVX2 whenever the integer kernels are SIMD (same bytes either way;
 * the portable set keeps the portable quantizer, so a generic run tests it). */
static bool quantize_simd(void) { return qset() != &generic_set; }

/* Activation rows in blocks of about QX_BLOCK_BYTES (they stay in L2 while the range's panels pass them
 * once per block: a prefill of a wide FFN would otherwise stream every row from L3 or memory once per
 * panel), then panels, then rows in groups of the set's widest tile: a panel (a few KB) stays in L1 while
 * the block's rows pass it. Every output is the same whatever block or tile it lands in (quant.h). o0 is a
 * multiple of the panel height (mathops.c's units are). */
enum { QX_BLOCK_BYTES = 256 * 1024 };

void rt_qmatmul_range(const rt_weight *w, int in, const uint8_t *xq, int rows, float *y, size_t ldy, int o0,
                      int o1) {
    const qkernel_set *ks = qset();
    qgeom g = geometry(w->type, w->flags, in);
    size_t xrow = rt_qx_row_bytes(in);
    int block = (int)(QX_BLOCK_BYTES / xrow) / ks->rt_max * ks->rt_max;
    if (block < ks->rt_max) block = ks->rt_max;
    for (int r0 = 0; r0 < rows; r0 += block) {
        int r1 = rows - r0 < block ? rows : r0 + block;
        for (int o = o0; o < o1; o += PANEL) {
            const uint8_t *panel = (const uint8_t *)w->p + (size_t)(o / PANEL) * g.panel_bytes;
            int valid = o1 - o < PANEL ? o1 - o : PANEL;
            for (int r = r0; r < r1;) {
                int rt = r1 - r < ks->rt_max ? r1 - r : ks->rt_max;
                ks->k[g.kind][rt - 1](panel, g.nb, g.sf32, xq + (size_t)r * xrow, xrow, y + (size_t)r * ldy + o,
                                      ldy, valid);
                r += rt;
            }
        }
    }
}
