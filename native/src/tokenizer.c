/* The engine's GGUF tokenizers (see tokenizer.h), held to llama.cpp's
 * tokenizer (llama-vocab.cpp, unicode.cpp) and to HF `tokenizers`.
 *
 * Pipeline of one encode call:
 *   1. added-token split: in framing text, the leftmost-longest occurrence of a
 *      CONTROL / USER_DEFINED / UNKNOWN token's text becomes that token;
 *   2. byte-level BPE ("gpt2"): each run of ordinary text between those tokens
 *      is pre-tokenized: for the digit-splitting names ("smollm", "starcoder",
 *      ...) every numeric code point is split off on its own first (llama.cpp's
 *      "\p{N}" regex, HF Digits(individual_digits=true)), then each part is
 *      split by the GPT-2 regex; "llama-bpe" / "qwen2" use the Llama 3 / Qwen2
 *      regexes instead (hand-coded below as llama.cpp's unicode.cpp does).
 *      Each pre-token's bytes become byte-level symbols merged by BPE, lowest
 *      merge rank first, leftmost first on ties (HF's Word::merge_all,
 *      llama.cpp's llm_tokenizer_bpe_session); Llama 3 first looks the whole
 *      pre-token up in the vocabulary (ignore_merges);
 *   3. SentencePiece ("llama"): each run (with a leading space at the start of
 *      the text or after a special token when add_space_prefix) has its spaces
 *      replaced by U+2581, is split into UTF-8 characters, and adjacent
 *      symbols are merged while their concatenation is a token, highest score
 *      first, leftmost on ties (llama.cpp's llm_tokenizer_spm_session); a
 *      symbol that is not a token becomes its bytes' <0xNN> tokens.
 *
 * bpe_encode_pieces: consecutive pieces of one kind are matched as one text (a
 * marker may straddle their boundary); content matches only the added tokens
 * that are whitespace runs.
 *
 * Like HF (no unk token, no byte fallback), a byte-level BPE byte whose
 * one-symbol token is missing from the vocabulary is dropped: SmolLM2 lacks
 * 21 of the 256.
 *
 * The tokenizer is immutable after creation; every encode call allocates its
 * own scratch, so concurrent calls on one tokenizer are safe. */

#include "tokenizer.h"

#include "unicode_data.h"

#include <limits.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- open-addressing hash tables ---------------------------------------- */

/* text -> token id; slots hold id + 1 (0 = empty). */
typedef struct {
    uint32_t *slots;
    uint32_t mask;
} vocab_map;

/* (left id, right id) -> (rank, merged id). */
typedef struct {
    uint64_t key; /* EMPTY_PAIR when free; ids are < 2^31 so no real key equals it */
    uint32_t rank;
    uint32_t new_id;
} merge_slot;

#define EMPTY_PAIR UINT64_MAX

typedef struct {
    merge_slot *slots;
    uint32_t mask;
} merge_map;

/* Byte trie over the added tokens' texts, for leftmost-longest matching. */
typedef struct {
    int32_t first_child;
    int32_t next_sibling;
    int32_t token; /* id whose text ends here, or -1 */
    unsigned char byte;
} trie_node;

struct bpe_tokenizer {
    int n_tokens;
    char *text_arena;    /* token texts, NUL-terminated, back to back */
    size_t *text_offset; /* [n_tokens] */
    char *bytes_arena;   /* token raw bytes (byte-level decoded) */
    size_t *bytes_offset;
    int32_t *bytes_len;
    int32_t *types;
    vocab_map vocab;
    merge_map merges;
    int32_t byte_token[256]; /* id of each byte's token (one-symbol / <0xNN>), -1 if absent */
    uint32_t to_unicode[256]; /* GPT-2 bytes_to_unicode */
    int kind;                /* TOK_BPE or TOK_SPM */
    int pre;                 /* PRE_* (byte-level BPE) */
    bool ignore_merges;      /* Llama 3: a pre-token that is a token is that token */
    bool add_space_prefix;   /* SentencePiece */
    float *scores;           /* SentencePiece: [n_tokens] */
    unsigned char *rstrip;   /* [n_tokens] or NULL: drop the whitespace after this added token */
    trie_node *trie; /* node 0 is the root; NULL when there are no added tokens */
    int n_trie;
    bool starts_added[256]; /* first bytes of added tokens: lets the scan skip cheaply */
    /* sharing (bpe_shared_*): guarded by g_shared_mu once registered */
    bool shared;
    int refs;
    uint64_t key[BPE_SHARE_KEY];
    struct bpe_tokenizer *next_shared;
};

static void set_err(char *err, size_t errlen, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static void set_err(char *err, size_t errlen, const char *fmt, ...) {
    if (!err || errlen == 0) return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err, errlen, fmt, ap);
    va_end(ap);
}

static uint64_t hash_bytes(const char *s, size_t n) {
    uint64_t h = 1469598103934665603ull; /* FNV-1a */
    for (size_t i = 0; i < n; i++) {
        h ^= (unsigned char)s[i];
        h *= 1099511628211ull;
    }
    return h;
}

static uint64_t hash_pair(uint64_t x) { /* splitmix64 finalizer */
    x ^= x >> 30;
    x *= 0xbf58476d1ce4e5b9ull;
    x ^= x >> 27;
    x *= 0x94d049bb133111ebull;
    x ^= x >> 31;
    return x;
}

#define MAX_TABLE_ENTRIES (1 << 28) /* keeps the power-of-two table sizes within uint32_t */

static uint32_t table_capacity(size_t n) {
    uint32_t cap = 16;
    while (cap < 2 * n) cap <<= 1;
    return cap;
}

static const char *token_text(const bpe_tokenizer *tok, int32_t id) { return tok->text_arena + tok->text_offset[id]; }

static int32_t vocab_find(const bpe_tokenizer *tok, const char *s, size_t n) {
    uint32_t i = (uint32_t)hash_bytes(s, n) & tok->vocab.mask;
    for (;;) {
        uint32_t slot = tok->vocab.slots[i];
        if (slot == 0) return -1;
        const char *t = token_text(tok, (int32_t)(slot - 1));
        if (strncmp(t, s, n) == 0 && t[n] == '\0') return (int32_t)(slot - 1);
        i = (i + 1) & tok->vocab.mask;
    }
}

/* First id wins for duplicate texts (the HF export keeps the first as well). */
static void vocab_insert(bpe_tokenizer *tok, int32_t id) {
    const char *s = token_text(tok, id);
    size_t n = strlen(s);
    if (vocab_find(tok, s, n) >= 0) return;
    uint32_t i = (uint32_t)hash_bytes(s, n) & tok->vocab.mask;
    while (tok->vocab.slots[i] != 0) i = (i + 1) & tok->vocab.mask;
    tok->vocab.slots[i] = (uint32_t)id + 1;
}

static const merge_slot *merge_find(const merge_map *m, int32_t left, int32_t right) {
    uint64_t key = ((uint64_t)(uint32_t)left << 32) | (uint32_t)right;
    uint32_t i = (uint32_t)hash_pair(key) & m->mask;
    for (;;) {
        const merge_slot *s = &m->slots[i];
        if (s->key == key) return s;
        if (s->key == EMPTY_PAIR) return NULL;
        i = (i + 1) & m->mask;
    }
}

/* A pair listed twice keeps its LAST rank, as HF's merge map (a HashMap
 * collected in list order) does. */
static void merge_insert(merge_map *m, int32_t left, int32_t right, uint32_t rank, int32_t new_id) {
    uint64_t key = ((uint64_t)(uint32_t)left << 32) | (uint32_t)right;
    uint32_t i = (uint32_t)hash_pair(key) & m->mask;
    while (m->slots[i].key != EMPTY_PAIR && m->slots[i].key != key) i = (i + 1) & m->mask;
    m->slots[i].key = key;
    m->slots[i].rank = rank;
    m->slots[i].new_id = (uint32_t)new_id;
}

/* ---- UTF-8 and the GPT-2 byte <-> unicode mapping ------------------------ */

/* UTF-8 per Unicode Table 3-7. Outcome of examining the bytes at s[0..n): a complete valid character of
 * *len bytes (> 0), an incomplete but so far valid prefix (0), or an invalid
 * sequence whose maximal valid subpart is *len bytes (< 0, -*len >= 1). */
static int utf8_scan(const unsigned char *s, size_t n, int *len) {
    unsigned char b = s[0];
    if (b < 0x80) return *len = 1;
    int need;
    unsigned char lo = 0x80, hi = 0xBF;
    if (b >= 0xC2 && b <= 0xDF) need = 1;
    else if (b >= 0xE0 && b <= 0xEF) {
        need = 2;
        if (b == 0xE0) lo = 0xA0;
        if (b == 0xED) hi = 0x9F;
    } else if (b >= 0xF0 && b <= 0xF4) {
        need = 3;
        if (b == 0xF0) lo = 0x90;
        if (b == 0xF4) hi = 0x8F;
    } else return *len = -1;
    for (int k = 1; k <= need; k++) {
        if ((size_t)k >= n) return *len = 0;
        unsigned char klo = k == 1 ? lo : 0x80, khi = k == 1 ? hi : 0xBF;
        if (s[k] < klo || s[k] > khi) return *len = -k; /* U+FFFD for s[0..k) */
    }
    return *len = need + 1;
}

/* Length of the valid UTF-8 sequence at s[0..n), or 0 if none starts there. */
static int utf8_valid_len(const unsigned char *s, size_t n) {
    int len;
    utf8_scan(s, n, &len);
    return len > 0 ? len : 0;
}

static uint32_t utf8_decode_valid(const unsigned char *s, int len) {
    switch (len) {
    case 1: return s[0];
    case 2: return ((uint32_t)(s[0] & 0x1F) << 6) | (s[1] & 0x3F);
    case 3: return ((uint32_t)(s[0] & 0x0F) << 12) | ((uint32_t)(s[1] & 0x3F) << 6) | (s[2] & 0x3F);
    default:
        return ((uint32_t)(s[0] & 0x07) << 18) | ((uint32_t)(s[1] & 0x3F) << 12) | ((uint32_t)(s[2] & 0x3F) << 6) |
               (s[3] & 0x3F);
    }
}

static int utf8_put(uint32_t cp, char *out) {
    if (cp < 0x80) {
        out[0] = (char)cp;
        return 1;
    }
    if (cp < 0x800) {
        out[0] = (char)(0xC0 | (cp >> 6));
        out[1] = (char)(0x80 | (cp & 0x3F));
        return 2;
    }
    if (cp < 0x10000) {
        out[0] = (char)(0xE0 | (cp >> 12));
        out[1] = (char)(0x80 | ((cp >> 6) & 0x3F));
        out[2] = (char)(0x80 | (cp & 0x3F));
        return 3;
    }
    out[0] = (char)(0xF0 | (cp >> 18));
    out[1] = (char)(0x80 | ((cp >> 12) & 0x3F));
    out[2] = (char)(0x80 | ((cp >> 6) & 0x3F));
    out[3] = (char)(0x80 | (cp & 0x3F));
    return 4;
}

/* GPT-2 bytes_to_unicode: printable Latin-1 bytes stand for themselves, the
 * other 68 bytes map in order to U+0100..U+0143. */
#define BYTE_ALPHABET_END 0x144

static bool byte_is_self_mapped(unsigned b) {
    return (b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
}

/* to_unicode[b] = code point standing for byte b; from_unicode[cp] = byte, or -1. */
static void build_byte_maps(uint32_t to_unicode[256], int16_t from_unicode[BYTE_ALPHABET_END]) {
    uint32_t next = 0x100;
    for (int cp = 0; cp < BYTE_ALPHABET_END; cp++) from_unicode[cp] = -1;
    for (unsigned b = 0; b < 256; b++) {
        to_unicode[b] = byte_is_self_mapped(b) ? b : next++;
        from_unicode[to_unicode[b]] = (int16_t)b;
    }
}

/* Raw bytes of a normal token: byte-level decode of its text; a text with a
 * character outside the byte alphabet is kept verbatim (HF's ByteLevel decoder
 * does the same). Returns the length written to out (room: strlen(text)). */
static int32_t decode_token_bytes(const char *text, const int16_t from_unicode[BYTE_ALPHABET_END], char *out) {
    const unsigned char *s = (const unsigned char *)text;
    size_t n = strlen(text), i = 0;
    int32_t len = 0;
    while (i < n) {
        int cl = utf8_valid_len(s + i, n - i);
        uint32_t cp = cl ? utf8_decode_valid(s + i, cl) : BYTE_ALPHABET_END;
        if (cp >= BYTE_ALPHABET_END || from_unicode[cp] < 0) {
            memcpy(out, text, n);
            return (int32_t)n;
        }
        out[len++] = (char)from_unicode[cp];
        i += (size_t)cl;
    }
    return len;
}

/* ---- construction -------------------------------------------------------- */

static int32_t trie_child(const bpe_tokenizer *tok, int32_t node, unsigned char byte) {
    for (int32_t c = tok->trie[node].first_child; c >= 0; c = tok->trie[c].next_sibling)
        if (tok->trie[c].byte == byte) return c;
    return -1;
}

static void trie_insert(bpe_tokenizer *tok, const char *text, int32_t id) {
    int32_t node = 0;
    for (const unsigned char *p = (const unsigned char *)text; *p; p++) {
        int32_t child = trie_child(tok, node, *p);
        if (child < 0) {
            child = tok->n_trie++;
            tok->trie[child] = (trie_node){.first_child = -1, .next_sibling = tok->trie[node].first_child, .token = -1, .byte = *p};
            tok->trie[node].first_child = child;
        }
        node = child;
    }
    tok->trie[node].token = id;
    tok->starts_added[(unsigned char)text[0]] = true;
}

/* Tokens matched as a whole in framing text (llama.cpp's cache_special_tokens). */
static bool is_added_type(int32_t type) {
    return type == BPE_TOKEN_CONTROL || type == BPE_TOKEN_USER_DEFINED || type == BPE_TOKEN_UNKNOWN;
}

enum { TOK_BPE, TOK_SPM };
enum { PRE_GPT2, PRE_DIGITS_GPT2, PRE_LLAMA3, PRE_QWEN2 };

/* llama.cpp's pre-tokenizer names (llama-vocab.cpp) whose regexes the engine
 * runs, with nothing else that changes the ids ("gpt2" is this project's own
 * name for the GPT-2 regex). Missing on purpose: "default" (llama.cpp's
 * four-regex default sequence for an unrecognised tokenizer, not GPT-2's). */
static const struct {
    const char *name;
    int pre;
} PRE_NAMES[] = {
    {"gpt2", PRE_GPT2},           {"gpt-2", PRE_GPT2},          {"phi-2", PRE_GPT2},
    {"mpt", PRE_GPT2},            {"olmo", PRE_GPT2},           {"smollm", PRE_DIGITS_GPT2},
    {"starcoder", PRE_DIGITS_GPT2}, {"refact", PRE_DIGITS_GPT2}, {"command-r", PRE_DIGITS_GPT2},
    {"codeshell", PRE_DIGITS_GPT2}, {"exaone", PRE_DIGITS_GPT2}, {"minerva-7b", PRE_DIGITS_GPT2},
    {"llama-bpe", PRE_LLAMA3},    {"llama3", PRE_LLAMA3},       {"llama-v3", PRE_LLAMA3},
    {"falcon3", PRE_LLAMA3},      {"falcon-h1", PRE_LLAMA3},    {"pixtral", PRE_LLAMA3},
    {"midm-2.0", PRE_LLAMA3},     {"lfm2", PRE_LLAMA3},         {"qwen2", PRE_QWEN2},
    {"deepseek-r1-qwen", PRE_QWEN2}, {"stablelm2", PRE_QWEN2},
};

static int parse_pre(const char *pre) {
    if (!pre) return -1;
    for (size_t i = 0; i < sizeof PRE_NAMES / sizeof PRE_NAMES[0]; i++)
        if (strcmp(pre, PRE_NAMES[i].name) == 0) return PRE_NAMES[i].pre;
    return -1;
}

static int parse_model(const char *model) {
    if (!model || strcmp(model, "gpt2") == 0) return TOK_BPE;
    if (strcmp(model, "llama") == 0) return TOK_SPM;
    return -1;
}

int bpe_supported(const char *model, const char *pre) {
    int kind = parse_model(model);
    return kind == TOK_SPM || (kind == TOK_BPE && parse_pre(pre) >= 0);
}

/* "<0xNN>" -> NN, or -1. */
static int byte_token_value(const char *text) {
    unsigned v;
    char tail;
    if (strlen(text) != 6 || strncmp(text, "<0x", 3) != 0 || text[5] != '>') return -1;
    if (sscanf(text + 3, "%2x%c", &v, &tail) != 2 || tail != '>') return -1;
    return (int)v;
}

/* SentencePiece piece -> raw bytes: U+2581 is a space, a BYTE token its byte. */
static int32_t spm_token_bytes(const char *text, int32_t type, char *out) {
    int b = type == BPE_TOKEN_BYTE ? byte_token_value(text) : -1;
    if (b >= 0) {
        out[0] = (char)b;
        return 1;
    }
    int32_t len = 0;
    for (const char *p = text; *p;) {
        if (strncmp(p, "\xE2\x96\x81", 3) == 0) {
            out[len++] = ' ';
            p += 3;
        } else {
            out[len++] = *p++;
        }
    }
    return len;
}

static bool build_merges(bpe_tokenizer *tok, const char *const *merges, int n_merges, char *err, size_t errlen) {
    tok->merges.mask = table_capacity((size_t)n_merges) - 1;
    tok->merges.slots = malloc(((size_t)tok->merges.mask + 1) * sizeof *tok->merges.slots);
    char *joined = NULL;
    size_t joined_cap = 0;
    if (!tok->merges.slots) goto oom;
    for (size_t i = 0; i <= tok->merges.mask; i++) tok->merges.slots[i].key = EMPTY_PAIR;
    for (int r = 0; r < n_merges; r++) {
        const char *m = merges[r];
        if (!m) {
            set_err(err, errlen, "bpe_create: merges[%d] is NULL", r);
            goto fail;
        }
        const char *space = strchr(m, ' ');
        if (!space || space == m || space[1] == '\0' || strchr(space + 1, ' ')) {
            set_err(err, errlen, "bpe_create: merges[%d] '%.64s' is not \"left right\"", r, m);
            goto fail;
        }
        size_t left_len = (size_t)(space - m), right_len = strlen(space + 1);
        int32_t left = vocab_find(tok, m, left_len);
        int32_t right = vocab_find(tok, space + 1, right_len);
        if (left_len + right_len + 1 > joined_cap) {
            joined_cap = 2 * (left_len + right_len + 1);
            char *grown = realloc(joined, joined_cap);
            if (!grown) goto oom;
            joined = grown;
        }
        memcpy(joined, m, left_len);
        memcpy(joined + left_len, space + 1, right_len);
        int32_t merged = vocab_find(tok, joined, left_len + right_len);
        if (left < 0 || right < 0 || merged < 0) {
            set_err(err, errlen, "bpe_create: merges[%d] '%.64s' uses a token that is not in the vocabulary", r, m);
            goto fail;
        }
        merge_insert(&tok->merges, left, right, (uint32_t)r, merged);
    }
    free(joined);
    return true;
oom:
    set_err(err, errlen, "bpe_create: out of memory");
fail:
    free(joined);
    return false;
}

bpe_tokenizer *bpe_create(const char *const *tokens, const int32_t *token_types, int n_tokens,
                          const char *const *merges, int n_merges, const char *pre, char *err, size_t errlen) {
    bpe_options opt = {.model = "gpt2", .pre = pre};
    return bpe_create_model(tokens, token_types, n_tokens, merges, n_merges, &opt, err, errlen);
}

bpe_tokenizer *bpe_create_model(const char *const *tokens, const int32_t *token_types, int n_tokens,
                                const char *const *merges, int n_merges, const bpe_options *opt, char *err,
                                size_t errlen) {
    if (err && errlen) err[0] = '\0';
    if (!opt) {
        set_err(err, errlen, "bpe_create: no options");
        return NULL;
    }
    if (!tokens || n_tokens <= 0) {
        set_err(err, errlen, "bpe_create: empty vocabulary (n_tokens=%d)", n_tokens);
        return NULL;
    }
    if (n_merges < 0 || (n_merges > 0 && !merges)) {
        set_err(err, errlen, "bpe_create: invalid merges (n_merges=%d)", n_merges);
        return NULL;
    }
    if (n_tokens > MAX_TABLE_ENTRIES || n_merges > MAX_TABLE_ENTRIES) {
        set_err(err, errlen, "bpe_create: vocabulary too large (%d tokens, %d merges)", n_tokens, n_merges);
        return NULL;
    }
    int kind = parse_model(opt->model);
    if (kind < 0) {
        set_err(err, errlen, "bpe_create: unsupported tokenizer model '%.64s' (supported: gpt2, llama)", opt->model);
        return NULL;
    }
    int pre_kind = kind == TOK_BPE ? parse_pre(opt->pre) : PRE_GPT2;
    if (pre_kind < 0) {
        set_err(err, errlen, "bpe_create: unsupported pre-tokenizer '%.64s'", opt->pre ? opt->pre : "(none)");
        return NULL;
    }
    if (kind == TOK_SPM) n_merges = 0; /* SentencePiece merges by score, not by a merge list */
    size_t text_total = 0, added_total = 0;
    for (int i = 0; i < n_tokens; i++) {
        if (!tokens[i]) {
            set_err(err, errlen, "bpe_create: tokens[%d] is NULL", i);
            return NULL;
        }
        int32_t type = token_types ? token_types[i] : BPE_TOKEN_NORMAL;
        if (type < 0 || type > BPE_TOKEN_BYTE) {
            set_err(err, errlen, "bpe_create: token_types[%d] = %d is not a GGUF token type (0..6)", i, (int)type);
            return NULL;
        }
        size_t len = strlen(tokens[i]);
        if (len > INT32_MAX) {
            set_err(err, errlen, "bpe_create: tokens[%d] is too long", i);
            return NULL;
        }
        text_total += len + 1;
        if (is_added_type(type)) added_total += len;
    }

    bpe_tokenizer *tok = calloc(1, sizeof *tok);
    if (!tok) {
        set_err(err, errlen, "bpe_create: out of memory");
        return NULL;
    }
    tok->n_tokens = n_tokens;
    tok->kind = kind;
    tok->pre = pre_kind;
    tok->ignore_merges = kind == TOK_BPE && pre_kind == PRE_LLAMA3;
    tok->add_space_prefix = kind == TOK_SPM && opt->add_space_prefix;
    size_t n = (size_t)n_tokens;
    if (opt->rstrip) {
        tok->rstrip = malloc(n);
        if (!tok->rstrip) {
            set_err(err, errlen, "bpe_create: out of memory");
            bpe_free(tok);
            return NULL;
        }
        memcpy(tok->rstrip, opt->rstrip, n);
    }
    if (kind == TOK_SPM) {
        tok->scores = malloc(n * sizeof *tok->scores);
        if (!tok->scores) {
            set_err(err, errlen, "bpe_create: out of memory");
            bpe_free(tok);
            return NULL;
        }
        for (size_t i = 0; i < n; i++) tok->scores[i] = opt->scores ? opt->scores[i] : 0.0f;
    }
    tok->text_arena = malloc(text_total);
    tok->text_offset = malloc(n * sizeof *tok->text_offset);
    tok->bytes_arena = malloc(text_total);
    tok->bytes_offset = malloc(n * sizeof *tok->bytes_offset);
    tok->bytes_len = malloc(n * sizeof *tok->bytes_len);
    tok->types = malloc(n * sizeof *tok->types);
    tok->vocab.mask = table_capacity(n) - 1;
    tok->vocab.slots = calloc((size_t)tok->vocab.mask + 1, sizeof *tok->vocab.slots);
    tok->trie = added_total ? malloc((added_total + 1) * sizeof *tok->trie) : NULL;
    if (!tok->text_arena || !tok->text_offset || !tok->bytes_arena || !tok->bytes_offset || !tok->bytes_len ||
        !tok->types || !tok->vocab.slots || (added_total && !tok->trie)) {
        set_err(err, errlen, "bpe_create: out of memory");
        bpe_free(tok);
        return NULL;
    }
    if (tok->trie) {
        tok->trie[0] = (trie_node){-1, -1, -1, 0};
        tok->n_trie = 1;
    }

    uint32_t to_unicode[256];
    int16_t from_unicode[BYTE_ALPHABET_END];
    build_byte_maps(to_unicode, from_unicode);
    memcpy(tok->to_unicode, to_unicode, sizeof to_unicode);
    size_t text_pos = 0, bytes_pos = 0;
    for (int i = 0; i < n_tokens; i++) {
        size_t len = strlen(tokens[i]);
        int32_t type = token_types ? token_types[i] : BPE_TOKEN_NORMAL;
        tok->types[i] = type;
        tok->text_offset[i] = text_pos;
        memcpy(tok->text_arena + text_pos, tokens[i], len + 1);
        text_pos += len + 1;
        tok->bytes_offset[i] = bytes_pos;
        vocab_insert(tok, i);
        if (is_added_type(type)) {
            memcpy(tok->bytes_arena + bytes_pos, tokens[i], len);
            tok->bytes_len[i] = (int32_t)len;
            /* a text that an earlier id already owns is that id's (as in HF) */
            if (len && vocab_find(tok, tokens[i], len) == i) trie_insert(tok, tokens[i], i);
        } else if (kind == TOK_SPM) {
            tok->bytes_len[i] = spm_token_bytes(tokens[i], type, tok->bytes_arena + bytes_pos);
        } else {
            tok->bytes_len[i] = decode_token_bytes(tokens[i], from_unicode, tok->bytes_arena + bytes_pos);
        }
        bytes_pos += (size_t)tok->bytes_len[i];
    }

    for (unsigned b = 0; b < 256; b++) {
        char sym[8];
        int len;
        if (kind == TOK_SPM) { /* llama.cpp's byte_to_token: <0xNN>, else the byte itself as a token */
            len = snprintf(sym, sizeof sym, "<0x%02X>", b);
            tok->byte_token[b] = vocab_find(tok, sym, (size_t)len);
            if (tok->byte_token[b] >= 0) continue;
            sym[0] = (char)b;
            len = 1;
            if (b == 0) continue; /* a NUL token text cannot exist */
        } else {
            len = utf8_put(to_unicode[b], sym);
        }
        tok->byte_token[b] = vocab_find(tok, sym, (size_t)len);
    }
    if (!build_merges(tok, merges, n_merges, err, errlen)) {
        bpe_free(tok);
        return NULL;
    }
    return tok;
}

static pthread_mutex_t g_shared_mu = PTHREAD_MUTEX_INITIALIZER;
static bpe_tokenizer *g_shared; /* registered tokenizers, each with refs >= 1 */

bpe_tokenizer *bpe_shared_get(const uint64_t key[BPE_SHARE_KEY]) {
    pthread_mutex_lock(&g_shared_mu);
    bpe_tokenizer *t = g_shared;
    while (t && memcmp(t->key, key, sizeof t->key) != 0) t = t->next_shared;
    if (t) t->refs++;
    pthread_mutex_unlock(&g_shared_mu);
    return t;
}

void bpe_shared_put(bpe_tokenizer *tok, const uint64_t key[BPE_SHARE_KEY]) {
    if (!tok || tok->shared) return;
    pthread_mutex_lock(&g_shared_mu);
    memcpy(tok->key, key, sizeof tok->key);
    tok->shared = true;
    tok->refs = 1;
    tok->next_shared = g_shared;
    g_shared = tok;
    pthread_mutex_unlock(&g_shared_mu);
}

void bpe_free(bpe_tokenizer *tok) {
    if (!tok) return;
    if (tok->shared) {
        pthread_mutex_lock(&g_shared_mu);
        bool last = --tok->refs == 0;
        if (last) { /* unlink: no bpe_shared_get can return it any more */
            bpe_tokenizer **pp = &g_shared;
            while (*pp != tok) pp = &(*pp)->next_shared;
            *pp = tok->next_shared;
        }
        pthread_mutex_unlock(&g_shared_mu);
        if (!last) return;
    }
    free(tok->text_arena);
    free(tok->text_offset);
    free(tok->bytes_arena);
    free(tok->bytes_offset);
    free(tok->bytes_len);
    free(tok->types);
    free(tok->vocab.slots);
    free(tok->merges.slots);
    free(tok->trie);
    free(tok->scores);
    free(tok->rstrip);
    free(tok);
}

int bpe_vocab_size(const bpe_tokenizer *tok) { return tok ? tok->n_tokens : 0; }

/* ---- encoding ------------------------------------------------------------- */

typedef struct {
    int32_t id;
    int32_t prev, next; /* neighbour indices, -1 at the ends */
    bool removed;
} bpe_symbol;

typedef struct {
    uint32_t rank;
    int32_t pos; /* index of the left symbol */
    int32_t new_id;
} bpe_candidate;

/* Per-call state: output cursor and scratch buffers. */
typedef struct {
    const bpe_tokenizer *tok;
    uint32_t *out;
    int max_out;
    size_t count;
    bpe_symbol *symbols;
    size_t symbols_cap;
    bpe_candidate *heap;
    size_t heap_cap, heap_len;
    char *scratch; /* a pre-token in byte-level form (ignore_merges), or SentencePiece text */
    size_t scratch_cap;
    bool prev_special; /* SentencePiece: the text so far is empty or ends in an added token */
    bool strip_space;  /* the last token was an RSTRIP one and no text has followed it yet */
    bool oom;
} encoder;

static char *scratch(encoder *e, size_t n) {
    if (n > e->scratch_cap) {
        char *p = realloc(e->scratch, n);
        if (!p) {
            e->oom = true;
            return NULL;
        }
        e->scratch = p;
        e->scratch_cap = n;
    }
    return e->scratch;
}

static void emit(encoder *e, int32_t id) {
    if (e->count < (size_t)e->max_out) e->out[e->count] = (uint32_t)id;
    e->count++;
}

static bool candidate_before(const bpe_candidate *a, const bpe_candidate *b) {
    return a->rank != b->rank ? a->rank < b->rank : a->pos < b->pos;
}

static void heap_push(encoder *e, bpe_candidate c) {
    size_t i = e->heap_len++; /* capacity is reserved by bpe_word */
    while (i > 0) {
        size_t parent = (i - 1) / 2;
        if (!candidate_before(&c, &e->heap[parent])) break;
        e->heap[i] = e->heap[parent];
        i = parent;
    }
    e->heap[i] = c;
}

static bpe_candidate heap_pop(encoder *e) {
    bpe_candidate top = e->heap[0], last = e->heap[--e->heap_len];
    size_t i = 0, n = e->heap_len;
    for (;;) {
        size_t child = 2 * i + 1;
        if (child >= n) break;
        if (child + 1 < n && candidate_before(&e->heap[child + 1], &e->heap[child])) child++;
        if (!candidate_before(&e->heap[child], &last)) break;
        e->heap[i] = e->heap[child];
        i = child;
    }
    if (n) e->heap[i] = last;
    return top;
}

static void push_pair(encoder *e, int32_t pos) {
    const bpe_symbol *s = e->symbols;
    if (pos < 0 || s[pos].next < 0) return;
    const merge_slot *m = merge_find(&e->tok->merges, s[pos].id, s[s[pos].next].id);
    if (m) heap_push(e, (bpe_candidate){m->rank, pos, (int32_t)m->new_id});
}

static bool reserve(encoder *e, size_t n_symbols) {
    /* every merge pushes at most two candidates: n - 1 initial + 2 (n - 1) */
    size_t heap_need = 3 * n_symbols;
    if (n_symbols > e->symbols_cap) {
        bpe_symbol *s = realloc(e->symbols, n_symbols * sizeof *s);
        if (!s) return false;
        e->symbols = s;
        e->symbols_cap = n_symbols;
    }
    if (heap_need > e->heap_cap) {
        bpe_candidate *h = realloc(e->heap, heap_need * sizeof *h);
        if (!h) return false;
        e->heap = h;
        e->heap_cap = heap_need;
    }
    return true;
}

/* BPE over one pre-token: its bytes are byte-level symbols, merged like HF's
 * Word::merge_all (lowest rank, then leftmost; stale candidates skipped). */
static void bpe_word(encoder *e, const unsigned char *s, size_t n) {
    const bpe_tokenizer *tok = e->tok;
    if (n == 1) {
        if (tok->byte_token[s[0]] >= 0) emit(e, tok->byte_token[s[0]]);
        return;
    }
    if (tok->ignore_merges && n) { /* llama.cpp and HF ignore_merges: a whole-word token wins */
        char *text = scratch(e, 2 * n); /* byte-level symbols are U+0021..U+0143: 1 or 2 bytes */
        if (!text) return;
        size_t len = 0;
        for (size_t i = 0; i < n; i++) len += (size_t)utf8_put(tok->to_unicode[s[i]], text + len);
        int32_t id = vocab_find(tok, text, len);
        if (id >= 0) {
            emit(e, id);
            return;
        }
    }
    if (!reserve(e, n)) {
        e->oom = true;
        return;
    }
    bpe_symbol *sym = e->symbols;
    int32_t count = 0;
    for (size_t i = 0; i < n; i++) {
        int32_t id = tok->byte_token[s[i]];
        if (id < 0) continue; /* no symbol for this byte: HF drops it (no unk token) */
        sym[count] = (bpe_symbol){id, count - 1, -1, false};
        if (count > 0) sym[count - 1].next = count;
        count++;
    }
    e->heap_len = 0;
    for (int32_t i = 0; i + 1 < count; i++) push_pair(e, i);
    while (e->heap_len) {
        bpe_candidate top = heap_pop(e);
        bpe_symbol *left = &sym[top.pos];
        if (left->removed || left->next < 0) continue;
        bpe_symbol *right = &sym[left->next];
        const merge_slot *m = merge_find(&tok->merges, left->id, right->id);
        if (!m || (int32_t)m->new_id != top.new_id) continue; /* stale */
        left->id = top.new_id;
        right->removed = true;
        left->next = right->next;
        if (right->next >= 0) sym[right->next].prev = top.pos;
        push_pair(e, left->prev);
        push_pair(e, top.pos);
    }
    for (int32_t i = 0; i < count; i++)
        if (!sym[i].removed) emit(e, sym[i].id);
}

/* Code point class and byte length of the character at s[i]; an invalid byte
 * counts as one "other" character (unreachable from HF, which takes str). */
static int char_at(const unsigned char *s, size_t n, size_t i, int *len) {
    if (s[i] < 0x80) {
        *len = 1;
        return bpe_unicode_class(s[i]);
    }
    int cl = utf8_valid_len(s + i, n - i);
    if (!cl) {
        *len = 1;
        return BPE_UCLASS_OTHER;
    }
    *len = cl;
    return bpe_unicode_class(utf8_decode_valid(s + i, cl));
}

/* End of the run of characters of class cls starting at i. */
static size_t run_end(const unsigned char *s, size_t n, size_t i, int cls) {
    while (i < n) {
        int len;
        if (char_at(s, n, i, &len) != cls) break;
        i += (size_t)len;
    }
    return i;
}

/* Length of a contraction ('s 't 're 've 'm 'll 'd, lowercase only) at s[i]. */
static size_t contraction_len(const unsigned char *s, size_t n, size_t i) {
    if (i + 1 >= n) return 0;
    switch (s[i + 1]) {
    case 's': case 't': case 'm': case 'd': return 2;
    case 'r': case 'v': return i + 2 < n && s[i + 2] == 'e' ? 3 : 0;
    case 'l': return i + 2 < n && s[i + 2] == 'l' ? 3 : 0;
    default: return 0;
    }
}

/* The GPT-2 regex, alternatives tried in order at each position:
 *   's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
 * Every character belongs to one of the classes, so the matches tile s. */
static void regex_split(encoder *e, const unsigned char *s, size_t n) {
    size_t i = 0;
    while (i < n) {
        size_t end = s[i] == '\'' ? contraction_len(s, n, i) : 0;
        int len;
        int cls = char_at(s, n, i, &len);
        int next_cls = s[i] == ' ' && i + 1 < n ? char_at(s, n, i + 1, &len) : BPE_UCLASS_SPACE;
        if (end) {
            end += i;
        } else if (next_cls != BPE_UCLASS_SPACE) { /* " ?X+" with the optional space */
            end = run_end(s, n, i + 1, next_cls);
        } else if (cls != BPE_UCLASS_SPACE) {
            end = run_end(s, n, i, cls);
        } else {
            /* \s+(?!\S): the whole run at the end of the text, else all of it but
             * the last character (which then starts the next match); \s+ when the
             * run is one character followed by non-space. */
            end = run_end(s, n, i, BPE_UCLASS_SPACE);
            if (end < n) {
                size_t last = end - 1;
                while ((s[last] & 0xC0) == 0x80) last--; /* start of the last (valid) character */
                if (last > i) end = last;
            }
        }
        bpe_word(e, s + i, end - i);
        i = end;
    }
}


static bool is_cr_lf(const unsigned char *s, size_t n, size_t i) { return i < n && (s[i] == '\r' || s[i] == '\n'); }

/* Class of the character at i, BPE_UCLASS_OTHER's stand-in -1 past the end. */
static int class_at(const unsigned char *s, size_t n, size_t i, int *len) {
    if (i >= n) {
        *len = 0;
        return -1;
    }
    return char_at(s, n, i, len);
}

static size_t next_char(const unsigned char *s, size_t n, size_t i) {
    int len;
    class_at(s, n, i, &len);
    return i + (size_t)len;
}

/* The Llama 3 regex (max_digits 3) and Qwen2's (max_digits 1), alternatives in order:
 *   (?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|
 *   \s*[\r\n]+|\s+(?!\S)|\s+
 * step for step as llama.cpp's unicode_regex_split_custom_llama3 / _qwen2. */
static void regex_split_llama3(encoder *e, const unsigned char *s, size_t n, int max_digits) {
    size_t pos = 0;
    while (pos < n) {
        size_t start = pos;
        int len;
        int cls = class_at(s, n, pos, &len);
        unsigned char c = s[pos];
        if (c == '\'' && pos + 1 < n) { /* contractions, ASCII case-insensitive */
            unsigned char c1 = (unsigned char)(s[pos + 1] | 0x20), c2 = pos + 2 < n ? (unsigned char)(s[pos + 2] | 0x20) : 0;
            size_t end = 0;
            if (c1 == 's' || c1 == 't' || c1 == 'm' || c1 == 'd') end = pos + 2;
            else if ((c1 == 'r' && c2 == 'e') || (c1 == 'v' && c2 == 'e') || (c1 == 'l' && c2 == 'l')) end = pos + 3;
            if (end) {
                bpe_word(e, s + pos, end - pos);
                pos = end;
                continue;
            }
        }
        size_t after = pos + (size_t)len;
        int len2;
        int next_cls = class_at(s, n, after, &len2);
        /* [^\r\n\p{L}\p{N}]?\p{L}+ */
        if (!(c == '\r' || c == '\n' || cls == BPE_UCLASS_NUMBER) &&
            (cls == BPE_UCLASS_LETTER || next_cls == BPE_UCLASS_LETTER)) {
            pos = run_end(s, n, after, BPE_UCLASS_LETTER);
            bpe_word(e, s + start, pos - start);
            continue;
        }
        /* \p{N}{1,max_digits} */
        if (cls == BPE_UCLASS_NUMBER) {
            for (int k = 0; k < max_digits && pos < n && class_at(s, n, pos, &len) == BPE_UCLASS_NUMBER; k++)
                pos += (size_t)len;
            bpe_word(e, s + start, pos - start);
            continue;
        }
        /* " ?[^\s\p{L}\p{N}]+[\r\n]*" */
        int cls2 = c == ' ' ? next_cls : cls;
        if (cls2 != BPE_UCLASS_SPACE && cls2 != BPE_UCLASS_LETTER && cls2 != BPE_UCLASS_NUMBER) {
            if (c == ' ') pos = after;
            while (pos < n && class_at(s, n, pos, &len) == BPE_UCLASS_OTHER) pos += (size_t)len;
            while (is_cr_lf(s, n, pos)) pos++;
            bpe_word(e, s + start, pos - start);
            continue;
        }
        /* whitespace run: \s*[\r\n]+ up to its last CR/LF, else \s+(?!\S), else \s+ */
        size_t ws_end = pos, last_crlf = 0, last_start = pos;
        int n_ws = 0;
        while (ws_end < n && class_at(s, n, ws_end, &len) == BPE_UCLASS_SPACE) {
            if (s[ws_end] == '\r' || s[ws_end] == '\n') last_crlf = ws_end + 1;
            last_start = ws_end;
            ws_end += (size_t)len;
            n_ws++;
        }
        if (last_crlf) pos = last_crlf;
        else if (n_ws > 1 && ws_end < n) pos = last_start;
        else if (n_ws > 0) pos = ws_end;
        else pos = next_char(s, n, pos); /* unreachable: every class is handled above */
        bpe_word(e, s + start, pos - start);
    }
}

/* ---- SentencePiece ------------------------------------------------------------ */

typedef struct {
    int32_t start, n; /* bytes of the symbol in the text; n == 0 once merged away */
    int32_t prev, next;
} spm_symbol;

typedef struct {
    float score;
    int32_t left, right;
    int32_t size; /* bytes of left + right when pushed: stale when it differs */
} spm_bigram;

static bool spm_before(const spm_bigram *a, const spm_bigram *b) { /* highest score, then leftmost */
    return a->score != b->score ? a->score > b->score : a->left < b->left;
}

typedef struct {
    spm_bigram *heap;
    size_t len;
} spm_heap;

static void spm_push(spm_heap *h, spm_bigram c) {
    size_t i = h->len++;
    while (i > 0) {
        size_t parent = (i - 1) / 2;
        if (!spm_before(&c, &h->heap[parent])) break;
        h->heap[i] = h->heap[parent];
        i = parent;
    }
    h->heap[i] = c;
}

static spm_bigram spm_pop(spm_heap *h) {
    spm_bigram top = h->heap[0], last = h->heap[--h->len];
    size_t i = 0, n = h->len;
    for (;;) {
        size_t child = 2 * i + 1;
        if (child >= n) break;
        if (child + 1 < n && spm_before(&h->heap[child + 1], &h->heap[child])) child++;
        if (!spm_before(&h->heap[child], &last)) break;
        h->heap[i] = h->heap[child];
        i = child;
    }
    if (n) h->heap[i] = last;
    return top;
}

static void spm_try_bigram(const bpe_tokenizer *tok, const char *text, const spm_symbol *sym, spm_heap *h,
                           int32_t left, int32_t right) {
    if (left < 0 || right < 0) return;
    int32_t size = sym[left].n + sym[right].n;
    int32_t id = vocab_find(tok, text + sym[left].start, (size_t)size);
    /* An added token is a whole-text match, never a merge result (SentencePiece's rule): in framing
     * text its every occurrence is already split off (so llama.cpp agrees), and in content text a
     * client cannot assemble a marker by merges. */
    if (id < 0 || is_added_type(tok->types[id])) return;
    spm_push(h, (spm_bigram){tok->scores[id], left, right, size});
}

/* One SentencePiece run (spaces already U+2581): llama.cpp's llm_tokenizer_spm_session. */
static void spm_encode(encoder *e, const char *text, size_t n) {
    const bpe_tokenizer *tok = e->tok;
    spm_symbol *sym = malloc((n ? n : 1) * sizeof *sym);
    spm_heap h = {malloc(3 * (n ? n : 1) * sizeof *h.heap), 0}; /* n - 1 seeds + 2 per merge */
    if (!sym || !h.heap) {
        free(sym);
        free(h.heap);
        e->oom = true;
        return;
    }
    int32_t count = 0;
    for (size_t off = 0; off < n; count++) {
        int len = utf8_valid_len((const unsigned char *)text + off, n - off);
        if (len == 0) len = 1; /* (input is valid UTF-8) */
        sym[count] = (spm_symbol){(int32_t)off, len, count - 1, off + (size_t)len == n ? -1 : count + 1};
        off += (size_t)len;
    }
    for (int32_t i = 1; i < count; i++) spm_try_bigram(tok, text, sym, &h, i - 1, i);
    while (h.len) {
        spm_bigram b = spm_pop(&h);
        spm_symbol *l = &sym[b.left], *r = &sym[b.right];
        if (l->n == 0 || r->n == 0 || l->n + r->n != b.size) continue;
        l->n += r->n;
        r->n = 0;
        l->next = r->next;
        if (r->next >= 0) sym[r->next].prev = b.left;
        spm_try_bigram(tok, text, sym, &h, l->prev, b.left);
        spm_try_bigram(tok, text, sym, &h, b.left, l->next);
    }
    for (int32_t i = count ? 0 : -1; i >= 0; i = sym[i].next) {
        int32_t id = vocab_find(tok, text + sym[i].start, (size_t)sym[i].n);
        if (id >= 0) {
            emit(e, id);
            continue;
        }
        /* Every merged symbol is a token, so only a single character lands here: byte fallback. */
        for (int32_t k = 0; k < sym[i].n; k++) {
            int32_t bid = tok->byte_token[(unsigned char)text[sym[i].start + k]];
            if (bid >= 0) emit(e, bid);
        }
    }
    free(sym);
    free(h.heap);
}

static void spm_run(encoder *e, const unsigned char *s, size_t n) {
    bool prefix = e->tok->add_space_prefix && e->prev_special;
    size_t spaces = prefix;
    for (size_t i = 0; i < n; i++) spaces += s[i] == ' ';
    char *text = scratch(e, n + 2 * spaces + 1);
    if (!text) return;
    size_t len = 0;
    if (prefix) {
        memcpy(text, "\xE2\x96\x81", 3);
        len = 3;
    }
    for (size_t i = 0; i < n; i++) {
        if (s[i] == ' ') {
            memcpy(text + len, "\xE2\x96\x81", 3);
            len += 3;
        } else {
            text[len++] = (char)s[i];
        }
    }
    spm_encode(e, text, len);
}

/* Pre-tokenize and encode one run of ordinary text. */
static void encode_ordinary(encoder *e, const unsigned char *s, size_t n) {
    const bpe_tokenizer *tok = e->tok;
    if (tok->kind == TOK_SPM) {
        if (n) { /* llama.cpp has no empty text fragments */
            spm_run(e, s, n);
            e->prev_special = false;
        }
        return;
    }
    if (tok->pre == PRE_LLAMA3 || tok->pre == PRE_QWEN2) {
        regex_split_llama3(e, s, n, tok->pre == PRE_LLAMA3 ? 3 : 1);
        return;
    }
    if (tok->pre == PRE_GPT2) {
        regex_split(e, s, n);
        return;
    }
    /* Digits(individual_digits): each numeric character is a part of its own;
     * the regex runs on each part separately (ends of parts are ends of text). */
    size_t start = 0, i = 0;
    while (i < n) {
        int len;
        if (char_at(s, n, i, &len) == BPE_UCLASS_NUMBER) {
            regex_split(e, s + start, i - start);
            bpe_word(e, s + i, (size_t)len);
            start = i + (size_t)len;
        }
        i += (size_t)len;
    }
    regex_split(e, s + start, n - start);
}

/* Ordinary text accumulates across pieces until an added token (or the end)
 * closes the run. */
typedef struct {
    unsigned char *buf;
    size_t len;
} text_run;

static void run_append(text_run *r, const char *s, size_t n) {
    if (n) memcpy(r->buf + r->len, s, n);
    r->len += n;
}

static void run_flush(encoder *e, text_run *r) {
    encode_ordinary(e, r->buf, r->len);
    r->len = 0;
}

/* Longest added token starting at s[i]; returns its length (0: none). */
/* A USER_DEFINED token that is only ASCII whitespace (MPT's and Gemma's
 * space / newline runs): text, never a marker, so content matches it too. */
static bool is_blank_user_token(const bpe_tokenizer *tok, int32_t id) {
    if (tok->types[id] != BPE_TOKEN_USER_DEFINED) return false;
    for (const char *p = token_text(tok, id); *p; p++)
        if (!strchr(" \t\n\r\v\f", *p)) return false;
    return true;
}

static size_t added_match(const bpe_tokenizer *tok, const unsigned char *s, size_t n, size_t i, bool content,
                          int32_t *id) {
    size_t best = 0;
    int32_t node = 0;
    for (size_t k = i; k < n; k++) {
        node = trie_child(tok, node, s[k]);
        if (node < 0) break;
        int32_t t = tok->trie[node].token;
        if (t >= 0 && (!content || is_blank_user_token(tok, t))) {
            best = k - i + 1;
            *id = tok->trie[node].token;
        }
    }
    return best;
}

/* Split text at added tokens (leftmost-longest), the rest is ordinary. Framing
 * text matches every added token; content (a client's text) only the
 * whitespace-only USER_DEFINED ones, so it never forges a marker, CONTROL or
 * USER_DEFINED (<think>, <tool_call>), while runs of spaces tokenize as in
 * llama.cpp (which matches every USER_DEFINED token in all text). */
/* Past the whitespace an RSTRIP token drops (llama.cpp's isspace: space, \t \n \v \f \r), which goes on
 * into the next piece, content too, as llama.cpp strips it from the one rendered text. */
static size_t skip_stripped(encoder *e, const unsigned char *s, size_t n, size_t i) {
    if (!e->strip_space) return i;
    while (i < n && (s[i] == ' ' || (s[i] >= '\t' && s[i] <= '\r'))) i++;
    if (i < n) e->strip_space = false;
    return i;
}

static void encode_marked(encoder *e, text_run *r, const char *text, size_t n, bool content) {
    const bpe_tokenizer *tok = e->tok;
    const unsigned char *s = (const unsigned char *)text;
    size_t copied = skip_stripped(e, s, n, 0);
    if (tok->trie) {
        for (size_t i = copied; i < n;) {
            int32_t id;
            size_t len = tok->starts_added[s[i]] ? added_match(tok, s, n, i, content, &id) : 0;
            if (!len) {
                i++;
                continue;
            }
            run_append(r, text + copied, i - copied);
            run_flush(e, r);
            emit(e, id);
            e->prev_special = true;
            e->strip_space = tok->rstrip && tok->rstrip[id];
            i = skip_stripped(e, s, n, i + len);
            copied = i;
        }
    }
    run_append(r, text + copied, n - copied);
}

int bpe_encode_pieces(const bpe_tokenizer *tok, const char *const *texts, const size_t *lens, const int *plain,
                      int n_pieces, uint32_t *out, int max_out) {
    if (!tok || n_pieces < 0 || (n_pieces > 0 && (!texts || !lens)) || max_out < 0 || (max_out > 0 && !out))
        return -1;
    size_t total = 0;
    for (int i = 0; i < n_pieces; i++) {
        if (!texts[i] && lens[i] > 0) return -1;
        if (lens[i] > (size_t)INT_MAX - total) return -1;
        total += lens[i];
    }
    encoder e = {.tok = tok, .out = out, .max_out = max_out, .prev_special = true};
    text_run run = {malloc(total ? total : 1), 0};
    char *joined = NULL; /* consecutive pieces of one kind are matched as one text */
    if (!run.buf) return -1;
    for (int i = 0; i < n_pieces;) {
        bool content = plain && plain[i];
        int j = i + 1;
        while (j < n_pieces && (plain && plain[j]) == content) j++;
        if (j == i + 1) {
            if (lens[i]) encode_marked(&e, &run, texts[i], lens[i], content);
        } else {
            if (!joined && !(joined = malloc(total ? total : 1))) {
                e.oom = true;
                break;
            }
            size_t len = 0;
            for (int k = i; k < j; k++) {
                if (lens[k]) memcpy(joined + len, texts[k], lens[k]);
                len += lens[k];
            }
            encode_marked(&e, &run, joined, len, content);
        }
        i = j;
    }
    run_flush(&e, &run);
    free(run.buf);
    free(joined);
    free(e.symbols);
    free(e.heap);
    free(e.scratch);
    if (e.oom || e.count > (size_t)INT_MAX) return -1;
    return (int)e.count;
}

int bpe_encode(const bpe_tokenizer *tok, const char *text, size_t len, int parse_special, uint32_t *out,
               int max_out) {
    int plain = parse_special ? 0 : 1;
    return bpe_encode_pieces(tok, &text, &len, &plain, 1, out, max_out);
}

/* ---- vocabulary queries ---------------------------------------------------- */

static bool valid_id(const bpe_tokenizer *tok, uint32_t id) { return tok && id < (uint32_t)tok->n_tokens; }

int bpe_token_bytes(const bpe_tokenizer *tok, uint32_t id, char *out, int max_bytes) {
    if (!valid_id(tok, id) || max_bytes < 0 || (max_bytes > 0 && !out)) return -1;
    int32_t len = tok->bytes_len[id];
    int32_t n = len < max_bytes ? len : max_bytes;
    if (n > 0) memcpy(out, tok->bytes_arena + tok->bytes_offset[id], (size_t)n);
    return len;
}

int bpe_token_type(const bpe_tokenizer *tok, uint32_t id) { return valid_id(tok, id) ? tok->types[id] : 0; }

const char *bpe_token_text(const bpe_tokenizer *tok, uint32_t id) {
    return valid_id(tok, id) ? token_text(tok, (int32_t)id) : NULL;
}

int32_t bpe_token_id(const bpe_tokenizer *tok, const char *text) {
    if (!tok || !text) return -1;
    return vocab_find(tok, text, strlen(text));
}

/* ---- UTF-8 assembly for decode streams ------------------------------------ */

void utf8_assembler_reset(utf8_assembler *a) {
    if (!a) return;
    memset(a, 0, sizeof *a);
}

int utf8_assembler_feed(utf8_assembler *a, const char *bytes, int n, char *out) {
    if (!out) return -1;
    out[0] = '\0';
    if (!a || n < 0 || (n > 0 && !bytes) || a->n_pending < 0 || a->n_pending > 3) return -1;
    /* Pending bytes (at most 3, an incomplete character) then the new bytes. */
    int olen = 0;
    unsigned char buf[4 + 4];
    size_t total = (size_t)a->n_pending + (size_t)n, pos = 0;
    while (pos < total) {
        /* window of up to 4 bytes starting at pos over pending ++ bytes */
        size_t w = 0;
        for (; w < 4 && pos + w < total; w++) {
            size_t k = pos + w;
            buf[w] = k < (size_t)a->n_pending ? a->pending[k] : (unsigned char)bytes[k - (size_t)a->n_pending];
        }
        int len;
        utf8_scan(buf, w, &len);
        if (len == 0) break; /* incomplete: keep for the next feed */
        if (len > 0) {
            memcpy(out + olen, buf, (size_t)len);
            olen += len;
            pos += (size_t)len;
        } else {
            memcpy(out + olen, "\xEF\xBF\xBD", 3);
            olen += 3;
            pos += (size_t)-len;
        }
    }
    /* Keep the incomplete tail; it is at most 3 bytes and may overlap pending. */
    unsigned char tail[4];
    int n_tail = 0;
    for (size_t k = pos; k < total; k++)
        tail[n_tail++] = k < (size_t)a->n_pending ? a->pending[k] : (unsigned char)bytes[k - (size_t)a->n_pending];
    memcpy(a->pending, tail, (size_t)n_tail);
    a->n_pending = n_tail;
    out[olen] = '\0';
    return olen;
}
