/* Test driver for native/src/tokenizer.c (not part of the library build).
 *
 *   tok_driver encode VOCAB INPUT    encode each record of INPUT
 *   tok_driver utf8 INPUT            run utf8_assembler over each record's feeds
 *   tok_driver bytes VOCAB IDS       bpe_token_bytes of each id in IDS (whitespace-separated), one hex line each
 *   tok_driver bench VOCAB TEXT N    time N encodes (parse_special=1) of the file TEXT
 *   tok_driver misuse VOCAB          invalid arguments must fail cleanly ("ok" when they do)
 *
 * Binary-safe formats ("<len>\n<bytes>\n" is a blob):
 *   VOCAB: "pre <name>\n" "model <name>\n" "space_prefix <0|1>\n"
 *          "<n_tokens>\n" then per token "<type> <score> " blob,
 *          "<n_merges>\n" then per merge a blob.
 *   INPUT (encode): "<n_records>\n", per record "<n_pieces>\n" then per piece
 *          "<plain> " blob. One piece goes through bpe_encode, more through
 *          bpe_encode_pieces.
 *   INPUT (utf8): "<n_records>\n", per record "<n_feeds>\n" then a blob per feed.
 * Output (encode): per record a line of ids and a line with the hex of the
 *   concatenated bpe_token_bytes of those ids ("-" when empty).
 * Output (utf8): per record a line: the hex output of each feed ("-" when
 *   empty), then the number of bytes left pending.
 * Failed self-checks print to stderr and exit 1; a vocabulary bpe_create
 * rejects prints "CREATE_ERROR: <message>" and exits 2. */

#define _POSIX_C_SOURCE 200809L
#include "tokenizer.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static void die(const char *what) {
    fprintf(stderr, "tok_driver: %s\n", what);
    exit(1);
}

static void *xmalloc(size_t n) {
    void *p = malloc(n ? n : 1);
    if (!p) die("out of memory");
    return p;
}

static long read_long(FILE *f) {
    long v;
    if (fscanf(f, "%ld", &v) != 1) die("malformed input: expected a number");
    return v;
}

/* "<len>\n<bytes>\n" -> NUL-terminated copy (the length is returned too). */
static char *read_blob(FILE *f, size_t *len_out) {
    long len = read_long(f);
    if (len < 0 || fgetc(f) != '\n') die("malformed blob header");
    char *buf = xmalloc((size_t)len + 1);
    if (fread(buf, 1, (size_t)len, f) != (size_t)len || fgetc(f) != '\n') die("truncated blob");
    buf[len] = '\0';
    if (len_out) *len_out = (size_t)len;
    return buf;
}

static FILE *open_or_die(const char *path) {
    FILE *f = fopen(path, "rb");
    if (!f) die("cannot open input file");
    return f;
}

static bpe_tokenizer *load_vocab(const char *path) {
    FILE *f = open_or_die(path);
    char pre[64], model[64];
    int space_prefix;
    if (fscanf(f, "pre %63s model %63s space_prefix %d", pre, model, &space_prefix) != 3) die("malformed vocab header");
    int n_tokens = (int)read_long(f);
    char **tokens = xmalloc((size_t)n_tokens * sizeof *tokens);
    int32_t *types = xmalloc((size_t)n_tokens * sizeof *types);
    float *scores = xmalloc((size_t)n_tokens * sizeof *scores);
    for (int i = 0; i < n_tokens; i++) {
        types[i] = (int32_t)read_long(f);
        if (fscanf(f, "%f", &scores[i]) != 1 || fgetc(f) != ' ') die("malformed vocab: score");
        tokens[i] = read_blob(f, NULL);
    }
    int n_merges = (int)read_long(f);
    char **merges = xmalloc((size_t)n_merges * sizeof *merges);
    for (int i = 0; i < n_merges; i++) merges[i] = read_blob(f, NULL);
    fclose(f);

    char err[256];
    bpe_options opt = {.model = model, .pre = pre, .scores = scores, .add_space_prefix = space_prefix};
    bpe_tokenizer *tok = bpe_create_model((const char *const *)tokens, types, n_tokens, (const char *const *)merges,
                                          n_merges, &opt, err, sizeof err);
    /* bpe_supported answers what creation does (a refused name is refused by both). */
    if (tok && !bpe_supported(model, pre)) die("bpe_supported refuses a tokenizer bpe_create_model built");
    if (!tok && (strstr(err, "unsupported") != NULL) == (bpe_supported(model, pre) != 0))
        die("bpe_supported accepts a tokenizer bpe_create_model refused");
    if (!tok) {
        printf("CREATE_ERROR: %s\n", err);
        exit(2);
    }
    /* The queries must reflect the input vocabulary. */
    if (bpe_vocab_size(tok) != n_tokens) die("bpe_vocab_size mismatch");
    for (int i = 0; i < n_tokens; i++) {
        if (strcmp(bpe_token_text(tok, (uint32_t)i), tokens[i]) != 0) die("bpe_token_text mismatch");
        if (bpe_token_type(tok, (uint32_t)i) != types[i]) die("bpe_token_type mismatch");
        int32_t id = bpe_token_id(tok, tokens[i]);
        if (id < 0 || id > i || strcmp(tokens[id], tokens[i]) != 0) die("bpe_token_id mismatch");
    }
    if (bpe_token_text(tok, (uint32_t)n_tokens) || bpe_token_type(tok, (uint32_t)n_tokens) != 0 ||
        bpe_token_bytes(tok, (uint32_t)n_tokens, NULL, 0) != -1)
        die("out-of-range id accepted");
    for (int i = 0; i < n_tokens; i++) free(tokens[i]);
    for (int i = 0; i < n_merges; i++) free(merges[i]);
    free(tokens);
    free(types);
    free(scores);
    free(merges);
    return tok;
}

static int encode_record(const bpe_tokenizer *tok, char **texts, size_t *lens, int *plain, int n, uint32_t *out,
                         int max_out) {
    if (n == 1) return bpe_encode(tok, texts[0], lens[0], !plain[0], out, max_out);
    return bpe_encode_pieces(tok, (const char *const *)texts, lens, plain, n, out, max_out);
}

static void print_hex(const unsigned char *s, size_t n) {
    if (n == 0) fputs("-", stdout);
    for (size_t i = 0; i < n; i++) printf("%02x", s[i]);
}

static int cmd_encode(const char *vocab_path, const char *input_path) {
    bpe_tokenizer *tok = load_vocab(vocab_path);
    FILE *f = open_or_die(input_path);
    long n_records = read_long(f);
    for (long r = 0; r < n_records; r++) {
        int n = (int)read_long(f);
        char **texts = xmalloc((size_t)n * sizeof *texts);
        size_t *lens = xmalloc((size_t)n * sizeof *lens);
        int *plain = xmalloc((size_t)n * sizeof *plain);
        for (int i = 0; i < n; i++) {
            plain[i] = (int)read_long(f);
            texts[i] = read_blob(f, &lens[i]);
        }
        /* Size query, full encode, then a truncated one: same count, same prefix. */
        int count = encode_record(tok, texts, lens, plain, n, NULL, 0);
        if (count < 0) die("encode failed");
        uint32_t *ids = xmalloc((size_t)count * sizeof *ids + 1);
        if (encode_record(tok, texts, lens, plain, n, ids, count) != count) die("count changed");
        int half = count / 2;
        uint32_t *prefix = xmalloc((size_t)half * sizeof *prefix + 1);
        if (encode_record(tok, texts, lens, plain, n, prefix, half) != count) die("truncated count");
        if (half && memcmp(prefix, ids, (size_t)half * sizeof *ids) != 0) die("truncated prefix differs");

        size_t cap = 64, used = 0;
        unsigned char *bytes = xmalloc(cap);
        for (int i = 0; i < count; i++) {
            printf(i ? " %u" : "%u", ids[i]);
            int len = bpe_token_bytes(tok, ids[i], NULL, 0);
            if (len < 0) die("bpe_token_bytes failed");
            while (used + (size_t)len > cap) {
                cap *= 2;
                bytes = realloc(bytes, cap);
                if (!bytes) die("out of memory");
            }
            if (bpe_token_bytes(tok, ids[i], (char *)bytes + used, len) != len) die("bpe_token_bytes length");
            used += (size_t)len;
        }
        putchar('\n');
        print_hex(bytes, used);
        putchar('\n');
        for (int i = 0; i < n; i++) free(texts[i]);
        free(texts);
        free(lens);
        free(plain);
        free(ids);
        free(prefix);
        free(bytes);
    }
    fclose(f);
    bpe_free(tok);
    return 0;
}

static int cmd_bytes(const char *vocab_path, const char *ids_path) {
    bpe_tokenizer *tok = load_vocab(vocab_path);
    FILE *f = open_or_die(ids_path);
    unsigned id;
    char buf[4096];
    while (fscanf(f, "%u", &id) == 1) {
        int n = bpe_token_bytes(tok, id, buf, (int)sizeof buf);
        if (n < 0 || n > (int)sizeof buf) die("bpe_token_bytes failed");
        print_hex((const unsigned char *)buf, (size_t)n);
        putchar('\n');
    }
    fclose(f);
    bpe_free(tok);
    return 0;
}

static int cmd_utf8(const char *input_path) {
    FILE *f = open_or_die(input_path);
    long n_records = read_long(f);
    for (long r = 0; r < n_records; r++) {
        utf8_assembler a;
        utf8_assembler_reset(&a);
        long n_feeds = read_long(f);
        for (long k = 0; k < n_feeds; k++) {
            size_t len;
            char *feed = read_blob(f, &len);
            char *out = xmalloc(3 * (len + 8) + 1);
            int olen = utf8_assembler_feed(&a, feed, (int)len, out);
            if (olen < 0 || out[olen] != '\0') die("utf8_assembler_feed failed");
            if (k) putchar(' ');
            print_hex((const unsigned char *)out, (size_t)olen);
            free(out);
            free(feed);
        }
        printf(" %d\n", a.n_pending);
    }
    fclose(f);
    return 0;
}

static int cmd_bench(const char *vocab_path, const char *text_path, int repeat) {
    bpe_tokenizer *tok = load_vocab(vocab_path);
    FILE *f = open_or_die(text_path);
    fseek(f, 0, SEEK_END);
    long size = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *text = xmalloc((size_t)size);
    if (fread(text, 1, (size_t)size, f) != (size_t)size) die("short read");
    fclose(f);
    int count = bpe_encode(tok, text, (size_t)size, 1, NULL, 0);
    uint32_t *ids = xmalloc((size_t)count * sizeof *ids + 1);
    struct timespec t0, t1;
    double best = 1e30;
    for (int r = 0; r < repeat; r++) {
        clock_gettime(CLOCK_MONOTONIC, &t0);
        if (bpe_encode(tok, text, (size_t)size, 1, ids, count) != count) die("bench count changed");
        clock_gettime(CLOCK_MONOTONIC, &t1);
        double ms = (double)(t1.tv_sec - t0.tv_sec) * 1e3 + (double)(t1.tv_nsec - t0.tv_nsec) / 1e6;
        if (ms < best) best = ms;
    }
    printf("bytes %ld tokens %d best_ms %.3f\n", size, count, best);
    free(ids);
    free(text);
    bpe_free(tok);
    return 0;
}

/* Invalid arguments fail cleanly instead of crashing. */
static int cmd_misuse(const char *vocab_path) {
    bpe_tokenizer *tok = load_vocab(vocab_path);
    char err[128] = "";
    const char *tokens[] = {"a", "b"};
    const char *bad_merge[] = {"a c"};
    uint32_t ids[4];
    const char *texts[] = {"ab", NULL};
    size_t lens[] = {2, 1};
    char out[64];
    utf8_assembler a;
    utf8_assembler_reset(&a);
    struct {
        const char *what;
        int ok;
    } checks[] = {
        {"create without tokens", !bpe_create(NULL, NULL, 2, NULL, 0, "gpt2", err, sizeof err) && err[0]},
        {"create with 0 tokens", !bpe_create(tokens, NULL, 0, NULL, 0, "gpt2", err, sizeof err)},
        {"create with a NULL merge list", !bpe_create(tokens, NULL, 2, NULL, 1, "gpt2", err, sizeof err)},
        {"create with an unknown merge", !bpe_create(tokens, NULL, 2, bad_merge, 1, "gpt2", NULL, 0)},
        {"encode NULL tokenizer", bpe_encode(NULL, "a", 1, 1, ids, 4) == -1},
        {"encode NULL text", bpe_encode(tok, NULL, 1, 1, ids, 4) == -1},
        {"encode NULL out", bpe_encode(tok, "a", 1, 1, NULL, 4) == -1},
        {"encode negative max_out", bpe_encode(tok, "a", 1, 1, ids, -1) == -1},
        {"encode empty", bpe_encode(tok, NULL, 0, 1, NULL, 0) == 0},
        {"pieces NULL lens", bpe_encode_pieces(tok, texts, NULL, NULL, 1, ids, 4) == -1},
        {"pieces NULL text", bpe_encode_pieces(tok, texts, lens, NULL, 2, ids, 4) == -1},
        {"pieces negative count", bpe_encode_pieces(tok, texts, lens, NULL, -1, ids, 4) == -1},
        {"pieces none", bpe_encode_pieces(tok, NULL, NULL, NULL, 0, NULL, 0) == 0},
        {"token bytes NULL out", bpe_token_bytes(tok, 0, NULL, 4) == -1},
        {"token bytes length query", bpe_token_bytes(tok, 0, NULL, 0) >= 0},
        {"token id NULL", bpe_token_id(tok, NULL) == -1 && bpe_token_id(NULL, "a") == -1},
        {"token text NULL tokenizer", bpe_token_text(NULL, 0) == NULL && bpe_vocab_size(NULL) == 0},
        {"feed NULL assembler", utf8_assembler_feed(NULL, "a", 1, out) == -1},
        {"feed NULL bytes", utf8_assembler_feed(&a, NULL, 1, out) == -1},
        {"feed negative length", utf8_assembler_feed(&a, "a", -1, out) == -1},
        {"feed NULL out", utf8_assembler_feed(&a, "a", 1, NULL) == -1},
    };
    int failed = 0;
    for (size_t i = 0; i < sizeof checks / sizeof checks[0]; i++) {
        if (!checks[i].ok) {
            printf("FAILED: %s\n", checks[i].what);
            failed = 1;
        }
    }
    bpe_free(NULL);
    bpe_free(tok);
    if (!failed) printf("ok\n");
    return failed;
}

int main(int argc, char **argv) {
    if (argc == 4 && strcmp(argv[1], "encode") == 0) return cmd_encode(argv[2], argv[3]);
    if (argc == 3 && strcmp(argv[1], "utf8") == 0) return cmd_utf8(argv[2]);
    if (argc == 4 && strcmp(argv[1], "bytes") == 0) return cmd_bytes(argv[2], argv[3]);
    if (argc == 5 && strcmp(argv[1], "bench") == 0) return cmd_bench(argv[2], argv[3], atoi(argv[4]));
    if (argc == 3 && strcmp(argv[1], "misuse") == 0) return cmd_misuse(argv[2]);
    fprintf(stderr, "usage: tok_driver encode VOCAB INPUT | utf8 INPUT | bench VOCAB TEXT N | misuse VOCAB\n");
    return 64;
}
