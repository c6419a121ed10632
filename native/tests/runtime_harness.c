/* Runtime harness: builds llama models with random weights in memory (no
 * bundle, no loader) and checks the runtime's invariants through its ABI:
 *
 *   (a) batched greedy == unbatched greedy, token for token and logits row
 *       for logits row, over mixed prefill/decode lanes;
 *   (b) chunked prefill (small prefill_chunk) == one-shot, bit for bit;
 *   (c) a prefix-seeded sequence == a cold prefill, bit for bit, also after
 *       a rollback into a shared block (copy-on-write);
 *   (d) block accounting: after freeing every sequence the pool holds only
 *       the cached prefixes, and nothing once they are evicted;
 *   plus the failure paths (validation, context limit, pool exhaustion).
 *
 * The numpy comparison of values lives in tests/native/test_native_batch_steps.py.
 *
 *   `runtime_harness`        run the checks (exit status 1 on failure)
 *   `runtime_harness bench`  decode tok/s for 1 and 16 lanes on a random
 *                            model of SmolLM2-135M's shape
 *
 * Build (from the repository root; add -fsanitize=address,undefined to check
 * memory, BASERT_REF_SIMD=avx2|generic and BASERT_REF_THREADS=1 select the
 * other kernel sets and a single thread at run time):
 *   gcc -std=c11 -O3 -D_GNU_SOURCE -Inative/include -Inative/src \
 *       native/tests/runtime_harness.c native/src/?*.c -o /tmp/runtime_harness -lm -lpthread
 */

#include "baseRT/reference.h"
#include "generate.h"
#include "errors.h"
#include "forward.h"
#include "handles.h"
#include "f16.h"
#include "kv.h"
#include "mathops.h"
#include "model.h"
#include "prefix.h"
#include "sampling.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static int g_failures;

#define CHECK(cond, ...)                                                                                        \
    do {                                                                                                        \
        if (!(cond)) {                                                                                          \
            g_failures++;                                                                                       \
            fprintf(stderr, "FAIL %s:%d: ", __FILE__, __LINE__);                                                \
            fprintf(stderr, __VA_ARGS__);                                                                       \
            fprintf(stderr, " [last error: %s]\n", baseRT_get_error());                                         \
        }                                                                                                       \
    } while (0)

/* ---- random models --------------------------------------------------------- */

static uint64_t g_rng = 0x9e3779b97f4a7c15ull;

static uint32_t rnd_u32(void) {
    g_rng ^= g_rng << 13;
    g_rng ^= g_rng >> 7;
    g_rng ^= g_rng << 17;
    return (uint32_t)(g_rng >> 11);
}

static float rnd_uniform(void) { return (float)rnd_u32() / 2147483648.0f - 1.0f; } /* [-1, 1) */

typedef struct {
    int dim, n_layers, n_heads, n_kv_heads, head_dim, ffn, vocab, max_seq;
} shape;

typedef struct {
    float *all; /* one allocation for every tensor */
    rt_layer *layers;
    float *embd, *final_norm;
} weights;

static float *fill(float **cursor, size_t n, float scale, float offset) {
    float *p = *cursor;
    for (size_t i = 0; i < n; i++) p[i] = offset + scale * rnd_uniform();
    *cursor += n;
    return p;
}

static weights make_weights(const shape *s) {
    size_t dim = s->dim, q = (size_t)s->n_heads * s->head_dim, kv = (size_t)s->n_kv_heads * s->head_dim;
    size_t per_layer = 2 * dim + q * dim + 2 * kv * dim + dim * q + 3 * (size_t)s->ffn * dim;
    size_t total = (size_t)s->vocab * dim + dim + per_layer * s->n_layers;
    weights w = {malloc(total * sizeof(float)), calloc((size_t)s->n_layers, sizeof(rt_layer)), NULL, NULL};
    if (!w.all || !w.layers) {
        fprintf(stderr, "out of memory building weights\n");
        exit(2);
    }
    float *c = w.all;
    /* Scaled so activations stay O(1) through the layers (tied head). */
    w.embd = fill(&c, (size_t)s->vocab * dim, 1.0f, 0.0f);
    w.final_norm = fill(&c, dim, 0.1f, 1.0f);
    for (int l = 0; l < s->n_layers; l++) {
        rt_layer *L = &w.layers[l];
        L->attn_norm = fill(&c, dim, 0.1f, 1.0f);
        L->ffn_norm = fill(&c, dim, 0.1f, 1.0f);
        L->wq = (rt_weight){fill(&c, q * dim, 1.7f / sqrtf((float)dim), 0.0f), RT_W_F32, 0};
        L->wk = (rt_weight){fill(&c, kv * dim, 1.7f / sqrtf((float)dim), 0.0f), RT_W_F32, 0};
        L->wv = (rt_weight){fill(&c, kv * dim, 1.7f / sqrtf((float)dim), 0.0f), RT_W_F32, 0};
        L->wo = (rt_weight){fill(&c, dim * q, 1.7f / sqrtf((float)q), 0.0f), RT_W_F32, 0};
        L->w_gate = (rt_weight){fill(&c, (size_t)s->ffn * dim, 1.7f / sqrtf((float)dim), 0.0f), RT_W_F32, 0};
        L->w_up = (rt_weight){fill(&c, (size_t)s->ffn * dim, 1.7f / sqrtf((float)dim), 0.0f), RT_W_F32, 0};
        L->w_down = (rt_weight){fill(&c, dim * s->ffn, 1.7f / sqrtf((float)s->ffn), 0.0f), RT_W_F32, 0};
    }
    return w;
}

static rt_model *make_model(const shape *s, const weights *w, int paged, int max_batch, int prefix, int chunk) {
    rt_model *m = calloc(1, sizeof *m);
    m->magic = RT_MODEL_MAGIC;
    BaseRTModelConfig *c = &m->cfg;
    c->dim = (uint32_t)s->dim;
    c->n_layers = (uint32_t)s->n_layers;
    c->n_heads = (uint32_t)s->n_heads;
    c->n_kv_heads = (uint32_t)s->n_kv_heads;
    c->head_dim = (uint32_t)s->head_dim;
    c->q_dim = (uint32_t)(s->n_heads * s->head_dim);
    c->kv_dim = (uint32_t)(s->n_kv_heads * s->head_dim);
    c->ffn_dim = (uint32_t)s->ffn;
    c->vocab_size = (uint32_t)s->vocab;
    c->max_seq_len = (uint32_t)s->max_seq;
    c->norm_eps = 1e-5f;
    c->rope_theta = 10000.0f;
    strcpy(c->architecture, "llama");
    m->paged_kv = paged;
    m->max_batch_size = max_batch;
    m->prefix_cache = prefix;
    m->prefill_chunk = chunk;
    m->kv_bits = 32;
    m->tok_embd = (rt_weight){w->embd, RT_W_F32, 0};
    m->lm_head = m->tok_embd;
    m->tied_embeddings = true;
    m->final_norm = w->final_norm;
    m->layers = w->layers;
    m->eos_id = UINT32_MAX; /* never stop early */
    if (rt_runtime_init(m) != BASERT_OK || !(m->handle = rt_handle_new(RT_KIND_MODEL, m))) {
        fprintf(stderr, "runtime init failed: %s\n", baseRT_get_error());
        exit(2);
    }
    return m;
}

static void free_model(rt_model *m) {
    rt_handle_release(m->handle);
    rt_runtime_free(m);
    free(m);
}

/* The sequence behind a handle (the harness reads lengths directly). */
#define SEQ(h) rt_seq_get(NULL, (h), "harness", -1)

static void random_tokens(uint32_t *out, int n, int vocab) {
    for (int i = 0; i < n; i++) out[i] = rnd_u32() % (uint32_t)vocab;
}

static bool same_bits(const void *a, const void *b, size_t bytes) { return memcmp(a, b, bytes) == 0; }

/* ---- (a) batched == unbatched ------------------------------------------------ */

enum { LANES = 6, STEPS = 34 };

static void check_batched_equals_unbatched(const shape *s, const weights *w) {
    rt_model *m = make_model(s, w, 1, 8, 0, 16);
    int vocab = s->vocab;
    size_t stride = baseRT_batch_logits_stride(m->handle);
    CHECK(stride == (size_t)vocab * 2, "stride %zu", stride);
    /* Lane i joins at step join[i] with a prompt of plen[i] tokens, fed in
     * chunks of up to feed[i] tokens per step: prefill and decode lanes mix. */
    const int plen[LANES] = {5, 40, 1, 23, 17, 64};
    const int join[LANES] = {0, 0, 3, 1, 7, 2};
    const int feed[LANES] = {5, 13, 1, 23, 4, 64};
    uint32_t prompt[LANES][64];
    for (int i = 0; i < LANES; i++) random_tokens(prompt[i], plen[i], vocab);

    baseRT_sequence_t batched[LANES], single[LANES];
    for (int i = 0; i < LANES; i++) {
        batched[i] = baseRT_sequence_create(m->handle);
        single[i] = baseRT_sequence_create(m->handle);
        CHECK(batched[i] && single[i], "sequence_create");
    }
    int fed[LANES] = {0};
    uint32_t last[LANES] = {0};
    uint16_t *rows_b = malloc(LANES * stride), *row_s = malloc(stride);
    int mismatches = 0, compared = 0;
    for (int step = 0; step < STEPS; step++) {
        baseRT_sequence_t lane_seq[LANES];
        uint32_t toks[LANES * 64];
        int counts[LANES], lane_of[LANES], n = 0, nt = 0;
        for (int i = 0; i < LANES; i++) {
            if (step < join[i]) continue;
            int c;
            if (fed[i] < plen[i]) {
                c = plen[i] - fed[i] < feed[i] ? plen[i] - fed[i] : feed[i];
                memcpy(toks + nt, prompt[i] + fed[i], (size_t)c * sizeof(uint32_t));
            } else {
                c = 1;
                toks[nt] = last[i];
            }
            lane_seq[n] = batched[i];
            counts[n] = c;
            lane_of[n++] = i;
            nt += c;
        }
        uint32_t out_b[LANES];
        int rc = baseRT_batch_step_fused_logits(m->handle, lane_seq, n, toks, counts);
        CHECK(rc == BASERT_OK, "batched step %d rc %d", step, rc);
        CHECK(baseRT_read_batch_logits(m->handle, n, rows_b) == vocab, "read_batch_logits");
        for (int k = 0; k < n; k++) out_b[k] = baseRT_argmax_logits_row(m->handle, (const char *)rows_b + k * stride);
        /* The same lanes one at a time, through the greedy entry point. */
        const uint32_t *tp = toks;
        for (int k = 0; k < n; k++) {
            int i = lane_of[k];
            uint32_t out_s;
            rc = baseRT_batch_step_fused(m->handle, &single[i], 1, tp, &counts[k], &out_s);
            CHECK(rc == BASERT_OK, "single step %d lane %d rc %d", step, i, rc);
            CHECK(baseRT_read_batch_logits(m->handle, 1, row_s) == vocab, "read_batch_logits single");
            compared++;
            if (out_s != out_b[k] || !same_bits(row_s, (const char *)rows_b + k * stride, stride)) mismatches++;
            tp += counts[k];
            if (fed[i] < plen[i]) fed[i] += counts[k];
            last[i] = out_b[k];
        }
    }
    CHECK(mismatches == 0, "batched vs unbatched: %d of %d lane-steps differ", mismatches, compared);
    printf("(a) batched == unbatched: %d lane-steps over %d steps, %d mismatches\n", compared, STEPS, mismatches);
    for (int i = 0; i < LANES; i++) {
        CHECK(SEQ(batched[i])->length == SEQ(single[i])->length, "lane %d lengths %d vs %d", i, SEQ(batched[i])->length,
              SEQ(single[i])->length);
        baseRT_sequence_free(batched[i]);
        baseRT_sequence_free(single[i]);
    }
    free(rows_b);
    free(row_s);
    BaseRTMemoryStats ms;
    CHECK(baseRT_model_memory_stats(m->handle, &ms) && ms.kv_cache_blocks_used == 0, "blocks leaked: %llu",
          (unsigned long long)ms.kv_cache_blocks_used);
    free_model(m);
}

/* ---- (b) chunked == one-shot --------------------------------------------------- */

/* Raw f32 logits of the last row after appending tokens to a fresh sequence. */
static void prefill_raw(rt_model *m, rt_seq *s, const uint32_t *tokens, int n, float *out) {
    rt_lane lane = {s, tokens, n};
    int rc = rt_prefix_reserve_kv(m, &lane, 1, "harness");
    CHECK(rc == BASERT_OK, "reserve %d", rc);
    rt_forward(m, &lane, 1, out, NULL, NULL);
}

static void check_chunked_equals_oneshot(const shape *s, const weights *w) {
    rt_model *small = make_model(s, w, 1, 4, 0, 16);
    rt_model *big = make_model(s, w, 1, 4, 0, 256);
    int vocab = s->vocab, n = 100;
    uint32_t toks[100];
    random_tokens(toks, n, vocab);
    float *a = malloc((size_t)vocab * 4 * sizeof(float)), *b = malloc((size_t)vocab * 4 * sizeof(float));
    rt_seq *sa = rt_seq_new(small, false), *sb = rt_seq_new(big, false);
    prefill_raw(small, sa, toks, n, a);
    prefill_raw(big, sb, toks, n, b);
    CHECK(same_bits(a, b, (size_t)vocab * sizeof(float)), "chunk 16 vs 256: prefill logits differ");
    /* Keep decoding on both: the KV written by the chunks must match too. */
    int diffs = 0;
    for (int i = 0; i < 8; i++) {
        uint32_t t = rt_argmax_f32(a, vocab);
        prefill_raw(small, sa, &t, 1, a);
        prefill_raw(big, sb, &t, 1, b);
        diffs += !same_bits(a, b, (size_t)vocab * sizeof(float));
    }
    CHECK(diffs == 0, "chunked decode differs on %d steps", diffs);
    /* Prefill split by the caller (37 + 63) == one shot. */
    rt_seq *sc = rt_seq_new(big, false);
    prefill_raw(big, sc, toks, 37, b);
    prefill_raw(big, sc, toks + 37, n - 37, b);
    rt_seq_truncate(sb, 0);
    prefill_raw(big, sb, toks, n, a);
    CHECK(same_bits(a, b, (size_t)vocab * sizeof(float)), "37+63 split differs from one shot");
    /* A batched step whose rows overflow the chunk: 3 lanes x 40 tokens, chunk 16. */
    uint32_t lt[3][40];
    baseRT_sequence_t ls[3];
    int counts[3] = {40, 40, 40};
    for (int i = 0; i < 3; i++) {
        random_tokens(lt[i], 40, vocab);
        ls[i] = baseRT_sequence_create(small->handle);
    }
    CHECK(baseRT_batch_step_fused_logits(small->handle, ls, 3, &lt[0][0], counts) == BASERT_OK, "3x40 step");
    uint16_t *rows = malloc(3 * (size_t)vocab * 2);
    baseRT_read_batch_logits(small->handle, 3, rows);
    for (int i = 0; i < 3; i++) {
        rt_seq_truncate(sb, 0);
        prefill_raw(big, sb, lt[i], 40, a);
        rt_logits_round_f16(a, NULL, (size_t)vocab);
        int bad = 0;
        for (int v = 0; v < vocab; v++) bad += rt_f16_to_f32(rows[(size_t)i * vocab + v]) != a[v];
        CHECK(bad == 0, "lane %d of the 3x40 step differs from its one-shot prefill in %d logits", i, bad);
        baseRT_sequence_free(ls[i]);
    }
    printf("(b) chunked (16) == one-shot (256): prefill, 8 decode steps, split prefill, 3x40 packed step\n");
    free(rows);
    free(a);
    free(b);
    rt_seq_delete(sa);
    rt_seq_delete(sb);
    rt_seq_delete(sc);
    free_model(small);
    free_model(big);
}

/* ---- (c) prefix-seeded == cold, (d) block accounting ------------------------------ */

static uint64_t blocks_used(rt_model *m) {
    BaseRTMemoryStats ms;
    baseRT_model_memory_stats(m->handle, &ms);
    return ms.kv_cache_blocks_used;
}

static void check_prefix_cache(const shape *s, const weights *w) {
    rt_model *m = make_model(s, w, 1, 4, 1, 16);
    int vocab = s->vocab;
    size_t stride = baseRT_batch_logits_stride(m->handle);
    uint16_t *warm = malloc(stride), *cold = malloc(stride);
    uint32_t p1[70], p2[70];
    random_tokens(p1, 70, vocab);
    memcpy(p2, p1, 40 * sizeof(uint32_t)); /* shares 2 full blocks (32 tokens) and 8 more tokens */
    random_tokens(p2 + 40, 30, vocab);
    uint32_t out;

    baseRT_sequence_t a = baseRT_sequence_create(m->handle);
    int n1 = 70;
    CHECK(baseRT_batch_step_fused(m->handle, &a, 1, p1, &n1, &out) == BASERT_OK, "prefill a");
    CHECK(baseRT_prefix_insert(m->handle, p1, 70, a) == BASERT_OK, "insert a");
    int cached;
    baseRT_prefix_cache_stats(m->handle, NULL, NULL, NULL, &cached);
    CHECK(cached == 4, "cached blocks %d, want 4", cached);
    CHECK(baseRT_prefix_insert(m->handle, p1, 70, a) == BASERT_OK, "insert again");
    baseRT_prefix_cache_stats(m->handle, NULL, NULL, NULL, &cached);
    CHECK(cached == 4, "re-insert is not idempotent: %d", cached);

    /* A whole-prompt match must leave a token: 64 of 64 tokens match 3 blocks. */
    BaseRTPrefixMatch full = baseRT_prefix_match(m->handle, p1, 64);
    CHECK(full.matched_tokens == 48 && full.n_blocks == 3, "64-token match gave %d", full.matched_tokens);
    baseRT_prefix_discard(m->handle, full.handle);

    BaseRTPrefixMatch mt = baseRT_prefix_match(m->handle, p2, 70);
    CHECK(mt.matched_tokens == 32 && mt.n_blocks == 2 && mt.handle != 0, "match %d tokens", mt.matched_tokens);
    baseRT_sequence_t b = baseRT_sequence_create(m->handle);
    CHECK(baseRT_sequence_seed_prefix(b, mt.blocks, mt.n_blocks, mt.matched_tokens) == BASERT_OK, "seed");
    int rest = 70 - mt.matched_tokens;
    CHECK(baseRT_batch_step_fused_logits(m->handle, &b, 1, p2 + mt.matched_tokens, &rest) == BASERT_OK, "warm prefill");
    baseRT_read_batch_logits(m->handle, 1, warm);
    baseRT_prefix_unlock(m->handle, mt.handle);

    baseRT_sequence_t c = baseRT_sequence_create(m->handle);
    int n2 = 70;
    CHECK(baseRT_batch_step_fused_logits(m->handle, &c, 1, p2, &n2) == BASERT_OK, "cold prefill");
    baseRT_read_batch_logits(m->handle, 1, cold);
    CHECK(same_bits(warm, cold, stride), "prefix-seeded logits differ from cold");

    /* Decode both for a while: still identical. */
    int diffs = 0;
    uint32_t tb = baseRT_argmax_logits_row(m->handle, warm), tc = tb;
    for (int i = 0; i < 12; i++) {
        uint32_t ob, oc;
        baseRT_batch_decode_step(m->handle, &b, 1, &tb, &ob);
        baseRT_batch_decode_step(m->handle, &c, 1, &tc, &oc);
        diffs += ob != oc;
        tb = ob;
        tc = oc;
    }
    CHECK(diffs == 0, "seeded decode diverged on %d steps", diffs);

    /* Rollback b into its shared block 1 (positions 16..31) and feed other
     * tokens: the write must go to a private copy, leaving the cached block
     * (still p1's positions 16..31) intact. */
    CHECK(baseRT_sequence_rollback(b, 20) == BASERT_OK, "rollback");
    uint32_t p3[70];
    memcpy(p3, p2, 20 * sizeof(uint32_t));
    random_tokens(p3 + 20, 50, vocab);
    int refeed = 50;
    CHECK(baseRT_batch_step_fused_logits(m->handle, &b, 1, p3 + 20, &refeed) == BASERT_OK, "refeed after rollback");
    baseRT_read_batch_logits(m->handle, 1, warm);
    rt_seq_truncate(SEQ(c), 0);
    CHECK(baseRT_batch_step_fused_logits(m->handle, &c, 1, p3, &n2) == BASERT_OK, "cold again");
    baseRT_read_batch_logits(m->handle, 1, cold);
    CHECK(same_bits(warm, cold, stride), "rollback into a shared block: logits differ from cold");
    /* The cache still serves p1's blocks unchanged. */
    BaseRTPrefixMatch m2 = baseRT_prefix_match(m->handle, p1, 70);
    CHECK(m2.matched_tokens == 64, "rematch p1: %d", m2.matched_tokens);
    baseRT_sequence_t d = baseRT_sequence_create(m->handle);
    baseRT_sequence_seed_prefix(d, m2.blocks, m2.n_blocks, m2.matched_tokens);
    int tail = 6;
    baseRT_batch_step_fused_logits(m->handle, &d, 1, p1 + 64, &tail);
    baseRT_read_batch_logits(m->handle, 1, warm);
    baseRT_prefix_unlock(m->handle, m2.handle);
    rt_seq_truncate(SEQ(c), 0);
    CHECK(baseRT_batch_step_fused_logits(m->handle, &c, 1, p1, &n1) == BASERT_OK, "cold p1");
    baseRT_read_batch_logits(m->handle, 1, cold);
    CHECK(same_bits(warm, cold, stride), "cached blocks were modified by a rollback + refeed");
    printf("(c) prefix-seeded == cold: prefill, 12 decode steps, rollback into a shared block, rematch\n");

    uint64_t hits, misses, reused;
    baseRT_prefix_cache_stats(m->handle, &hits, &misses, &reused, &cached);
    CHECK(hits == 2 && misses == 0 && reused == 96, "stats hits %llu misses %llu reused %llu",
          (unsigned long long)hits, (unsigned long long)misses, (unsigned long long)reused);
    BaseRTPrefixMatch rel = baseRT_prefix_match(m->handle, p1, 70);
    baseRT_prefix_release(m->handle, rel.handle);
    BaseRTPrefixMatch miss = baseRT_prefix_match(m->handle, p2 + 40, 30);
    CHECK(miss.handle == 0 && miss.matched_tokens == 0, "unexpected match");
    baseRT_prefix_cache_stats(m->handle, &hits, &misses, NULL, NULL);
    CHECK(hits == 2 && misses == 2, "after release/miss: hits %llu misses %llu", (unsigned long long)hits,
          (unsigned long long)misses);

    /* (d) Insert b too (it diverges from p1 in block 1), free everything. */
    CHECK(baseRT_prefix_insert(m->handle, p3, 70, b) == BASERT_OK, "insert b");
    baseRT_prefix_cache_stats(m->handle, NULL, NULL, NULL, &cached);
    baseRT_sequence_free(a);
    baseRT_sequence_free(b);
    baseRT_sequence_free(c);
    baseRT_sequence_free(d);
    CHECK(blocks_used(m) == (uint64_t)cached, "after freeing: %llu blocks used, %d cached",
          (unsigned long long)blocks_used(m), cached);
    /* A locked prefix survives eviction. */
    BaseRTPrefixMatch lock = baseRT_prefix_match(m->handle, p1, 70);
    int freed = baseRT_prefix_evict(m->handle, 1000);
    CHECK(freed == cached - 4, "evicted %d with p1 locked, want %d", freed, cached - 4);
    baseRT_prefix_release(m->handle, lock.handle);
    freed = baseRT_prefix_evict(m->handle, 1000);
    CHECK(freed == 4, "evicted %d after unlock", freed);
    CHECK(blocks_used(m) == 0, "after evicting: %llu blocks used", (unsigned long long)blocks_used(m));
    printf("(d) blocks: %d cached after freeing all sequences, 0 after eviction\n", cached);
    free(warm);
    free(cold);
    free_model(m);
}

/* ---- failure paths ----------------------------------------------------------------- */

static void check_failures(const shape *s, const weights *w) {
    rt_model *m = make_model(s, w, 1, 2, 1, 16);
    int vocab = s->vocab, max_seq = s->max_seq;
    baseRT_sequence_t a = baseRT_sequence_create(m->handle), b = baseRT_sequence_create(m->handle);
    uint32_t toks[512];
    random_tokens(toks, 512, vocab);
    uint32_t out[4];
    int one[2] = {1, 1};

    baseRT_sequence_t dup[2] = {a, a};
    CHECK(baseRT_batch_step_fused(m->handle, dup, 2, toks, one, out) == BASERT_ERR_INVALID_ARGUMENT, "duplicate lane");
    baseRT_sequence_t three[3] = {a, b, a};
    int ones3[3] = {1, 1, 1};
    CHECK(baseRT_batch_step_fused(m->handle, three, 3, toks, ones3, out) == BASERT_ERR_INVALID_ARGUMENT, "n > max batch");
    uint32_t bad_tok = (uint32_t)vocab;
    CHECK(baseRT_batch_step_fused(m->handle, &a, 1, &bad_tok, one, out) == BASERT_ERR_INVALID_ARGUMENT, "token >= vocab");
    int zero = 0;
    CHECK(baseRT_batch_step_fused(m->handle, &a, 1, toks, &zero, out) == BASERT_ERR_INVALID_ARGUMENT, "count 0");
    CHECK(baseRT_batch_step_fused(m->handle, &a, 1, toks, one, NULL) == BASERT_ERR_INVALID_ARGUMENT, "out NULL");
    CHECK(baseRT_batch_step_fused(NULL, &a, 1, toks, one, out) == BASERT_ERR_INVALID_ARGUMENT, "model NULL");
    CHECK(SEQ(a)->length == 0 && SEQ(b)->length == 0, "validation changed a sequence");

    /* Context limit: names the lane, changes nothing. */
    int n_first = max_seq - 4;
    CHECK(baseRT_batch_step_fused(m->handle, &a, 1, toks, &n_first, out) == BASERT_OK, "fill to max_seq-4");
    baseRT_sequence_t ab[2] = {b, a};
    int over[2] = {3, 5};
    CHECK(baseRT_batch_step_fused(m->handle, ab, 2, toks, over, out) == BASERT_ERR_INVALID_ARGUMENT, "past context");
    CHECK(strstr(baseRT_get_error(), "lane 1") != NULL, "context error does not name lane 1: %s",
          baseRT_get_error());
    CHECK(SEQ(a)->length == n_first && SEQ(b)->length == 0, "context failure changed state");

    /* Fault injection: GENERATION_FAILED, nothing changes. */
    baseRT_ref_inject_fault(RT_FAULT_STEP, 1);
    CHECK(baseRT_batch_step_fused(m->handle, &b, 1, toks, one, out) == BASERT_ERR_GENERATION_FAILED, "fault");
    CHECK(SEQ(b)->length == 0 && blocks_used(m) == (uint64_t)((n_first + 15) / 16), "fault changed state");
    baseRT_ref_inject_fault(RT_FAULT_SEQ_CREATE, 1);
    CHECK(baseRT_sequence_create(m->handle) == NULL && baseRT_get_error_code() == BASERT_ERR_OUT_OF_MEMORY, "create fault");

    /* Pool exhaustion: 2 lanes + default = 3 * max_seq tokens of blocks. Fill
     * the default sequence and lane a, cache a's blocks, then ask for more
     * than is left: cached blocks are evicted first, then OUT_OF_MEMORY with
     * every sequence untouched. */
    CHECK(baseRT_prefix_insert(m->handle, toks, n_first, a) == BASERT_OK, "insert a");
    baseRT_sequence_rollback(a, 0);
    int cached;
    baseRT_prefix_cache_stats(m->handle, NULL, NULL, NULL, &cached);
    CHECK(cached == n_first / 16 && blocks_used(m) == (uint64_t)cached, "cached %d used %llu", cached,
          (unsigned long long)blocks_used(m));
    CHECK(baseRT_batch_step_fused(m->handle, &a, 1, toks + 1, &n_first, out) == BASERT_OK, "refill a privately");
    baseRT_prefill(m->handle, toks, max_seq);
    CHECK(baseRT_get_error_code() == BASERT_OK && baseRT_get_position(m->handle) == max_seq, "fill default");
    baseRT_sequence_t c = baseRT_sequence_create(m->handle);
    baseRT_sequence_t bc[2] = {b, c};
    int fill[2] = {max_seq, max_seq};
    /* b + c need 2 * max_seq/16 blocks: more than the pool has even with the
     * cache evicted (default and a hold the rest). */
    CHECK(baseRT_batch_step_fused(m->handle, bc, 2, toks, fill, out) == BASERT_ERR_OUT_OF_MEMORY, "pool exhaustion");
    CHECK(SEQ(b)->length == 0 && SEQ(c)->length == 0, "OOM changed a sequence");
    int fill1 = max_seq;
    CHECK(baseRT_batch_step_fused(m->handle, &b, 1, toks, &fill1, out) == BASERT_OK, "b fits once the cache is evicted");
    baseRT_prefix_cache_stats(m->handle, NULL, NULL, NULL, &cached);
    CHECK(cached == 0, "cache not evicted under pressure: %d", cached);

    /* Stale handles. */
    baseRT_sequence_free(c);
    CHECK(baseRT_batch_step_fused(m->handle, &c, 1, toks, one, out) == BASERT_ERR_INVALID_ARGUMENT, "freed handle");
    CHECK(strstr(baseRT_get_error(), "freed") != NULL, "freed handle message: %s", baseRT_get_error());
    CHECK(baseRT_sequence_rollback(b, max_seq + 1) == BASERT_ERR_INVALID_ARGUMENT, "rollback past length");
    baseRT_sequence_free(NULL);
    printf("failure paths: validation, context limit, fault injection, pool exhaustion + auto-evict, stale handle\n");

    /* Non-paged model: no sequences, the default path still works. */
    rt_model *flat = make_model(s, w, 0, 1, 0, 16);
    CHECK(baseRT_sequence_create(flat->handle) == NULL && baseRT_get_error_code() == BASERT_ERR_UNSUPPORTED, "flat create");
    CHECK(baseRT_page_size(flat->handle) == 0 && baseRT_page_size(m->handle) == 16, "page size");
    float *emb = malloc((size_t)s->dim * sizeof(float));
    CHECK(baseRT_embed(flat->handle, toks, 30, emb, s->dim) == s->dim, "embed on a contiguous model");
    BaseRTMemoryStats ms;
    baseRT_model_memory_stats(flat->handle, &ms);
    CHECK(ms.kv_cache_layout == BASERT_KV_CACHE_CONTIGUOUS && ms.kv_cache_blocks_used == 0, "embed leaked blocks");
    free(emb);
    free_model(flat);
    /* Freeing a model with live sequences must not leak (checked under ASan). */
    free_model(m);
}

/* ---- single-sequence API ------------------------------------------------------------ */

typedef struct {
    uint32_t toks[64];
    int n;
} collected;

static bool collect(uint32_t tok, const char *text, void *ud) {
    collected *c = ud;
    (void)text;
    c->toks[c->n++] = tok;
    return c->n < 64;
}

static void check_default_sequence(const shape *s, const weights *w) {
    rt_model *m = make_model(s, w, 1, 2, 0, 16);
    int vocab = s->vocab;
    uint32_t prompt[30];
    random_tokens(prompt, 30, vocab);
    BaseRTSamplingConfig greedy = {0};
    greedy.top_p = 1.0f;
    collected got = {0};
    BaseRTGenerationStats st = baseRT_generate(m->handle, prompt, 30, 20, greedy, collect, &got);
    CHECK(st.prompt_tokens == 30 && st.generated_tokens == 20 && got.n == 20, "generate: %d generated",
          st.generated_tokens);
    CHECK(baseRT_get_position(m->handle) == 30 + 19, "position %d after generate", baseRT_get_position(m->handle));
    /* The same greedy continuation through a sequence and the batched API. */
    baseRT_sequence_t q = baseRT_sequence_create(m->handle);
    int n = 30, bad = 0;
    uint32_t t;
    baseRT_batch_step_fused(m->handle, &q, 1, prompt, &n, &t);
    for (int i = 0; i < 20; i++) {
        bad += t != got.toks[i];
        uint32_t nx;
        baseRT_batch_decode_step(m->handle, &q, 1, &t, &nx);
        t = nx;
    }
    CHECK(bad == 0, "generate vs batched greedy differ in %d tokens", bad);
    /* prefill appends; read_logits returns f16-rounded values whose argmax is
     * the returned token. */
    baseRT_reset(m->handle);
    CHECK(baseRT_get_position(m->handle) == 0, "reset");
    uint32_t first = baseRT_prefill(m->handle, prompt, 30);
    CHECK(first == got.toks[0], "prefill token %u vs %u", first, got.toks[0]);
    float *lg = malloc((size_t)vocab * sizeof(float));
    CHECK(baseRT_read_logits(m->handle, lg, vocab) == vocab && rt_argmax_f32(lg, vocab) == first, "read_logits");
    free(lg);
    float *e1 = malloc((size_t)s->dim * sizeof(float)), *e2 = malloc((size_t)s->dim * sizeof(float));
    CHECK(baseRT_embed(m->handle, prompt, 30, e1, s->dim) == s->dim, "embed");
    CHECK(baseRT_embed(m->handle, prompt, 30, e2, s->dim) == s->dim && same_bits(e1, e2, (size_t)s->dim * 4),
          "embed not deterministic");
    CHECK(baseRT_get_position(m->handle) == 30, "embed moved the default sequence");
    free(e1);
    free(e2);
    baseRT_sequence_free(q);
    printf("default sequence: generate == batched greedy, prefill/read_logits/reset/embed\n");
    free_model(m);
}

/* ---- benchmark ------------------------------------------------------------------------ */

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* Decode ms/step for 1 and 16 lanes, interleaved over several rounds; the
 * best round of each counts (the machine is shared: the minimum is the
 * least disturbed measurement). */
static void bench(void) {
    const shape smol = {576, 30, 9, 3, 64, 1536, 49152, 512};
    weights w = make_weights(&smol);
    rt_model *m = make_model(&smol, &w, 1, 16, 0, 256);
    printf("bench: SmolLM2-135M shape, random weights, %d threads, %s kernels\n", rt_threads_count(m->rt->threads),
           rt_mathops_isa());
    enum { WIDE = 16, PROMPT = 32, ROUNDS = 6 };
    baseRT_sequence_t seqs[WIDE + 1];
    uint32_t toks[(WIDE + 1) * PROMPT], out[WIDE + 1];
    int counts[WIDE + 1];
    random_tokens(toks, (WIDE + 1) * PROMPT, smol.vocab);
    for (int i = 0; i <= WIDE; i++) {
        seqs[i] = baseRT_sequence_create(m->handle);
        counts[i] = PROMPT;
    }
    double t0 = now_s();
    baseRT_batch_step_fused(m->handle, seqs, WIDE, toks, counts, out);
    double t1 = now_s();
    baseRT_batch_step_fused(m->handle, &seqs[WIDE], 1, toks, counts, &out[WIDE]);
    double t2 = now_s();
    printf("  prefill: %d lanes x %d tokens %.1f tok/s; 1 x %d tokens %.1f tok/s\n", WIDE, PROMPT,
           WIDE * PROMPT / (t1 - t0), PROMPT, PROMPT / (t2 - t1));
    double best1 = 1e9, best16 = 1e9;
    for (int round = 0; round < ROUNDS; round++) {
        double a = now_s();
        for (int s = 0; s < 6; s++) baseRT_batch_decode_step(m->handle, &seqs[WIDE], 1, &out[WIDE], &out[WIDE]);
        double b = now_s();
        for (int s = 0; s < 3; s++) baseRT_batch_decode_step(m->handle, seqs, WIDE, out, out);
        double c = now_s();
        if ((b - a) / 6 < best1) best1 = (b - a) / 6;
        if ((c - b) / 3 < best16) best16 = (c - b) / 3;
    }
    printf("  decode:  1 lane %.1f ms/step = %.1f tok/s; %d lanes %.1f ms/step = %.1f tok/s aggregate (%.2fx)\n",
           best1 * 1e3, 1 / best1, WIDE, best16 * 1e3, WIDE / best16, best1 * WIDE / best16);
    for (int i = 0; i <= WIDE; i++) baseRT_sequence_free(seqs[i]);
    free_model(m);
    free(w.all);
    free(w.layers);
}

int main(int argc, char **argv) {
    if (argc > 1 && strcmp(argv[1], "bench") == 0) {
        bench();
        return 0;
    }
    /* dim 36 / head_dim 12 and head_dim 40 exercise the kernels' scalar
     * tails, head_dim 64 their full vectors. */
    const shape shapes[] = {
        {64, 2, 4, 2, 16, 96, 300, 128},
        {36, 2, 3, 1, 12, 52, 97, 128},
        {128, 2, 2, 1, 64, 160, 211, 128},
        {80, 1, 2, 2, 40, 64, 150, 128},
    };
    for (size_t i = 0; i < sizeof shapes / sizeof shapes[0]; i++) {
        const shape *s = &shapes[i];
        printf("shape dim %d layers %d heads %d/%d head_dim %d ffn %d vocab %d (%s kernels)\n", s->dim, s->n_layers,
               s->n_heads, s->n_kv_heads, s->head_dim, s->ffn, s->vocab, rt_mathops_isa());
        weights w = make_weights(s);
        check_batched_equals_unbatched(s, &w);
        check_chunked_equals_oneshot(s, &w);
        check_prefix_cache(s, &w);
        check_failures(s, &w);
        check_default_sequence(s, &w);
        free(w.all);
        free(w.layers);
    }
    printf(g_failures ? "%d FAILURES\n" : "all runtime checks passed\n", g_failures);
    return g_failures ? 1 : 0;
}
