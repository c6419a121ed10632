#pragma once
/* The runtime's state (types only, no functions): the paged KV pool and its
 * sequences, forward scratch, logits buffers, taps, the prefix cache and the
 * thread pool of one model (rt_model.rt). One struct that every runtime file
 * sees, each section owned by the file its comment names; kv.h, prefix.h,
 * forward.h declare those files' functions, and generate.c creates and
 * frees the whole (rt_runtime_init / rt_runtime_free). */

#include "mathops.h"
#include "model.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* KV page size in tokens. */
#define RT_PAGE_SIZE 16

#define RT_SEQ_MAGIC 0x42525331u /* "BRS1": a live sequence */
#define RT_SEQ_DEAD 0x44454144u  /* "DEAD": magic of a freed sequence */

/* A KV history: `length` tokens whose K/V live in blocks[0..n_blocks), block
 * i holding positions [i*RT_PAGE_SIZE, (i+1)*RT_PAGE_SIZE). A block may be
 * shared (prefix cache, seeded sequences): it is then always full, and a
 * sequence that must write into a shared block copies it first. */
struct baseRT_sequence_s {
    uint32_t magic; /* RT_SEQ_MAGIC while alive */
    rt_model *m;
    int length;
    int n_blocks;
    int *blocks; /* capacity rt->max_blocks_per_seq */
    bool user;   /* created through baseRT_sequence_create */
    baseRT_sequence_t handle; /* the caller's handle (user sequences), else NULL */
    struct baseRT_sequence_s *prev, *next;
};
typedef struct baseRT_sequence_s rt_seq;

/* One lane of a forward: n tokens appended to seq at its current length. */
typedef struct {
    rt_seq *seq;
    const uint32_t *tokens;
    int n;
} rt_lane;

typedef struct rt_prefix_cache rt_prefix_cache;

typedef struct rt_runtime {
    /* ---- KV pool (kv.c): K and V laid out [layer][block][slot][kv_dim] ---- */
    int n_blocks;
    int max_blocks_per_seq; /* ceil(max_seq_len / RT_PAGE_SIZE) */
    int kv_type;            /* RT_KV_*: element type of both pools */
    size_t kv_row_bytes;    /* one token's K (or V) row of kv_dim values */
    size_t layer_bytes;     /* bytes per layer: n_blocks * RT_PAGE_SIZE * kv_row_bytes */
    void *k_pool, *v_pool;
    int *ref;        /* owners per block: sequences, trie nodes, pending matches */
    int *free_stack; /* free block ids */
    int n_free;

    /* ---- sequences (kv.c) ---- */
    rt_seq live;           /* sentinel of the circular list of live sequences */
    rt_seq *def;           /* the single-sequence API's default sequence */

    /* ---- forward scratch (forward.c) ---- */
    int chunk;     /* rows per forward slice (prefill_chunk) */
    int max_lanes; /* max(max_batch_size, 1) */
    float *x, *xb, *q, *k, *v, *att, *hb, *hb2;
    int *row_lane, *row_pos;
    float *att_scores;          /* [threads][n_heads / n_kv_heads][max_seq_len] */
    float *rope_cos, *rope_sin; /* [tables][max_seq_len][head_dim / 2]: full layers, then sliding ones */
    float *final_h;             /* [max(max_lanes, logits_cap)][dim] hidden rows whose logits a step returns */
    int *lane_out_first;        /* [max_lanes] a multi-row step's first logits row of each lane */
    int *lane_tap_first;        /* [max_lanes] a tapped step's first tap row of each lane */
    uint8_t *xq;                /* rt_matmul_scratch_bytes(chunk, max(dim, q_dim, ffn)): quantized matmul inputs */

    /* ---- outputs (batch.c, generate.c) ---- */
    float *logits;        /* [max_lanes][vocab]: forward output, then its f16-rounded values */
    uint16_t *logits_f16; /* [max_batch_size][vocab]: the batched logits scratch */
    int logits_rows;      /* rows the most recent fused step left there */
    int logits_cap;       /* rows logits / logits_f16 / final_h hold (grown for multi-row steps) */
    /* ---- hidden-state taps (batch.c, forward.c) ---- */
    uint16_t *tap_buf; /* [RT_MAX_TAPS][tap_cap][dim] f16, allocated by the first tapped step */
    int tap_cap;       /* rows one tapped step may cover: min(chunk, 1024) */
    int tap_count;     /* taps the most recent tapped step left readable (0: none) */
    int tap_rows;      /* rows per tap it left */
    float *def_logits;    /* [vocab] default sequence's last logits (f16-rounded) */
    bool def_logits_valid;
    float *sample_scratch; /* for the sampling routines (sampling.h) */
    rt_lane *lanes;        /* [max_lanes] */

    rt_threads *threads;
    rt_prefix_cache *prefix; /* NULL unless paged KV + prefix cache */
    size_t bytes;            /* bytes this runtime allocated (KV pool counted whole) */
} rt_runtime;
