#pragma once
/* Byte-level BPE tokenizer (GPT-2 family, as SmolLM2 uses it) and the UTF-8
 * assembler behind decode streams. Pure C11, no engine state: the loader hands
 * it the vocabulary arrays it read from the bundle header
 * (`tokenizer.ggml.tokens`, `.token_type`, `.merges`, `.pre`).
 *
 * Parity target: HF `tokenizers` with the equivalent tokenizer.json
 * (aiobasert/_hf_tokenizer.py builds it from the same arrays). */

#include <stddef.h>
#include <stdint.h>

typedef struct bpe_tokenizer bpe_tokenizer;

/* GGUF token types (llama.cpp's llama_token_type). */
enum {
    BPE_TOKEN_NORMAL = 1,
    BPE_TOKEN_UNKNOWN = 2,
    BPE_TOKEN_CONTROL = 3,      /* special: <|im_start|>, <|endoftext|> ... */
    BPE_TOKEN_USER_DEFINED = 4, /* added token matched as a whole in text */
    BPE_TOKEN_UNUSED = 5,
    BPE_TOKEN_BYTE = 6,
};

/* Build a tokenizer. `tokens[i]` is token i's text in byte-level (GPT-2
 * bytes-to-unicode) form, NUL-terminated UTF-8; `token_types` may be NULL
 * (all normal); `merges[i]` is "left right" (one space). `pre` names the
 * pre-tokenizer: "smollm" (digits split one by one, then the GPT-2 regex),
 * "gpt2" / "default" (GPT-2 regex only). Returns NULL and writes a message
 * into err on failure. */
bpe_tokenizer *bpe_create(const char *const *tokens, const int32_t *token_types, int n_tokens,
                          const char *const *merges, int n_merges, const char *pre, char *err, size_t errlen);
void bpe_free(bpe_tokenizer *tok);
int bpe_vocab_size(const bpe_tokenizer *tok);

/* Encode n_pieces pieces as ONE text. Piece i is framing when plain[i] == 0
 * (substrings equal to a CONTROL / USER_DEFINED token's text become that one
 * id, leftmost-longest) and content otherwise (marker text stays ordinary
 * text). The pre-tokenizer and BPE see the concatenation of the ordinary-text
 * runs, so a piece boundary tokenizes as the whole text would. `plain` may be
 * NULL (all framing). Writes up to max_out ids; returns the TOTAL count
 * (which may exceed max_out: the caller retries with a larger buffer), or -1
 * on invalid arguments. No BOS is added (the engine decides that). */
int bpe_encode_pieces(const bpe_tokenizer *tok, const char *const *texts, const size_t *lens, const int *plain,
                      int n_pieces, uint32_t *out, int max_out);
/* One text: parse_special != 0 behaves as a framing piece, 0 as content. */
int bpe_encode(const bpe_tokenizer *tok, const char *text, size_t len, int parse_special, uint32_t *out,
               int max_out);

/* Token id -> its exact raw bytes (byte-level decoded; CONTROL/USER_DEFINED
 * tokens give their literal text). Writes up to max_bytes; returns the full
 * length, or -1 for an out-of-range id. */
int bpe_token_bytes(const bpe_tokenizer *tok, uint32_t id, char *out, int max_bytes);
/* The token type of id (BPE_TOKEN_*), or 0 for an out-of-range id. */
int bpe_token_type(const bpe_tokenizer *tok, uint32_t id);
/* Literal text of a token as stored in the vocabulary (NUL-terminated). */
const char *bpe_token_text(const bpe_tokenizer *tok, uint32_t id);
/* Look up a token id by its vocabulary text; -1 when absent. */
int32_t bpe_token_id(const bpe_tokenizer *tok, const char *text);

/* Incremental UTF-8 assembly for decode streams: bytes go in token by token;
 * out comes the longest complete, valid UTF-8 prefix not yet emitted. A
 * multi-byte character split over tokens is emitted whole, once; a byte
 * sequence that can never become valid is emitted as U+FFFD. */
typedef struct {
    unsigned char pending[8];
    int n_pending;
} utf8_assembler;
void utf8_assembler_reset(utf8_assembler *a);
/* Feed n bytes; writes the text to emit into out (NUL-terminated, needs room
 * for 3 * (n + 8) + 1 bytes) and returns its length. */
int utf8_assembler_feed(utf8_assembler *a, const char *bytes, int n, char *out);
