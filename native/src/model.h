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

/* RoPE on one table of angles: pair i of a head turns by
 * pos * theta^(-2i/head_dim) / freq_factor[i], scaled and blended as llama.cpp's
 * rope_yarn does (linear: freq_scale = 1/factor, ext_factor 0). */
typedef struct {
    double theta;
    double freq_scale;      /* 1 / the linear or YaRN factor; 1 = unscaled */
    double ext_factor;      /* YaRN's extrapolation mix: 1 for YaRN, else 0 */
    double attn_factor;     /* YaRN's magnitude scale (1) */
    double beta_fast, beta_slow;
    uint32_t orig_ctx;      /* YaRN: the context the model was trained at */
    bool freq_factors;      /* divide by the model's rope_freqs (Llama 3's llama3 scaling) */
    /* Llama 3.1's llama3 scaling from the config (HF's rope_scaling) when there is no rope_freqs:
     * long wavelengths divided by llama3_factor, short ones kept, a smooth blend between. */
    double llama3_factor;   /* 0: not this scaling */
    double low_freq_factor, high_freq_factor;
} rt_rope_params;

typedef enum { RT_ROPE_ADJACENT, RT_ROPE_NEOX } rt_rope_pairs; /* (2i, 2i+1) or (i, i + head_dim/2) */
typedef enum { RT_ACT_SILU, RT_ACT_GELU_TANH } rt_activation;   /* the gated FFN's gate */

/* What an architecture is: everything the forward pass reads that differs
 * between model families. loader.c's architecture table sets the family's
 * fixed traits; the bundle's config sets the numbers. */
typedef struct {
    char name[32];
    rt_rope_pairs rope_pairs;
    rt_activation act;
    bool qkv_bias;         /* q/k/v projections have biases (Qwen2) */
    bool qk_norm;          /* per-head RMSNorm of q and k before RoPE (Qwen3, Gemma 3) */
    bool out_norms;        /* RMSNorm of the attention and FFN outputs before the residual add (Gemma 3) */
    float embed_scale;     /* the embedding row times this (Gemma: sqrt(dim)), else 1 */
    float attn_scale;      /* q.k times this: 1/sqrt(head_dim) unless the config says otherwise */
    float final_softcap;   /* logits = c * tanh(logits / c); 0 = none */
    uint32_t sliding_window; /* a sliding layer's query sees this many positions, itself included */
    rt_rope_params rope[2]; /* [0] full-attention layers, [1] sliding-window layers */
} rt_arch;

typedef struct {
    /* Matrices row-major [out][in] (PyTorch Linear layout), f16 as stored in
     * the bundle or f32 (f32 and bf16 bundles); norms are f32 [dim]. */
    float *attn_norm;  /* [dim] */
    rt_weight wq;      /* [q_dim][dim]; rows GGUF-permuted for adjacent-pair RoPE */
    rt_weight wk;      /* [kv_dim][dim] */
    rt_weight wv;      /* [kv_dim][dim] */
    rt_weight wo;      /* [dim][q_dim] */
    float *ffn_norm;   /* [dim] */
    rt_weight w_gate;  /* [ffn_dim][dim] */
    rt_weight w_up;    /* [ffn_dim][dim] */
    rt_weight w_down;  /* [dim][ffn_dim] */
    /* per architecture (NULL when it has none) */
    float *bq, *bk, *bv;          /* [q_dim], [kv_dim], [kv_dim] */
    float *q_norm, *k_norm;       /* [head_dim] */
    float *attn_out_norm;         /* [dim] */
    float *ffn_out_norm;          /* [dim] */
    bool sliding;                 /* sliding-window attention and rope[1] */
} rt_layer;

struct rt_runtime; /* runtime.h: KV pool, sequences, scratch, prefix cache */

typedef struct rt_model {
    uint32_t magic;
    baseRT_model_t handle; /* what the caller holds (handles.c) */
    char *path;
    BaseRTModelConfig cfg; /* max_seq_len = effective context */
    rt_arch arch;
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
    float *rope_freqs; /* [head_dim / 2] frequency divisors, NULL when absent */
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
    /* baseRT_set_speculation's flag (default false). Stored and reported only:
     * the reference engine's generate calls do no n-gram prediction of their
     * own (speculative decoding is the caller's, verified through the
     * multi-row steps). Atomic: a server may read it while another thread
     * sets it. */
    _Atomic bool speculation;
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
