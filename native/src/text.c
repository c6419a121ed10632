/* Tokenizer ABI: encode (framing / plain / pieces), token counting, decode
 * (incremental, stateless, raw), caller-owned decode streams, and the
 * model's special-token metadata. */

#include "errors.h"
#include "handles.h"
#include "json.h"
#include "model.h"
#include "tokenizer.h"

#include <limits.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define RT_STREAM_MAGIC 0x42524431u /* "BRD1": a live decode stream */

/* ---- per-thread buffers ------------------------------------------------------
 * "Static string" results live in per-thread buffers, freed at thread exit. */

typedef struct {
    char *data;
    size_t cap;
} grow_buf;

typedef struct {
    grow_buf decode, decode_static, special;
    /* baseRT_decode_token's incremental state: one model at a time per thread
     * (switching models starts a fresh stream). */
    const rt_model *decode_model;
    utf8_assembler decode_asm;
} tls_state;

static pthread_key_t g_tls_key;
static pthread_once_t g_tls_once = PTHREAD_ONCE_INIT;
static _Thread_local tls_state *t_state;

static void tls_destroy(void *p) {
    tls_state *s = p;
    free(s->decode.data);
    free(s->decode_static.data);
    free(s->special.data);
    free(s);
}

static void tls_make_key(void) { pthread_key_create(&g_tls_key, tls_destroy); }

static tls_state *tls_get(void) {
    if (!t_state) {
        pthread_once(&g_tls_once, tls_make_key);
        tls_state *s = calloc(1, sizeof *s);
        if (!s) return NULL;
        pthread_setspecific(g_tls_key, s);
        t_state = s;
    }
    return t_state;
}

static char *grow(grow_buf *b, size_t need) {
    if (b->cap < need) {
        size_t cap = need < 256 ? 256 : need;
        char *d = realloc(b->data, cap);
        if (!d) return NULL;
        b->data = d;
        b->cap = cap;
    }
    return b->data;
}

/* ---- encode -------------------------------------------------------------------- */

/* Encode the pieces with the model's BOS policy: BOS is prepended once when
 * add_bos, and (dedup_bos) a BOS the text itself starts with is not doubled.
 * Writes the ids when they fit in max_tokens; returns the count the whole
 * encoding needs (which may exceed max_tokens), or -1 with the error set. */
static long long encode_run(const char *fn, const rt_model *m, const char *const *texts, const size_t *lens,
                            const int *plain, int n, bool dedup_bos, uint32_t *out, int max_tokens) {
    int off = m->add_bos ? 1 : 0;
    int cap = max_tokens > off ? max_tokens - off : 0;
    uint32_t first = 0;
    uint32_t *dst = cap ? out + off : &first;
    int total = bpe_encode_pieces(m->tok, texts, lens, plain, n, dst, cap);
    if (total < 0) {
        rt_set_error(BASERT_ERR_UNKNOWN, "%s: the tokenizer rejected the input", fn);
        return -1;
    }
    bool dup = false;
    if (off && dedup_bos && total > 0) {
        if (cap == 0 && bpe_encode_pieces(m->tok, texts, lens, plain, n, &first, 1) < 0) {
            rt_set_error(BASERT_ERR_UNKNOWN, "%s: the tokenizer rejected the input", fn);
            return -1;
        }
        dup = (cap ? dst[0] : first) == m->bos_id;
    }
    long long need = (long long)off + total - (dup ? 1 : 0);
    if (need <= max_tokens && off && out) {
        if (dup) memmove(out, out + 1, (size_t)total * sizeof *out);
        else out[0] = m->bos_id;
    }
    return need;
}

static bool check_text(const char *fn, const char *text, size_t *len) {
    if (!text) {
        rt_set_error(BASERT_ERR_INVALID_ARGUMENT, "%s: text is NULL", fn);
        return false;
    }
    *len = strlen(text);
    if (*len > (size_t)INT_MAX / 2) {
        rt_set_error(BASERT_ERR_INVALID_ARGUMENT, "%s: text of %zu bytes is too long", fn, *len);
        return false;
    }
    if (!json_utf8_valid(text, *len)) {
        rt_set_error(BASERT_ERR_INVALID_ARGUMENT, "%s: text is not valid UTF-8", fn);
        return false;
    }
    return true;
}

static bool check_out(const char *fn, const uint32_t *out, int max_tokens) {
    if (max_tokens < 0 || (max_tokens > 0 && !out)) {
        rt_set_error(BASERT_ERR_INVALID_ARGUMENT, "%s: bad output buffer (out_tokens %p, max_tokens %d)", fn,
                     (const void *)out, max_tokens);
        return false;
    }
    return true;
}

static int finish_encode(const char *fn, long long need, int max_tokens) {
    if (need < 0) return -1;
    if (need > max_tokens) {
        rt_set_error(BASERT_ERR_INVALID_ARGUMENT,
                     "%s: the text needs %lld tokens, the buffer holds %d (size it with baseRT_token_count)", fn, need,
                     max_tokens);
        return -1;
    }
    if (need > INT_MAX) {
        rt_set_error(BASERT_ERR_INVALID_ARGUMENT, "%s: too many tokens", fn);
        return -1;
    }
    rt_clear_error();
    return (int)need;
}

static int encode_one(const char *fn, baseRT_model_t model, const char *text, bool framing, uint32_t *out,
                      int max_tokens) {
    rt_model *m = rt_model_check(model, fn);
    size_t len;
    if (!m || !check_text(fn, text, &len) || !check_out(fn, out, max_tokens)) return -1;
    int plain = framing ? 0 : 1;
    long long need = encode_run(fn, m, &text, &len, &plain, 1, framing, out, max_tokens);
    return finish_encode(fn, need, max_tokens);
}

int baseRT_encode(baseRT_model_t model, const char *text, uint32_t *out_tokens, int max_tokens) {
    return encode_one("baseRT_encode", model, text, true, out_tokens, max_tokens);
}

int baseRT_encode_plain(baseRT_model_t model, const char *text, uint32_t *out_tokens, int max_tokens) {
    return encode_one("baseRT_encode_plain", model, text, false, out_tokens, max_tokens);
}

int baseRT_encode_pieces(baseRT_model_t model, const char *const *texts, const int *plain, int n_pieces,
                         uint32_t *out_tokens, int max_tokens) {
    static const char fn[] = "baseRT_encode_pieces";
    rt_model *m = rt_model_check(model, fn);
    if (!m || !check_out(fn, out_tokens, max_tokens)) return -1;
    if (n_pieces < 0 || (n_pieces > 0 && !texts)) {
        rt_set_error(BASERT_ERR_INVALID_ARGUMENT, "%s: bad pieces (texts %p, n_pieces %d)", fn, (const void *)texts,
                     n_pieces);
        return -1;
    }
    size_t *lens = malloc((n_pieces ? (size_t)n_pieces : 1) * sizeof *lens);
    if (!lens) {
        rt_set_error(BASERT_ERR_OUT_OF_MEMORY, "%s: out of memory", fn);
        return -1;
    }
    size_t total_len = 0;
    /* A BOS the text starts with is deduplicated only when framing produced it. */
    bool dedup = true, seen_text = false;
    for (int i = 0; i < n_pieces; i++) {
        char what[48];
        snprintf(what, sizeof what, "%s (piece %d)", fn, i);
        if (!check_text(what, texts[i], &lens[i])) {
            free(lens);
            return -1;
        }
        total_len += lens[i];
        if (!seen_text && lens[i]) {
            seen_text = true;
            dedup = !plain || plain[i] == 0;
        }
    }
    if (total_len > (size_t)INT_MAX / 2) {
        free(lens);
        rt_set_error(BASERT_ERR_INVALID_ARGUMENT, "%s: %zu bytes of text is too long", fn, total_len);
        return -1;
    }
    long long need = encode_run(fn, m, texts, lens, plain, n_pieces, dedup, out_tokens, max_tokens);
    free(lens);
    return finish_encode(fn, need, max_tokens);
}

int baseRT_token_count(baseRT_model_t model, const char *text) {
    static const char fn[] = "baseRT_token_count";
    rt_model *m = rt_model_check(model, fn);
    size_t len;
    if (!m || !check_text(fn, text, &len)) return -1;
    int plain = 0;
    long long need = encode_run(fn, m, &text, &len, &plain, 1, true, NULL, 0);
    if (need < 0) return -1;
    if (need > INT_MAX) {
        rt_set_error(BASERT_ERR_INVALID_ARGUMENT, "%s: too many tokens", fn);
        return -1;
    }
    rt_clear_error();
    return (int)need;
}

/* ---- decode ---------------------------------------------------------------------- */

/* 1: a token with text; 0: a model id past the tokenizer's vocabulary (no
 * text); -1: not a token of this model (error set). */
static int check_token(const char *fn, const rt_model *m, uint32_t id) {
    if (id < (uint32_t)bpe_vocab_size(m->tok)) return 1;
    if (id < m->cfg.vocab_size) return 0;
    rt_set_error(BASERT_ERR_INVALID_ARGUMENT, "%s: token id %u is outside the vocabulary (%u)", fn, id,
                 m->cfg.vocab_size);
    return -1;
}

/* The token's raw bytes into b (NUL-terminated); returns the length or -1. */
static int token_bytes(const rt_model *m, uint32_t id, grow_buf *b) {
    char small[256];
    int n = bpe_token_bytes(m->tok, id, small, (int)sizeof small);
    if (n < 0 || !grow(b, (size_t)n + 1)) return -1;
    if (n <= (int)sizeof small) memcpy(b->data, small, (size_t)n);
    else bpe_token_bytes(m->tok, id, b->data, n);
    b->data[n] = '\0';
    return n;
}

/* Incremental decode of one token through an assembler into out. CONTROL
 * tokens (turn markers, eos) decode to "": they are protocol, not text. */
static const char *decode_into(const char *fn, const rt_model *m, utf8_assembler *a, uint32_t id, grow_buf *out) {
    int known = check_token(fn, m, id);
    if (known < 0) return NULL;
    if (!grow(out, 1)) goto oom;
    out->data[0] = '\0';
    if (known == 0 || bpe_token_type(m->tok, id) == BPE_TOKEN_CONTROL) return out->data;
    char small[256], *bytes = small;
    int n = bpe_token_bytes(m->tok, id, small, (int)sizeof small);
    if (n < 0) goto oom;
    if (n > (int)sizeof small) {
        if (!(bytes = malloc((size_t)n))) goto oom;
        bpe_token_bytes(m->tok, id, bytes, n);
    }
    if (grow(out, 3 * ((size_t)n + 8) + 1)) utf8_assembler_feed(a, bytes, n, out->data);
    else n = -1;
    if (bytes != small) free(bytes);
    if (n < 0) goto oom;
    return out->data;
oom:
    rt_set_error(BASERT_ERR_OUT_OF_MEMORY, "%s: out of memory", fn);
    return NULL;
}

const char *baseRT_decode_token(baseRT_model_t model, uint32_t token_id) {
    static const char fn[] = "baseRT_decode_token";
    rt_model *m = rt_model_check(model, fn);
    if (!m) return NULL;
    tls_state *s = tls_get();
    if (!s) {
        rt_set_error(BASERT_ERR_OUT_OF_MEMORY, "%s: out of memory", fn);
        return NULL;
    }
    if (s->decode_model != m) {
        s->decode_model = m;
        utf8_assembler_reset(&s->decode_asm);
    }
    const char *text = decode_into(fn, m, &s->decode_asm, token_id, &s->decode);
    if (text) rt_clear_error();
    return text;
}

const char *baseRT_decode_token_static(baseRT_model_t model, uint32_t token_id) {
    static const char fn[] = "baseRT_decode_token_static";
    rt_model *m = rt_model_check(model, fn);
    if (!m) return NULL;
    int known = check_token(fn, m, token_id);
    if (known < 0) return NULL;
    tls_state *s = tls_get();
    if (!s || !grow(&s->decode_static, 1) || (known && token_bytes(m, token_id, &s->decode_static) < 0)) {
        rt_set_error(BASERT_ERR_OUT_OF_MEMORY, "%s: out of memory", fn);
        return NULL;
    }
    if (!known) s->decode_static.data[0] = '\0';
    rt_clear_error();
    return s->decode_static.data;
}

int baseRT_decode_token_raw(baseRT_model_t model, uint32_t token_id, char *out, int max_bytes) {
    static const char fn[] = "baseRT_decode_token_raw";
    rt_model *m = rt_model_check(model, fn);
    if (!m) return -1;
    if (max_bytes < 0 || (max_bytes > 0 && !out)) {
        rt_set_error(BASERT_ERR_INVALID_ARGUMENT, "%s: bad output buffer (out %p, max_bytes %d)", fn, (void *)out,
                     max_bytes);
        return -1;
    }
    int known = check_token(fn, m, token_id);
    if (known < 0) return -1;
    int n = known ? bpe_token_bytes(m->tok, token_id, out, max_bytes) : 0;
    if (n < 0) {
        rt_set_error(BASERT_ERR_UNKNOWN, "%s: the tokenizer has no bytes for token %u", fn, token_id);
        return -1;
    }
    rt_clear_error();
    return n;
}

/* ---- decode streams ---------------------------------------------------------------- */

struct baseRT_decode_stream {
    uint32_t magic;
    baseRT_model_t model; /* a handle: the model may be freed before the stream */
    baseRT_decode_stream_t handle; /* the caller's (handles.c) */
    utf8_assembler a;
    grow_buf out;
};

static struct baseRT_decode_stream *stream_check(baseRT_decode_stream_t s, const char *fn) {
    if (!s) {
        rt_set_error(BASERT_ERR_INVALID_ARGUMENT, "%s: stream is NULL", fn);
        return NULL;
    }
    int why = RT_HANDLE_FOREIGN;
    struct baseRT_decode_stream *st = rt_handle_get(s, RT_KIND_STREAM, &why); /* never follows a stale pointer */
    if (!st || st->magic != RT_STREAM_MAGIC) {
        rt_set_error(BASERT_ERR_INVALID_ARGUMENT, "%s: %p is not a live decode stream (%s)", fn, (void *)s,
                     why == RT_HANDLE_STALE ? "freed" : "foreign");
        return NULL;
    }
    return st;
}

baseRT_decode_stream_t baseRT_decode_stream_create(baseRT_model_t model) {
    static const char fn[] = "baseRT_decode_stream_create";
    rt_model *m = rt_model_check(model, fn);
    if (!m) return NULL;
    struct baseRT_decode_stream *s = calloc(1, sizeof *s);
    if (!s || !grow(&s->out, 64) || !(s->handle = rt_handle_new(RT_KIND_STREAM, s))) {
        if (s) free(s->out.data);
        free(s);
        rt_set_error(BASERT_ERR_OUT_OF_MEMORY, "%s: out of memory", fn);
        return NULL;
    }
    s->magic = RT_STREAM_MAGIC;
    s->model = m->handle;
    utf8_assembler_reset(&s->a);
    rt_clear_error();
    return s->handle;
}

void baseRT_decode_stream_reset(baseRT_decode_stream_t stream) {
    struct baseRT_decode_stream *s = stream_check(stream, "baseRT_decode_stream_reset");
    if (!s) return;
    utf8_assembler_reset(&s->a);
    rt_clear_error();
}

void baseRT_decode_stream_reset_for_prompt(baseRT_decode_stream_t stream, const uint32_t *prompt, int n_prompt) {
    static const char fn[] = "baseRT_decode_stream_reset_for_prompt";
    struct baseRT_decode_stream *s = stream_check(stream, fn);
    if (!s) return;
    if (n_prompt < 0 || (n_prompt > 0 && !prompt)) {
        rt_set_error(BASERT_ERR_INVALID_ARGUMENT, "%s: bad prompt (prompt %p, n_prompt %d)", fn, (const void *)prompt,
                     n_prompt);
        return;
    }
    /* ChatML / llama framing has no channel state to resume: a plain reset. */
    utf8_assembler_reset(&s->a);
    rt_clear_error();
}

const char *baseRT_decode_stream_token(baseRT_decode_stream_t stream, uint32_t token_id) {
    static const char fn[] = "baseRT_decode_stream_token";
    struct baseRT_decode_stream *s = stream_check(stream, fn);
    rt_model *m = s ? rt_model_check(s->model, fn) : NULL;
    if (!m) return NULL;
    const char *text = decode_into(fn, m, &s->a, token_id, &s->out);
    if (text) rt_clear_error();
    return text;
}

void baseRT_decode_stream_free(baseRT_decode_stream_t stream) {
    if (!stream) return;
    struct baseRT_decode_stream *s = stream_check(stream, "baseRT_decode_stream_free");
    if (!s) return;
    rt_handle_release(s->handle);
    s->magic = 0;
    free(s->out.data);
    free(s);
    rt_clear_error();
}

/* ---- special tokens and metadata ---------------------------------------------------- */

uint32_t baseRT_bos_id(baseRT_model_t model) {
    rt_model *m = rt_model_check(model, "baseRT_bos_id");
    if (!m) return 0;
    rt_clear_error();
    return m->bos_id;
}

const char *baseRT_bos_token(baseRT_model_t model) {
    rt_model *m = rt_model_check(model, "baseRT_bos_token");
    if (!m) return "";
    rt_clear_error();
    return m->bos_str;
}

const char *baseRT_eos_token(baseRT_model_t model) {
    rt_model *m = rt_model_check(model, "baseRT_eos_token");
    if (!m) return "";
    rt_clear_error();
    return m->eos_str;
}

uint32_t baseRT_eos_token_id(baseRT_model_t model) {
    rt_model *m = rt_model_check(model, "baseRT_eos_token_id");
    if (!m) return 0;
    rt_clear_error();
    return m->eos_id;
}

int baseRT_add_bos(baseRT_model_t model) {
    rt_model *m = rt_model_check(model, "baseRT_add_bos");
    if (!m) return 0;
    rt_clear_error();
    return m->add_bos ? 1 : 0;
}

int32_t baseRT_is_eos_token(baseRT_model_t model, uint32_t token) {
    rt_model *m = rt_model_check(model, "baseRT_is_eos_token");
    if (!m) return 0;
    rt_clear_error();
    for (int i = 0; i < m->n_eos_ids; i++)
        if (m->eos_ids[i] == token) return 1;
    return 0;
}

int baseRT_special_token_count(baseRT_model_t model) {
    rt_model *m = rt_model_check(model, "baseRT_special_token_count");
    if (!m) return 0;
    rt_clear_error();
    return m->n_special;
}

const char *baseRT_special_token(baseRT_model_t model, int index, uint32_t *id_out) {
    static const char fn[] = "baseRT_special_token";
    if (id_out) *id_out = UINT32_MAX;
    rt_model *m = rt_model_check(model, fn);
    if (!m) return "";
    if (index < 0 || index >= m->n_special) {
        rt_set_error(BASERT_ERR_INVALID_ARGUMENT, "%s: index %d is outside [0, %d)", fn, index, m->n_special);
        return "";
    }
    tls_state *s = tls_get();
    uint32_t id = m->special_ids[index];
    if (!s || token_bytes(m, id, &s->special) < 0) {
        rt_set_error(BASERT_ERR_OUT_OF_MEMORY, "%s: out of memory", fn);
        return "";
    }
    if (id_out) *id_out = id;
    rt_clear_error();
    return s->special.data;
}

const char *baseRT_chat_template_jinja(baseRT_model_t model) {
    rt_model *m = rt_model_check(model, "baseRT_chat_template_jinja");
    if (!m) return "";
    rt_clear_error();
    return m->chat_template;
}

const char *baseRT_chat_template(baseRT_model_t model) {
    rt_model *m = rt_model_check(model, "baseRT_chat_template");
    if (!m) return "unknown";
    rt_clear_error();
    if (strstr(m->chat_template, "<|im_start|>")) return "chatml";
    if (strstr(m->chat_template, "<|start_header_id|>")) return "llama3";
    if (strstr(m->chat_template, "<start_of_turn>")) return "gemma";
    return "unknown";
}
