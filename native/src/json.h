#pragma once
/* A small JSON DOM (RFC 8259) for the .base header, and a string builder for
 * the JSON the engine emits. The parser is strict (no comments, no trailing
 * commas, no lone surrogates, valid UTF-8 only), bounded (input size and
 * nesting depth) and safe on any input: garbage or truncated text is an error
 * with a byte offset, never a crash or an over-read. */

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define JSON_MAX_DEPTH 128
#define JSON_MAX_INPUT ((size_t)1 << 30)

typedef enum { JSON_NULL, JSON_BOOL, JSON_NUMBER, JSON_STRING, JSON_ARRAY, JSON_OBJECT } json_type;

typedef struct json_value json_value;
typedef struct json_member json_member;

struct json_value {
    json_type type;
    bool is_int; /* JSON_NUMBER written as an integer that fits int64 (then u.num.i is exact) */
    union {
        bool b;
        struct {
            double d;
            int64_t i;
        } num;
        struct {
            const char *s; /* NUL-terminated; may also contain NULs (\u0000): use len */
            size_t len;
        } str;
        struct {
            json_value *items;
            size_t n;
        } arr;
        struct {
            json_member *members;
            size_t n;
        } obj;
    } u;
};

struct json_member {
    const char *key;
    size_t key_len;
    json_value value;
};

typedef struct json_doc json_doc;

/* Parse `len` bytes (no NUL terminator needed). NULL on error, with a message
 * ("byte N: reason") in err. The document owns every value and string. */
json_doc *json_parse(const char *text, size_t len, char *err, size_t errlen);
const json_value *json_root(const json_doc *doc);
void json_free(json_doc *doc);

/* Accessors: all accept NULL and values of the wrong type (returning NULL /
 * 0 / false), so lookups chain without checks in between. */
const json_value *json_get(const json_value *obj, const char *key); /* last duplicate wins */
size_t json_count(const json_value *v);                              /* items or members; 0 otherwise */
const json_value *json_at(const json_value *arr, size_t i);
const char *json_string(const json_value *v); /* NULL unless a string */
bool json_number(const json_value *v, double *out);
bool json_int64(const json_value *v, int64_t *out); /* integral numbers only */
bool json_bool(const json_value *v, bool *out);

/* Whether n bytes are well-formed UTF-8 (no overlongs, no surrogates, <= U+10FFFF). */
bool json_utf8_valid(const char *s, size_t n);

/* Growable string for emitting JSON. On allocation failure `oom` is set and
 * later appends are ignored; check it once at the end. */
typedef struct {
    char *data;
    size_t len, cap;
    bool oom;
} json_buf;

void json_buf_puts(json_buf *b, const char *s);
void json_buf_printf(json_buf *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
void json_buf_put_string(json_buf *b, const char *s); /* quoted and escaped */
/* Hand the NUL-terminated text to the caller (NULL after an allocation failure). */
char *json_buf_take(json_buf *b);
void json_buf_free(json_buf *b);
