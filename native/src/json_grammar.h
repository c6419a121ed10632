/* The JSON grammar's byte-level automaton: types, one step, the initial state.
 * json_schema compiles a schema into a gr_schema for it; structural_tag runs it
 * inside a tag's JSON region; grammar runs it over the vocabulary. */
#ifndef BASERT_REF_JSON_GRAMMAR_H
#define BASERT_REF_JSON_GRAMMAR_H

#include <stdbool.h>
#include <stdint.h>

#define GR_MAX_DEPTH 64
#define GR_MAX_PROPS 32  /* object properties a schema may declare (a 32-bit seen/candidate set) */
#define GR_MAX_NAME 64   /* bytes of a property name */

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

/* Feed one byte; false when the grammar rejects it (the state is then undefined). */
bool gr_feed(const gr_obj *obj, gr_state *s, unsigned c);
/* The state before the first byte of a value under sc. */
gr_state gr_initial(const gr_schema *sc);

static inline bool number_can_end(uint8_t lex) {
    return lex == L_NUM_ZERO || lex == L_NUM_INT || lex == L_NUM_FRAC || lex == L_NUM_EXP_DIG;
}

/* The output may end here (an eos may follow). */
static inline bool gr_can_end(const gr_state *s) {
    return s->lex == L_DONE || (s->depth == 0 && number_can_end(s->lex));
}

#endif
