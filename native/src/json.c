/* JSON DOM parser and writer (see json.h). Values and strings live in an arena
 * owned by the document; while a container is open its children wait on a
 * shared stack and move into the arena, exactly sized, when it closes. */

#include "json.h"

#include <locale.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- arena ---------------------------------------------------------------- */

typedef struct arena_chunk {
    struct arena_chunk *next;
    size_t used, cap;
    _Alignas(max_align_t) unsigned char data[];
} arena_chunk;

struct json_doc {
    arena_chunk *chunks;
    json_value root;
};

#define ARENA_CHUNK_MIN ((size_t)64 * 1024)

static void *arena_alloc(json_doc *doc, size_t size) {
    size = (size + 15) & ~(size_t)15;
    arena_chunk *c = doc->chunks;
    if (!c || c->cap - c->used < size) {
        size_t cap = size > ARENA_CHUNK_MIN ? size : ARENA_CHUNK_MIN;
        c = malloc(sizeof *c + cap);
        if (!c) return NULL;
        c->next = doc->chunks;
        c->used = 0;
        c->cap = cap;
        doc->chunks = c;
    }
    void *p = c->data + c->used;
    c->used += size;
    return p;
}

/* ---- parser ---------------------------------------------------------------- */

typedef struct {
    const unsigned char *p, *end, *start;
    json_doc *doc;
    json_value *vals; /* children of open arrays */
    size_t n_vals, cap_vals;
    json_member *mems; /* members of open objects */
    size_t n_mems, cap_mems;
    char *err;
    size_t errlen;
    bool failed;
} parser;

static bool fail(parser *ps, const char *what) {
    if (!ps->failed) {
        ps->failed = true;
        if (ps->err && ps->errlen) snprintf(ps->err, ps->errlen, "byte %zu: %s", (size_t)(ps->p - ps->start), what);
    }
    return false;
}

static void skip_ws(parser *ps) {
    while (ps->p < ps->end && (*ps->p == ' ' || *ps->p == '\t' || *ps->p == '\n' || *ps->p == '\r')) ps->p++;
}

static bool literal(parser *ps, const char *word, size_t n) {
    if ((size_t)(ps->end - ps->p) < n || memcmp(ps->p, word, n) != 0) return fail(ps, "invalid literal");
    ps->p += n;
    return true;
}

static int hex4(const unsigned char *s) {
    int v = 0;
    for (int i = 0; i < 4; i++) {
        int c = s[i], d;
        if (c >= '0' && c <= '9') d = c - '0';
        else if (c >= 'a' && c <= 'f') d = c - 'a' + 10;
        else if (c >= 'A' && c <= 'F') d = c - 'A' + 10;
        else return -1;
        v = v * 16 + d;
    }
    return v;
}

static size_t utf8_put(unsigned char *out, uint32_t cp) {
    if (cp < 0x80) {
        out[0] = (unsigned char)cp;
        return 1;
    }
    if (cp < 0x800) {
        out[0] = (unsigned char)(0xC0 | (cp >> 6));
        out[1] = (unsigned char)(0x80 | (cp & 0x3F));
        return 2;
    }
    if (cp < 0x10000) {
        out[0] = (unsigned char)(0xE0 | (cp >> 12));
        out[1] = (unsigned char)(0x80 | ((cp >> 6) & 0x3F));
        out[2] = (unsigned char)(0x80 | (cp & 0x3F));
        return 3;
    }
    out[0] = (unsigned char)(0xF0 | (cp >> 18));
    out[1] = (unsigned char)(0x80 | ((cp >> 12) & 0x3F));
    out[2] = (unsigned char)(0x80 | ((cp >> 6) & 0x3F));
    out[3] = (unsigned char)(0x80 | (cp & 0x3F));
    return 4;
}

/* Length of the well-formed UTF-8 sequence at s (at most n bytes), 0 if none. */
static size_t utf8_seq_len(const unsigned char *s, size_t n) {
    unsigned char c = s[0];
    if (c < 0x80) return 1;
    size_t len;
    unsigned char lo = 0x80, hi = 0xBF;
    if (c >= 0xC2 && c <= 0xDF) len = 2;
    else if (c >= 0xE0 && c <= 0xEF) {
        len = 3;
        if (c == 0xE0) lo = 0xA0;      /* overlong */
        else if (c == 0xED) hi = 0x9F; /* surrogates */
    } else if (c >= 0xF0 && c <= 0xF4) {
        len = 4;
        if (c == 0xF0) lo = 0x90;      /* overlong */
        else if (c == 0xF4) hi = 0x8F; /* > U+10FFFF */
    } else return 0;
    if (n < len) return 0;
    if (s[1] < lo || s[1] > hi) return 0;
    for (size_t i = 2; i < len; i++)
        if ((s[i] & 0xC0) != 0x80) return 0;
    return len;
}

bool json_utf8_valid(const char *s, size_t n) {
    const unsigned char *p = (const unsigned char *)s;
    size_t i = 0;
    while (i < n) {
        size_t l = utf8_seq_len(p + i, n - i);
        if (!l) return false;
        i += l;
    }
    return true;
}

/* Parse a string at ps->p (the opening quote) into arena memory. */
static bool parse_string(parser *ps, const char **out, size_t *out_len) {
    ps->p++; /* opening quote */
    /* Find the closing quote first: the decoded text is never longer than the raw. */
    const unsigned char *q = ps->p;
    while (q < ps->end && *q != '"') q += (*q == '\\' && q + 1 < ps->end) ? 2 : 1;
    if (q >= ps->end) return fail(ps, "unterminated string");
    size_t raw = (size_t)(q - ps->p);
    unsigned char *buf = arena_alloc(ps->doc, raw + 1);
    if (!buf) return fail(ps, "out of memory");
    size_t n = 0;
    while (ps->p < q) {
        unsigned char c = *ps->p;
        if (c == '\\') {
            unsigned char e = ps->p[1]; /* ps->p + 1 < q: an escape never ends before the quote */
            ps->p += 2;
            switch (e) {
            case '"': buf[n++] = '"'; break;
            case '\\': buf[n++] = '\\'; break;
            case '/': buf[n++] = '/'; break;
            case 'b': buf[n++] = '\b'; break;
            case 'f': buf[n++] = '\f'; break;
            case 'n': buf[n++] = '\n'; break;
            case 'r': buf[n++] = '\r'; break;
            case 't': buf[n++] = '\t'; break;
            case 'u': {
                if (q - ps->p < 4) return fail(ps, "truncated \\u escape");
                int hi = hex4(ps->p);
                if (hi < 0) return fail(ps, "bad \\u escape");
                ps->p += 4;
                uint32_t cp = (uint32_t)hi;
                if (cp >= 0xDC00 && cp <= 0xDFFF) return fail(ps, "lone low surrogate in \\u escape");
                if (cp >= 0xD800 && cp <= 0xDBFF) {
                    if (q - ps->p < 6 || ps->p[0] != '\\' || ps->p[1] != 'u')
                        return fail(ps, "lone high surrogate in \\u escape");
                    int lo = hex4(ps->p + 2);
                    if (lo < 0xDC00 || lo > 0xDFFF) return fail(ps, "bad low surrogate in \\u escape");
                    ps->p += 6;
                    cp = 0x10000 + ((cp - 0xD800) << 10) + ((uint32_t)lo - 0xDC00);
                }
                /* \uXXXX takes 6 raw bytes and yields at most 3 (4 for a 12-byte pair). */
                n += utf8_put(buf + n, cp);
                break;
            }
            default: ps->p -= 1; return fail(ps, "bad escape");
            }
        } else if (c < 0x20) {
            return fail(ps, "control character in string");
        } else if (c < 0x80) {
            buf[n++] = c;
            ps->p++;
        } else {
            size_t l = utf8_seq_len(ps->p, (size_t)(q - ps->p));
            if (!l) return fail(ps, "invalid UTF-8 in string");
            memcpy(buf + n, ps->p, l);
            n += l;
            ps->p += l;
        }
    }
    ps->p = q + 1;
    buf[n] = '\0';
    *out = (const char *)buf;
    *out_len = n;
    return true;
}

static locale_t g_c_locale;
static pthread_once_t g_c_locale_once = PTHREAD_ONCE_INIT;
static void make_c_locale(void) { g_c_locale = newlocale(LC_NUMERIC_MASK, "C", (locale_t)0); }

static bool parse_number(parser *ps, json_value *v) {
    const unsigned char *s = ps->p, *p = s;
    bool neg = false, integral = true;
    if (p < ps->end && *p == '-') {
        neg = true;
        p++;
    }
    if (p >= ps->end || *p < '0' || *p > '9') return fail(ps, "invalid number");
    if (*p == '0') p++;
    else
        while (p < ps->end && *p >= '0' && *p <= '9') p++;
    if (p < ps->end && *p == '.') {
        integral = false;
        p++;
        if (p >= ps->end || *p < '0' || *p > '9') return fail(ps, "invalid number: digit expected after '.'");
        while (p < ps->end && *p >= '0' && *p <= '9') p++;
    }
    if (p < ps->end && (*p == 'e' || *p == 'E')) {
        integral = false;
        p++;
        if (p < ps->end && (*p == '+' || *p == '-')) p++;
        if (p >= ps->end || *p < '0' || *p > '9') return fail(ps, "invalid number: digit expected in exponent");
        while (p < ps->end && *p >= '0' && *p <= '9') p++;
    }
    size_t n = (size_t)(p - s);
    if (n > 512) return fail(ps, "number too long");
    char tmp[520];
    memcpy(tmp, s, n);
    tmp[n] = '\0';

    v->type = JSON_NUMBER;
    v->is_int = false;
    if (integral) {
        /* Exact int64 when it fits (tensor offsets must not round through a double). */
        uint64_t mag = 0;
        bool overflow = false;
        for (const char *d = tmp + (neg ? 1 : 0); *d; d++) {
            uint64_t digit = (uint64_t)(*d - '0');
            if (mag > (UINT64_MAX - digit) / 10) {
                overflow = true;
                break;
            }
            mag = mag * 10 + digit;
        }
        uint64_t limit = neg ? (uint64_t)INT64_MAX + 1 : (uint64_t)INT64_MAX;
        if (!overflow && mag <= limit) {
            v->is_int = true;
            v->u.num.i = neg ? (int64_t)(0 - mag) : (int64_t)mag;
        }
    }
    pthread_once(&g_c_locale_once, make_c_locale);
    v->u.num.d = g_c_locale ? strtod_l(tmp, NULL, g_c_locale) : strtod(tmp, NULL);
    ps->p = p;
    return true;
}

static bool push_value(parser *ps, const json_value *v) {
    if (ps->n_vals == ps->cap_vals) {
        size_t cap = ps->cap_vals ? ps->cap_vals * 2 : 256;
        json_value *nv = realloc(ps->vals, cap * sizeof *nv);
        if (!nv) return fail(ps, "out of memory");
        ps->vals = nv;
        ps->cap_vals = cap;
    }
    ps->vals[ps->n_vals++] = *v;
    return true;
}

static bool push_member(parser *ps, const json_member *m) {
    if (ps->n_mems == ps->cap_mems) {
        size_t cap = ps->cap_mems ? ps->cap_mems * 2 : 64;
        json_member *nm = realloc(ps->mems, cap * sizeof *nm);
        if (!nm) return fail(ps, "out of memory");
        ps->mems = nm;
        ps->cap_mems = cap;
    }
    ps->mems[ps->n_mems++] = *m;
    return true;
}

static bool parse_value(parser *ps, json_value *v, int depth);

static bool parse_array(parser *ps, json_value *v, int depth) {
    ps->p++; /* '[' */
    size_t mark = ps->n_vals;
    skip_ws(ps);
    if (ps->p < ps->end && *ps->p == ']') {
        ps->p++;
    } else {
        for (;;) {
            json_value item;
            if (!parse_value(ps, &item, depth + 1) || !push_value(ps, &item)) return false;
            skip_ws(ps);
            if (ps->p >= ps->end) return fail(ps, "unterminated array");
            if (*ps->p == ',') {
                ps->p++;
                continue;
            }
            if (*ps->p == ']') {
                ps->p++;
                break;
            }
            return fail(ps, "expected ',' or ']' in array");
        }
    }
    size_t n = ps->n_vals - mark;
    v->type = JSON_ARRAY;
    v->u.arr.n = n;
    v->u.arr.items = NULL;
    if (n) {
        v->u.arr.items = arena_alloc(ps->doc, n * sizeof(json_value));
        if (!v->u.arr.items) return fail(ps, "out of memory");
        memcpy(v->u.arr.items, ps->vals + mark, n * sizeof(json_value));
    }
    ps->n_vals = mark;
    return true;
}

static bool parse_object(parser *ps, json_value *v, int depth) {
    ps->p++; /* '{' */
    size_t mark = ps->n_mems;
    skip_ws(ps);
    if (ps->p < ps->end && *ps->p == '}') {
        ps->p++;
    } else {
        for (;;) {
            json_member m;
            skip_ws(ps);
            if (ps->p >= ps->end) return fail(ps, "unterminated object");
            if (*ps->p != '"') return fail(ps, "expected a string key in object");
            if (!parse_string(ps, &m.key, &m.key_len)) return false;
            skip_ws(ps);
            if (ps->p >= ps->end || *ps->p != ':') return fail(ps, "expected ':' after object key");
            ps->p++;
            if (!parse_value(ps, &m.value, depth + 1) || !push_member(ps, &m)) return false;
            skip_ws(ps);
            if (ps->p >= ps->end) return fail(ps, "unterminated object");
            if (*ps->p == ',') {
                ps->p++;
                continue;
            }
            if (*ps->p == '}') {
                ps->p++;
                break;
            }
            return fail(ps, "expected ',' or '}' in object");
        }
    }
    size_t n = ps->n_mems - mark;
    v->type = JSON_OBJECT;
    v->u.obj.n = n;
    v->u.obj.members = NULL;
    if (n) {
        v->u.obj.members = arena_alloc(ps->doc, n * sizeof(json_member));
        if (!v->u.obj.members) return fail(ps, "out of memory");
        memcpy(v->u.obj.members, ps->mems + mark, n * sizeof(json_member));
    }
    ps->n_mems = mark;
    return true;
}

static bool parse_value(parser *ps, json_value *v, int depth) {
    if (depth > JSON_MAX_DEPTH) return fail(ps, "nesting too deep");
    memset(v, 0, sizeof *v);
    skip_ws(ps);
    if (ps->p >= ps->end) return fail(ps, "unexpected end of input");
    switch (*ps->p) {
    case '{': return parse_object(ps, v, depth);
    case '[': return parse_array(ps, v, depth);
    case '"':
        v->type = JSON_STRING;
        return parse_string(ps, &v->u.str.s, &v->u.str.len);
    case 't':
        v->type = JSON_BOOL;
        v->u.b = true;
        return literal(ps, "true", 4);
    case 'f':
        v->type = JSON_BOOL;
        v->u.b = false;
        return literal(ps, "false", 5);
    case 'n': v->type = JSON_NULL; return literal(ps, "null", 4);
    default:
        if (*ps->p == '-' || (*ps->p >= '0' && *ps->p <= '9')) return parse_number(ps, v);
        return fail(ps, "unexpected character");
    }
}

void json_free(json_doc *doc) {
    if (!doc) return;
    arena_chunk *c = doc->chunks;
    while (c) {
        arena_chunk *next = c->next;
        free(c);
        c = next;
    }
    free(doc);
}

json_doc *json_parse(const char *text, size_t len, char *err, size_t errlen) {
    if (err && errlen) err[0] = '\0';
    if (!text) {
        if (err && errlen) snprintf(err, errlen, "no input");
        return NULL;
    }
    if (len > JSON_MAX_INPUT) {
        if (err && errlen) snprintf(err, errlen, "input of %zu bytes exceeds the %zu-byte limit", len, JSON_MAX_INPUT);
        return NULL;
    }
    json_doc *doc = calloc(1, sizeof *doc);
    if (!doc) {
        if (err && errlen) snprintf(err, errlen, "out of memory");
        return NULL;
    }
    parser ps = {0};
    ps.start = ps.p = (const unsigned char *)text;
    ps.end = ps.p + len;
    ps.doc = doc;
    ps.err = err;
    ps.errlen = errlen;
    bool ok = parse_value(&ps, &doc->root, 0);
    if (ok) {
        skip_ws(&ps);
        if (ps.p != ps.end) ok = fail(&ps, "trailing characters after the document");
    }
    free(ps.vals);
    free(ps.mems);
    if (!ok) {
        json_free(doc);
        return NULL;
    }
    return doc;
}

const json_value *json_root(const json_doc *doc) { return doc ? &doc->root : NULL; }

/* ---- accessors ------------------------------------------------------------- */

const json_value *json_get(const json_value *obj, const char *key) {
    if (!obj || obj->type != JSON_OBJECT || !key) return NULL;
    size_t klen = strlen(key);
    for (size_t i = obj->u.obj.n; i-- > 0;) {
        const json_member *m = &obj->u.obj.members[i];
        if (m->key_len == klen && memcmp(m->key, key, klen) == 0) return &m->value;
    }
    return NULL;
}

size_t json_count(const json_value *v) {
    if (!v) return 0;
    if (v->type == JSON_ARRAY) return v->u.arr.n;
    if (v->type == JSON_OBJECT) return v->u.obj.n;
    return 0;
}

const json_value *json_at(const json_value *arr, size_t i) {
    if (!arr || arr->type != JSON_ARRAY || i >= arr->u.arr.n) return NULL;
    return &arr->u.arr.items[i];
}

const char *json_string(const json_value *v) { return v && v->type == JSON_STRING ? v->u.str.s : NULL; }

bool json_number(const json_value *v, double *out) {
    if (!v || v->type != JSON_NUMBER) return false;
    if (out) *out = v->u.num.d;
    return true;
}

bool json_int64(const json_value *v, int64_t *out) {
    if (!v || v->type != JSON_NUMBER || !v->is_int) return false;
    if (out) *out = v->u.num.i;
    return true;
}

bool json_bool(const json_value *v, bool *out) {
    if (!v || v->type != JSON_BOOL) return false;
    if (out) *out = v->u.b;
    return true;
}

/* ---- writer ---------------------------------------------------------------- */

static bool buf_reserve(json_buf *b, size_t extra) {
    if (b->oom) return false;
    if (b->cap - b->len > extra) return true;
    size_t cap = b->cap ? b->cap : 256;
    while (cap - b->len <= extra) {
        if (cap > SIZE_MAX / 2) {
            b->oom = true;
            return false;
        }
        cap *= 2;
    }
    char *d = realloc(b->data, cap);
    if (!d) {
        b->oom = true;
        return false;
    }
    b->data = d;
    b->cap = cap;
    return true;
}

void json_buf_puts(json_buf *b, const char *s) {
    size_t n = strlen(s);
    if (!buf_reserve(b, n)) return;
    memcpy(b->data + b->len, s, n + 1);
    b->len += n;
}

void json_buf_printf(json_buf *b, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(NULL, 0, fmt, ap);
    va_end(ap);
    if (n < 0 || !buf_reserve(b, (size_t)n)) return;
    va_start(ap, fmt);
    vsnprintf(b->data + b->len, (size_t)n + 1, fmt, ap);
    va_end(ap);
    b->len += (size_t)n;
}

void json_buf_put_string(json_buf *b, const char *s) {
    json_buf_puts(b, "\"");
    for (const unsigned char *p = (const unsigned char *)s; *p; p++) {
        char esc[8];
        switch (*p) {
        case '"': json_buf_puts(b, "\\\""); break;
        case '\\': json_buf_puts(b, "\\\\"); break;
        case '\n': json_buf_puts(b, "\\n"); break;
        case '\r': json_buf_puts(b, "\\r"); break;
        case '\t': json_buf_puts(b, "\\t"); break;
        default:
            if (*p < 0x20) {
                snprintf(esc, sizeof esc, "\\u%04x", *p);
                json_buf_puts(b, esc);
            } else {
                esc[0] = (char)*p;
                esc[1] = '\0';
                json_buf_puts(b, esc);
            }
        }
    }
    json_buf_puts(b, "\"");
}

char *json_buf_take(json_buf *b) {
    if (b->oom) {
        json_buf_free(b);
        return NULL;
    }
    if (!b->data && !buf_reserve(b, 0)) return NULL;
    if (b->len == 0) b->data[0] = '\0';
    char *d = b->data;
    b->data = NULL;
    b->len = b->cap = 0;
    return d;
}

void json_buf_free(json_buf *b) {
    free(b->data);
    b->data = NULL;
    b->len = b->cap = 0;
}
