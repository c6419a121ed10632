#pragma once
/* The model object (model.c): what a loaded bundle is -- config, load options
 * as applied, weights, tokenizer and metadata -- and the checks that turn a
 * caller's model handle into one. The loader (loader.c) fills it; the
 * runtime keeps its own mutable state behind `rt` (runtime.h). */

#include "baseRT/baseRT.h"
#include "mathops.h"
#include "tokenizer.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define RT_MODEL_MAGIC 0x42524d31u /* "BRM1": handle validation */

/* Largest head_dim a Q8_0 KV pool takes (attention widens a page slice on the
 * stack); the loader falls back to an f16 pool above it. */
#define RT_KV_MAX_HEAD_DIM 256

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

struct rt_runtime; /* runtime.h: KV pool, sequences, scratch, prefix cache */

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
    /* The API call whose token callback is running on this model (NULL when
     * none): the runtime refuses re-entrant use from inside it (rt_model_busy). */
    const char *in_callback;
} rt_model;

/* Validate a handle; sets INVALID_ARGUMENT naming `fn` and returns NULL when bad. */
rt_model *rt_model_check(baseRT_model_t model, const char *fn);
/* rt_model_check without touching the error state (pure queries). */
rt_model *rt_model_lookup(baseRT_model_t model);
/* rt_model_check for entry points that need the runtime: NULL with the error
 * set for a tokenizer-only model too. */
rt_model *rt_runtime_model(baseRT_model_t model, const char *fn);
/* Is m inside a token callback? Then sets INVALID_ARGUMENT naming `fn` and
 * returns true: the callback must not reset, re-run, step or free the model
 * whose generation called it (that would pull its buffers away under it). */
bool rt_model_busy(const rt_model *m, const char *fn);
/* Free everything the loader allocated (not the runtime state). NULL-safe. */
void rt_model_destroy(rt_model *m);
