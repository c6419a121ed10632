/* The JSON grammar's automaton. The JSON grammar accepts exactly ONE JSON value (RFC 8259: objects, arrays,
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
 */

#include "json_grammar.h"

#include <string.h>

static const char *const LITERALS[3] = {"true", "false", "null"};
static const uint8_t LITERAL_LEN[3] = {4, 5, 4};

/* ---- the JSON automaton ----------------------------------------------------------- */

static inline bool in_object(const gr_state *s) { return s->depth && ((s->stack >> (s->depth - 1)) & 1u); }

static inline void value_done(gr_state *s) { s->lex = s->depth ? L_AFTER : L_DONE; }


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
bool gr_feed(const gr_obj *obj, gr_state *s, unsigned c) {
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


gr_state gr_initial(const gr_schema *sc) {
    gr_state s;
    memset(&s, 0, sizeof s);
    s.lex = L_VALUE;
    s.top = sc->top;
    return s;
}
