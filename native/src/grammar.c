/* Grammar-constrained decoding for the reference engine (baseRT_grammar_* in
 * baseRT.h): a JSON grammar over the model's vocabulary, and xgrammar-style
 * STRUCTURAL TAGS (free text, with JSON-constrained regions after triggers).
 *
 * The JSON grammar accepts exactly ONE JSON value (RFC 8259: objects, arrays,
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
 * Schemas (baseRT_grammar_create_from_schema and a structural tag's
 * json_schema contents): `{}`, `true`, `{"type": X}` for X in
 * object/array/string/number/integer/boolean/null ("integer" = a number
 * without fraction or exponent), and ONE level of object properties: `{"type":
 * "object", "properties": {name: S, ...}, "required": [...],
 * "additionalProperties": false}` where each S is `{}`, `true` or `{"type":
 * X}` (a nested value of type object/array is generic JSON). Keys are then
 * exactly the declared names (no escapes), each at most once, in any order;
 * '}' only once every required name was written. An absent
 * additionalProperties is read as false (xgrammar's strict mode: the grammar
 * may be stricter than the schema, never looser). Annotations (description,
 * title, default, examples, $schema, $id, $comment) are ignored, and so is
 * `"x-guidance": {"whitespace_flexible": false}` (compact is what this grammar
 * writes); other llguidance options are UNSUPPORTED (the host honours them).
 * Anything else -> NULL with BASERT_ERR_UNSUPPORTED naming it (also an
 * unknown or list-valued "type", `false`, additionalProperties true or a
 * schema, more than GR_MAX_PROPS properties): the SDK then falls back to its
 * host backend, which validates them. A schema that is not JSON ->
 * BASERT_ERR_INVALID_ARGUMENT. GBNF (baseRT_grammar_create) is UNSUPPORTED.
 *
 * Structural tags (baseRT_grammar_create_from_structural_tag): the
 * "triggered_tags" format, `{"type": "structural_tag", "format": {"type":
 * "triggered_tags", "triggers": [...], "tags": [{"begin", "content":
 * {"type": "json_schema", "json_schema": S}, "end"}], "at_least_one",
 * "stop_after_first"}}` (the bare format object is accepted too), and the
 * older `{"type": "structural_tag", "structures": [{"begin", "schema",
 * "end"}], "triggers": [...]}`. As in xgrammar: free text until a trigger
 * appears (first occurrence, Aho-Corasick over the triggers), then the rest of
 * one of that trigger's tags' begin strings, the tag's JSON (compact, under S
 * as above), its end string, then free text again; `at_least_one`: the output
 * STARTS with a tag (any of them); `stop_after_first`: after the first tag
 * only an eos may follow. Each tag's begin must start with exactly one
 * trigger, and no begin may be a prefix of another. The "tags_with_separator"
 * format (`tags`, `separator`, `at_least_one`, `stop_after_first`) is tags
 * only: tag (separator tag)*, optionally none unless at_least_one, one with
 * stop_after_first; an eos may come where a tag could end the output.
 * `excludes` (triggered_tags, and the "any_text" format: free text alone)
 * are strings the free text must not contain. Free text is bytes:
 * CONTROL tokens (markers) are text there as the model's unconstrained output
 * would have them (and may be a begin/end string's bytes), but never JSON
 * content; tokens without bytes are allowed in free text only. When every
 * token may follow (free text that no token can turn into a broken tag),
 * fill_bitmask returns 0. Eos is allowed in free text and after a
 * stop_after_first tag. Such a grammar never reports completed (free text can
 * always continue): lanes end on eos (terminated), as the header says. */

#include "errors.h"
#include "handles.h"
#include "json.h"
#include "model.h"
#include "tokenizer.h"

#include <stdlib.h>
#include <string.h>

#define RT_GRAMMAR_MAGIC 0x42524731u /* "BRG1" */
#define GR_MAX_DEPTH 64
#define GR_MAX_PROPS 32  /* object properties a schema may declare (a 32-bit seen/candidate set) */
#define GR_MAX_NAME 64   /* bytes of a property name */
#define ST_MAX_TAGS 64   /* tags of a structural tag (a 64-bit candidate set) */
#define ST_MAX_TRIGGERS 16
#define ST_MAX_TRIGGER_BYTES 1024 /* all triggers together: bounds the trigger automaton */
#define ST_MAX_TEXT 4096          /* bytes of one begin / end string */

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
    L_PROP,         /* a declared property's name: kpos bytes matched, cand = names still possible */
};

/* value type restriction */
enum { T_ANY, T_OBJECT, T_ARRAY, T_STRING, T_NUMBER, T_INTEGER, T_BOOLEAN, T_NULL };

/* UTF-8 first-continuation ranges (RFC 3629) */
enum { U_ANY, U_E0, U_ED, U_F0, U_F4 };

/* The declared properties of a schema's top-level object. */
typedef struct {
    int n;
    uint32_t all, required;
    uint8_t len[GR_MAX_PROPS];
    uint8_t type[GR_MAX_PROPS];
    char name[GR_MAX_PROPS][GR_MAX_NAME];
} gr_obj;

typedef struct {
    uint8_t top;  /* T_* of the top-level value */
    gr_obj *obj;  /* non-NULL: top is T_OBJECT with exactly these keys */
} gr_schema;

typedef struct {
    uint64_t stack; /* bit d: the container at depth d+1 is an object */
    uint32_t seen;  /* declared properties written so far (gr_obj) */
    uint32_t cand;  /* L_PROP: names the key can still become */
    uint8_t depth;  /* open containers */
    uint8_t lex;
    uint8_t a, b;   /* per-state data, see the enum */
    uint8_t is_key; /* the current string is an object key */
    uint8_t top;    /* T_* restriction of the top-level value */
    uint8_t vtype;  /* T_* restriction of the declared property whose value comes next */
    uint8_t kpos;   /* L_PROP: bytes of the name matched */
    uint8_t num_int; /* the current number must be an integer */
} gr_state;

/* structural-tag phases */
enum { S_FREE, S_BEGIN, S_JSON, S_END, S_SEP, S_STOP, S_TERM };

typedef struct {
    char *begin, *end;
    uint32_t begin_len, end_len;
    int trigger;
    gr_schema schema;
} st_tag;

typedef struct {
    int n_tags, n_trig, n_excl, n_nodes; /* patterns n_trig.. of the automaton are excludes */
    st_tag *tags;
    uint32_t *trig_len;
    uint64_t *trig_tags; /* [n_trig]: the tags each trigger dispatches to */
    char *sep;           /* tags_with_separator: between two tags */
    uint32_t sep_len;
    bool with_sep;       /* tags_with_separator: tags only (no free text), `sep` between them */
    uint16_t *go;        /* [n_nodes * 256]: trigger automaton transitions */
    int16_t *done;       /* [n_nodes]: the trigger whose occurrence ends at this node, or -1 */
    bool at_least_one, stop_after_first;
} st_spec;

typedef struct {
    uint8_t phase;
    uint8_t tag;   /* S_JSON / S_END: the tag */
    uint8_t opt;   /* S_BEGIN: no tag at all is fine (an eos may come instead, at pos 0) */
    uint16_t node; /* S_FREE: trigger automaton node */
    uint32_t pos;  /* S_BEGIN / S_END / S_SEP: bytes of the begin / end / separator matched */
    uint64_t cand; /* S_BEGIN: tags whose begin still matches */
    gr_state js;   /* S_JSON */
} st_state;

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

static const char *const LITERALS[3] = {"true", "false", "null"};
static const uint8_t LITERAL_LEN[3] = {4, 5, 4};

/* ---- the JSON automaton ----------------------------------------------------------- */

static inline bool in_object(const gr_state *s) { return s->depth && ((s->stack >> (s->depth - 1)) & 1u); }

static inline void value_done(gr_state *s) { s->lex = s->depth ? L_AFTER : L_DONE; }

static inline bool number_can_end(uint8_t lex) {
    return lex == L_NUM_ZERO || lex == L_NUM_INT || lex == L_NUM_FRAC || lex == L_NUM_EXP_DIG;
}

/* In the declared object (its keys are constrained). */
static inline bool in_declared(const gr_obj *obj, const gr_state *s) { return obj && s->depth == 1; }

/* Start a value with byte c (state L_VALUE or L_ARR_FIRST). */
static bool start_value(const gr_obj *obj, gr_state *s, unsigned c) {
    uint8_t top = s->depth == 0 ? s->top : in_declared(obj, s) ? s->vtype : T_ANY;
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
        s->num_int = top == T_INTEGER;
        return true;
    default:
        if (c < '0' || c > '9') return false;
        if (top != T_ANY && top != T_NUMBER && top != T_INTEGER) return false;
        s->lex = c == '0' ? L_NUM_ZERO : L_NUM_INT;
        s->num_int = top == T_INTEGER;
        return true;
    }
}

static inline bool is_hex(unsigned c) {
    return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f') || (c >= 'A' && c <= 'F');
}

/* Close the current object with '}' (declared: only once every required key is written). */
static bool close_object(const gr_obj *obj, gr_state *s) {
    if (in_declared(obj, s) && (obj->required & ~s->seen)) return false;
    s->depth--;
    value_done(s);
    return true;
}

/* A key starts ('"' after '{' or ','). In the declared object it must become
 * one of the names not written yet; a ',' is only allowed while one is left,
 * so this never dead-ends. */
static bool start_key(const gr_obj *obj, gr_state *s) {
    if (in_declared(obj, s)) {
        uint32_t left = obj->all & ~s->seen;
        if (!left) return false;
        s->cand = left;
        s->kpos = 0;
        s->lex = L_PROP;
        return true;
    }
    s->lex = L_STR;
    s->is_key = 1;
    return true;
}

/* A byte after a complete value inside a container (L_AFTER). */
static bool after_value(const gr_obj *obj, gr_state *s, unsigned c) {
    bool object = in_object(s);
    if (c == ',') {
        if (object && in_declared(obj, s) && !(obj->all & ~s->seen)) return false;
        s->lex = object ? L_KEY : L_VALUE;
        return true;
    }
    if (object && c == '}') return close_object(obj, s);
    if (!object && c == ']') {
        s->depth--;
        value_done(s);
        return true;
    }
    return false;
}

/* The number ended before byte c: inside a container c continues the
 * container; at top level nothing may follow a number (compact output). */
static bool end_number(const gr_obj *obj, gr_state *s, unsigned c) {
    if (s->depth == 0) return false;
    s->lex = L_AFTER;
    return after_value(obj, s, c);
}

/* A byte of a declared property's name (L_PROP). */
static bool prop_byte(const gr_obj *obj, gr_state *s, unsigned c) {
    uint32_t cand = s->cand, keep = 0;
    if (c == '"') {
        for (int i = 0; i < obj->n; i++)
            if ((cand >> i) & 1u && obj->len[i] == s->kpos) {
                s->seen |= 1u << i;
                s->vtype = obj->type[i];
                s->lex = L_COLON;
                return true;
            }
        return false;
    }
    for (int i = 0; i < obj->n; i++)
        if ((cand >> i) & 1u && s->kpos < obj->len[i] && (unsigned char)obj->name[i][s->kpos] == c) keep |= 1u << i;
    if (!keep) return false;
    s->cand = keep;
    s->kpos++;
    return true;
}

/* Feed one byte; false when it cannot continue a valid (compact) JSON prefix.
 * On false the state is left in an unspecified state: callers feed a copy. */
static bool gr_feed(const gr_obj *obj, gr_state *s, unsigned c) {
    switch (s->lex) {
    case L_VALUE:
        return start_value(obj, s, c);
    case L_ARR_FIRST:
        if (c == ']') {
            s->depth--;
            value_done(s);
            return true;
        }
        return start_value(obj, s, c);
    case L_OBJ_FIRST:
        if (c == '}') return close_object(obj, s);
        /* fall through */
    case L_KEY:
        if (c != '"') return false;
        return start_key(obj, s);
    case L_PROP:
        return prop_byte(obj, s, c);
    case L_COLON:
        if (c != ':') return false;
        s->lex = L_VALUE;
        return true;
    case L_AFTER:
        return after_value(obj, s, c);
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
        if (c == '.' && !s->num_int) {
            s->lex = L_NUM_DOT;
            return true;
        }
        if ((c == 'e' || c == 'E') && !s->num_int) {
            s->lex = L_NUM_EXP;
            return true;
        }
        return end_number(obj, s, c);
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
        return end_number(obj, s, c);
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
        return end_number(obj, s, c);
    default:
        return false;
    }
}

/* The output may end here (an eos may follow). */
static inline bool gr_can_end(const gr_state *s) {
    return s->lex == L_DONE || (s->depth == 0 && number_can_end(s->lex));
}

static gr_state gr_initial(const gr_schema *sc) {
    gr_state s;
    memset(&s, 0, sizeof s);
    s.lex = L_VALUE;
    s.top = sc->top;
    return s;
}

/* ---- the structural-tag automaton --------------------------------------------------- */

static inline uint64_t st_all(const st_spec *sp) {
    return sp->n_tags == 64 ? UINT64_MAX : (((uint64_t)1 << sp->n_tags) - 1);
}

static void st_begin_settle(const st_spec *sp, st_state *s);

/* Any tag may start here (tags_with_separator; at_least_one's first tag). */
static void st_any_tag(const st_spec *sp, st_state *s, bool optional) {
    s->phase = S_BEGIN;
    s->cand = st_all(sp);
    s->pos = 0;
    s->opt = optional;
    st_begin_settle(sp, s);
}

static void st_after_tag(const st_spec *sp, st_state *s) {
    s->node = 0;
    s->pos = 0;
    if (sp->stop_after_first)
        s->phase = S_STOP;
    else if (!sp->with_sep)
        s->phase = S_FREE;
    else if (sp->sep_len)
        s->phase = S_SEP;
    else
        st_any_tag(sp, s, true);
}

static void st_enter_end(const st_spec *sp, st_state *s) {
    s->phase = S_END;
    s->pos = 0;
    if (sp->tags[s->tag].end_len == 0) st_after_tag(sp, s);
}

/* In S_BEGIN: once a candidate's whole begin is matched (begins are prefix-free,
 * so it is the only candidate left), its JSON starts. */
static void st_begin_settle(const st_spec *sp, st_state *s) {
    for (int i = 0; i < sp->n_tags; i++)
        if ((s->cand >> i) & 1u && sp->tags[i].begin_len == s->pos) {
            s->phase = S_JSON;
            s->tag = (uint8_t)i;
            s->js = gr_initial(&sp->tags[i].schema);
            return;
        }
}

/* Feed one byte of a token (ctrl: the token is a CONTROL token). */
static bool st_feed(const st_spec *sp, st_state *s, unsigned c, bool ctrl) {
    switch (s->phase) {
    case S_FREE: {
        uint16_t n = sp->go[(size_t)s->node * 256 + c];
        s->node = n;
        int t = sp->done[n];
        if (t >= sp->n_trig) return false; /* an excluded string */
        if (t >= 0) {
            s->phase = S_BEGIN;
            s->cand = sp->trig_tags[t];
            s->pos = sp->trig_len[t];
            s->opt = 0;
            st_begin_settle(sp, s);
        }
        return true;
    }
    case S_BEGIN: {
        uint64_t keep = 0;
        for (int i = 0; i < sp->n_tags; i++) {
            const st_tag *t = &sp->tags[i];
            if ((s->cand >> i) & 1u && s->pos < t->begin_len && (unsigned char)t->begin[s->pos] == c)
                keep |= (uint64_t)1 << i;
        }
        if (!keep) return false;
        s->cand = keep;
        s->pos++;
        st_begin_settle(sp, s);
        return true;
    }
    case S_JSON: {
        if (ctrl) return false; /* markers are never JSON */
        const st_tag *t = &sp->tags[s->tag];
        gr_state js = s->js;
        if (gr_feed(t->schema.obj, &js, c)) {
            s->js = js;
            if (js.lex == L_DONE) st_enter_end(sp, s);
            return true;
        }
        /* a top-level number ends where its continuation does not: the end string
         * goes on from here (creation refused ends that could continue a number) */
        if (s->js.depth == 0 && number_can_end(s->js.lex)) {
            st_enter_end(sp, s);
            return s->phase == S_END && st_feed(sp, s, c, ctrl);
        }
        return false;
    }
    case S_END: {
        const st_tag *t = &sp->tags[s->tag];
        if ((unsigned char)t->end[s->pos] != c) return false;
        if (++s->pos == t->end_len) st_after_tag(sp, s);
        return true;
    }
    case S_SEP:
        if ((unsigned char)sp->sep[s->pos] != c) return false;
        if (++s->pos == sp->sep_len) st_any_tag(sp, s, false);
        return true;
    default:
        return false; /* S_STOP (an eos only), S_TERM */
    }
}

static inline bool st_eos_ok(const st_state *s) {
    return s->phase == S_FREE || s->phase == S_STOP || s->phase == S_TERM || (s->phase == S_SEP && s->pos == 0) ||
           (s->phase == S_BEGIN && s->opt && s->pos == 0);
}

/* ---- schemas ---------------------------------------------------------------------- */

/* printable, truncated copy of a key for messages */
static void key_name(char *out, size_t cap, const char *key, size_t len) {
    size_t n = 0;
    for (size_t k = 0; k < len && n < cap - 1; k++) {
        unsigned char c = (unsigned char)key[k];
        out[n++] = (c >= 0x20 && c != 0x7f) ? (char)c : '?';
    }
    out[n] = 0;
}

static bool key_is(const json_member *m, const char *name) {
    return m->key_len == strlen(name) && memcmp(m->key, name, m->key_len) == 0;
}

static bool is_annotation(const json_member *m) {
    static const char *const ANN[] = {"description", "title", "default", "examples", "$schema", "$id", "$comment"};
    for (size_t i = 0; i < sizeof ANN / sizeof *ANN; i++)
        if (key_is(m, ANN[i])) return true;
    /* llguidance's options: only the compact output this grammar produces anyway
     * ({"whitespace_flexible": false}); any other option is the host's to honour */
    if (key_is(m, "x-guidance") && m->value.type == JSON_OBJECT) {
        bool b = true;
        for (size_t i = 0; i < m->value.u.obj.n; i++) {
            const json_member *o = &m->value.u.obj.members[i];
            if (!key_is(o, "whitespace_flexible") || !json_bool(&o->value, &b) || b) return false;
        }
        return true;
    }
    return false;
}

/* T_* of a single type name, or T_ANY when it is not one */
static uint8_t type_of(const json_value *v) {
    static const char *const TYPES[] = {"object", "array", "string", "number", "integer", "boolean", "null"};
    const char *t = json_string(v);
    for (size_t k = 0; t && k < sizeof TYPES / sizeof *TYPES; k++)
        if (v->u.str.len == strlen(TYPES[k]) && strcmp(t, TYPES[k]) == 0) return (uint8_t)(k + 1);
    return T_ANY;
}

static int unsupported_key(const char *fn, const char *where, const json_member *m) {
    char name[64];
    key_name(name, sizeof name, m->key, m->key_len);
    rt_set_error(BASERT_ERR_UNSUPPORTED,
                 "%s: schema keyword \"%s\"%s is not supported by the reference engine's grammar (only {}, "
                 "{\"type\": ...} and one level of properties/required)",
                 fn, name, where);
    return BASERT_ERR_UNSUPPORTED;
}

static int bad_type(const char *fn) {
    /* a list of types, or a name this grammar does not know: the host backend decides */
    rt_set_error(BASERT_ERR_UNSUPPORTED,
                 "%s: schema keyword \"type\" with this value is not supported (only a single type name)", fn);
    return BASERT_ERR_UNSUPPORTED;
}

/* A property's schema: {} / true / {"type": X} (+ annotations) -> its T_*. */
static int prop_type(const char *fn, const json_value *v, uint8_t *out) {
    bool b;
    *out = T_ANY;
    if (json_bool(v, &b)) {
        if (b) return BASERT_OK;
        rt_set_error(BASERT_ERR_UNSUPPORTED, "%s: a property schema `false` is not supported", fn);
        return BASERT_ERR_UNSUPPORTED;
    }
    if (!v || v->type != JSON_OBJECT) {
        rt_set_error(BASERT_ERR_UNSUPPORTED, "%s: a property schema that is not an object is not supported", fn);
        return BASERT_ERR_UNSUPPORTED;
    }
    for (size_t i = 0; i < v->u.obj.n; i++) {
        const json_member *m = &v->u.obj.members[i];
        if (key_is(m, "type")) {
            if ((*out = type_of(&m->value)) == T_ANY) return bad_type(fn);
        } else if (!is_annotation(m)) {
            return unsupported_key(fn, " in a property", m);
        }
    }
    return BASERT_OK;
}

static int schema_compile(const char *fn, const json_value *root, gr_schema *out) {
    out->top = T_ANY;
    out->obj = NULL;
    bool b;
    if (json_bool(root, &b)) {
        if (b) return BASERT_OK;
        rt_set_error(BASERT_ERR_UNSUPPORTED, "%s: the schema `false` (matches nothing) is not supported", fn);
        return BASERT_ERR_UNSUPPORTED;
    }
    if (!root || root->type != JSON_OBJECT) {
        rt_set_error(BASERT_ERR_UNSUPPORTED, "%s: a schema that is not an object or `true` is not supported", fn);
        return BASERT_ERR_UNSUPPORTED;
    }
    const json_value *props = NULL, *required = NULL;
    bool declared = false;
    for (size_t i = 0; i < root->u.obj.n; i++) {
        const json_member *m = &root->u.obj.members[i];
        if (key_is(m, "type")) {
            if ((out->top = type_of(&m->value)) == T_ANY) return bad_type(fn);
        } else if (key_is(m, "properties")) {
            props = &m->value;
            declared = true;
        } else if (key_is(m, "required")) {
            required = &m->value;
            declared = true;
        } else if (key_is(m, "additionalProperties")) {
            if (!json_bool(&m->value, &b) || b) {
                rt_set_error(BASERT_ERR_UNSUPPORTED,
                             "%s: schema keyword \"additionalProperties\" is only supported as false", fn);
                return BASERT_ERR_UNSUPPORTED;
            }
            declared = true;
        } else if (!is_annotation(m)) {
            return unsupported_key(fn, "", m);
        }
    }
    if (!declared) return BASERT_OK;
    if (out->top != T_ANY && out->top != T_OBJECT) {
        rt_set_error(BASERT_ERR_UNSUPPORTED, "%s: properties/required with a non-object \"type\" are not supported",
                     fn);
        return BASERT_ERR_UNSUPPORTED;
    }
    if ((props && props->type != JSON_OBJECT) || (required && required->type != JSON_ARRAY)) {
        rt_set_error(BASERT_ERR_UNSUPPORTED, "%s: \"properties\" must be an object and \"required\" an array", fn);
        return BASERT_ERR_UNSUPPORTED;
    }
    size_t n = props ? props->u.obj.n : 0;
    if (n > GR_MAX_PROPS) {
        rt_set_error(BASERT_ERR_UNSUPPORTED, "%s: \"properties\" with more than %d names is not supported", fn,
                     GR_MAX_PROPS);
        return BASERT_ERR_UNSUPPORTED;
    }
    gr_obj *obj = calloc(1, sizeof *obj);
    if (!obj) {
        rt_set_error(BASERT_ERR_OUT_OF_MEMORY, "%s: out of memory", fn);
        return BASERT_ERR_OUT_OF_MEMORY;
    }
    for (size_t i = 0; i < n; i++) {
        const json_member *m = &props->u.obj.members[i];
        bool plain = m->key_len > 0 && m->key_len < GR_MAX_NAME;
        for (size_t k = 0; plain && k < m->key_len; k++) {
            unsigned char c = (unsigned char)m->key[k];
            plain = c >= 0x20 && c != '"' && c != '\\';
        }
        for (size_t j = 0; plain && j < i; j++)
            plain = !(obj->len[j] == m->key_len && memcmp(obj->name[j], m->key, m->key_len) == 0);
        if (!plain) {
            free(obj);
            rt_set_error(BASERT_ERR_UNSUPPORTED,
                         "%s: property names must be unique, 1-%d bytes, without quotes, backslashes or control "
                         "characters",
                         fn, GR_MAX_NAME - 1);
            return BASERT_ERR_UNSUPPORTED;
        }
        int rc = prop_type(fn, &m->value, &obj->type[i]);
        if (rc != BASERT_OK) {
            free(obj);
            return rc;
        }
        memcpy(obj->name[i], m->key, m->key_len);
        obj->len[i] = (uint8_t)m->key_len;
    }
    obj->n = (int)n;
    obj->all = n == 32 ? UINT32_MAX : (((uint32_t)1 << n) - 1);
    for (size_t r = 0; required && r < required->u.arr.n; r++) {
        const json_value *v = &required->u.arr.items[r];
        const char *name = json_string(v);
        int hit = -1;
        for (int i = 0; name && i < obj->n; i++)
            if (obj->len[i] == v->u.str.len && memcmp(obj->name[i], name, v->u.str.len) == 0) hit = i;
        if (hit < 0) {
            free(obj);
            rt_set_error(BASERT_ERR_UNSUPPORTED,
                         "%s: schema keyword \"required\" names something that is not a declared property", fn);
            return BASERT_ERR_UNSUPPORTED;
        }
        obj->required |= 1u << hit;
    }
    out->top = T_OBJECT;
    out->obj = obj;
    return BASERT_OK;
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

static void st_free(st_spec *sp) {
    if (!sp) return;
    for (int i = 0; sp->tags && i < sp->n_tags; i++) {
        free(sp->tags[i].begin);
        free(sp->tags[i].end);
        free(sp->tags[i].schema.obj);
    }
    free(sp->tags);
    free(sp->trig_len);
    free(sp->trig_tags);
    free(sp->sep);
    free(sp->go);
    free(sp->done);
    free(sp);
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

/* ---- structural tags: parsing and the trigger automaton ----------------------------- */

static int st_fail(const char *fn, int code, const char *why) {
    rt_set_error(code, "%s: %s", fn, why);
    return code;
}

static int st_text(const char *fn, const json_value *v, const char *what, char **out, uint32_t *len) {
    if (v && v->type == JSON_ARRAY && v->u.arr.n == 1) v = &v->u.arr.items[0];
    const char *s = json_string(v);
    if (!s) {
        rt_set_error(BASERT_ERR_INVALID_ARGUMENT, "%s: a tag's \"%s\" must be a string", fn, what);
        return BASERT_ERR_INVALID_ARGUMENT;
    }
    if (v->u.str.len > ST_MAX_TEXT) {
        rt_set_error(BASERT_ERR_UNSUPPORTED, "%s: a tag's \"%s\" is longer than %d bytes", fn, what, ST_MAX_TEXT);
        return BASERT_ERR_UNSUPPORTED;
    }
    *out = malloc(v->u.str.len + 1);
    if (!*out) return st_fail(fn, BASERT_ERR_OUT_OF_MEMORY, "out of memory");
    memcpy(*out, s, v->u.str.len + 1);
    *len = (uint32_t)v->u.str.len;
    return BASERT_OK;
}

static bool starts_with(const char *s, uint32_t n, const char *p, uint32_t m) { return m <= n && memcmp(s, p, m) == 0; }

/* One tag: {"begin", "content": {"type": "json_schema", "json_schema": S}, "end"}
 * or (legacy) {"begin", "schema": S, "end"}. */
static int st_tag_parse(const char *fn, const json_value *v, bool legacy, st_tag *t) {
    if (!v || v->type != JSON_OBJECT) return st_fail(fn, BASERT_ERR_INVALID_ARGUMENT, "a tag must be an object");
    const char *type = json_string(json_get(v, "type"));
    if (type && strcmp(type, "tag") != 0)
        return st_fail(fn, BASERT_ERR_UNSUPPORTED, "only tags of type \"tag\" are supported");
    int rc = st_text(fn, json_get(v, "begin"), "begin", &t->begin, &t->begin_len);
    if (rc == BASERT_OK) rc = st_text(fn, json_get(v, "end"), "end", &t->end, &t->end_len);
    if (rc != BASERT_OK) return rc;
    const json_value *schema;
    if (legacy) {
        schema = json_get(v, "schema");
    } else {
        const json_value *content = json_get(v, "content");
        const char *ctype = json_string(json_get(content, "type"));
        if (!ctype) return st_fail(fn, BASERT_ERR_INVALID_ARGUMENT, "a tag needs a \"content\" with a \"type\"");
        if (strcmp(ctype, "json_schema") != 0)
            return st_fail(fn, BASERT_ERR_UNSUPPORTED, "only json_schema tag contents are supported");
        schema = json_get(content, "json_schema");
    }
    if (!schema) return st_fail(fn, BASERT_ERR_INVALID_ARGUMENT, "a tag's content needs a JSON schema");
    rc = schema_compile(fn, schema, &t->schema);
    if (rc != BASERT_OK) return rc;
    uint8_t top = t->schema.top;
    if ((top == T_ANY || top == T_NUMBER || top == T_INTEGER) &&
        (t->end_len == 0 || strchr("0123456789.eE+-", t->end[0])))
        return st_fail(fn, BASERT_ERR_UNSUPPORTED,
                       "a tag whose JSON may be a number needs an end string that cannot continue the number");
    return BASERT_OK;
}

/* The trigger automaton (Aho-Corasick): go[node][byte], done[node]. */
/* Pattern i of the free-text automaton: the triggers, then the excludes. */
static const json_value *st_pattern(const st_spec *sp, const json_value *trigs, const json_value *excl, int i) {
    return i < sp->n_trig ? &trigs->u.arr.items[i] : &excl->u.arr.items[i - sp->n_trig];
}

/* The free-text automaton (Aho-Corasick over the triggers and the excludes):
 * go[node][byte], done[node] = the pattern whose occurrence ends there. */
static int st_build_triggers(const char *fn, st_spec *sp, const json_value *trigs, const json_value *excl) {
    size_t total = 0;
    int n_pat = sp->n_trig + sp->n_excl;
    for (int i = 0; i < n_pat; i++) {
        const json_value *v = st_pattern(sp, trigs, excl, i);
        if (!json_string(v) || v->u.str.len == 0)
            return st_fail(fn, BASERT_ERR_INVALID_ARGUMENT, "triggers and excludes must be non-empty strings");
        total += v->u.str.len;
    }
    if (total > ST_MAX_TRIGGER_BYTES) return st_fail(fn, BASERT_ERR_UNSUPPORTED, "the triggers are too long");
    size_t cap = total + 1;
    sp->go = malloc(cap * 256 * sizeof *sp->go);
    sp->done = malloc(cap * sizeof *sp->done);
    int16_t *own = malloc(cap * sizeof *own);
    uint16_t *fail = calloc(cap, sizeof *fail), *queue = malloc(cap * sizeof *queue);
    sp->trig_len = calloc(n_pat ? (size_t)n_pat : 1, sizeof *sp->trig_len);
    if (!sp->go || !sp->done || !own || !fail || !queue || !sp->trig_len) {
        free(own), free(fail), free(queue);
        return st_fail(fn, BASERT_ERR_OUT_OF_MEMORY, "out of memory");
    }
    const uint16_t NONE = UINT16_MAX;
    for (size_t k = 0; k < cap * 256; k++) sp->go[k] = NONE;
    for (size_t k = 0; k < cap; k++) own[k] = -1;
    int n = 1;
    int rc = BASERT_OK;
    for (int i = 0; i < n_pat && rc == BASERT_OK; i++) {
        const json_value *v = st_pattern(sp, trigs, excl, i);
        const unsigned char *s = (const unsigned char *)v->u.str.s;
        sp->trig_len[i] = (uint32_t)v->u.str.len;
        int u = 0;
        for (size_t k = 0; k < v->u.str.len; k++) {
            if (own[u] >= 0) break; /* an earlier trigger is a prefix of this one */
            uint16_t *e = &sp->go[(size_t)u * 256 + s[k]];
            if (*e == NONE) *e = (uint16_t)n++;
            u = *e;
        }
        bool has_child = false;
        for (int c = 0; c < 256 && !has_child; c++) has_child = sp->go[(size_t)u * 256 + c] != NONE;
        if (own[u] >= 0 || has_child)
            rc = st_fail(fn, BASERT_ERR_INVALID_ARGUMENT, "no trigger (or exclude) may be a prefix of another");
        else
            own[u] = (int16_t)i;
    }
    if (rc == BASERT_OK) {
        int head = 0, tail = 0;
        sp->done[0] = -1;
        for (int c = 0; c < 256; c++) {
            uint16_t *e = &sp->go[c];
            if (*e == NONE) {
                *e = 0;
            } else {
                fail[*e] = 0;
                sp->done[*e] = own[*e];
                queue[tail++] = *e;
            }
        }
        while (head < tail) {
            int u = queue[head++];
            for (int c = 0; c < 256; c++) {
                uint16_t *e = &sp->go[(size_t)u * 256 + c];
                uint16_t via_fail = sp->go[(size_t)fail[u] * 256 + c];
                if (*e == NONE) {
                    *e = via_fail;
                } else {
                    int v = *e;
                    fail[v] = via_fail;
                    sp->done[v] = own[v] >= 0 ? own[v] : sp->done[via_fail];
                    queue[tail++] = (uint16_t)v;
                }
            }
        }
        sp->n_nodes = n;
    }
    free(own), free(fail), free(queue);
    return rc;
}

static int st_parse(const char *fn, const json_value *root, st_spec *sp) {
    if (!root || root->type != JSON_OBJECT)
        return st_fail(fn, BASERT_ERR_INVALID_ARGUMENT, "the structural tag must be a JSON object");
    const char *type = json_string(json_get(root, "type"));
    const json_value *fmt = root, *tags;
    bool legacy = false;
    if (type && strcmp(type, "structural_tag") == 0) {
        if (json_get(root, "structures")) {
            legacy = true;
        } else {
            fmt = json_get(root, "format");
            type = json_string(json_get(fmt, "type"));
        }
    }
    const json_value *excl = NULL;
    bool any_text = false;
    if (!legacy) {
        if (!type) return st_fail(fn, BASERT_ERR_INVALID_ARGUMENT, "the structural tag has no format \"type\"");
        sp->with_sep = strcmp(type, "tags_with_separator") == 0;
        any_text = strcmp(type, "any_text") == 0;
        if (strcmp(type, "triggered_tags") != 0 && !sp->with_sep && !any_text)
            return st_fail(fn, BASERT_ERR_UNSUPPORTED,
                           "only the \"triggered_tags\", \"tags_with_separator\" and \"any_text\" formats (and the "
                           "legacy structures form) are supported");
        excl = json_get(fmt, "excludes");
        if (excl && (excl->type != JSON_ARRAY || sp->with_sep))
            return st_fail(fn, BASERT_ERR_INVALID_ARGUMENT, "\"excludes\" must be an array (of free-text formats)");
        if (excl && excl->u.arr.n > ST_MAX_TRIGGERS) return st_fail(fn, BASERT_ERR_UNSUPPORTED, "too many excludes");
        sp->n_excl = excl ? (int)excl->u.arr.n : 0;
        if (any_text) { /* free text without the excluded strings; budgets are not supported */
            const json_value *mt = json_get(fmt, "max_tokens"), *mc = json_get(fmt, "max_chars");
            if ((mt && mt->type != JSON_NULL) || (mc && mc->type != JSON_NULL))
                return st_fail(fn, BASERT_ERR_UNSUPPORTED, "any_text max_tokens / max_chars are not supported");
            return st_build_triggers(fn, sp, NULL, excl);
        }
        const json_value *v;
        if ((v = json_get(fmt, "at_least_one")) && !json_bool(v, &sp->at_least_one))
            return st_fail(fn, BASERT_ERR_INVALID_ARGUMENT, "at_least_one must be a boolean");
        if ((v = json_get(fmt, "stop_after_first")) && !json_bool(v, &sp->stop_after_first))
            return st_fail(fn, BASERT_ERR_INVALID_ARGUMENT, "stop_after_first must be a boolean");
    }
    tags = json_get(fmt, legacy ? "structures" : "tags");
    if (!tags || tags->type != JSON_ARRAY) return st_fail(fn, BASERT_ERR_INVALID_ARGUMENT, "a structural tag needs tags");
    if (tags->u.arr.n == 0 || tags->u.arr.n > ST_MAX_TAGS)
        return st_fail(fn, BASERT_ERR_UNSUPPORTED, "1-64 tags are supported");
    sp->n_tags = (int)tags->u.arr.n;
    sp->tags = calloc((size_t)sp->n_tags, sizeof *sp->tags);
    if (!sp->tags) return st_fail(fn, BASERT_ERR_OUT_OF_MEMORY, "out of memory");
    const json_value *trigs = NULL;
    int rc = BASERT_OK;
    if (sp->with_sep) { /* tags only: the separator between them; a one-node (unused) trigger automaton */
        const json_value *sep = json_get(fmt, "separator");
        rc = st_text(fn, sep ? sep : &(json_value){.type = JSON_NULL}, "separator", &sp->sep, &sp->sep_len);
        sp->n_nodes = 1;
        sp->go = calloc(256, sizeof *sp->go);
        sp->done = malloc(sizeof *sp->done);
        if (rc == BASERT_OK && (!sp->go || !sp->done)) rc = st_fail(fn, BASERT_ERR_OUT_OF_MEMORY, "out of memory");
        if (rc == BASERT_OK) sp->done[0] = -1;
    } else {
        trigs = json_get(fmt, "triggers");
        if (!trigs || trigs->type != JSON_ARRAY)
            return st_fail(fn, BASERT_ERR_INVALID_ARGUMENT, "triggered tags need a \"triggers\" array");
        if (trigs->u.arr.n == 0 || trigs->u.arr.n > ST_MAX_TRIGGERS)
            return st_fail(fn, BASERT_ERR_UNSUPPORTED, "1-16 triggers are supported");
        sp->n_trig = (int)trigs->u.arr.n;
        sp->trig_tags = calloc((size_t)sp->n_trig, sizeof *sp->trig_tags);
        rc = sp->trig_tags ? st_build_triggers(fn, sp, trigs, excl)
                           : st_fail(fn, BASERT_ERR_OUT_OF_MEMORY, "out of memory");
    }
    for (int i = 0; i < sp->n_tags && rc == BASERT_OK; i++)
        rc = st_tag_parse(fn, &tags->u.arr.items[i], legacy, &sp->tags[i]);
    if (rc != BASERT_OK) return rc;
    for (int i = 0; i < sp->n_tags; i++) {
        st_tag *t = &sp->tags[i];
        t->trigger = -1;
        for (int k = 0; k < sp->n_trig; k++) {
            const json_value *v = &trigs->u.arr.items[k];
            if (!starts_with(t->begin, t->begin_len, v->u.str.s, (uint32_t)v->u.str.len)) continue;
            if (t->trigger >= 0)
                return st_fail(fn, BASERT_ERR_INVALID_ARGUMENT, "a tag's begin starts with two triggers");
            t->trigger = k;
        }
        if (t->trigger < 0 && !sp->with_sep)
            return st_fail(fn, BASERT_ERR_INVALID_ARGUMENT, "a tag's begin starts with no trigger");
        if (t->trigger >= 0) sp->trig_tags[t->trigger] |= (uint64_t)1 << i;
        for (int j = 0; j < i; j++) {
            const st_tag *o = &sp->tags[j];
            if (starts_with(t->begin, t->begin_len, o->begin, o->begin_len) ||
                starts_with(o->begin, o->begin_len, t->begin, t->begin_len))
                return st_fail(fn, BASERT_ERR_INVALID_ARGUMENT, "no tag's begin may be a prefix of another's");
        }
    }
    for (int k = 0; k < sp->n_trig; k++) /* a trigger nothing can follow would dead-end the output */
        if (!sp->trig_tags[k]) return st_fail(fn, BASERT_ERR_INVALID_ARGUMENT, "every trigger needs a tag");
    return BASERT_OK;
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
    int rc = schema_compile(fn, json_root(doc), &sc);
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
