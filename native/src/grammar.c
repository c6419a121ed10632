/* Grammar-constrained decoding for the reference engine (baseRT_grammar_* in
 * baseRT.h): the grammar handle over a model's vocabulary, token masks and
 * token acceptance. What a grammar accepts lives below it: the JSON automaton
 * (json_grammar.c), the schema subset (json_schema.c) and structural tags
 * (structural_tag.c). */

#include "errors.h"
#include "handles.h"
#include "json.h"
#include "json_grammar.h"
#include "json_schema.h"
#include "model.h"
#include "structural_tag.h"
#include "tokenizer.h"

#include <stdlib.h>
#include <string.h>

#define RT_GRAMMAR_MAGIC 0x42524731u /* "BRG1" */

typedef struct rt_grammar {
    uint32_t magic;
    int vocab;         /* config.vocab_size */
    int words;         /* (vocab + 31) / 32 */
    uint8_t *bytes;    /* every token's raw bytes, concatenated */
    uint32_t *off;     /* [vocab + 1]: token i = bytes[off[i] .. off[i+1]) */
    uint8_t *usable;   /* [vocab]: 1 when the token may be matched by its bytes */
    uint32_t *by_first;      /* the usable tokens, grouped by their first byte ... */
    uint32_t first_at[257];  /* ... byte c's group: by_first[first_at[c] .. first_at[c+1]) */
    uint8_t *ctrl;     /* [vocab]: 1 for a CONTROL token (structural tags: usable, never JSON) */
    uint8_t *is_eos;   /* [vocab] */
    uint32_t *eos;     /* the eos ids */
    int n_eos;
    gr_schema schema;  /* the JSON grammar's */
    gr_state init, cur;
    st_spec *st;       /* non-NULL: a structural-tag grammar, stepped on st_cur */
    st_state st_init, st_cur;
    uint32_t *free_mask; /* [n_nodes * words]: cached masks of the free-text states */
    uint8_t *free_seen;  /* [n_nodes]: 0 not cached, 1 cached (mask applies), 2 cached (every token) */
    void *handle; /* the caller's (handles.c) */
} rt_grammar;

/* ---- handles ---------------------------------------------------------------------- */

static rt_grammar *grammar_check(baseRT_grammar_t grammar, const char *fn) {
    if (!grammar) {
        rt_set_error(BASERT_ERR_INVALID_ARGUMENT, "%s: grammar handle is NULL", fn);
        return NULL;
    }
    int why = RT_HANDLE_FOREIGN;
    rt_grammar *g = rt_handle_get(grammar, RT_KIND_GRAMMAR, &why); /* never follows a stale pointer */
    if (!g || g->magic != RT_GRAMMAR_MAGIC) {
        rt_set_error(BASERT_ERR_INVALID_ARGUMENT, "%s: %p is not a live grammar handle (%s)", fn, grammar,
                     why == RT_HANDLE_STALE ? "freed" : "foreign");
        return NULL;
    }
    return g;
}

static void grammar_destroy(rt_grammar *g) {
    if (!g) return;
    g->magic = 0;
    free(g->bytes);
    free(g->off);
    free(g->usable);
    free(g->by_first);
    free(g->ctrl);
    free(g->is_eos);
    free(g->eos);
    free(g->schema.obj);
    st_free(g->st);
    free(g->free_mask);
    free(g->free_seen);
    free(g);
}

/* A grammar over m's vocabulary (the token tables); the caller sets its
 * schema or structural tag and publishes it with grammar_publish. with_control:
 * CONTROL tokens are matched by their bytes (structural tags) instead of never. */
static rt_grammar *grammar_alloc(const char *fn, rt_model *m, bool with_control) {
    if (!m->tok) {
        rt_set_error(BASERT_ERR_UNSUPPORTED, "%s: the model has no tokenizer", fn);
        return NULL;
    }
    int vocab = (int)m->cfg.vocab_size;
    int n_tok = bpe_vocab_size(m->tok);
    rt_grammar *g = calloc(1, sizeof *g);
    if (!g) goto oom;
    g->vocab = vocab;
    g->words = (vocab + 31) / 32;
    g->off = calloc((size_t)vocab + 1, sizeof *g->off);
    g->usable = calloc((size_t)vocab, 1);
    g->ctrl = calloc((size_t)vocab, 1);
    g->is_eos = calloc((size_t)vocab, 1);
    g->eos = calloc(m->n_eos_ids > 0 ? (size_t)m->n_eos_ids : 1, sizeof *g->eos);
    if (!g->off || !g->usable || !g->ctrl || !g->is_eos || !g->eos) goto oom;
    for (int i = 0; i < m->n_eos_ids; i++) {
        uint32_t e = m->eos_ids[i];
        if (e < (uint32_t)vocab && !g->is_eos[e]) {
            g->is_eos[e] = 1;
            g->eos[g->n_eos++] = e;
        }
    }
    /* token bytes: two passes (lengths, then the bytes) */
    size_t total = 0;
    char small[256];
    for (int i = 0; i < vocab; i++) {
        g->off[i] = (uint32_t)total;
        if (i >= n_tok || g->is_eos[i]) continue;
        g->ctrl[i] = bpe_token_type(m->tok, (uint32_t)i) == BPE_TOKEN_CONTROL;
        if (g->ctrl[i] && !with_control) continue;
        int n = bpe_token_bytes(m->tok, (uint32_t)i, small, (int)sizeof small);
        if (n <= 0) continue;
        if (total + (size_t)n > UINT32_MAX) goto oom;
        g->usable[i] = 1;
        total += (size_t)n;
    }
    g->off[vocab] = (uint32_t)total;
    g->bytes = malloc(total ? total : 1);
    if (!g->bytes) goto oom;
    for (int i = 0; i < vocab; i++) {
        if (!g->usable[i]) continue;
        uint32_t n = g->off[i + 1] - g->off[i];
        if (n <= sizeof small) {
            bpe_token_bytes(m->tok, (uint32_t)i, small, (int)sizeof small);
            memcpy(g->bytes + g->off[i], small, n);
        } else {
            char *big = malloc(n);
            if (!big) goto oom;
            bpe_token_bytes(m->tok, (uint32_t)i, big, (int)n);
            memcpy(g->bytes + g->off[i], big, n);
            free(big);
        }
    }
    /* group the usable tokens by first byte (a counting sort): a mask then only
     * walks the groups whose first byte the current state accepts */
    g->by_first = malloc(((size_t)vocab + 1) * sizeof *g->by_first);
    if (!g->by_first) goto oom;
    memset(g->first_at, 0, sizeof g->first_at);
    for (int i = 0; i < vocab; i++)
        if (g->usable[i]) g->first_at[g->bytes[g->off[i]] + 1]++;
    for (int c = 0; c < 256; c++) g->first_at[c + 1] += g->first_at[c];
    {
        uint32_t fill_at[256];
        memcpy(fill_at, g->first_at, sizeof fill_at);
        for (int i = 0; i < vocab; i++)
            if (g->usable[i]) g->by_first[fill_at[g->bytes[g->off[i]]]++] = (uint32_t)i;
    }
    return g;
oom:
    grammar_destroy(g);
    rt_set_error(BASERT_ERR_OUT_OF_MEMORY, "%s: out of memory building the grammar", fn);
    return NULL;
}

static baseRT_grammar_t grammar_publish(const char *fn, rt_grammar *g) {
    g->init = gr_initial(&g->schema);
    g->cur = g->init;
    g->st_cur = g->st_init;
    g->magic = RT_GRAMMAR_MAGIC;
    if (!(g->handle = rt_handle_new(RT_KIND_GRAMMAR, g))) {
        grammar_destroy(g);
        rt_set_error(BASERT_ERR_OUT_OF_MEMORY, "%s: out of memory building the grammar", fn);
        return NULL;
    }
    rt_clear_error();
    return g->handle;
}

/* ---- public API ------------------------------------------------------------------- */

baseRT_grammar_t baseRT_grammar_create(baseRT_model_t model, const char *gbnf) {
    static const char fn[] = "baseRT_grammar_create";
    if (!rt_model_check(model, fn)) return NULL;
    if (!gbnf) {
        rt_set_error(BASERT_ERR_INVALID_ARGUMENT, "%s: gbnf is NULL", fn);
        return NULL;
    }
    rt_set_error(BASERT_ERR_UNSUPPORTED,
                 "%s: GBNF grammars are not supported by the reference engine (use "
                 "baseRT_grammar_create_json, a JSON schema or a structural tag)",
                 fn);
    return NULL;
}

baseRT_grammar_t baseRT_grammar_create_json(baseRT_model_t model) {
    static const char fn[] = "baseRT_grammar_create_json";
    rt_model *m = rt_model_check(model, fn);
    if (!m) return NULL;
    rt_grammar *g = grammar_alloc(fn, m, false);
    return g ? grammar_publish(fn, g) : NULL;
}

baseRT_grammar_t baseRT_grammar_create_from_schema(baseRT_model_t model, const char *json_schema) {
    static const char fn[] = "baseRT_grammar_create_from_schema";
    rt_model *m = rt_model_check(model, fn);
    if (!m) return NULL;
    if (!json_schema) {
        rt_set_error(BASERT_ERR_INVALID_ARGUMENT, "%s: json_schema is NULL", fn);
        return NULL;
    }
    char err[160];
    json_doc *doc = json_parse(json_schema, strlen(json_schema), err, sizeof err);
    if (!doc) {
        rt_set_error(BASERT_ERR_INVALID_ARGUMENT, "%s: json_schema is not valid JSON (%s)", fn, err);
        return NULL;
    }
    gr_schema sc;
    int rc = gr_schema_compile(fn, json_root(doc), &sc);
    json_free(doc);
    if (rc != BASERT_OK) return NULL;
    rt_grammar *g = grammar_alloc(fn, m, false);
    if (!g) {
        free(sc.obj);
        return NULL;
    }
    g->schema = sc;
    return grammar_publish(fn, g);
}

baseRT_grammar_t baseRT_grammar_create_from_structural_tag(baseRT_model_t model, const char *tag_json) {
    static const char fn[] = "baseRT_grammar_create_from_structural_tag";
    rt_model *m = rt_model_check(model, fn);
    if (!m) return NULL;
    if (!tag_json) {
        rt_set_error(BASERT_ERR_INVALID_ARGUMENT, "%s: tag_json is NULL", fn);
        return NULL;
    }
    char err[160];
    json_doc *doc = json_parse(tag_json, strlen(tag_json), err, sizeof err);
    if (!doc) {
        rt_set_error(BASERT_ERR_INVALID_ARGUMENT, "%s: tag_json is not valid JSON (%s)", fn, err);
        return NULL;
    }
    st_spec *sp = calloc(1, sizeof *sp);
    int rc = sp ? st_parse(fn, json_root(doc), sp) : st_fail(fn, BASERT_ERR_OUT_OF_MEMORY, "out of memory");
    json_free(doc);
    if (rc != BASERT_OK) {
        st_free(sp);
        return NULL;
    }
    rt_grammar *g = grammar_alloc(fn, m, true);
    if (g) {
        g->free_mask = calloc((size_t)sp->n_nodes * (size_t)g->words, sizeof *g->free_mask);
        g->free_seen = calloc((size_t)sp->n_nodes, 1);
    }
    if (!g || !g->free_mask || !g->free_seen) {
        if (g) grammar_destroy(g);
        st_free(sp);
        rt_set_error(BASERT_ERR_OUT_OF_MEMORY, "%s: out of memory building the grammar", fn);
        return NULL;
    }
    g->st = sp;
    memset(&g->st_init, 0, sizeof g->st_init);
    if (sp->at_least_one || sp->with_sep) /* the output starts with one of the tags (or, optionally, is empty) */
        st_any_tag(sp, &g->st_init, !sp->at_least_one);
    return grammar_publish(fn, g);
}

void baseRT_grammar_free(baseRT_grammar_t grammar) {
    rt_grammar *g = grammar_check(grammar, "baseRT_grammar_free");
    if (!g) return;
    rt_handle_release(g->handle);
    grammar_destroy(g);
    rt_clear_error();
}

void baseRT_grammar_reset(baseRT_grammar_t grammar) {
    rt_grammar *g = grammar_check(grammar, "baseRT_grammar_reset");
    if (!g) return;
    g->cur = g->init;
    g->st_cur = g->st_init;
    rt_clear_error();
}

int baseRT_grammar_bitmask_size(baseRT_grammar_t grammar) {
    rt_grammar *g = grammar_check(grammar, "baseRT_grammar_bitmask_size");
    if (!g) return 0;
    rt_clear_error();
    return g->words;
}

static inline void set_bit(uint32_t *mask, uint32_t i) { mask[i >> 5] |= 1u << (i & 31); }

/* The structural-tag mask of st_cur; 1 when it excludes some token. Free-text
 * masks depend on the automaton node only, so they are computed once per node. */
static int st_fill(rt_grammar *g, uint32_t *mask) {
    const st_spec *sp = g->st;
    const st_state cur = g->st_cur;
    bool free_text = cur.phase == S_FREE;
    if (free_text && g->free_seen[cur.node]) {
        memcpy(mask, g->free_mask + (size_t)cur.node * g->words, (size_t)g->words * sizeof *mask);
        return g->free_seen[cur.node] == 1;
    }
    memset(mask, 0, (size_t)g->words * sizeof *mask);
    int allowed = 0;
    if (st_eos_ok(&cur))
        for (int i = 0; i < g->n_eos; i++) set_bit(mask, g->eos[i]), allowed++;
    if (cur.phase != S_TERM && cur.phase != S_STOP) {
        if (free_text) /* no bytes: a no-op in free text, never elsewhere */
            for (int i = 0; i < g->vocab; i++)
                if (!g->usable[i] && !g->is_eos[i]) set_bit(mask, (uint32_t)i), allowed++;
        for (int c = 0; c < 256; c++) {
            uint32_t a = g->first_at[c], b = g->first_at[c + 1];
            if (a == b) continue;
            st_state first = cur; /* the state after the group's first byte, for normal tokens */
            bool viable = st_feed(sp, &first, (unsigned)c, false);
            for (uint32_t k = a; k < b; k++) {
                uint32_t i = g->by_first[k];
                bool ctrl = g->ctrl[i];
                if (!viable && !ctrl) continue;
                st_state s = ctrl ? cur : first; /* a marker is re-fed whole: never JSON */
                const uint8_t *p = g->bytes + g->off[i] + (ctrl ? 0 : 1), *end = g->bytes + g->off[i + 1];
                while (p < end && st_feed(sp, &s, *p, ctrl)) p++;
                if (p == end) set_bit(mask, i), allowed++;
            }
        }
    }
    int apply = allowed < g->vocab;
    if (free_text) {
        memcpy(g->free_mask + (size_t)cur.node * g->words, mask, (size_t)g->words * sizeof *mask);
        g->free_seen[cur.node] = apply ? 1 : 2;
    }
    return apply;
}

int baseRT_grammar_fill_bitmask(baseRT_grammar_t grammar, int32_t *out_bitmask) {
    static const char fn[] = "baseRT_grammar_fill_bitmask";
    rt_grammar *g = grammar_check(grammar, fn);
    if (!g) return 0;
    if (!out_bitmask) {
        rt_set_error(BASERT_ERR_INVALID_ARGUMENT, "%s: out_bitmask is NULL", fn);
        return 0;
    }
    uint32_t *mask = (uint32_t *)out_bitmask;
    if (g->st) {
        int apply = st_fill(g, mask);
        rt_clear_error();
        return apply;
    }
    memset(mask, 0, (size_t)g->words * sizeof *mask);
    const gr_state cur = g->cur;
    const gr_obj *obj = g->schema.obj;
    if (gr_can_end(&cur) || cur.lex == L_TERMINATED)
        for (int i = 0; i < g->n_eos; i++) set_bit(mask, g->eos[i]);
    if (cur.lex != L_DONE && cur.lex != L_TERMINATED) {
        const uint8_t *bytes = g->bytes;
        const uint32_t *off = g->off;
        for (int c = 0; c < 256; c++) { /* only the groups whose first byte can follow */
            uint32_t a = g->first_at[c], b = g->first_at[c + 1];
            gr_state first = cur;
            if (a == b || !gr_feed(obj, &first, (unsigned)c)) continue;
            for (uint32_t k = a; k < b; k++) {
                uint32_t i = g->by_first[k];
                gr_state s = first;
                const uint8_t *p = bytes + off[i] + 1, *end = bytes + off[i + 1];
                while (p < end && gr_feed(obj, &s, *p)) p++;
                if (p == end) set_bit(mask, i);
            }
        }
    }
    rt_clear_error();
    return 1;
}

static int st_accept(const char *fn, rt_grammar *g, uint32_t token_id) {
    st_state *cur = &g->st_cur;
    if (g->is_eos[token_id]) {
        if (!st_eos_ok(cur)) {
            rt_set_error(BASERT_ERR_INVALID_ARGUMENT, "%s: eos token %u rejected: a tag is incomplete", fn, token_id);
            return 0;
        }
        cur->phase = S_TERM;
        rt_clear_error();
        return 1;
    }
    if (!g->usable[token_id]) {
        if (cur->phase != S_FREE) {
            rt_set_error(BASERT_ERR_INVALID_ARGUMENT, "%s: token %u (no bytes) is only allowed in free text", fn,
                         token_id);
            return 0;
        }
        rt_clear_error();
        return 1;
    }
    st_state s = *cur;
    for (uint32_t k = g->off[token_id]; k < g->off[token_id + 1]; k++) {
        if (!st_feed(g->st, &s, g->bytes[k], g->ctrl[token_id])) {
            rt_set_error(BASERT_ERR_INVALID_ARGUMENT, "%s: token %u rejected by the structural tag at its byte %u",
                         fn, token_id, k - g->off[token_id]);
            return 0;
        }
    }
    *cur = s;
    rt_clear_error();
    return 1;
}

int baseRT_grammar_accept_token(baseRT_grammar_t grammar, uint32_t token_id) {
    static const char fn[] = "baseRT_grammar_accept_token";
    rt_grammar *g = grammar_check(grammar, fn);
    if (!g) return 0;
    if (token_id >= (uint32_t)g->vocab) {
        rt_set_error(BASERT_ERR_INVALID_ARGUMENT, "%s: token %u is outside the vocabulary (%d)", fn, token_id, g->vocab);
        return 0;
    }
    if (g->st) return st_accept(fn, g, token_id);
    if (g->is_eos[token_id]) {
        if (!gr_can_end(&g->cur) && g->cur.lex != L_TERMINATED) {
            rt_set_error(BASERT_ERR_INVALID_ARGUMENT, "%s: eos token %u rejected: the JSON value is incomplete", fn,
                         token_id);
            return 0;
        }
        g->cur.lex = L_TERMINATED;
        rt_clear_error();
        return 1;
    }
    if (!g->usable[token_id]) {
        rt_set_error(BASERT_ERR_INVALID_ARGUMENT, "%s: token %u (a control token or no bytes) is never allowed", fn,
                     token_id);
        return 0;
    }
    gr_state s = g->cur;
    for (uint32_t k = g->off[token_id]; k < g->off[token_id + 1]; k++) {
        if (!gr_feed(g->schema.obj, &s, g->bytes[k])) {
            rt_set_error(BASERT_ERR_INVALID_ARGUMENT, "%s: token %u rejected by the JSON grammar at its byte %u", fn,
                         token_id, k - g->off[token_id]);
            return 0;
        }
    }
    g->cur = s;
    rt_clear_error();
    return 1;
}

int baseRT_grammar_is_terminated(baseRT_grammar_t grammar) {
    rt_grammar *g = grammar_check(grammar, "baseRT_grammar_is_terminated");
    if (!g) return 0;
    rt_clear_error();
    return g->st ? g->st_cur.phase == S_TERM : g->cur.lex == L_TERMINATED;
}

int baseRT_grammar_is_completed(baseRT_grammar_t grammar) {
    rt_grammar *g = grammar_check(grammar, "baseRT_grammar_is_completed");
    if (!g) return 0;
    rt_clear_error();
    if (g->st) return 0; /* free text can always continue: structural tags end on eos (terminated) */
    return g->cur.lex == L_DONE || g->cur.lex == L_TERMINATED;
}
