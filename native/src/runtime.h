#pragma once
/* Runtime-private state of the reference engine: the paged KV pool and its
 * sequences, forward scratch, logits buffers, the prefix cache and the thread
 * pool. Only kv.c, forward.c, batch.c, prefix.c, api_runtime.c include this. */

#include "internal.h"
#include "mathops.h"

#define RT_SEQ_DEAD 0x44454144u /* "DEAD": magic of a freed sequence */

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
    float *rope_cos, *rope_sin; /* [max_seq_len][head_dim / 2] */
    float *final_h;             /* [max(max_lanes, logits_cap)][dim] hidden rows whose logits a step returns */
    int *lane_out_first;        /* [max_lanes] a multi-row step's first logits row of each lane */
    int *lane_tap_first;        /* [max_lanes] a tapped step's first tap row of each lane */
    uint8_t *xq;                /* rt_matmul_scratch_bytes(chunk, max(dim, q_dim, ffn)): quantized matmul inputs */

    /* ---- outputs (batch.c, api_runtime.c) ---- */
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
    float *sample_scratch; /* for the front's sampling routines */
    rt_lane *lanes;        /* [max_lanes] */

    rt_threads *threads;
    rt_prefix_cache *prefix; /* NULL unless paged KV + prefix cache */
    size_t bytes;            /* bytes this runtime allocated (KV pool counted whole) */
} rt_runtime;

/* ---- kv.c ------------------------------------------------------------------ */
int rt_kv_init(rt_model *m);
void rt_kv_free(rt_model *m);
size_t rt_kv_block_bytes(const rt_model *m); /* K + V of one block, all layers */
/* KV element types: f32, f16, or Q8_0 blocks of 32 ({f16 d, int8 q[32]}, 34
 * bytes, value = d * q) along each token's row -- head slices start on block
 * boundaries (head_dim % 32 == 0 is required for Q8_0). */
enum { RT_KV_F32 = 0, RT_KV_F16 = 1, RT_KV_Q8 = 2 };
#define RT_KV_Q8_BLOCK 34
int rt_kv_type(const rt_model *m);
size_t rt_kv_row_bytes(const rt_model *m);
/* An internal sequence (default / embed scratch), on the live list. NULL with
 * OUT_OF_MEMORY set. */
rt_seq *rt_seq_new(rt_model *m, bool user);
/* Return every block, unlink, release the handle and free. */
void rt_seq_delete(rt_seq *s);
/* Drop whole blocks past `length` (<= s->length). */
void rt_seq_truncate(rt_seq *s, int length);
/* The sequence of a live handle h (of model m unless m is NULL), else NULL
 * with INVALID_ARGUMENT set; `lane` < 0 omits the lane from the message. */
rt_seq *rt_seq_get(const rt_model *m, baseRT_sequence_t h, const char *fn, int lane);
void rt_block_incref(rt_runtime *rt, int block);
/* Returns true when the block went back to the free list. */
bool rt_block_decref(rt_runtime *rt, int block);
/* Context limit for every lane: INVALID_ARGUMENT naming the lane otherwise. */
int rt_kv_check_lengths(const rt_model *m, const rt_lane *lanes, int n_lanes, const char *fn);
/* Make room for every lane's new tokens: fresh blocks, a private copy of a
 * shared block about to be written. Evicts unlocked cached prefixes when that
 * makes the step fit (and leaves the cache alone when nothing would). All or
 * nothing: on OUT_OF_MEMORY no sequence has changed. */
int rt_kv_reserve(rt_model *m, const rt_lane *lanes, int n_lanes, const char *fn);

/* ---- forward.c ------------------------------------------------------------- */
int rt_forward_init(rt_model *m);
void rt_forward_free(rt_model *m);
/* Most hidden-state taps one step may request (baseRT.h). */
#define RT_MAX_TAPS 8
/* What a multi-row step returns besides KV: per lane its LAST out_rows[i]
 * rows' logits (>= 1, lanes in order, rows ascending) and, for each of the
 * n_taps hidden_states indices in tap_layers (0 = embedding output, k = the
 * residual after layer k-1, n_layers = final pre-norm hidden), its LAST
 * tap_rows[i] rows (>= 0) into tap block j of rt->tap_buf. Validated by the
 * caller, buffers sized by the caller. */
typedef struct {
    const int *out_rows;
    const int *tap_layers;
    int n_taps;
    const int *tap_rows;
} rt_rows;
/* Run the lanes (validated and reserved) and advance their lengths. logits
 * (may be NULL): f32 [rows][vocab] of each lane's last row (rows NULL), or of
 * the rows `rows` asks for. pooled (may be NULL): [dim] sum over all rows of
 * the final-normed hidden state. */
void rt_forward(rt_model *m, const rt_lane *lanes, int n_lanes, float *logits, double *pooled, const rt_rows *rows);

/* ---- prefix.c -------------------------------------------------------------- */
int rt_prefix_init(rt_model *m);
void rt_prefix_free(rt_model *m);
/* Evict LRU unlocked cached prefixes until n blocks went back to the pool;
 * returns the number freed. 0 when the cache is disabled. */
int rt_prefix_evict_blocks(rt_model *m, int n_blocks);
int rt_prefix_cached_blocks(const rt_model *m);
/* Add the cache's references (trie nodes, pending matches) per block to
 * counts[n_blocks]; returns the number of out-of-range block ids found. */
int rt_prefix_count_refs(const rt_model *m, int *counts);
/* Blocks rt_prefix_evict_blocks could return to the pool right now. */
int rt_prefix_evictable_blocks(const rt_model *m);

/* ---- batch.c --------------------------------------------------------------- */
/* Round rows of f32 logits to f16 in place (the values every greedy/sampled
 * choice is made on), writing the halves to f16 when not NULL. */
void rt_logits_round_f16(float *logits, uint16_t *f16, size_t n);
/* Common validation for entry points that take a model: the runtime model or
 * NULL with the error set. */
rt_model *rt_runtime_model(baseRT_model_t model, const char *fn);
