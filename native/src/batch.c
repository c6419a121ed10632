/* Batched steps over caller-owned sequences (continuous batching).
 *
 * Every step validates all of its arguments, then checks the context limit
 * of every lane and reserves KV for all of them, before any sequence
 * changes: a failed step leaves every sequence as it was. The forward leaves
 * one f32 logits row per lane; they are rounded to f16 (the engine's logits
 * element type) and every greedy or sampled choice is made on the rounded
 * values, so a host that reads the rows back and runs baseRT_argmax_logits_row
 * or baseRT_sample_logits_row sees exactly what the fused path saw. */

#include "runtime.h"

#include <stdlib.h>
#include <string.h>

rt_model *rt_runtime_model(baseRT_model_t model, const char *fn) {
    rt_model *m = rt_model_check(model, fn);
    if (!m) return NULL;
    if (!m->rt) {
        rt_set_error(BASERT_ERR_INVALID_ARGUMENT, "%s: the model was loaded tokenizer-only (no runtime state)", fn);
        return NULL;
    }
    return m;
}

void rt_logits_round_f16(float *logits, uint16_t *f16, size_t n) {
    for (size_t i = 0; i < n; i++) {
        uint16_t h = rt_f32_to_f16(logits[i]);
        if (f16) f16[i] = h;
        logits[i] = rt_f16_to_f32(h);
    }
}

/* How a step's per-lane token counts are given. */
typedef enum {
    COUNTS_ONE,    /* no counts: one token per lane (decode step) */
    COUNTS_GIVEN,  /* in_token_counts */
    COUNTS_PADDED, /* in_token_counts with trailing pads, stripped before the forward */
} counts_kind;

/* Validate a step and build its lanes in rt->lanes. */
static int step_validate(rt_model *m, const char *fn, baseRT_sequence_t *seqs, int n_seqs, const uint32_t *in_tokens,
                         counts_kind kind, const int *counts, const int *pads) {
    if (!m->paged_kv) {
        rt_set_error(BASERT_ERR_UNSUPPORTED, "%s: batched steps need a model loaded with paged KV", fn);
        return BASERT_ERR_UNSUPPORTED;
    }
    const char *null_arg = !seqs ? "seqs"
                           : !in_tokens ? "in_tokens"
                           : kind != COUNTS_ONE && !counts ? "in_token_counts"
                           : kind == COUNTS_PADDED && !pads ? "pads"
                                                            : NULL;
    if (null_arg) {
        rt_set_error(BASERT_ERR_INVALID_ARGUMENT, "%s: %s is NULL", fn, null_arg);
        return BASERT_ERR_INVALID_ARGUMENT;
    }
    if (n_seqs <= 0 || n_seqs > m->max_batch_size) {
        rt_set_error(BASERT_ERR_INVALID_ARGUMENT, "%s: n_seqs %d is outside [1, %d] (max_batch_size)", fn, n_seqs,
                     m->max_batch_size);
        return BASERT_ERR_INVALID_ARGUMENT;
    }
    rt_runtime *rt = m->rt;
    const uint32_t *tok = in_tokens;
    for (int i = 0; i < n_seqs; i++) {
        rt_seq *seq = rt_seq_get(m, seqs[i], fn, i);
        if (!seq) return BASERT_ERR_INVALID_ARGUMENT;
        for (int j = 0; j < i; j++) {
            if (seqs[j] == seqs[i]) {
                rt_set_error(BASERT_ERR_INVALID_ARGUMENT, "%s: lanes %d and %d are the same sequence", fn, j, i);
                return BASERT_ERR_INVALID_ARGUMENT;
            }
        }
        int count = kind == COUNTS_ONE ? 1 : counts[i];
        int pad = kind == COUNTS_PADDED ? pads[i] : 0;
        if (count <= 0) {
            rt_set_error(BASERT_ERR_INVALID_ARGUMENT, "%s: lane %d: token count %d must be > 0", fn, i, count);
            return BASERT_ERR_INVALID_ARGUMENT;
        }
        if (pad < 0 || pad >= count) {
            rt_set_error(BASERT_ERR_INVALID_ARGUMENT, "%s: lane %d: pads %d must be in [0, %d)", fn, i, pad, count);
            return BASERT_ERR_INVALID_ARGUMENT;
        }
        if (count > (int)m->cfg.max_seq_len) { /* also keeps the running token pointer bounded */
            rt_set_error(BASERT_ERR_INVALID_ARGUMENT, "%s: lane %d: %d tokens exceed the context limit of %d", fn,
                         i, count, (int)m->cfg.max_seq_len);
            return BASERT_ERR_INVALID_ARGUMENT;
        }
        for (int k = 0; k < count - pad; k++) {
            if (tok[k] >= m->cfg.vocab_size) {
                rt_set_error(BASERT_ERR_INVALID_ARGUMENT, "%s: lane %d: token %u at offset %d is >= vocab size %u",
                             fn, i, tok[k], k, m->cfg.vocab_size);
                return BASERT_ERR_INVALID_ARGUMENT;
            }
        }
        rt->lanes[i] = (rt_lane){seq, tok, count - pad};
        tok += count;
    }
    return rt_kv_check_lengths(m, rt->lanes, n_seqs, fn);
}

/* The shared body of every fused step: validate, fault hook, reserve, run.
 * On success rt->logits holds n_seqs f16-rounded rows and rt->logits_f16
 * their halves. */
static int fused_step(rt_model *m, const char *fn, baseRT_sequence_t *seqs, int n_seqs, const uint32_t *in_tokens,
                      counts_kind kind, const int *counts, const int *pads) {
    int rc = step_validate(m, fn, seqs, n_seqs, in_tokens, kind, counts, pads);
    if (rc != BASERT_OK) return rc;
    if (rt_fault_should_fail(RT_FAULT_STEP)) {
        rt_set_error(BASERT_ERR_GENERATION_FAILED, "%s: injected fault (batch step failed)", fn);
        return BASERT_ERR_GENERATION_FAILED;
    }
    rt_runtime *rt = m->rt;
    rc = rt_kv_reserve(m, rt->lanes, n_seqs, fn);
    if (rc != BASERT_OK) return rc;
    rt_forward(m, rt->lanes, n_seqs, rt->logits, NULL);
    rt_logits_round_f16(rt->logits, rt->logits_f16, (size_t)n_seqs * m->cfg.vocab_size);
    rt->logits_rows = n_seqs;
    return BASERT_OK;
}

static int greedy_step(baseRT_model_t model, const char *fn, baseRT_sequence_t *seqs, int n_seqs,
                       const uint32_t *in_tokens, counts_kind kind, const int *counts, const int *pads,
                       uint32_t *out_tokens) {
    rt_model *m = rt_runtime_model(model, fn);
    if (!m) return rt_last_error_code();
    if (!out_tokens) {
        rt_set_error(BASERT_ERR_INVALID_ARGUMENT, "%s: out_tokens is NULL", fn);
        return BASERT_ERR_INVALID_ARGUMENT;
    }
    int rc = fused_step(m, fn, seqs, n_seqs, in_tokens, kind, counts, pads);
    if (rc != BASERT_OK) return rc;
    int vocab = (int)m->cfg.vocab_size;
    for (int i = 0; i < n_seqs; i++) out_tokens[i] = rt_argmax_f32(m->rt->logits + (size_t)i * vocab, vocab);
    rt_clear_error();
    return BASERT_OK;
}

int baseRT_batch_step_fused(baseRT_model_t model, baseRT_sequence_t *seqs, int n_seqs, const uint32_t *in_tokens,
                            const int *in_token_counts, uint32_t *out_tokens) {
    return greedy_step(model, "baseRT_batch_step_fused", seqs, n_seqs, in_tokens, COUNTS_GIVEN, in_token_counts, NULL,
                       out_tokens);
}

/* One unified pass here too: a mixed prefill/decode step needs no split. */
int baseRT_batch_step(baseRT_model_t model, baseRT_sequence_t *seqs, int n_seqs, const uint32_t *in_tokens,
                      const int *in_token_counts, uint32_t *out_tokens) {
    return greedy_step(model, "baseRT_batch_step", seqs, n_seqs, in_tokens, COUNTS_GIVEN, in_token_counts, NULL,
                       out_tokens);
}

int baseRT_batch_decode_step(baseRT_model_t model, baseRT_sequence_t *seqs, int n_seqs, const uint32_t *new_tokens,
                             uint32_t *out_tokens) {
    return greedy_step(model, "baseRT_batch_decode_step", seqs, n_seqs, new_tokens, COUNTS_ONE, NULL, NULL,
                       out_tokens);
}

/* Pads are stripped before the forward: no pad KV is written, so the
 * caller's rollback to the real length is a no-op. */
int baseRT_batch_step_fused_pads(baseRT_model_t model, baseRT_sequence_t *seqs, int n_seqs, const uint32_t *in_tokens,
                                 const int *in_token_counts, const int *pads, uint32_t *out_tokens) {
    return greedy_step(model, "baseRT_batch_step_fused_pads", seqs, n_seqs, in_tokens, COUNTS_PADDED,
                       in_token_counts, pads, out_tokens);
}

int baseRT_batch_step_fused_logits(baseRT_model_t model, baseRT_sequence_t *seqs, int n_seqs, const uint32_t *in_tokens,
                                   const int *in_token_counts) {
    static const char fn[] = "baseRT_batch_step_fused_logits";
    rt_model *m = rt_runtime_model(model, fn);
    if (!m) return rt_last_error_code();
    int rc = fused_step(m, fn, seqs, n_seqs, in_tokens, COUNTS_GIVEN, in_token_counts, NULL);
    if (rc != BASERT_OK) return rc;
    rt_clear_error();
    return BASERT_OK;
}

int baseRT_batch_step_fused_sample(baseRT_model_t model, baseRT_sequence_t *seqs, int n_seqs, const uint32_t *in_tokens,
                                   const int *in_token_counts, const BaseRTRowSampling *rows, uint32_t *out_tokens) {
    static const char fn[] = "baseRT_batch_step_fused_sample";
    rt_model *m = rt_runtime_model(model, fn);
    if (!m) return rt_last_error_code();
    if (!rows || !out_tokens) {
        rt_set_error(BASERT_ERR_INVALID_ARGUMENT, "%s: %s is NULL", fn, !rows ? "rows" : "out_tokens");
        return BASERT_ERR_INVALID_ARGUMENT;
    }
    int rc = step_validate(m, fn, seqs, n_seqs, in_tokens, COUNTS_GIVEN, in_token_counts, NULL);
    if (rc != BASERT_OK) return rc;
    for (int i = 0; i < n_seqs; i++) {
        if (rows[i].history_count > 0 && !rows[i].history) {
            rt_set_error(BASERT_ERR_INVALID_ARGUMENT, "%s: rows[%d].history is NULL with history_count %u", fn, i,
                         rows[i].history_count);
            return BASERT_ERR_INVALID_ARGUMENT;
        }
    }
    rc = fused_step(m, fn, seqs, n_seqs, in_tokens, COUNTS_GIVEN, in_token_counts, NULL);
    if (rc != BASERT_OK) return rc;
    int vocab = (int)m->cfg.vocab_size;
    for (int i = 0; i < n_seqs; i++)
        out_tokens[i] = rt_sample_row_f32(m->rt->logits + (size_t)i * vocab, vocab, &rows[i], m->rt->sample_scratch);
    rt_clear_error();
    return BASERT_OK;
}

/* The sampling pass of baseRT_batch_step_fused_sample on its own, over rows
 * the last fused step left. The rows are not modified. */
int baseRT_sample_logits_rows(baseRT_model_t model, int first_row, int n_rows, const BaseRTRowSampling *rows,
                              uint32_t *out_tokens) {
    static const char fn[] = "baseRT_sample_logits_rows";
    rt_model *m = rt_runtime_model(model, fn);
    if (!m) return rt_last_error_code();
    rt_runtime *rt = m->rt;
    if (!rows || !out_tokens) {
        rt_set_error(BASERT_ERR_INVALID_ARGUMENT, "%s: %s is NULL", fn, !rows ? "rows" : "out_tokens");
        return BASERT_ERR_INVALID_ARGUMENT;
    }
    if (first_row < 0 || n_rows <= 0 || (int64_t)first_row + n_rows > rt->logits_rows) {
        rt_set_error(BASERT_ERR_INVALID_ARGUMENT, "%s: rows [%d, %d + %d) are outside the %d rows of the last step",
                     fn, first_row, first_row, n_rows, rt->logits_rows);
        return BASERT_ERR_INVALID_ARGUMENT;
    }
    for (int i = 0; i < n_rows; i++) {
        if (rows[i].history_count > 0 && !rows[i].history) {
            rt_set_error(BASERT_ERR_INVALID_ARGUMENT, "%s: rows[%d].history is NULL with history_count %u", fn, i,
                         rows[i].history_count);
            return BASERT_ERR_INVALID_ARGUMENT;
        }
    }
    int vocab = (int)m->cfg.vocab_size;
    for (int i = 0; i < n_rows; i++)
        out_tokens[i] = rt_sample_row_f32(rt->logits + (size_t)(first_row + i) * vocab, vocab, &rows[i],
                                          rt->sample_scratch);
    rt_clear_error();
    return BASERT_OK;
}

int baseRT_read_batch_logits(baseRT_model_t model, int n_seqs, void *out_logits_f16) {
    static const char fn[] = "baseRT_read_batch_logits";
    rt_model *m = rt_runtime_model(model, fn);
    if (!m) return -rt_last_error_code();
    rt_runtime *rt = m->rt;
    if (!out_logits_f16) {
        rt_set_error(BASERT_ERR_INVALID_ARGUMENT, "%s: out_logits_f16 is NULL", fn);
        return -BASERT_ERR_INVALID_ARGUMENT;
    }
    if (n_seqs <= 0 || n_seqs > rt->logits_rows) {
        rt_set_error(BASERT_ERR_INVALID_ARGUMENT, "%s: n_seqs %d is outside [1, %d] (rows left by the last step)", fn,
                     n_seqs, rt->logits_rows);
        return -BASERT_ERR_INVALID_ARGUMENT;
    }
    memcpy(out_logits_f16, rt->logits_f16, (size_t)n_seqs * m->cfg.vocab_size * sizeof(uint16_t));
    rt_clear_error();
    return (int)m->cfg.vocab_size;
}

size_t baseRT_batch_logits_stride(baseRT_model_t model) {
    rt_model *m = rt_model_check(model, "baseRT_batch_logits_stride");
    if (!m) return 0;
    rt_clear_error();
    return (size_t)m->cfg.vocab_size * sizeof(uint16_t);
}
