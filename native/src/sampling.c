/* Host-side sampling over logits rows.
 *
 * Pipeline of baseRT_sample_logits_row / rt_sample_cfg_f32, in order:
 *   1. logit_bias      (+inf forces a token, -inf bans it, else added)
 *   2. penalties over the last repeat_window prev_tokens (0 = all):
 *      repeat (positive logits divided by it, negative multiplied; 0 or 1 =
 *      off), then presence (subtracted once per distinct token), then
 *      frequency (subtracted once per occurrence)
 *   3. temperature     (0 = greedy: the lowest-index argmax of the row as
 *      biased and penalized so far)
 *   4. top_k (0 = off), 5. top_p (1 = off), 6. min_p (0 = off, relative to
 *      the most likely survivor), all over the tempered logits
 *   7. one draw from the softmax of the survivors, by Gumbel-max.
 * rt_sample_row_f32 (the fused-sample path, BaseRTRowSampling) is steps 2-7
 * with the same code: a row sampled on the host with cfg->seed + seed_offset
 * == S and the same parameters gives the token the fused path gives with
 * rs->seed == S.
 *
 * The engine's logits are f16 (baseRT_read_batch_logits): every f32 entry
 * point here first rounds the row to f16, so argmax and sampling agree bit
 * for bit whether a row went through the host readback or not.
 * NaN logits count as -inf. A row with a +inf logit returns the lowest such
 * index; a row with no finite logit returns its argmax (0 when all -inf).
 *
 * Randomness is counter-based: Gumbel noise for token t is a splitmix64
 * finaliser of (seed, t), so a result depends only on its inputs, never on
 * the thread or the call history. seed 0 in a BaseRTSamplingConfig draws a
 * fresh seed per call from a per-thread stream seeded from the clock. */

#include "sampling.h"

#include "errors.h"
#include "f16.h"
#include "model.h"

#include <math.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

typedef struct {
    float v;
    uint32_t i;
} cand;

/* ---- per-thread work buffers --------------------------------------------------- */

typedef struct {
    cand *cands;
    size_t cap_cands;
    float *row, *scratch;
    size_t cap_row;
    uint32_t *hist;
    size_t cap_hist;
    uint64_t rng; /* seed-0 stream; 0 = not yet seeded */
} work;

static pthread_key_t g_work_key;
static pthread_once_t g_work_once = PTHREAD_ONCE_INIT;
static _Thread_local work *t_work;

static void work_destroy(void *p) {
    work *w = p;
    free(w->cands);
    free(w->row);
    free(w->scratch);
    free(w->hist);
    free(w);
}

static void work_make_key(void) { pthread_key_create(&g_work_key, work_destroy); }

static work *work_get(void) {
    if (!t_work) {
        pthread_once(&g_work_once, work_make_key);
        work *w = calloc(1, sizeof *w);
        if (!w) return NULL;
        pthread_setspecific(g_work_key, w);
        t_work = w;
    }
    return t_work;
}

static bool reserve(void **p, size_t *cap, size_t n, size_t elem) {
    if (*cap >= n) return true;
    void *q = realloc(*p, (n ? n : 1) * elem);
    if (!q) return false;
    *p = q;
    *cap = n;
    return true;
}

static cand *work_cands(work *w, size_t n) {
    return reserve((void **)&w->cands, &w->cap_cands, n, sizeof(cand)) ? w->cands : NULL;
}

static bool work_rows(work *w, size_t n) {
    if (w->cap_row >= n) return true;
    float *r = realloc(w->row, n * sizeof *r);
    if (r) w->row = r;
    float *s = realloc(w->scratch, n * sizeof *s);
    if (s) w->scratch = s;
    if (!r || !s) return false;
    w->cap_row = n;
    return true;
}

/* ---- randomness ------------------------------------------------------------------ */

static uint64_t mix64(uint64_t z) {
    z += 0x9e3779b97f4a7c15ull;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

/* Uniform in (0, 1): never 0 or 1, so logs stay finite. */
static double unit_open(uint64_t r) { return ((double)(r >> 11) + 0.5) * 0x1.0p-53; }

static uint64_t entropy_seed(void) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    uint64_t s = (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
    s ^= (uint64_t)getpid() << 32;
    s ^= (uint64_t)(uintptr_t)&ts; /* differs per thread stack */
    return mix64(s) | 1;
}

/* ---- row helpers --------------------------------------------------------------------- */

static uint32_t argmax_exact(const float *row, int vocab) {
    uint32_t best = 0;
    float bv = -INFINITY;
    for (int i = 0; i < vocab; i++) {
        if (row[i] > bv) { /* NaN never compares greater: it never wins */
            bv = row[i];
            best = (uint32_t)i;
        }
    }
    return best;
}

void rt_logits_round_f16(float *logits, uint16_t *f16, size_t n) { rt_round_f16_n(logits, f16, n); }

uint32_t rt_argmax_f32(const float *row, int vocab) {
    uint32_t best = 0;
    float bv = -INFINITY, buf[256];
    for (int i0 = 0; i0 < vocab; i0 += 256) { /* compare the f16 values, rounded a slice at a time */
        int n = vocab - i0 < 256 ? vocab - i0 : 256;
        memcpy(buf, row + i0, (size_t)n * sizeof(float));
        rt_round_f16_n(buf, NULL, (size_t)n);
        for (int i = 0; i < n; i++) {
            if (buf[i] > bv) { /* NaN never compares greater: it never wins */
                bv = buf[i];
                best = (uint32_t)(i0 + i);
            }
        }
    }
    return best;
}

static inline float f16_at(const void *row, int i) {
    uint16_t h;
    memcpy(&h, (const unsigned char *)row + 2 * (size_t)i, 2);
    return rt_f16_to_f32(h);
}

/* a ranks before b: larger value, then lower index. */
static inline bool better(cand a, cand b) { return a.v > b.v || (a.v == b.v && a.i < b.i); }

static int cmp_cand(const void *pa, const void *pb) {
    cand a = *(const cand *)pa, b = *(const cand *)pb;
    return better(a, b) ? -1 : better(b, a) ? 1 : 0;
}

/* Heap with the worst candidate at the root. */
static void sift_down(cand *h, size_t n, size_t i) {
    for (;;) {
        size_t l = 2 * i + 1, r = l + 1, w = i;
        if (l < n && better(h[w], h[l])) w = l;
        if (r < n && better(h[w], h[r])) w = r;
        if (w == i) return;
        cand t = h[i];
        h[i] = h[w];
        h[w] = t;
        i = w;
    }
}

/* Move the best k of c[0..n) to c[0..k), sorted best first. */
static void select_top(cand *c, size_t n, size_t k) {
    if (k < n) {
        for (size_t i = k / 2; i-- > 0;) sift_down(c, k, i);
        for (size_t j = k; j < n; j++) {
            if (better(c[j], c[0])) {
                c[0] = c[j];
                sift_down(c, k, 0);
            }
        }
    } else {
        k = n;
    }
    qsort(c, k, sizeof *c, cmp_cand);
}

static int cmp_u32(const void *pa, const void *pb) {
    uint32_t a = *(const uint32_t *)pa, b = *(const uint32_t *)pb;
    return (a > b) - (a < b);
}

/* Penalties over the history window (hist is scratch for a sorted copy). */
static void apply_penalties(float *s, int vocab, const uint32_t *tokens, size_t n, float repeat, float presence,
                            float frequency, uint32_t *hist) {
    bool rep = isfinite(repeat) && repeat > 0.0f && repeat != 1.0f;
    bool pres = isfinite(presence) && presence != 0.0f;
    bool freq = isfinite(frequency) && frequency != 0.0f;
    if (!n || !(rep || pres || freq)) return;
    memcpy(hist, tokens, n * sizeof *hist);
    /* Sorting groups repeats so each distinct token is penalized once. */
    qsort(hist, n, sizeof *hist, cmp_u32);
    for (size_t i = 0; i < n;) {
        uint32_t t = hist[i];
        size_t j = i;
        while (j < n && hist[j] == t) j++;
        if (t < (uint32_t)vocab) {
            float x = s[t];
            if (rep) x = x > 0.0f ? x / repeat : x * repeat;
            if (pres) x -= presence;
            if (freq) x -= (float)(j - i) * frequency;
            s[t] = x;
        }
        i = j;
    }
}

/* top_k, top_p, min_p over candidates; returns how many survive (>= 1).
 * The survivors are sorted best first when top_k or top_p ran. */
static size_t filter_candidates(cand *c, size_t n, int top_k, float top_p, float min_p) {
    bool sorted = false;
    if (top_k > 0 && (size_t)top_k < n) {
        select_top(c, n, (size_t)top_k);
        n = (size_t)top_k;
        sorted = true;
    }
    if (!isnan(top_p) && top_p < 1.0f) {
        if (!sorted) select_top(c, n, n);
        sorted = true;
        double mx = c[0].v, total = 0.0;
        for (size_t i = 0; i < n; i++) total += exp((double)c[i].v - mx);
        double want = top_p > 0.0f ? (double)top_p * total : 0.0, cum = 0.0;
        size_t keep = n;
        for (size_t i = 0; i < n; i++) {
            cum += exp((double)c[i].v - mx);
            if (cum >= want) {
                keep = i + 1;
                break;
            }
        }
        n = keep;
    }
    if (!isnan(min_p) && min_p > 0.0f) {
        float mx = c[0].v;
        if (!sorted)
            for (size_t i = 1; i < n; i++) mx = c[i].v > mx ? c[i].v : mx;
        float thr = min_p >= 1.0f ? mx : mx + logf(min_p);
        size_t kept = 0;
        for (size_t i = 0; i < n; i++)
            if (c[i].v >= thr) c[kept++] = c[i];
        n = kept ? kept : 1;
    }
    return n;
}

/* The row as the sampler sees it: f16-rounded, NaN as -inf. */
static void load_row(float *s, const float *row, int vocab) {
    memcpy(s, row, (size_t)vocab * sizeof(float));
    rt_round_f16_n(s, NULL, (size_t)vocab);
    for (int i = 0; i < vocab; i++)
        if (isnan(s[i])) s[i] = -INFINITY;
}

/* Gumbel-max over the survivors: argmax of logit/T + Gumbel(seed, token id). */
static uint32_t gumbel_pick(const cand *c, size_t n, uint32_t seed) {
    uint32_t best = c[0].i;
    double best_key = -INFINITY;
    for (size_t i = 0; i < n; i++) {
        double u = unit_open(mix64(((uint64_t)seed << 32 | c[i].i) ^ 0x632be59bd9b4e019ull));
        double key = (double)c[i].v - log(-log(u));
        if (key > best_key || (key == best_key && c[i].i < best)) {
            best_key = key;
            best = c[i].i;
        }
    }
    return best;
}

/* Tempered candidates of s: finite entries only. Returns the count; sets
 * *forced to a +inf index when there is one. */
static size_t gather(const float *s, int vocab, float temperature, cand *c, int64_t *forced) {
    size_t n = 0;
    *forced = -1;
    for (int i = 0; i < vocab; i++) {
        float x = s[i];
        if (x == INFINITY) {
            *forced = i;
            return 0;
        }
        if (!isfinite(x)) continue;
        c[n].v = x / temperature;
        c[n].i = (uint32_t)i;
        /* A huge logit over a tiny temperature overflows: it dominates, like +inf. */
        if (c[n].v == INFINITY) {
            *forced = i;
            return 0;
        }
        n++;
    }
    return n;
}

uint32_t rt_sample_cfg_f32(const float *row, int vocab, const BaseRTSamplingConfig *cfg, const uint32_t *prev,
                           int n_prev, int repeat_window, uint32_t seed_offset, float *scratch) {
    if (vocab <= 0) return 0;
    work *w = work_get();
    size_t window = prev && n_prev > 0 ? (size_t)n_prev : 0;
    if (repeat_window > 0 && (size_t)repeat_window < window) window = (size_t)repeat_window;
    cand *c = w ? work_cands(w, (size_t)vocab) : NULL;
    if (!c || !reserve((void **)&w->hist, &w->cap_hist, window, sizeof(uint32_t)))
        return rt_argmax_f32(row, vocab); /* out of memory: degrade to greedy rather than fail */

    float *s = scratch;
    load_row(s, row, vocab);
    for (int32_t j = 0; j < cfg->n_logit_bias && cfg->logit_bias_tokens && cfg->logit_bias_values; j++) {
        int32_t t = cfg->logit_bias_tokens[j];
        float b = cfg->logit_bias_values[j];
        if (t < 0 || t >= vocab || isnan(b)) continue;
        s[t] = isinf(b) ? b : s[t] + b;
    }
    apply_penalties(s, vocab, prev + (window ? (size_t)n_prev - window : 0), window, cfg->repeat_penalty,
                    cfg->presence_penalty, cfg->frequency_penalty, w->hist);
    float temp = cfg->temperature;
    if (!(temp > 0.0f)) return argmax_exact(s, vocab);

    int64_t forced;
    size_t n = gather(s, vocab, temp, c, &forced);
    if (forced >= 0) return (uint32_t)forced;
    if (n == 0) return argmax_exact(s, vocab);
    n = filter_candidates(c, n, cfg->top_k, cfg->top_p, cfg->min_p);
    uint32_t seed;
    if (cfg->seed != 0) {
        seed = cfg->seed + seed_offset; /* wraps modulo 2^32 */
    } else {
        if (!w->rng) w->rng = entropy_seed();
        w->rng += 0x9e3779b97f4a7c15ull;
        seed = (uint32_t)mix64(w->rng);
    }
    return gumbel_pick(c, n, seed);
}

uint32_t rt_sample_row_f32(const float *row, int vocab, const BaseRTRowSampling *rs, float *scratch) {
    if (vocab <= 0) return 0;
    if (!rs || !(rs->temperature > 0.0f)) return rt_argmax_f32(row, vocab);
    work *w = work_get();
    size_t window = rs->history ? rs->history_count : 0;
    cand *c = w ? work_cands(w, (size_t)vocab) : NULL;
    if (!c || !reserve((void **)&w->hist, &w->cap_hist, window, sizeof(uint32_t))) return rt_argmax_f32(row, vocab);

    float *s = scratch;
    load_row(s, row, vocab);
    apply_penalties(s, vocab, rs->history, window, rs->repeat_penalty, rs->presence_penalty, rs->frequency_penalty,
                    w->hist);
    int64_t forced;
    size_t n = gather(s, vocab, rs->temperature, c, &forced);
    if (forced >= 0) return (uint32_t)forced;
    if (n == 0) return argmax_exact(s, vocab);
    n = filter_candidates(c, n, rs->top_k, rs->top_p, rs->min_p);
    return gumbel_pick(c, n, rs->seed);
}

/* ---- exported host-side row operations ----------------------------------------------- */

bool rt_sampling_config_check(const char *fn, const BaseRTSamplingConfig *c, int vocab) {
    const char *bad = NULL;
    if (isnan(c->temperature) || c->temperature < 0.0f) bad = "temperature must be >= 0";
    else if (c->top_k < 0) bad = "top_k must be >= 0";
    else if (isnan(c->top_p) || c->top_p <= 0.0f || c->top_p > 1.0f) bad = "top_p must be in (0, 1]";
    else if (isnan(c->min_p) || c->min_p < 0.0f || c->min_p > 1.0f) bad = "min_p must be in [0, 1]";
    else if (!isfinite(c->repeat_penalty) || c->repeat_penalty < 0.0f) bad = "repeat_penalty must be finite and >= 0";
    else if (!isfinite(c->presence_penalty)) bad = "presence_penalty must be finite";
    else if (!isfinite(c->frequency_penalty)) bad = "frequency_penalty must be finite";
    else if (c->n_logit_bias < 0 || (c->n_logit_bias > 0 && (!c->logit_bias_tokens || !c->logit_bias_values)))
        bad = "logit_bias needs n_logit_bias >= 0 and both arrays";
    if (bad) {
        rt_set_error(BASERT_ERR_INVALID_ARGUMENT, "%s: %s", fn, bad);
        return false;
    }
    for (int32_t j = 0; j < c->n_logit_bias; j++) {
        if (c->logit_bias_tokens[j] < 0 || c->logit_bias_tokens[j] >= vocab || isnan(c->logit_bias_values[j])) {
            rt_set_error(BASERT_ERR_INVALID_ARGUMENT, "%s: logit_bias[%d] (token %d, value %g) is invalid", fn, j,
                         c->logit_bias_tokens[j], (double)c->logit_bias_values[j]);
            return false;
        }
    }
    return true;
}

uint32_t baseRT_sample_logits_row(baseRT_model_t model, const void *row, const BaseRTSamplingConfig *cfg,
                                  const uint32_t *prev_tokens, int n_prev, int repeat_window, uint32_t seed_offset) {
    static const char fn[] = "baseRT_sample_logits_row";
    rt_model *m = rt_model_check(model, fn);
    if (!m) return 0;
    int vocab = (int)m->cfg.vocab_size;
    if (!row || !cfg) {
        rt_set_error(BASERT_ERR_INVALID_ARGUMENT, "%s: row and cfg must not be NULL", fn);
        return 0;
    }
    if (n_prev < 0 || (n_prev > 0 && !prev_tokens) || repeat_window < 0) {
        rt_set_error(BASERT_ERR_INVALID_ARGUMENT, "%s: bad history (prev_tokens %p, n_prev %d, repeat_window %d)", fn,
                     (const void *)prev_tokens, n_prev, repeat_window);
        return 0;
    }
    if (!rt_sampling_config_check(fn, cfg, vocab)) return 0;
    work *w = work_get();
    if (!w || !work_rows(w, (size_t)vocab)) {
        rt_set_error(BASERT_ERR_OUT_OF_MEMORY, "%s: out of memory", fn);
        return 0;
    }
    for (int i = 0; i < vocab; i++) w->row[i] = f16_at(row, i);
    uint32_t tok = rt_sample_cfg_f32(w->row, vocab, cfg, prev_tokens, n_prev, repeat_window, seed_offset, w->scratch);
    rt_clear_error();
    return tok;
}

uint32_t baseRT_argmax_logits_row(baseRT_model_t model, const void *row) {
    static const char fn[] = "baseRT_argmax_logits_row";
    rt_model *m = rt_model_check(model, fn);
    if (!m) return 0;
    if (!row) {
        rt_set_error(BASERT_ERR_INVALID_ARGUMENT, "%s: row is NULL", fn);
        return 0;
    }
    uint32_t best = 0;
    float bv = -INFINITY;
    for (int i = 0; i < (int)m->cfg.vocab_size; i++) {
        float x = f16_at(row, i);
        if (x > bv) {
            bv = x;
            best = (uint32_t)i;
        }
    }
    rt_clear_error();
    return best;
}

int baseRT_logits_row_logprobs(baseRT_model_t model, const void *row, uint32_t token, int top_k,
                               float *out_token_logprob, uint32_t *out_ids, float *out_logprobs) {
    static const char fn[] = "baseRT_logits_row_logprobs";
    rt_model *m = rt_model_check(model, fn);
    if (!m) return -1;
    int vocab = (int)m->cfg.vocab_size;
    if (!row || top_k < 0 || (top_k > 0 && (!out_ids || !out_logprobs)) || token >= (uint32_t)vocab) {
        rt_set_error(BASERT_ERR_INVALID_ARGUMENT, "%s: bad arguments (row %p, token %u of %d, top_k %d)", fn, row,
                     token, vocab, top_k);
        return -1;
    }
    work *w = work_get();
    size_t k = (size_t)(top_k < vocab ? top_k : vocab);
    if (!w || !work_rows(w, (size_t)vocab) || (k && !work_cands(w, (size_t)vocab))) {
        rt_set_error(BASERT_ERR_OUT_OF_MEMORY, "%s: out of memory", fn);
        return -1;
    }
    float *x = w->row;
    float mx = -INFINITY;
    size_t n_pinf = 0;
    for (int i = 0; i < vocab; i++) {
        float v = f16_at(row, i);
        x[i] = isnan(v) ? -INFINITY : v;
        if (x[i] == INFINITY) n_pinf++;
        else if (x[i] > mx) mx = x[i];
    }
    /* log-softmax; +inf logits share all the mass, an all -inf row has none. */
    double lse;
    if (n_pinf) lse = INFINITY;
    else if (mx == -INFINITY) lse = INFINITY;
    else {
        double sum = 0.0;
        for (int i = 0; i < vocab; i++) sum += exp((double)x[i] - mx);
        lse = mx + log(sum);
    }
#define LOGPROB(v)                                                                                                     \
    (n_pinf ? ((v) == INFINITY ? (float)-log((double)n_pinf) : -INFINITY) : (float)((double)(v)-lse))
    if (out_token_logprob) *out_token_logprob = LOGPROB(x[token]);
    if (k) {
        cand *c = w->cands;
        for (int i = 0; i < vocab; i++) c[i] = (cand){x[i], (uint32_t)i};
        select_top(c, (size_t)vocab, k);
        for (size_t j = 0; j < k; j++) {
            out_ids[j] = c[j].i;
            out_logprobs[j] = LOGPROB(c[j].v);
        }
    }
#undef LOGPROB
    rt_clear_error();
    return (int)k;
}

int baseRT_mask_logits_row(baseRT_model_t model, void *row, const int32_t *bitmask) {
    static const char fn[] = "baseRT_mask_logits_row";
    rt_model *m = rt_model_check(model, fn);
    if (!m) return BASERT_ERR_INVALID_ARGUMENT;
    if (!row || !bitmask) {
        rt_set_error(BASERT_ERR_INVALID_ARGUMENT, "%s: row and bitmask must not be NULL", fn);
        return BASERT_ERR_INVALID_ARGUMENT;
    }
    const uint16_t neg_inf = 0xFC00; /* f16 -inf */
    for (uint32_t i = 0; i < m->cfg.vocab_size; i++) {
        if (!(((uint32_t)bitmask[i >> 5] >> (i & 31)) & 1u))
            memcpy((unsigned char *)row + 2 * (size_t)i, &neg_inf, 2);
    }
    rt_clear_error();
    return BASERT_OK;
}
