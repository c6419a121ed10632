/* Runtime lifecycle and the single-sequence API (generate / prefill /
 * read_logits / reset / position / embed) on the model's default sequence. */

#include "generate.h"

#include "errors.h"
#include "forward.h"
#include "kv.h"
#include "mathops.h"
#include "prefix.h"
#include "sampling.h"
#include "tokenizer.h"

#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* Trailing tokens baseRT_generate's repetition penalties look at (llama.cpp's
 * repeat_last_n default). */
enum { GENERATE_REPEAT_WINDOW = 64 };

static int check_config(const rt_model *m) {
    const BaseRTModelConfig *c = &m->cfg;
    const char *bad = NULL;
    if (c->n_layers == 0 || c->dim == 0 || c->ffn_dim == 0 || c->vocab_size == 0 || c->max_seq_len == 0)
        bad = "a zero dimension";
    else if (c->n_heads == 0 || c->n_kv_heads == 0 || c->n_heads % c->n_kv_heads != 0)
        bad = "n_heads not a multiple of n_kv_heads";
    else if (c->head_dim == 0 || c->head_dim % 2 != 0)
        bad = "an odd head_dim";
    else if (c->q_dim != c->n_heads * c->head_dim || c->kv_dim != c->n_kv_heads * c->head_dim)
        bad = "q_dim / kv_dim inconsistent with the head counts";
    else if (m->prefill_chunk < 1 || m->max_batch_size < 1)
        bad = "a non-positive prefill_chunk or max_batch_size";
    if (bad) rt_set_error(BASERT_ERR_INVALID_FORMAT, "model config has %s", bad);
    return bad ? BASERT_ERR_INVALID_FORMAT : BASERT_OK;
}

int rt_runtime_init(rt_model *m) {
    int rc = check_config(m);
    if (rc != BASERT_OK) return rc;
    rt_runtime *rt = calloc(1, sizeof *rt);
    if (!rt) {
        rt_set_error(BASERT_ERR_OUT_OF_MEMORY, "runtime: out of memory");
        return BASERT_ERR_OUT_OF_MEMORY;
    }
    m->rt = rt;
    /* The process-wide pool. Without worker threads everything still runs,
     * on the caller's thread. */
    rt->threads = rt_threads_acquire();
    if ((rc = rt_kv_init(m)) != BASERT_OK || (rc = rt_forward_init(m)) != BASERT_OK ||
        (rc = rt_prefix_init(m)) != BASERT_OK)
        goto fail;
    size_t vocab = m->cfg.vocab_size;
    rt->logits = malloc((size_t)rt->max_lanes * vocab * sizeof(float));
    rt->logits_f16 = malloc((size_t)m->max_batch_size * vocab * sizeof(uint16_t));
    rt->def_logits = malloc(vocab * sizeof(float));
    rt->sample_scratch = malloc(2 * vocab * sizeof(float));
    rt->lanes = malloc((size_t)rt->max_lanes * sizeof(rt_lane));
    if (!rt->logits || !rt->logits_f16 || !rt->def_logits || !rt->sample_scratch || !rt->lanes) {
        rt_set_error(BASERT_ERR_OUT_OF_MEMORY, "runtime: cannot allocate the logits buffers");
        rc = BASERT_ERR_OUT_OF_MEMORY;
        goto fail;
    }
    rt->bytes += (size_t)rt->max_lanes * vocab * sizeof(float) + (size_t)m->max_batch_size * vocab * sizeof(uint16_t) +
                 3 * vocab * sizeof(float);
    rt->logits_cap = m->max_batch_size; /* = max_lanes: max_batch_size >= 1 (check_config) */
    rt->def = rt_seq_new(m, false);
    if (!rt->def) {
        rc = BASERT_ERR_OUT_OF_MEMORY;
        goto fail;
    }
    return BASERT_OK;
fail:
    rt_runtime_free(m);
    return rc;
}

void rt_runtime_free(rt_model *m) {
    rt_runtime *rt = m->rt;
    if (!rt) return;
    rt_prefix_free(m);
    rt_kv_free(m); /* every live sequence too, the default one included */
    rt_forward_free(m);
    free(rt->logits);
    free(rt->logits_f16);
    free(rt->def_logits);
    free(rt->sample_scratch);
    free(rt->lanes);
    rt_threads_release(rt->threads);
    free(rt);
    m->rt = NULL;
}

/* ---- default-sequence forward -------------------------------------------- */

static double now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec / 1e6;
}

static int check_tokens(const rt_model *m, const char *fn, const uint32_t *tokens, int n) {
    if (!tokens || n <= 0) {
        rt_set_error(BASERT_ERR_INVALID_ARGUMENT, "%s: need at least one token (tokens=%p, n=%d)", fn,
                     (const void *)tokens, n);
        return BASERT_ERR_INVALID_ARGUMENT;
    }
    for (int i = 0; i < n; i++) {
        if (tokens[i] >= m->cfg.vocab_size) {
            rt_set_error(BASERT_ERR_INVALID_ARGUMENT, "%s: token %u at index %d is >= vocab size %u", fn, tokens[i],
                         i, m->cfg.vocab_size);
            return BASERT_ERR_INVALID_ARGUMENT;
        }
    }
    return BASERT_OK;
}

/* Append tokens to the default sequence; its last row's logits, rounded to
 * f16, land in rt->def_logits. */
static int default_forward(rt_model *m, const char *fn, const uint32_t *tokens, int n) {
    rt_runtime *rt = m->rt;
    rt_lane lane = {rt->def, tokens, n};
    int rc = rt_kv_check_lengths(m, &lane, 1, fn);
    if (rc == BASERT_OK) rc = rt_prefix_reserve_kv(m, &lane, 1, fn);
    if (rc != BASERT_OK) return rc;
    rt_forward(m, &lane, 1, rt->def_logits, NULL, NULL);
    rt_logits_round_f16(rt->def_logits, NULL, m->cfg.vocab_size);
    rt->def_logits_valid = true;
    return BASERT_OK;
}

static void reset_default(rt_runtime *rt) {
    rt_seq_truncate(rt->def, 0);
    rt->def_logits_valid = false;
}

/* ---- token text for the generate callback -------------------------------- */

typedef struct {
    utf8_assembler utf8;
    char *bytes, *text;
    int cap; /* bytes capacity; text holds 3 * (cap + 8) + 1 */
} text_stream;

static const char *token_text(const rt_model *m, text_stream *ts, uint32_t id) {
    if (!m->tok) return "";
    int n = bpe_token_bytes(m->tok, id, ts->bytes, ts->cap);
    if (n > ts->cap) {
        char *b = realloc(ts->bytes, (size_t)n);
        char *t = realloc(ts->text, 3 * ((size_t)n + 8) + 1);
        if (b) ts->bytes = b;
        if (t) ts->text = t;
        if (!b || !t) return "";
        ts->cap = n;
        n = bpe_token_bytes(m->tok, id, ts->bytes, ts->cap);
    }
    if (n < 0) return "";
    utf8_assembler_feed(&ts->utf8, ts->bytes, n, ts->text);
    return ts->text;
}

static bool is_eos(const rt_model *m, uint32_t id) {
    if (id == m->eos_id) return true;
    for (int i = 0; i < m->n_eos_ids; i++)
        if (m->eos_ids[i] == id) return true;
    return false;
}

/* ---- public API ---------------------------------------------------------- */

BaseRTGenerationStats baseRT_generate(baseRT_model_t model, const uint32_t *prompt_tokens, int n_prompt, int max_tokens,
                                      BaseRTSamplingConfig sampling, baseRT_token_callback callback, void *user_data) {
    static const char fn[] = "baseRT_generate";
    BaseRTGenerationStats st = {0};
    rt_model *m = rt_runtime_model(model, fn);
    if (!m || check_tokens(m, fn, prompt_tokens, n_prompt) != BASERT_OK) return st;
    if (max_tokens < 0) {
        rt_set_error(BASERT_ERR_INVALID_ARGUMENT, "%s: max_tokens %d is negative", fn, max_tokens);
        return st;
    }
    if (sampling.n_logit_bias < 0 ||
        (sampling.n_logit_bias > 0 && (!sampling.logit_bias_tokens || !sampling.logit_bias_values))) {
        rt_set_error(BASERT_ERR_INVALID_ARGUMENT, "%s: logit bias arrays missing for n_logit_bias %d", fn,
                     (int)sampling.n_logit_bias);
        return st;
    }
    rt_runtime *rt = m->rt;
    int vocab = (int)m->cfg.vocab_size;
    /* Penalty history: the prompt, then every generated token (at most one
     * more than the context has room for after the prompt). */
    int64_t room = (int64_t)m->cfg.max_seq_len - n_prompt + 1;
    size_t max_generated = (size_t)(max_tokens < room ? max_tokens : (room > 0 ? room : 0));
    uint32_t *history = malloc(((size_t)n_prompt + max_generated) * sizeof(uint32_t));
    text_stream ts = {.cap = 256};
    ts.bytes = malloc((size_t)ts.cap);
    ts.text = malloc(3 * ((size_t)ts.cap + 8) + 1);
    if (!history || !ts.bytes || !ts.text) {
        rt_set_error(BASERT_ERR_OUT_OF_MEMORY, "%s: out of memory", fn);
        goto done;
    }
    memcpy(history, prompt_tokens, (size_t)n_prompt * sizeof(uint32_t));
    int n_history = n_prompt;
    utf8_assembler_reset(&ts.utf8);
    reset_default(rt);
    st.prompt_tokens = n_prompt;

    double t0 = now_ms();
    if (default_forward(m, fn, prompt_tokens, n_prompt) != BASERT_OK) goto done;
    double t1 = now_ms();
    st.prefill_time_ms = (float)(t1 - t0);
    st.prefill_tokens_per_sec = st.prefill_time_ms > 0 ? (float)(n_prompt * 1e3 / (t1 - t0)) : 0.0f;

    int decode_steps = 0;
    bool failed = false;
    while (st.generated_tokens < max_tokens) {
        uint32_t tok = sampling.temperature <= 0.0f
                           ? rt_argmax_f32(rt->def_logits, vocab)
                           : rt_sample_cfg_f32(rt->def_logits, vocab, &sampling, history, n_history,
                                               GENERATE_REPEAT_WINDOW, (uint32_t)st.generated_tokens,
                                               rt->sample_scratch);
        if (is_eos(m, tok)) break;
        history[n_history++] = tok;
        st.generated_tokens++;
        if (callback) {
            /* Re-entrant calls on this model are refused while the callback
             * runs (rt_model_busy): history, ts and the default sequence stay ours. */
            const char *text = token_text(m, &ts, tok);
            m->in_callback = fn;
            bool more = callback(tok, text, user_data);
            m->in_callback = NULL;
            if (!more) break;
        }
        if (st.generated_tokens == max_tokens || rt->def->length >= (int)m->cfg.max_seq_len) break;
        if (default_forward(m, fn, &tok, 1) != BASERT_OK) {
            failed = true;
            break;
        }
        decode_steps++;
    }
    double t2 = now_ms();
    st.decode_time_ms = (float)(t2 - t1);
    st.decode_tokens_per_sec = t2 > t1 ? (float)(decode_steps * 1e3 / (t2 - t1)) : 0.0f;
    if (!failed) rt_clear_error();
done:
    free(history);
    free(ts.bytes);
    free(ts.text);
    return st;
}

uint32_t baseRT_prefill(baseRT_model_t model, const uint32_t *tokens, int n_tokens) {
    static const char fn[] = "baseRT_prefill";
    rt_model *m = rt_runtime_model(model, fn);
    if (!m || check_tokens(m, fn, tokens, n_tokens) != BASERT_OK) return 0;
    if (default_forward(m, fn, tokens, n_tokens) != BASERT_OK) return 0;
    rt_clear_error();
    return rt_argmax_f32(m->rt->def_logits, (int)m->cfg.vocab_size);
}

int baseRT_read_logits(baseRT_model_t model, float *out, int max_logits) {
    static const char fn[] = "baseRT_read_logits";
    rt_model *m = rt_runtime_model(model, fn);
    if (!m) return 0;
    int vocab = (int)m->cfg.vocab_size;
    if (!out || max_logits < vocab) {
        rt_set_error(BASERT_ERR_INVALID_ARGUMENT, "%s: need a buffer of %d floats (out=%p, max_logits=%d)", fn, vocab,
                     (void *)out, max_logits);
        return 0;
    }
    if (!m->rt->def_logits_valid) {
        rt_set_error(BASERT_ERR_INVALID_ARGUMENT, "%s: no logits: nothing was prefilled since the last reset", fn);
        return 0;
    }
    memcpy(out, m->rt->def_logits, (size_t)vocab * sizeof(float));
    rt_clear_error();
    return vocab;
}

void baseRT_reset(baseRT_model_t model) {
    rt_model *m = rt_runtime_model(model, "baseRT_reset");
    if (!m) return;
    reset_default(m->rt);
    rt_clear_error();
}

int baseRT_get_position(baseRT_model_t model) {
    rt_model *m = rt_runtime_model(model, "baseRT_get_position");
    if (!m) return -1;
    rt_clear_error();
    return m->rt->def->length;
}

/* The speculation flag is per handle and only stored: this engine's generate
 * calls do no n-gram prediction (their output is the same either way), so a
 * server can scope a request's `speculation` override with set/get and the
 * tokens never depend on it. */
void baseRT_set_speculation(baseRT_model_t model, bool enabled) {
    rt_model *m = rt_runtime_model(model, "baseRT_set_speculation");
    if (!m) return;
    atomic_store(&m->speculation, enabled);
    rt_clear_error();
}

bool baseRT_get_speculation(baseRT_model_t model) {
    rt_model *m = rt_runtime_model(model, "baseRT_get_speculation");
    if (!m) return false;
    rt_clear_error();
    return atomic_load(&m->speculation);
}

int baseRT_embed(baseRT_model_t model, const uint32_t *tokens, int n_tokens, float *out_embedding, int max_dims) {
    static const char fn[] = "baseRT_embed";
    rt_model *m = rt_runtime_model(model, fn);
    if (!m || check_tokens(m, fn, tokens, n_tokens) != BASERT_OK) return 0;
    int dim = (int)m->cfg.dim;
    if (!out_embedding || max_dims < dim) {
        rt_set_error(BASERT_ERR_INVALID_ARGUMENT, "%s: need an output of %d floats (out=%p, max_dims=%d)", fn, dim,
                     (void *)out_embedding, max_dims);
        return 0;
    }
    double *pooled = calloc((size_t)dim, sizeof(double));
    rt_seq *s = pooled ? rt_seq_new(m, false) : NULL;
    if (!s) {
        free(pooled);
        rt_set_error(BASERT_ERR_OUT_OF_MEMORY, "%s: out of memory", fn);
        return 0;
    }
    rt_lane lane = {s, tokens, n_tokens};
    int rc = rt_kv_check_lengths(m, &lane, 1, fn);
    if (rc == BASERT_OK) rc = rt_prefix_reserve_kv(m, &lane, 1, fn);
    if (rc == BASERT_OK) {
        rt_forward(m, &lane, 1, NULL, pooled, NULL);
        for (int i = 0; i < dim; i++) out_embedding[i] = (float)(pooled[i] / n_tokens);
    }
    rt_seq_delete(s);
    free(pooled);
    if (rc != BASERT_OK) return 0;
    rt_clear_error();
    return dim;
}
