/* Schemas (baseRT_grammar_create_from_schema and a structural tag's
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
 */

#include "json_schema.h"

#include "errors.h"

#include <stdlib.h>
#include <string.h>

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

int gr_schema_compile(const char *fn, const json_value *root, gr_schema *out) {
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
