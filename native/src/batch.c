/* Batched steps over caller-owned sequences (continuous batching).
 *
 * Every step validates all of its arguments, then checks the context limit
 * of every lane and reserves KV for all of them, before any sequence
 * changes: a failed step leaves every sequence as it was. The forward leaves
 * one f32 logits row per lane; they are rounded to f16 (the engine's logits
 * element type) and every greedy or sampled choice is made on the rounded
 * values, so a host that reads the rows back and runs baseRT_argmax_logits_row
 * or baseRT_sample_logits_row sees exactly what the fused path saw. */

#include "errors.h"
#include "forward.h"
#include "f16.h"
#include "kv.h"
#include "model.h"
#include "prefix.h"
#include "sampling.h"

#include <stdlib.h>
#include <string.h>

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
    rc = rt_prefix_reserve_kv(m, rt->lanes, n_seqs, fn);
    if (rc != BASERT_OK) return rc;
    rt_forward(m, rt->lanes, n_seqs, rt->logits, NULL, NULL);
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

/* ---- multi-row logits and hidden-state taps ------------------------------------ */

/* Grow the logits buffers (and final_h) to `rows` rows; OUT_OF_MEMORY leaves
 * them as they were, still valid. */
static int rows_reserve(rt_model *m, int rows, const char *fn) {
    rt_runtime *rt = m->rt;
    if (rows <= rt->logits_cap) return BASERT_OK;
    size_t vocab = m->cfg.vocab_size, dim = m->cfg.dim, old = (size_t)rt->logits_cap;
    float *logits = realloc(rt->logits, (size_t)rows * vocab * sizeof(float));
    if (logits) rt->logits = logits;
    uint16_t *f16 = logits ? realloc(rt->logits_f16, (size_t)rows * vocab * sizeof(uint16_t)) : NULL;
    if (f16) rt->logits_f16 = f16;
    float *final_h = f16 ? realloc(rt->final_h, (size_t)rows * dim * sizeof(float)) : NULL;
    if (final_h) rt->final_h = final_h;
    if (!final_h) {
        rt_set_error(BASERT_ERR_OUT_OF_MEMORY, "%s: cannot grow the logits scratch to %d rows", fn, rows);
        return BASERT_ERR_OUT_OF_MEMORY;
    }
    rt->bytes += ((size_t)rows - old) * (vocab * (sizeof(float) + sizeof(uint16_t)) + dim * sizeof(float));
    rt->logits_cap = rows;
    return BASERT_OK;
}

static int tap_capacity(const rt_model *m) { return m->prefill_chunk < 1024 ? m->prefill_chunk : 1024; }

/* Validate the rows/taps arguments of a multi-row step (the common step
 * arguments are step_validate's) and size its buffers. Returns the rows'
 * total in *n_out. */
static int rows_validate(rt_model *m, const char *fn, int n_seqs, const int *counts, const int *out_rows,
                         const int *tap_layers, int n_tap_layers, const int *tap_rows, int *n_out) {
    const char *null_arg = !out_rows                              ? "out_rows"
                           : n_tap_layers > 0 && !tap_layers ? "tap_layers"
                           : n_tap_layers > 0 && !tap_rows   ? "tap_rows"
                                                              : NULL;
    if (null_arg) {
        rt_set_error(BASERT_ERR_INVALID_ARGUMENT, "%s: %s is NULL", fn, null_arg);
        return BASERT_ERR_INVALID_ARGUMENT;
    }
    if (n_tap_layers < 0 || n_tap_layers > RT_MAX_TAPS) {
        rt_set_error(BASERT_ERR_INVALID_ARGUMENT, "%s: n_tap_layers %d is outside [0, %d]", fn, n_tap_layers,
                     RT_MAX_TAPS);
        return BASERT_ERR_INVALID_ARGUMENT;
    }
    int n_layers = (int)m->cfg.n_layers;
    for (int j = 0; j < n_tap_layers; j++) {
        if (tap_layers[j] < 0 || tap_layers[j] > n_layers) {
            rt_set_error(BASERT_ERR_INVALID_ARGUMENT, "%s: tap_layers[%d] %d is outside [0, %d] (hidden_states indices)",
                         fn, j, tap_layers[j], n_layers);
            return BASERT_ERR_INVALID_ARGUMENT;
        }
    }
    int64_t out_total = 0, tap_total = 0;
    int chunk = m->prefill_chunk, cap = tap_capacity(m);
    for (int i = 0; i < n_seqs; i++) {
        if (out_rows[i] < 1 || out_rows[i] > counts[i]) {
            rt_set_error(BASERT_ERR_INVALID_ARGUMENT, "%s: lane %d: out_rows %d is outside [1, %d] (its fed rows)", fn,
                         i, out_rows[i], counts[i]);
            return BASERT_ERR_INVALID_ARGUMENT;
        }
        out_total += out_rows[i];
        if (n_tap_layers == 0) continue;
        /* The fed rows go through in prefill chunks; taps come from the last one. */
        int last_chunk = (counts[i] - 1) % chunk + 1;
        if (tap_rows[i] < 0 || tap_rows[i] > last_chunk) {
            rt_set_error(BASERT_ERR_INVALID_ARGUMENT,
                         "%s: lane %d: tap_rows %d is outside [0, %d] (rows of its last prefill chunk)", fn, i,
                         tap_rows[i], last_chunk);
            return BASERT_ERR_INVALID_ARGUMENT;
        }
        tap_total += tap_rows[i];
    }
    int64_t out_cap = (int64_t)m->max_batch_size * 8;
    if (out_total > out_cap) {
        rt_set_error(BASERT_ERR_INVALID_ARGUMENT, "%s: %lld logits rows exceed the scratch of %lld (max_batch_size x 8)",
                     fn, (long long)out_total, (long long)out_cap);
        return BASERT_ERR_INVALID_ARGUMENT;
    }
    if (tap_total > cap) {
        rt_set_error(BASERT_ERR_INVALID_ARGUMENT, "%s: %lld tapped rows exceed baseRT_tap_rows_capacity %d", fn,
                     (long long)tap_total, cap);
        return BASERT_ERR_INVALID_ARGUMENT;
    }
    int rc = rows_reserve(m, (int)out_total, fn);
    if (rc != BASERT_OK) return rc;
    rt_runtime *rt = m->rt;
    if (n_tap_layers > 0 && !rt->tap_buf) {
        size_t bytes = (size_t)RT_MAX_TAPS * (size_t)cap * m->cfg.dim * sizeof(uint16_t);
        rt->tap_buf = malloc(bytes);
        if (!rt->tap_buf) {
            rt_set_error(BASERT_ERR_OUT_OF_MEMORY, "%s: cannot allocate the tap buffer (%zu bytes)", fn, bytes);
            return BASERT_ERR_OUT_OF_MEMORY;
        }
        rt->tap_cap = cap;
        rt->bytes += bytes;
    }
    *n_out = (int)out_total;
    return BASERT_OK;
}

/* The shared body of the multi-row steps: validate everything, then the fault
 * hook and the KV reservation, then one forward. A failed call leaves every
 * sequence as it was; a tapped step that fails after validation leaves no
 * readable taps (they would be stale). */
static int rows_step(baseRT_model_t model, const char *fn, baseRT_sequence_t *seqs, int n_seqs,
                     const uint32_t *in_tokens, const int *in_token_counts, const int *out_rows, const int *tap_layers,
                     int n_tap_layers, const int *tap_rows) {
    rt_model *m = rt_runtime_model(model, fn);
    if (!m) return rt_last_error_code();
    int rc = step_validate(m, fn, seqs, n_seqs, in_tokens, COUNTS_GIVEN, in_token_counts, NULL);
    if (rc != BASERT_OK) return rc;
    int n_out = 0;
    rc = rows_validate(m, fn, n_seqs, in_token_counts, out_rows, tap_layers, n_tap_layers, tap_rows, &n_out);
    if (rc != BASERT_OK) return rc;
    rt_runtime *rt = m->rt;
    if (n_tap_layers > 0) rt->tap_count = rt->tap_rows = 0;
    if (rt_fault_should_fail(RT_FAULT_STEP)) {
        rt_set_error(BASERT_ERR_GENERATION_FAILED, "%s: injected fault (batch step failed)", fn);
        return BASERT_ERR_GENERATION_FAILED;
    }
    rc = rt_prefix_reserve_kv(m, rt->lanes, n_seqs, fn);
    if (rc != BASERT_OK) return rc;
    rt_rows rows = {out_rows, tap_layers, n_tap_layers, tap_rows};
    rt_forward(m, rt->lanes, n_seqs, rt->logits, NULL, &rows);
    rt_logits_round_f16(rt->logits, rt->logits_f16, (size_t)n_out * m->cfg.vocab_size);
    rt->logits_rows = n_out;
    if (n_tap_layers > 0) {
        int tapped = 0;
        for (int i = 0; i < n_seqs; i++) tapped += tap_rows[i];
        rt->tap_count = n_tap_layers;
        rt->tap_rows = tapped;
    }
    rt_clear_error();
    return BASERT_OK;
}

int baseRT_batch_step_fused_logits_rows(baseRT_model_t model, baseRT_sequence_t *seqs, int n_seqs,
                                        const uint32_t *in_tokens, const int *in_token_counts, const int *out_rows) {
    return rows_step(model, "baseRT_batch_step_fused_logits_rows", seqs, n_seqs, in_tokens, in_token_counts, out_rows,
                     NULL, 0, NULL);
}

int baseRT_batch_step_fused_logits_rows_taps(baseRT_model_t model, baseRT_sequence_t *seqs, int n_seqs,
                                             const uint32_t *in_tokens, const int *in_token_counts, const int *out_rows,
                                             const int *tap_layers, int n_tap_layers, const int *tap_rows) {
    return rows_step(model, "baseRT_batch_step_fused_logits_rows_taps", seqs, n_seqs, in_tokens, in_token_counts,
                     out_rows, tap_layers, n_tap_layers, tap_rows);
}

/* Greedy verify: rows_step's forward (taps included when asked for), then each
 * requested row argmaxed as the greedy paths do (rt_argmax_f32 on the
 * f16-rounded row: lowest index wins ties, exactly baseRT_argmax_logits_row
 * on the row read back). Out token j of lane i is the greedy choice after the
 * lane's (in_token_counts[i] - out_rows[i] + j)-th fed token: with out_rows =
 * in_token_counts, after its j-th. The rows stay in the host logits buffer
 * as after baseRT_batch_step_fused_logits_rows. */
int baseRT_batch_step_fused_rows_argmax(baseRT_model_t model, baseRT_sequence_t *seqs, int n_seqs,
                                        const uint32_t *in_tokens, const int *in_token_counts, const int *out_rows,
                                        const int *tap_layers, int n_tap_layers, const int *tap_rows,
                                        uint32_t *out_tokens) {
    static const char fn[] = "baseRT_batch_step_fused_rows_argmax";
    rt_model *m = rt_runtime_model(model, fn);
    if (!m) return rt_last_error_code();
    if (!out_tokens) {
        rt_set_error(BASERT_ERR_INVALID_ARGUMENT, "%s: out_tokens is NULL", fn);
        return BASERT_ERR_INVALID_ARGUMENT;
    }
    int rc = rows_step(model, fn, seqs, n_seqs, in_tokens, in_token_counts, out_rows, tap_layers, n_tap_layers,
                       tap_rows);
    if (rc != BASERT_OK) return rc;
    rt_runtime *rt = m->rt;
    int vocab = (int)m->cfg.vocab_size;
    for (int i = 0; i < rt->logits_rows; i++) out_tokens[i] = rt_argmax_f32(rt->logits + (size_t)i * vocab, vocab);
    return BASERT_OK;
}

int baseRT_tap_rows_capacity(baseRT_model_t model) {
    rt_model *m = rt_runtime_model(model, "baseRT_tap_rows_capacity");
    if (!m) return -rt_last_error_code();
    rt_clear_error();
    return tap_capacity(m);
}

/* Taps come from the batched steps, which need paged KV. */
int baseRT_model_supports_taps(baseRT_model_t model) {
    rt_model *m = rt_model_check(model, "baseRT_model_supports_taps");
    if (!m) return -rt_last_error_code();
    rt_clear_error();
    return m->rt && m->paged_kv ? 1 : 0;
}

int baseRT_read_tap_rows(baseRT_model_t model, int tap_index, int n_rows, void *out_f16) {
    static const char fn[] = "baseRT_read_tap_rows";
    rt_model *m = rt_runtime_model(model, fn);
    if (!m) return -rt_last_error_code();
    rt_runtime *rt = m->rt;
    if (!out_f16) {
        rt_set_error(BASERT_ERR_INVALID_ARGUMENT, "%s: out_f16 is NULL", fn);
        return -BASERT_ERR_INVALID_ARGUMENT;
    }
    if (tap_index < 0 || tap_index >= rt->tap_count) {
        rt_set_error(BASERT_ERR_INVALID_ARGUMENT, "%s: tap_index %d is outside [0, %d) (taps of the last tapped step)",
                     fn, tap_index, rt->tap_count);
        return -BASERT_ERR_INVALID_ARGUMENT;
    }
    if (n_rows < 0 || n_rows > rt->tap_rows) {
        rt_set_error(BASERT_ERR_INVALID_ARGUMENT, "%s: n_rows %d is outside [0, %d] (rows the last tapped step tapped)",
                     fn, n_rows, rt->tap_rows);
        return -BASERT_ERR_INVALID_ARGUMENT;
    }
    size_t dim = m->cfg.dim;
    memcpy(out_f16, rt->tap_buf + (size_t)tap_index * rt->tap_cap * dim, (size_t)n_rows * dim * sizeof(uint16_t));
    rt_clear_error();
    return (int)dim;
}
