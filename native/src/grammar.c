/* Grammar-constrained decoding for the reference engine: a generic JSON
 * grammar over the model's vocabulary (baseRT_grammar_* in baseRT.h).
 *
 * The grammar accepts exactly ONE JSON value (RFC 8259: objects, arrays,
 * strings with every escape incl. \uXXXX, numbers, true/false/null), written
 * COMPACTLY: no whitespace outside strings, before, between or after tokens
 * (the same output the host llguidance backend produces with
 * whitespace_flexible=false). Nesting is limited to GR_MAX_DEPTH containers.
 * Strings must be well-formed UTF-8 (no overlongs, no surrogates, no raw
 * control characters); \uXXXX escapes are checked syntactically only, as in
 * the RFC's grammar.
 *
 * The recognizer is a byte-level pushdown automaton whose whole state fits in
 * a small fixed-size struct (the container stack is a 64-bit bitset), so
 * fill_bitmask copies it for every vocabulary token and feeds the token's
 * bytes (precomputed once per grammar), stopping at the first rejected byte.
 *
 * End of output: once a complete value has been parsed the grammar is
 * "completed" and ONLY the model's eos ids are allowed. A top-level NUMBER can
 * always continue (no whitespace is allowed after it), so it never reports
 * completed; while it is in an accepting state ("12", "1.5e3", not "1." or
 * "-") the eos ids are allowed beside its continuation bytes, and accepting an
 * eos ends it. Accepting an eos sets "terminated" (and completed). CONTROL
 * tokens and tokens with no bytes are never allowed, except the eos ids as
 * above.
 *
 * Schemas (baseRT_grammar_create_from_schema): `{}`, `true` and
 * `{"type": X}` for X in object/array/string/number/integer/boolean/null,
 * which restrict the top-level value's type ("integer" = a number without
 * fraction or exponent). Any other keyword -> NULL with BASERT_ERR_UNSUPPORTED
 * naming it (also an unknown or list-valued "type", `false`, a non-object
 * schema: the SDK then falls back to its host backend, which validates them);
 * text that is not JSON -> BASERT_ERR_INVALID_ARGUMENT. GBNF
 * (baseRT_grammar_create) and structural tags are UNSUPPORTED. */

#include "front.h"
#include "json.h"

#include <stdlib.h>
#include <string.h>

#define RT_GRAMMAR_MAGIC 0x42524731u /* "BRG1" */
#define GR_MAX_DEPTH 64

/* lexical states: what the next byte may be */
enum {
    L_VALUE,     /* a value starts (top level, after ':' or after ',' in an array) */
    L_ARR_FIRST, /* after '[': a value or ']' */
    L_OBJ_FIRST, /* after '{': '"' (a key) or '}' */
    L_KEY,       /* after ',' in an object: '"' */
    L_COLON,     /* after a key: ':' */
    L_AFTER,     /* after a value inside a container: ',' or its closer */
    L_DONE,      /* a complete top-level value: no more bytes */
    L_STR,       /* inside a string */
    L_ESC,       /* after '\' */
    L_HEX,       /* in \uXXXX, a = hex digits seen */
    L_UTF8,      /* a = continuation bytes still needed, b = the first one's range id */
    L_LIT,       /* in true/false/null: a = literal, b = bytes matched */
    L_NUM_MINUS, /* after '-': a digit */
    L_NUM_ZERO,  /* a leading 0 */
    L_NUM_INT,   /* integer digits after 1-9 */
    L_NUM_DOT,   /* after '.': a digit */
    L_NUM_FRAC,  /* fraction digits */
    L_NUM_EXP,   /* after e/E: sign or digit */
    L_NUM_EXP_SIGN, /* after e+/e-: a digit */
    L_NUM_EXP_DIG,  /* exponent digits */
    L_TERMINATED,   /* an eos was accepted */
};

/* top-level type restriction */
enum { T_ANY, T_OBJECT, T_ARRAY, T_STRING, T_NUMBER, T_INTEGER, T_BOOLEAN, T_NULL };

/* UTF-8 first-continuation ranges (RFC 3629) */
enum { U_ANY, U_E0, U_ED, U_F0, U_F4 };

typedef struct {
    uint64_t stack; /* bit d: the container at depth d+1 is an object */
    uint8_t depth;  /* open containers */
    uint8_t lex;
    uint8_t a, b;   /* per-state data, see the enum */
    uint8_t is_key; /* the current string is an object key */
    uint8_t top;    /* T_* restriction of the top-level value */
} gr_state;

typedef struct rt_grammar {
    uint32_t magic;
    int vocab;         /* config.vocab_size */
    int words;         /* (vocab + 31) / 32 */
    uint8_t *bytes;    /* every token's raw bytes, concatenated */
    uint32_t *off;     /* [vocab + 1]: token i = bytes[off[i] .. off[i+1]) */
    uint8_t *usable;   /* [vocab]: 1 when the token may be matched by its bytes */
    uint8_t *is_eos;   /* [vocab] */
    uint32_t *eos;     /* the eos ids */
    int n_eos;
    gr_state init, cur;
    void *handle; /* the caller's (handles.c) */
} rt_grammar;

static const char *const LITERALS[3] = {"true", "false", "null"};
static const uint8_t LITERAL_LEN[3] = {4, 5, 4};

/* ---- the automaton -------------------------------------------------------------- */

static inline bool in_object(const gr_state *s) { return s->depth && ((s->stack >> (s->depth - 1)) & 1u); }

static inline void value_done(gr_state *s) { s->lex = s->depth ? L_AFTER : L_DONE; }

static inline bool number_can_end(uint8_t lex) {
    return lex == L_NUM_ZERO || lex == L_NUM_INT || lex == L_NUM_FRAC || lex == L_NUM_EXP_DIG;
}

/* Start a value with byte c (state L_VALUE or L_ARR_FIRST). */
static bool start_value(gr_state *s, unsigned c) {
    uint8_t top = s->depth == 0 ? s->top : T_ANY;
    switch (c) {
    case '{':
    case '[':
        if (top != T_ANY && top != (c == '{' ? T_OBJECT : T_ARRAY)) return false;
        if (s->depth >= GR_MAX_DEPTH) return false;
        if (c == '{')
            s->stack |= (uint64_t)1 << s->depth;
        else
            s->stack &= ~((uint64_t)1 << s->depth);
        s->depth++;
        s->lex = c == '{' ? L_OBJ_FIRST : L_ARR_FIRST;
        return true;
    case '"':
        if (top != T_ANY && top != T_STRING) return false;
        s->lex = L_STR;
        s->is_key = 0;
        return true;
    case 't':
    case 'f':
    case 'n':
        if (top != T_ANY && top != (c == 'n' ? T_NULL : T_BOOLEAN)) return false;
        s->lex = L_LIT;
        s->a = c == 't' ? 0 : c == 'f' ? 1 : 2;
        s->b = 1;
        return true;
    case '-':
        if (top != T_ANY && top != T_NUMBER && top != T_INTEGER) return false;
        s->lex = L_NUM_MINUS;
        return true;
    default:
        if (c < '0' || c > '9') return false;
        if (top != T_ANY && top != T_NUMBER && top != T_INTEGER) return false;
        s->lex = c == '0' ? L_NUM_ZERO : L_NUM_INT;
        return true;
    }
}

static inline bool is_hex(unsigned c) {
    return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f') || (c >= 'A' && c <= 'F');
}

/* A byte after a complete value inside a container (L_AFTER). */
static bool after_value(gr_state *s, unsigned c) {
    bool obj = in_object(s);
    if (c == ',') {
        s->lex = obj ? L_KEY : L_VALUE;
        return true;
    }
    if (c == (obj ? '}' : ']')) {
        s->depth--;
        value_done(s);
        return true;
    }
    return false;
}

/* The number ended before byte c: inside a container c continues the
 * container; at top level nothing may follow a number (compact output). */
static bool end_number(gr_state *s, unsigned c) {
    if (s->depth == 0) return false;
    s->lex = L_AFTER;
    return after_value(s, c);
}

/* Feed one byte; false when it cannot continue a valid (compact) JSON prefix.
 * On false the state is left in an unspecified state: callers feed a copy. */
static bool gr_feed(gr_state *s, unsigned c) {
    bool integer_only = s->depth == 0 && s->top == T_INTEGER;
    switch (s->lex) {
    case L_VALUE:
        return start_value(s, c);
    case L_ARR_FIRST:
        if (c == ']') {
            s->depth--;
            value_done(s);
            return true;
        }
        return start_value(s, c);
    case L_OBJ_FIRST:
        if (c == '}') {
            s->depth--;
            value_done(s);
            return true;
        }
        /* fall through */
    case L_KEY:
        if (c != '"') return false;
        s->lex = L_STR;
        s->is_key = 1;
        return true;
    case L_COLON:
        if (c != ':') return false;
        s->lex = L_VALUE;
        return true;
    case L_AFTER:
        return after_value(s, c);
    case L_DONE:
    case L_TERMINATED:
        return false;
    case L_STR:
        if (c == '"') {
            if (s->is_key)
                s->lex = L_COLON;
            else
                value_done(s);
            return true;
        }
        if (c == '\\') {
            s->lex = L_ESC;
            return true;
        }
        if (c < 0x20) return false;
        if (c < 0x80) return true;
        if (c >= 0xC2 && c <= 0xDF) {
            s->lex = L_UTF8, s->a = 1, s->b = U_ANY;
        } else if (c >= 0xE0 && c <= 0xEF) {
            s->lex = L_UTF8, s->a = 2, s->b = c == 0xE0 ? U_E0 : c == 0xED ? U_ED : U_ANY;
        } else if (c >= 0xF0 && c <= 0xF4) {
            s->lex = L_UTF8, s->a = 3, s->b = c == 0xF0 ? U_F0 : c == 0xF4 ? U_F4 : U_ANY;
        } else {
            return false; /* 0x80-0xC1 (stray continuation, overlong lead) or 0xF5+ */
        }
        return true;
    case L_UTF8: {
        unsigned lo = 0x80, hi = 0xBF;
        switch (s->b) {
        case U_E0: lo = 0xA0; break;
        case U_ED: hi = 0x9F; break;
        case U_F0: lo = 0x90; break;
        case U_F4: hi = 0x8F; break;
        default: break;
        }
        if (c < lo || c > hi) return false;
        s->b = U_ANY;
        if (--s->a == 0) s->lex = L_STR;
        return true;
    }
    case L_ESC:
        if (c == 'u') {
            s->lex = L_HEX;
            s->a = 0;
            return true;
        }
        if (c == '"' || c == '\\' || c == '/' || c == 'b' || c == 'f' || c == 'n' || c == 'r' || c == 't') {
            s->lex = L_STR;
            return true;
        }
        return false;
    case L_HEX:
        if (!is_hex(c)) return false;
        if (++s->a == 4) s->lex = L_STR;
        return true;
    case L_LIT:
        if (c != (unsigned char)LITERALS[s->a][s->b]) return false;
        if (++s->b == LITERAL_LEN[s->a]) value_done(s);
        return true;
    case L_NUM_MINUS:
        if (c < '0' || c > '9') return false;
        s->lex = c == '0' ? L_NUM_ZERO : L_NUM_INT;
        return true;
    case L_NUM_ZERO:
    case L_NUM_INT:
        if (c >= '0' && c <= '9') return s->lex == L_NUM_INT; /* no leading zeros */
        if (c == '.' && !integer_only) {
            s->lex = L_NUM_DOT;
            return true;
        }
        if ((c == 'e' || c == 'E') && !integer_only) {
            s->lex = L_NUM_EXP;
            return true;
        }
        return end_number(s, c);
    case L_NUM_DOT:
        if (c < '0' || c > '9') return false;
        s->lex = L_NUM_FRAC;
        return true;
    case L_NUM_FRAC:
        if (c >= '0' && c <= '9') return true;
        if (c == 'e' || c == 'E') {
            s->lex = L_NUM_EXP;
            return true;
        }
        return end_number(s, c);
    case L_NUM_EXP:
        if (c == '+' || c == '-') {
            s->lex = L_NUM_EXP_SIGN;
            return true;
        }
        /* fall through */
    case L_NUM_EXP_SIGN:
        if (c < '0' || c > '9') return false;
        s->lex = L_NUM_EXP_DIG;
        return true;
    case L_NUM_EXP_DIG:
        if (c >= '0' && c <= '9') return true;
        return end_number(s, c);
    default:
        return false;
    }
}

/* The output may end here (an eos may follow). */
static inline bool gr_can_end(const gr_state *s) {
    return s->lex == L_DONE || (s->depth == 0 && number_can_end(s->lex));
}

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
    free(g->is_eos);
    free(g->eos);
    free(g);
}

/* A grammar over m's vocabulary whose top-level value has type `top`. */
static baseRT_grammar_t grammar_new(const char *fn, rt_model *m, uint8_t top) {
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
    g->is_eos = calloc((size_t)vocab, 1);
    g->eos = calloc(m->n_eos_ids > 0 ? (size_t)m->n_eos_ids : 1, sizeof *g->eos);
    if (!g->off || !g->usable || !g->is_eos || !g->eos) goto oom;
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
        if (i >= n_tok || g->is_eos[i] || bpe_token_type(m->tok, (uint32_t)i) == BPE_TOKEN_CONTROL) continue;
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
    memset(&g->init, 0, sizeof g->init);
    g->init.lex = L_VALUE;
    g->init.top = top;
    g->cur = g->init;
    g->magic = RT_GRAMMAR_MAGIC;
    if (!(g->handle = rt_handle_new(RT_KIND_GRAMMAR, g))) goto oom;
    rt_clear_error();
    return g->handle;
oom:
    grammar_destroy(g);
    rt_set_error(BASERT_ERR_OUT_OF_MEMORY, "%s: out of memory building the grammar", fn);
    return NULL;
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
                 "baseRT_grammar_create_json or a {\"type\": ...} schema)",
                 fn);
    return NULL;
}

baseRT_grammar_t baseRT_grammar_create_json(baseRT_model_t model) {
    static const char fn[] = "baseRT_grammar_create_json";
    rt_model *m = rt_model_check(model, fn);
    if (!m) return NULL;
    return grammar_new(fn, m, T_ANY);
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
    const json_value *root = json_root(doc);
    uint8_t top = T_ANY;
    bool b;
    if (json_bool(root, &b)) {
        if (!b) {
            json_free(doc);
            rt_set_error(BASERT_ERR_UNSUPPORTED, "%s: the schema `false` (matches nothing) is not supported", fn);
            return NULL;
        }
    } else if (!root || root->type != JSON_OBJECT) {
        json_free(doc);
        rt_set_error(BASERT_ERR_UNSUPPORTED, "%s: a schema that is not an object or `true` is not supported", fn);
        return NULL;
    } else {
        for (size_t i = 0; i < root->u.obj.n; i++) {
            const json_member *mem = &root->u.obj.members[i];
            if (mem->key_len == 4 && memcmp(mem->key, "type", 4) == 0) {
                static const char *const TYPES[] = {"object", "array", "string", "number",
                                                    "integer", "boolean", "null"};
                const char *t = json_string(&mem->value);
                top = T_ANY;
                for (size_t k = 0; t && k < sizeof TYPES / sizeof *TYPES; k++)
                    if (mem->value.u.str.len == strlen(TYPES[k]) && strcmp(t, TYPES[k]) == 0) top = (uint8_t)(k + 1);
                if (top == T_ANY) {
                    json_free(doc);
                    /* a list of types, or a name this grammar does not know: the host backend decides */
                    rt_set_error(BASERT_ERR_UNSUPPORTED,
                                 "%s: schema keyword \"type\" with this value is not supported (only a single "
                                 "type name)",
                                 fn);
                    return NULL;
                }
            } else {
                /* name the keyword (printable, truncated) */
                char name[64];
                size_t n = 0;
                for (size_t k = 0; k < mem->key_len && n < sizeof name - 1; k++) {
                    unsigned char c = (unsigned char)mem->key[k];
                    name[n++] = (c >= 0x20 && c != 0x7f) ? (char)c : '?';
                }
                name[n] = 0;
                json_free(doc);
                rt_set_error(BASERT_ERR_UNSUPPORTED,
                             "%s: schema keyword \"%s\" is not supported by the reference engine's grammar (only "
                             "{} and {\"type\": ...})",
                             fn, name);
                return NULL;
            }
        }
    }
    json_free(doc);
    return grammar_new(fn, m, top);
}

baseRT_grammar_t baseRT_grammar_create_from_structural_tag(baseRT_model_t model, const char *tag_json) {
    static const char fn[] = "baseRT_grammar_create_from_structural_tag";
    if (!rt_model_check(model, fn)) return NULL;
    if (!tag_json) {
        rt_set_error(BASERT_ERR_INVALID_ARGUMENT, "%s: tag_json is NULL", fn);
        return NULL;
    }
    rt_set_error(BASERT_ERR_UNSUPPORTED, "%s: structural tags are not supported by the reference engine", fn);
    return NULL;
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
    rt_clear_error();
}

int baseRT_grammar_bitmask_size(baseRT_grammar_t grammar) {
    rt_grammar *g = grammar_check(grammar, "baseRT_grammar_bitmask_size");
    if (!g) return 0;
    rt_clear_error();
    return g->words;
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
    memset(mask, 0, (size_t)g->words * sizeof *mask);
    const gr_state cur = g->cur;
    if (gr_can_end(&cur) || cur.lex == L_TERMINATED)
        for (int i = 0; i < g->n_eos; i++) mask[g->eos[i] >> 5] |= 1u << (g->eos[i] & 31);
    if (cur.lex != L_DONE && cur.lex != L_TERMINATED) {
        const uint8_t *bytes = g->bytes;
        const uint32_t *off = g->off;
        for (int i = 0; i < g->vocab; i++) {
            if (!g->usable[i]) continue;
            gr_state s = cur;
            const uint8_t *p = bytes + off[i], *end = bytes + off[i + 1];
            while (p < end && gr_feed(&s, *p)) p++;
            if (p == end) mask[i >> 5] |= 1u << (i & 31);
        }
    }
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
        if (!gr_feed(&s, g->bytes[k])) {
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
    return g->cur.lex == L_TERMINATED;
}

int baseRT_grammar_is_completed(baseRT_grammar_t grammar) {
    rt_grammar *g = grammar_check(grammar, "baseRT_grammar_is_completed");
    if (!g) return 0;
    rt_clear_error();
    return g->cur.lex == L_DONE || g->cur.lex == L_TERMINATED;
}
