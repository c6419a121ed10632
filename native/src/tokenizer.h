#pragma once
/* The GGUF tokenizers the engine runs exactly, and the UTF-8 assembler behind
 * decode streams. Pure C11, no engine state: the loader hands it the
 * vocabulary arrays it read from the bundle header (`tokenizer.ggml.tokens`,
 * `.token_type`, `.merges`, `.scores`, `.model`, `.pre`, `.add_space_prefix`).
 *
 *  - model "gpt2": byte-level BPE with one of the pre-tokenizer regexes below;
 *  - model "llama": SentencePiece BPE (merge by highest score, <0xNN> byte
 *    fallback, spaces as U+2581), as llama.cpp runs it (Llama 2, Mistral,
 *    Phi-3, Gemma 1-3).
 *
 * Parity targets: llama.cpp's tokenizer on its own vocabulary test files, and
 * HF `tokenizers` with the equivalent tokenizer.json (aiobasert/_hf_tokenizer.py). */

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

/* Build a byte-level BPE tokenizer (bpe_create_model with model "gpt2").
 * `tokens[i]` is token i's text in byte-level (GPT-2 bytes-to-unicode) form,
 * NUL-terminated UTF-8 (SentencePiece: its text with U+2581 for spaces);
 * `token_types` may be NULL (all normal); `merges[i]` is "left right" (one
 * space). `pre` names the pre-tokenizer (see bpe_supported). Returns NULL and
 * writes a message into err on failure. */
bpe_tokenizer *bpe_create(const char *const *tokens, const int32_t *token_types, int n_tokens,
                          const char *const *merges, int n_merges, const char *pre, char *err, size_t errlen);

/* Everything bpe_create_model needs beyond the token and merge arrays. */
typedef struct {
    const char *model;     /* tokenizer.ggml.model: "gpt2" (NULL too) or "llama" */
    const char *pre;       /* tokenizer.ggml.pre (byte-level BPE only; see bpe_supported) */
    const float *scores;   /* "llama": one score per token (NULL: all 0) */
    int add_space_prefix;  /* "llama": prefix a space to text at the start / after a special token */
    /* NULL, or one flag per token: in framing text, the whitespace after this added token is dropped
     * (llama.cpp's LLAMA_TOKEN_ATTR_RSTRIP, which it sets on Phi-3's special tokens) */
    const unsigned char *rstrip;
} bpe_options;

/* 1 when the engine tokenizes (model, pre) exactly as llama.cpp does, else 0.
 * "llama" takes any pre (llama.cpp ignores it for SentencePiece). Byte-level
 * pre-tokenizers: the GPT-2 regex ("gpt2", "gpt-2", "phi-2", "mpt", "olmo"),
 * digits alone then GPT-2 ("smollm", "starcoder", "refact", "command-r",
 * "codeshell", "exaone", "minerva-7b"), Llama 3 ("llama-bpe", "llama3",
 * "llama-v3", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2"; also
 * whole-word lookup before BPE) and Qwen2 ("qwen2", "deepseek-r1-qwen",
 * "stablelm2"). */
int bpe_supported(const char *model, const char *pre);
bpe_tokenizer *bpe_create_model(const char *const *tokens, const int32_t *token_types, int n_tokens,
                                const char *const *merges, int n_merges, const bpe_options *opt, char *err,
                                size_t errlen);
void bpe_free(bpe_tokenizer *tok);
/* Sharing: a built tokenizer is immutable, so handles loading the same bundle file share one (a
 * 262k-token vocabulary is ~30 MB; every intake worker opens a tokenizer-only handle). key: the
 * loader's identity of the file. bpe_shared_get returns a registered tokenizer with that key, retained
 * (NULL: none); bpe_shared_put registers tok (then bpe_free drops one reference, the last frees it). */
enum { BPE_SHARE_KEY = 6 };
bpe_tokenizer *bpe_shared_get(const uint64_t key[BPE_SHARE_KEY]);
void bpe_shared_put(bpe_tokenizer *tok, const uint64_t key[BPE_SHARE_KEY]);
int bpe_vocab_size(const bpe_tokenizer *tok);

/* Encode n_pieces pieces as ONE text. Piece i is framing when plain[i] == 0
 * (substrings equal to a CONTROL / USER_DEFINED / UNKNOWN token's text become
 * that one id, leftmost-longest) and content otherwise (marker text stays
 * ordinary text; only USER_DEFINED tokens made of ASCII whitespace, such as
 * MPT's and Gemma's space runs, are matched, as llama.cpp matches them in all
 * text). Consecutive pieces of one kind are matched
 * as one text. The pre-tokenizer and BPE see the concatenation of the
 * ordinary-text runs, so a piece boundary tokenizes as the whole text would
 * (SentencePiece with add_space_prefix: each run that starts the text or
 * follows an added token gets the leading space, as in llama.cpp). `plain` may
 * be NULL (all framing). Writes up to max_out ids; returns the TOTAL count
 * (which may exceed max_out: the caller retries with a larger buffer), or -1
 * on invalid arguments. No BOS is added (the engine decides that). */
int bpe_encode_pieces(const bpe_tokenizer *tok, const char *const *texts, const size_t *lens, const int *plain,
                      int n_pieces, uint32_t *out, int max_out);
/* One text: parse_special != 0 behaves as a framing piece, 0 as content. */
int bpe_encode(const bpe_tokenizer *tok, const char *text, size_t len, int parse_special, uint32_t *out,
               int max_out);

/* Token id -> its exact raw bytes (byte-level decoded, or for SentencePiece
 * U+2581 -> space and <0xNN> -> the byte; CONTROL / USER_DEFINED / UNKNOWN
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
