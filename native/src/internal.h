#pragma once
/* Shared internals of the reference engine. Ownership of the .c files:
 *   errors.c, json.c, json.h, loader.c, api_model.c, api_tokenizer.c,
 *   sampling.c          -- "front": load, config, tokenizer ABI, decode
 *                          streams, host-side logits-row ops
 *   kv.c, forward.c, batch.c, prefix.c, api_runtime.c, mathops.c
 *                       -- "runtime": paged KV, sequences, the forward pass,
 *                          batched steps, single-sequence path, prefix cache
 *   tokenizer.c, unicode_data.c -- BPE tokenizer (tokenizer.h)
 * The model handle (rt_model) is filled by the loader; the runtime keeps its
 * own state behind `rt` and is created by rt_runtime_init(). */

#include "baseRT/baseRT.h"
#include "mathops.h"
#include "tokenizer.h"

#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define RT_MODEL_MAGIC 0x42524d31u /* "BRM1": handle validation */
#define RT_SEQ_MAGIC 0x42525331u   /* "BRS1" */
#define RT_STREAM_MAGIC 0x42524431u

/* ---- errors (errors.c) ------------------------------------------------- */
/* Thread-local error state. Every public entry point that succeeds calls
 * rt_clear_error(); every failure calls rt_set_error() with a message that
 * names the function and the bad value. */
void rt_set_error(BaseRTErrorCode code, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
void rt_clear_error(void);
BaseRTErrorCode rt_last_error_code(void);

/* ---- handle table (handles.c) ------------------------------------------ */
/* Model, sequence, decode-stream and grammar handles are table entries, not
 * pointers (see handles.c):
 * a lookup never follows caller memory, and a freed handle stays invalid even
 * when its slot or its object's address is reused. */
enum { RT_KIND_MODEL = 1, RT_KIND_SEQ = 2, RT_KIND_STREAM = 3, RT_KIND_GRAMMAR = 4 };
enum { RT_HANDLE_OK = 0, RT_HANDLE_STALE = 1, RT_HANDLE_FOREIGN = 2 };
/* A new handle for obj; NULL when out of memory. */
void *rt_handle_new(int kind, void *obj);
/* Invalidate a handle (no-op for a handle that is not live). */
void rt_handle_release(const void *h);
/* The object of a live handle of `kind`, else NULL with *why (may be NULL)
 * RT_HANDLE_STALE (freed) or RT_HANDLE_FOREIGN. */
void *rt_handle_get(const void *h, int kind, int *why);
/* Live handles of a kind, process-wide (tests, through baseRT_ref_*). */
int rt_handle_live_count(int kind);

/* ---- model ------------------------------------------------------------- */
typedef struct {
    /* Matrices row-major [out][in] (PyTorch Linear layout), f16 as stored in
     * the bundle or f32 (f32 and bf16 bundles); norms are f32 [dim]. */
    float *attn_norm;  /* [dim] */
    rt_weight wq;      /* [q_dim][dim], GGUF-permuted rows: adjacent-pair RoPE */
    rt_weight wk;      /* [kv_dim][dim], GGUF-permuted rows */
    rt_weight wv;      /* [kv_dim][dim] */
    rt_weight wo;      /* [dim][q_dim] */
    float *ffn_norm;   /* [dim] */
    rt_weight w_gate;  /* [ffn_dim][dim] */
    rt_weight w_up;    /* [ffn_dim][dim] */
    rt_weight w_down;  /* [dim][ffn_dim] */
} rt_layer;

struct rt_runtime; /* runtime-private: KV pool, sequences, scratch, prefix cache */

typedef struct rt_model {
    uint32_t magic;
    baseRT_model_t handle; /* what the caller holds (handles.c) */
    char *path;
    BaseRTModelConfig cfg; /* architecture "llama"; max_seq_len = effective context */
    int trained_context;   /* from the bundle (max_position_embeddings) */
    bool tokenizer_only;

    /* load options as applied */
    int paged_kv;
    int max_batch_size; /* >= 1 */
    int prefix_cache;
    int prefill_chunk; /* tokens per forward chunk, >= 16 */
    int kv_bits;       /* effective: 32 (f32 pool, kv_bits 0 = auto), 16 (f16) or 8 (Q8_0) */

    /* weights (NULL when tokenizer_only) */
    rt_weight tok_embd; /* [vocab][dim] */
    rt_weight lm_head;  /* [vocab][dim]; shares tok_embd's memory when tied */
    bool tied_embeddings;
    float *final_norm; /* [dim] */
    rt_layer *layers;  /* [n_layers] */
    size_t weight_bytes;

    /* tokenizer and metadata */
    bpe_tokenizer *tok;
    uint32_t bos_id, eos_id;
    int add_bos;
    uint32_t *eos_ids; /* every stop id, eos_id included */
    int n_eos_ids;
    char *bos_str, *eos_str;
    char *chat_template; /* jinja, "" when absent */
    uint32_t *special_ids; /* CONTROL + USER_DEFINED ids, ascending */
    int n_special;
    uint64_t weights_identity;
    char *capability_descriptor; /* JSON, built at load */

    struct rt_runtime *rt; /* NULL when tokenizer_only */
} rt_model;

/* Validate a handle; sets INVALID_ARGUMENT naming `fn` and returns NULL when bad. */
rt_model *rt_model_check(baseRT_model_t model, const char *fn);

/* ---- runtime hooks (runtime owner) ------------------------------------- */
/* Called by the loader after weights and config are in place. Allocates the
 * KV pool (max_batch_size lanes x max_seq_len tokens, paged in blocks),
 * scratch buffers and the default sequence. Returns BASERT_OK or sets the
 * error and returns its code. */
int rt_runtime_init(rt_model *m);
void rt_runtime_free(rt_model *m);
/* Largest head_dim a Q8_0 KV pool takes (attention widens a page slice on the stack). */
#define RT_KV_MAX_HEAD_DIM 256
/* KV page size in tokens (16). */
#define RT_PAGE_SIZE 16

/* ---- host-side sampling (sampling.c, front owner) ---------------------- */
/* All take f32 logits rows of length vocab. */
uint32_t rt_argmax_f32(const float *row, int vocab); /* lowest index wins ties */
/* Full CPU pipeline of baseRT_sample_logits_row over a scratch copy. */
uint32_t rt_sample_cfg_f32(const float *row, int vocab, const BaseRTSamplingConfig *cfg, const uint32_t *prev,
                           int n_prev, int repeat_window, uint32_t seed_offset, float *scratch);
/* Gumbel-max sampling of baseRT_batch_step_fused_sample for one row
 * (temperature <= 0: argmax). Deterministic in (row values, rs->seed). */
uint32_t rt_sample_row_f32(const float *row, int vocab, const BaseRTRowSampling *rs, float *scratch);

/* ---- f16 helpers (mathops.c, runtime owner) ---------------------------- */
uint16_t rt_f32_to_f16(float f); /* round to nearest even */
float rt_f16_to_f32(uint16_t h);
float rt_bf16_to_f32(uint16_t h);

/* ---- fault injection (errors.c) ---------------------------------------- */
/* Test-only switch (not part of the baseRT ABI), read from the environment at
 * load and settable at run time through baseRT_ref_inject_fault():
 *   kind 1: fail the Nth fused batch step (GENERATION_FAILED)
 *   kind 2: fail the Nth baseRT_sequence_create (OUT_OF_MEMORY)
 * n counts calls from the moment it is set (1 = the next call); 0 disarms. */
enum { RT_FAULT_STEP = 1, RT_FAULT_SEQ_CREATE = 2 };
bool rt_fault_should_fail(int kind);
