/* Structural tags: free text with JSON-constrained regions after triggers (xgrammar's
 * triggered_tags / tags_with_separator / any_text): the spec, its parser, its automaton. */
#ifndef BASERT_REF_STRUCTURAL_TAG_H
#define BASERT_REF_STRUCTURAL_TAG_H

#include "json.h"
#include "json_grammar.h"

#define ST_MAX_TAGS 64   /* tags of a structural tag (a 64-bit candidate set) */
#define ST_MAX_TRIGGERS 16
#define ST_MAX_TRIGGER_BYTES 1024 /* all triggers together: bounds the trigger automaton */
#define ST_MAX_TEXT 4096          /* bytes of one begin / end string */

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

/* Parse a structural tag (root) into sp (zeroed by the caller); BASERT_OK or an error code with a message. */
int st_parse(const char *fn, const json_value *root, st_spec *sp);
void st_free(st_spec *sp);
/* Set an error (code, naming fn) and return code. */
int st_fail(const char *fn, int code, const char *why);
/* Any tag may start here (tags_with_separator; at_least_one's first tag). */
void st_any_tag(const st_spec *sp, st_state *s, bool optional);
/* Feed one byte (ctrl: it belongs to a CONTROL token); false when rejected. */
bool st_feed(const st_spec *sp, st_state *s, unsigned c, bool ctrl);

static inline bool st_eos_ok(const st_state *s) {
    return s->phase == S_FREE || s->phase == S_STOP || s->phase == S_TERM || (s->phase == S_SEP && s->pos == 0) ||
           (s->phase == S_BEGIN && s->opt && s->pos == 0);
}

#endif
