/* The llama forward over a packed batch of rows (docs/BUNDLE.md).
 *
 * Lane i contributes lanes[i].n consecutive positions starting at its
 * sequence's length. Rows are processed in slices of at most `chunk` rows;
 * within a slice every layer runs as one batched matmul per weight, so the
 * weights stream from memory once per slice whatever the number of lanes.
 * Every per-row value is computed by the same operations in the same order
 * whatever slice or batch it lands in (see mathops.h), which makes batched,
 * chunked and prefix-seeded runs bit-identical to single, one-shot, cold ones.
 * Attention reads K/V back from the pool, so a row sees exactly the values an
 * earlier slice, an earlier step or a seeded prefix block stored. */

#include "forward.h"

#include "errors.h"
#include "f16.h"
#include "kv.h"
#include "mathops.h"

#include <math.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

/* YaRN's ramp between the interpolated and extrapolated angle of pair i (llama.cpp's rope_yarn_ramp). */
static double yarn_ramp(double low, double high, int i) {
    double y = ((double)i - low) / fmax(0.001, high - low);
    return 1.0 - fmin(1.0, fmax(0.0, y));
}

/* YaRN's correction dimension for a number of rotations (ggml_rope_yarn_corr_dim). */
static double yarn_corr_dim(int n_dims, uint32_t n_ctx_orig, double n_rot, double base) {
    return n_dims * log((double)n_ctx_orig / (n_rot * 2.0 * M_PI)) / (2.0 * log(base));
}

/* Llama 3.1's llama3 scaling of pair i (HF's _compute_llama3_parameters, what llama.cpp's converter
 * stores in rope_freqs): wavelengths shorter than orig_ctx / high_freq_factor kept, longer than
 * orig_ctx / low_freq_factor divided by the factor, a smooth blend between. */
static double llama3_divisor(const rt_rope_params *r, int head_dim, int i) {
    double freq = pow(r->theta, -2.0 * (double)i / (double)head_dim);
    double wavelen = 2.0 * M_PI / freq, ctx = (double)r->orig_ctx;
    if (wavelen < ctx / r->high_freq_factor) return 1.0;
    if (wavelen > ctx / r->low_freq_factor) return r->llama3_factor;
    double smooth = (ctx / wavelen - r->low_freq_factor) / (r->high_freq_factor - r->low_freq_factor);
    return 1.0 / ((1.0 - smooth) / r->llama3_factor + smooth);
}

/* One RoPE table [max_seq][head_dim/2] of cos / sin: pair i at position pos turns
 * by pos * theta^(-2i/head_dim) / freq_factor[i], then scaled as ggml's rope_yarn
 * does (linear: times freq_scale; YaRN: blended with the unscaled angle along a
 * ramp and the magnitude scaled). Angles in double, rounded once to f32. */
static void rope_table(const rt_rope_params *r, const float *freq_factors, int head_dim, uint32_t max_seq,
                       float *cos_out, float *sin_out) {
    int half = head_dim / 2;
    double lo = 0.0, hi = 0.0, mscale = r->attn_factor;
    if (r->ext_factor != 0.0) {
        lo = fmax(0.0, floor(yarn_corr_dim(head_dim, r->orig_ctx, r->beta_fast, r->theta)));
        hi = fmin(head_dim - 1, ceil(yarn_corr_dim(head_dim, r->orig_ctx, r->beta_slow, r->theta)));
        mscale *= 1.0 + 0.1 * log(1.0 / r->freq_scale);
    }
    for (uint32_t pos = 0; pos < max_seq; pos++) {
        for (int i = 0; i < half; i++) {
            double extrap = (double)pos * pow(r->theta, -2.0 * (double)i / (double)head_dim);
            if (r->freq_factors && freq_factors) extrap /= (double)freq_factors[i];
            else if (r->llama3_factor > 0.0) extrap /= llama3_divisor(r, head_dim, i);
            double angle = r->freq_scale * extrap;
            if (r->ext_factor != 0.0) {
                double mix = yarn_ramp(lo, hi, i) * r->ext_factor;
                angle = angle * (1.0 - mix) + extrap * mix;
            }
            cos_out[(size_t)pos * half + i] = (float)(cos(angle) * mscale);
            sin_out[(size_t)pos * half + i] = (float)(sin(angle) * mscale);
        }
    }
}

int rt_forward_init(rt_model *m) {
    rt_runtime *rt = m->rt;
    const BaseRTModelConfig *c = &m->cfg;
    size_t C = (size_t)m->prefill_chunk;
    size_t half = c->head_dim / 2;
    int n_threads = rt_threads_count(rt->threads);
    size_t n_tables = m->arch.sliding_window ? 2 : 1; /* sliding-window layers have a RoPE table of their own */
    rt->chunk = m->prefill_chunk;
    rt->max_lanes = m->max_batch_size > 1 ? m->max_batch_size : 1;
    struct {
        void **p;
        size_t bytes;
    } allocs[] = {
        {(void **)&rt->x, C * c->dim * sizeof(float)},
        {(void **)&rt->xb, C * c->dim * sizeof(float)},
        {(void **)&rt->q, C * c->q_dim * sizeof(float)},
        {(void **)&rt->k, C * c->kv_dim * sizeof(float)},
        {(void **)&rt->v, C * c->kv_dim * sizeof(float)},
        {(void **)&rt->att, C * c->q_dim * sizeof(float)},
        {(void **)&rt->hb, C * c->ffn_dim * sizeof(float)},
        {(void **)&rt->hb2, C * c->ffn_dim * sizeof(float)},
        {(void **)&rt->row_lane, C * sizeof(int)},
        {(void **)&rt->row_pos, C * sizeof(int)},
        {(void **)&rt->lane_out_first, (size_t)rt->max_lanes * sizeof(int)},
        {(void **)&rt->lane_tap_first, (size_t)rt->max_lanes * sizeof(int)},
        {(void **)&rt->att_scores, (size_t)n_threads * (c->n_heads / c->n_kv_heads) * c->max_seq_len * sizeof(float)},
        {(void **)&rt->rope_cos, n_tables * c->max_seq_len * half * sizeof(float)},
        {(void **)&rt->rope_sin, n_tables * c->max_seq_len * half * sizeof(float)},
        {(void **)&rt->final_h, (size_t)rt->max_lanes * c->dim * sizeof(float)},
        /* activations quantized per 32 for quantized weights: any matmul's input rows */
        {(void **)&rt->xq, rt_matmul_scratch_bytes((int)(C > (size_t)rt->max_lanes ? C : (size_t)rt->max_lanes),
                                                   (int)(c->dim > c->q_dim ? (c->dim > c->ffn_dim ? c->dim : c->ffn_dim)
                                                         : (c->q_dim > c->ffn_dim ? c->q_dim : c->ffn_dim)))},
    };
    for (size_t i = 0; i < sizeof allocs / sizeof allocs[0]; i++) {
        *allocs[i].p = malloc(allocs[i].bytes ? allocs[i].bytes : 1);
        if (!*allocs[i].p) {
            rt_set_error(BASERT_ERR_OUT_OF_MEMORY, "forward scratch: cannot allocate %zu bytes", allocs[i].bytes);
            return BASERT_ERR_OUT_OF_MEMORY;
        }
        rt->bytes += allocs[i].bytes;
    }
    for (size_t table = 0; table < n_tables; table++) {
        size_t at = table * c->max_seq_len * half;
        rope_table(&m->arch.rope[table], m->rope_freqs, (int)c->head_dim, c->max_seq_len, rt->rope_cos + at,
                   rt->rope_sin + at);
    }
    return BASERT_OK;
}

void rt_forward_free(rt_model *m) {
    rt_runtime *rt = m->rt;
    float *fs[] = {rt->x, rt->xb, rt->q, rt->k, rt->v, rt->att, rt->hb, rt->hb2,
                   rt->att_scores, rt->rope_cos, rt->rope_sin, rt->final_h};
    for (size_t i = 0; i < sizeof fs / sizeof fs[0]; i++) free(fs[i]);
    free(rt->row_lane);
    free(rt->row_pos);
    free(rt->lane_out_first);
    free(rt->lane_tap_first);
    free(rt->tap_buf);
    free(rt->xq);
}

/* ---- row-wise ops ---------------------------------------------------------- */

static void rmsnorm(float *out, const float *x, const float *w, int n, float eps) {
    double ss = 0.0;
    for (int i = 0; i < n; i++) ss += (double)x[i] * (double)x[i];
    float scale = (float)(1.0 / sqrt(ss / n + (double)eps));
    for (int i = 0; i < n; i++) out[i] = (x[i] * scale) * w[i];
}

/* Rotate pair i of each head by the table's angle: pairs (2i, 2i+1) (llama's
 * GGUF-permuted rows) or (i, i + head_dim/2) (NeoX: Qwen, Gemma). */
static void rope(float *vec, int n_heads, int head_dim, rt_rope_pairs pairs, const float *cos_row,
                 const float *sin_row) {
    int half = head_dim / 2;
    int stride = pairs == RT_ROPE_NEOX ? 1 : 2, other = pairs == RT_ROPE_NEOX ? half : 1;
    for (int h = 0; h < n_heads; h++) {
        float *v = vec + (size_t)h * head_dim;
        for (int i = 0; i < half; i++) {
            float *x = v + i * stride, *y = x + other;
            float a = *x, b = *y, c = cos_row[i], s = sin_row[i];
            *x = a * c - b * s;
            *y = a * s + b * c;
        }
    }
}

static void add_bias(float *x, const float *b, int n) {
    for (int i = 0; i < n; i++) x[i] += b[i];
}

/* ---- attention ------------------------------------------------------------- */

/* Widen cnt tokens' Q8_0 head slices (hd values, rows `rb` bytes apart) to f32 [cnt][hd]. */
static float *kv_widen_q8(float *out, const char *src, size_t rb, int cnt, int hd) {
    for (int t = 0; t < cnt; t++) {
        const unsigned char *row = (const unsigned char *)src + (size_t)t * rb;
        for (int b = 0; b < hd / 32; b++) {
            const unsigned char *blk = row + (size_t)b * RT_KV_Q8_BLOCK;
            uint16_t h;
            memcpy(&h, blk, 2);
            float d = rt_f16_to_f32(h);
            for (int i = 0; i < 32; i++) out[(size_t)t * hd + b * 32 + i] = d * (float)(int8_t)blk[2 + i];
        }
    }
    return out;
}

/* The pool slot of position t0 of sequence s, and in *cnt how many positions from
 * t0 (before n) follow it in the same page. */
static size_t page_segment(const rt_seq *s, int t0, int n, int *cnt) {
    int in_page = t0 % RT_PAGE_SIZE;
    *cnt = n - t0 < RT_PAGE_SIZE - in_page ? n - t0 : RT_PAGE_SIZE - in_page;
    return (size_t)s->blocks[t0 / RT_PAGE_SIZE] * RT_PAGE_SIZE + (size_t)in_page;
}

/* Attention work (multiply-adds of query heads against cached keys) worth a thread: one (row, kv head) item
 * is claimed at a time, so a thread with less would mostly wait to be woken. */
enum { ATTN_MIN_WORK = 32768 };

typedef struct {
    rt_model *m;
    const rt_lane *lanes;
    int layer, rows;
    atomic_int next_item; /* (row, kv head) pairs, claimed one at a time */
} attn_job;

/* The query heads of one row that share kv head `kvh` (GQA): causal softmax
 * attention over positions [0, pos] of the row's lane, read from the pool in
 * position order. Scores are the matmul dot products (query heads against a
 * block of keys at a time), so each one is the same value whatever the block
 * or the row's batch. scores: [group][max_seq_len]. */
static void attend(rt_model *m, const rt_seq *s, int layer, int pos, int kvh, const float *q, float *out,
                   float *scores) {
    const rt_runtime *rt = m->rt;
    int hd = (int)m->cfg.head_dim, max_seq = (int)m->cfg.max_seq_len;
    int group = (int)(m->cfg.n_heads / m->cfg.n_kv_heads);
    size_t kv_off = (size_t)kvh * hd;
    /* This layer's K / V; token t of the pool at t * row bytes, this head at kv_off values in. */
    const char *kl = (const char *)rt->k_pool + (size_t)layer * rt->layer_bytes;
    const char *vl = (const char *)rt->v_pool + (size_t)layer * rt->layer_bytes;
    size_t rb = rt->kv_row_bytes;
    bool q8 = rt->kv_type == RT_KV_Q8;
    size_t head_off = q8 ? kv_off / 32 * RT_KV_Q8_BLOCK : kv_off * (rt->kv_type == RT_KV_F16 ? 2 : 4);
    int wtype = rt->kv_type == RT_KV_F16 ? RT_W_F16 : RT_W_F32;
    size_t ld = q8 ? (size_t)hd : rb / (rt->kv_type == RT_KV_F16 ? 2 : 4); /* row stride in values */
    float page[RT_PAGE_SIZE * RT_KV_MAX_HEAD_DIM]; /* a Q8_0 page slice, widened */
    float scale = m->arch.attn_scale;
    int n = pos + 1;
    /* A sliding-window layer sees the last `window` positions, itself included. */
    uint32_t window = m->layers[layer].sliding ? m->arch.sliding_window : 0;
    int lo = window && (uint32_t)n > window ? n - (int)window : 0;

    for (int t0 = lo, cnt; t0 < n; t0 += cnt) {
        size_t first = page_segment(s, t0, n, &cnt);
        rt_weight keys = {(void *)(kl + first * rb + head_off), wtype, 0};
        if (q8) keys = (rt_weight){kv_widen_q8(page, kl + first * rb + head_off, rb, cnt, hd), RT_W_F32, 0};
        rt_dots(q, (size_t)hd, group, &keys, ld, cnt, scores + t0, (size_t)max_seq, hd);
    }
    for (int g = 0; g < group; g++) {
        float *sc = scores + (size_t)g * max_seq;
        float mx = -INFINITY;
        for (int t = lo; t < n; t++) {
            sc[t] *= scale;
            if (sc[t] > mx) mx = sc[t];
        }
        float sum = 0.0f;
        for (int t = lo; t < n; t++) {
            sc[t] = expf(sc[t] - mx);
            sum += sc[t];
        }
        float *o = out + (size_t)g * hd;
        memset(o, 0, (size_t)hd * sizeof(float));
        for (int t0 = lo, cnt; t0 < n; t0 += cnt) {
            size_t first = page_segment(s, t0, n, &cnt);
            rt_weight vals = {(void *)(vl + first * rb + head_off), wtype, 0};
            if (q8) vals = (rt_weight){kv_widen_q8(page, vl + first * rb + head_off, rb, cnt, hd), RT_W_F32, 0};
            rt_axpy_rows(sc + t0, cnt, &vals, ld, o, hd);
        }
        float inv = 1.0f / sum;
        for (int d = 0; d < hd; d++) o[d] *= inv;
    }
}

static void attn_task(void *ctx, int tid) {
    attn_job *j = ctx;
    rt_model *m = j->m;
    rt_runtime *rt = m->rt;
    int n_kv = (int)m->cfg.n_kv_heads, q_dim = (int)m->cfg.q_dim;
    size_t span = (size_t)(m->cfg.n_heads / m->cfg.n_kv_heads) * m->cfg.head_dim; /* q floats per kv head */
    int items = j->rows * n_kv;
    float *scores = rt->att_scores + (size_t)tid * (m->cfg.n_heads / m->cfg.n_kv_heads) * m->cfg.max_seq_len;
    for (;;) {
        int it = atomic_fetch_add_explicit(&j->next_item, 1, memory_order_relaxed);
        if (it >= items) return;
        int r = it / n_kv, kvh = it % n_kv;
        const float *q = rt->q + (size_t)r * q_dim + kvh * span;
        float *out = rt->att + (size_t)r * q_dim + kvh * span;
        attend(m, j->lanes[rt->row_lane[r]].seq, j->layer, rt->row_pos[r], kvh, q, out, scores);
    }
}

/* The gated FFN: g = act(g) * u (SwiGLU's silu, GeGLU's tanh-approximated gelu), element by element (so
 * any split gives the same values), shared out in chunks when a wide batch makes it worth a wake-up. */
enum { SILU_CHUNK = 4096, SILU_PARALLEL = 4 * SILU_CHUNK }; /* elements per claim, per thread at least */

typedef struct {
    float *g;
    const float *u;
    size_t n;
    rt_activation act;
    atomic_size_t next;
} silu_job;

static void silu_task(void *ctx, int tid) {
    (void)tid;
    silu_job *j = ctx;
    for (;;) {
        size_t i0 = atomic_fetch_add_explicit(&j->next, SILU_CHUNK, memory_order_relaxed);
        if (i0 >= j->n) return;
        size_t i1 = i0 + SILU_CHUNK < j->n ? i0 + SILU_CHUNK : j->n;
        if (j->act == RT_ACT_GELU_TANH)
            for (size_t i = i0; i < i1; i++) j->g[i] = rt_gelu_tanh(j->g[i]) * j->u[i];
        else
            for (size_t i = i0; i < i1; i++) j->g[i] = rt_silu(j->g[i]) * j->u[i];
    }
}

/* ---- one slice of rows through all layers ---------------------------------- */

/* One K or V row into the pool: as is (f32), or rounded to nearest-even f16. */
static void kv_store(const rt_runtime *rt, char *dst, const float *src, int n) {
    if (rt->kv_type == RT_KV_Q8) { /* GGML's quantize_row_q8_0: d = amax / 127, q = round(x / d) */
        for (int b = 0; b < n / 32; b++) {
            const float *x = src + b * 32;
            unsigned char *blk = (unsigned char *)dst + (size_t)b * RT_KV_Q8_BLOCK;
            float amax = 0.0f;
            for (int i = 0; i < 32; i++) amax = fmaxf(amax, fabsf(x[i]));
            float d = amax / 127.0f, id = d > 0.0f ? 1.0f / d : 0.0f;
            uint16_t h = rt_f32_to_f16(d);
            memcpy(blk, &h, 2);
            for (int i = 0; i < 32; i++) {
                float r = nearbyintf(x[i] * id);
                /* clamped before the conversion: NaN (Inf * 0) and +-Inf (a subnormal d) would be UB */
                int q = r > 127.0f ? 127 : r < -127.0f ? -127 : r == r ? (int)r : 0;
                blk[2 + i] = (unsigned char)(int8_t)q;
            }
        }
    } else if (rt->kv_type == RT_KV_F16) {
        rt_f32_to_f16_n(src, (uint16_t *)dst, (size_t)n);
    } else {
        memcpy(dst, src, (size_t)n * sizeof(float));
    }
}

/* Copy the slice's tapped rows of hidden_states index `idx` (rt->x as it is
 * now) into every tap block that asks for it, rounded to f16. A lane's tapped
 * rows are its last tap_rows[lane] positions of this step; the slice may hold
 * any part of them (slices cut across lanes), each lands at its own row. */
static void tap_slice(rt_model *m, const rt_lane *lanes, int R, const rt_rows *rows, int idx) {
    if (!rows || rows->n_taps == 0) return;
    rt_runtime *rt = m->rt;
    size_t dim = m->cfg.dim;
    for (int j = 0; j < rows->n_taps; j++) {
        if (rows->tap_layers[j] != idx) continue;
        uint16_t *block = rt->tap_buf + (size_t)j * rt->tap_cap * dim;
        for (int r = 0; r < R; r++) {
            int li = rt->row_lane[r];
            const rt_lane *ln = &lanes[li];
            int first = ln->seq->length + ln->n - rows->tap_rows[li];
            if (rt->row_pos[r] < first) continue;
            uint16_t *dst = block + (size_t)(rt->lane_tap_first[li] + rt->row_pos[r] - first) * dim;
            const float *src = rt->x + (size_t)r * dim;
            rt_f32_to_f16_n(src, dst, dim);
        }
    }
}

static void forward_slice(rt_model *m, const rt_lane *lanes, int R, const rt_rows *rows) {
    rt_runtime *rt = m->rt;
    const BaseRTModelConfig *c = &m->cfg;
    const rt_arch *A = &m->arch;
    int dim = (int)c->dim, q_dim = (int)c->q_dim, kv_dim = (int)c->kv_dim, ffn = (int)c->ffn_dim;
    int hd = (int)c->head_dim, half = hd / 2;

    double attn_work = 0;
    for (int r = 0; r < R; r++) attn_work += (double)(rt->row_pos[r] + 1);
    attn_work *= (double)c->n_heads * hd;

    for (uint32_t l = 0; l < c->n_layers; l++) {
        const rt_layer *L = &m->layers[l];
        tap_slice(m, lanes, R, rows, (int)l); /* hidden_states[l]: the residual entering layer l */
        for (int r = 0; r < R; r++)
            rmsnorm(rt->xb + (size_t)r * dim, rt->x + (size_t)r * dim, L->attn_norm, dim, c->norm_eps);
        rt_mm_target qkv[3] = {
            {L->wq, rt->q, q_dim, (size_t)q_dim},
            {L->wk, rt->k, kv_dim, (size_t)kv_dim},
            {L->wv, rt->v, kv_dim, (size_t)kv_dim},
        };
        rt_matmul(rt->threads, rt->xb, (size_t)dim, R, dim, qkv, 3, rt->xq);
        if (A->qkv_bias)
            for (int r = 0; r < R; r++) {
                add_bias(rt->q + (size_t)r * q_dim, L->bq, q_dim);
                add_bias(rt->k + (size_t)r * kv_dim, L->bk, kv_dim);
                add_bias(rt->v + (size_t)r * kv_dim, L->bv, kv_dim);
            }
        if (A->qk_norm)
            for (int r = 0; r < R; r++) {
                for (uint32_t h = 0; h < c->n_heads; h++) {
                    float *qh = rt->q + (size_t)r * q_dim + (size_t)h * hd;
                    rmsnorm(qh, qh, L->q_norm, hd, c->norm_eps);
                }
                for (uint32_t h = 0; h < c->n_kv_heads; h++) {
                    float *kh = rt->k + (size_t)r * kv_dim + (size_t)h * hd;
                    rmsnorm(kh, kh, L->k_norm, hd, c->norm_eps);
                }
            }
        size_t table = L->sliding ? (size_t)c->max_seq_len * half : 0;

        char *kl = (char *)rt->k_pool + (size_t)l * rt->layer_bytes;
        char *vl = (char *)rt->v_pool + (size_t)l * rt->layer_bytes;
        for (int r = 0; r < R; r++) {
            int pos = rt->row_pos[r];
            const float *cs = rt->rope_cos + table + (size_t)pos * half;
            const float *sn = rt->rope_sin + table + (size_t)pos * half;
            float *qr = rt->q + (size_t)r * q_dim, *kr = rt->k + (size_t)r * kv_dim;
            rope(qr, (int)c->n_heads, hd, A->rope_pairs, cs, sn);
            rope(kr, (int)c->n_kv_heads, hd, A->rope_pairs, cs, sn);
            const rt_seq *s = lanes[rt->row_lane[r]].seq;
            size_t slot = (size_t)s->blocks[pos / RT_PAGE_SIZE] * RT_PAGE_SIZE + (size_t)(pos % RT_PAGE_SIZE);
            kv_store(rt, kl + slot * rt->kv_row_bytes, kr, kv_dim);
            kv_store(rt, vl + slot * rt->kv_row_bytes, rt->v + (size_t)r * kv_dim, kv_dim);
        }

        attn_job aj = {m, lanes, (int)l, R, 0};
        int nt = rt_threads_for_work(rt->threads, attn_work, ATTN_MIN_WORK, R * (int)c->n_kv_heads);
        rt_threads_run(rt->threads, attn_task, &aj, nt);

        rt_mm_target o = {L->wo, rt->xb, dim, (size_t)dim};
        rt_matmul(rt->threads, rt->att, (size_t)q_dim, R, q_dim, &o, 1, rt->xq);
        if (A->out_norms)
            for (int r = 0; r < R; r++)
                rmsnorm(rt->xb + (size_t)r * dim, rt->xb + (size_t)r * dim, L->attn_out_norm, dim, c->norm_eps);
        for (size_t i = 0; i < (size_t)R * dim; i++) rt->x[i] += rt->xb[i];

        for (int r = 0; r < R; r++)
            rmsnorm(rt->xb + (size_t)r * dim, rt->x + (size_t)r * dim, L->ffn_norm, dim, c->norm_eps);
        rt_mm_target gu[2] = {
            {L->w_gate, rt->hb, ffn, (size_t)ffn},
            {L->w_up, rt->hb2, ffn, (size_t)ffn},
        };
        rt_matmul(rt->threads, rt->xb, (size_t)dim, R, dim, gu, 2, rt->xq);
        silu_job sj = {rt->hb, rt->hb2, (size_t)R * ffn, A->act, 0};
        rt_threads_run(rt->threads, silu_task, &sj,
                       rt_threads_for_work(rt->threads, (double)sj.n, SILU_PARALLEL, (int)(sj.n / SILU_CHUNK) + 1));
        rt_mm_target d = {L->w_down, rt->xb, dim, (size_t)dim};
        rt_matmul(rt->threads, rt->hb, (size_t)ffn, R, ffn, &d, 1, rt->xq);
        if (A->out_norms)
            for (int r = 0; r < R; r++)
                rmsnorm(rt->xb + (size_t)r * dim, rt->xb + (size_t)r * dim, L->ffn_out_norm, dim, c->norm_eps);
        for (size_t i = 0; i < (size_t)R * dim; i++) rt->x[i] += rt->xb[i];
    }
    tap_slice(m, lanes, R, rows, (int)c->n_layers); /* the final pre-norm hidden */
}

void rt_forward(rt_model *m, const rt_lane *lanes, int n_lanes, float *logits, double *pooled, const rt_rows *rows) {
    rt_runtime *rt = m->rt;
    int dim = (int)m->cfg.dim;
    /* Where each lane's output rows and tapped rows start (lanes in order). */
    int n_out = n_lanes;
    if (rows) {
        int out = 0, tap = 0;
        for (int i = 0; i < n_lanes; i++) {
            rt->lane_out_first[i] = out;
            rt->lane_tap_first[i] = tap;
            out += rows->out_rows[i];
            tap += rows->n_taps ? rows->tap_rows[i] : 0;
        }
        n_out = out;
    }
    int lane = 0, off = 0;
    while (lane < n_lanes) {
        /* Pack the next slice: consecutive rows of consecutive lanes. */
        int R = 0;
        while (R < rt->chunk && lane < n_lanes) {
            const rt_lane *ln = &lanes[lane];
            int take = ln->n - off < rt->chunk - R ? ln->n - off : rt->chunk - R;
            for (int k = 0; k < take; k++, R++) {
                rt->row_lane[R] = lane;
                rt->row_pos[R] = ln->seq->length + off + k;
                float *xr = rt->x + (size_t)R * dim;
                rt_weight_row(&m->tok_embd, ln->tokens[off + k], dim, xr);
                if (m->arch.embed_scale != 1.0f)
                    for (int i = 0; i < dim; i++) xr[i] *= m->arch.embed_scale;
            }
            off += take;
            if (off == ln->n) {
                lane++;
                off = 0;
            }
        }
        forward_slice(m, lanes, R, rows);
        for (int r = 0; r < R; r++) {
            int li = rt->row_lane[r];
            const rt_lane *ln = &lanes[li];
            const float *h = rt->x + (size_t)r * dim;
            int n_rows = rows ? rows->out_rows[li] : 1;
            int first = ln->seq->length + ln->n - n_rows;
            if (rt->row_pos[r] >= first) {
                int at = (rows ? rt->lane_out_first[li] : li) + rt->row_pos[r] - first;
                memcpy(rt->final_h + (size_t)at * dim, h, (size_t)dim * sizeof(float));
            }
            if (pooled) {
                rmsnorm(rt->xb, h, m->final_norm, dim, m->cfg.norm_eps);
                for (int i = 0; i < dim; i++) pooled[i] += (double)rt->xb[i];
            }
        }
    }
    for (int i = 0; i < n_lanes; i++) lanes[i].seq->length += lanes[i].n;
    if (!logits) return;
    for (int i = 0; i < n_out; i++) {
        float *h = rt->final_h + (size_t)i * dim;
        rmsnorm(h, h, m->final_norm, dim, m->cfg.norm_eps);
    }
    /* The head in blocks of rows the quantized-input scratch holds; every row's
     * logits are the same whatever block it lands in. */
    int block = rt->chunk > rt->max_lanes ? rt->chunk : rt->max_lanes;
    size_t vocab = m->cfg.vocab_size;
    for (int r0 = 0; r0 < n_out; r0 += block) {
        int nr = n_out - r0 < block ? n_out - r0 : block;
        rt_mm_target head = {m->lm_head, logits + (size_t)r0 * vocab, (int)vocab, vocab};
        rt_matmul(rt->threads, rt->final_h + (size_t)r0 * dim, (size_t)dim, nr, dim, &head, 1, rt->xq);
    }
    float cap = m->arch.final_softcap;
    if (cap > 0.0f)
        for (size_t i = 0; i < (size_t)n_out * vocab; i++) logits[i] = cap * tanhf(logits[i] / cap);
}
