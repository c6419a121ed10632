/* Structural tags (baseRT_grammar_create_from_structural_tag): the
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

#include "structural_tag.h"

#include "errors.h"
#include "json_schema.h"

#include <stdlib.h>
#include <string.h>

/* ---- the structural-tag automaton --------------------------------------------------- */

static inline uint64_t st_all(const st_spec *sp) {
    return sp->n_tags == 64 ? UINT64_MAX : (((uint64_t)1 << sp->n_tags) - 1);
}

static void st_begin_settle(const st_spec *sp, st_state *s);

/* Any tag may start here (tags_with_separator; at_least_one's first tag). */
void st_any_tag(const st_spec *sp, st_state *s, bool optional) {
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
bool st_feed(const st_spec *sp, st_state *s, unsigned c, bool ctrl) {
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


void st_free(st_spec *sp) {
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

/* ---- structural tags: parsing and the trigger automaton ----------------------------- */

int st_fail(const char *fn, int code, const char *why) {
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
    rc = gr_schema_compile(fn, schema, &t->schema);
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

int st_parse(const char *fn, const json_value *root, st_spec *sp) {
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
