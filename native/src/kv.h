#pragma once
/* The paged KV pool and its sequences (kv.c): blocks, refcounts, the free
 * list and each sequence's block table. Below the prefix cache: the cache
 * holds block references through rt_block_incref / rt_block_decref, and kv.c
 * never calls into it (reserving with eviction is prefix.c's
 * rt_prefix_reserve_kv). */

#include "runtime.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

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
/* Free blocks the lanes' new tokens need: fresh blocks, plus one private copy
 * per shared block about to be written. */
int64_t rt_kv_blocks_needed(const rt_model *m, const rt_lane *lanes, int n_lanes);
/* Take those blocks (the caller checked rt_kv_blocks_needed <= rt->n_free):
 * copy each shared block about to be written, append fresh ones. */
void rt_kv_take_blocks(rt_model *m, const rt_lane *lanes, int n_lanes);
