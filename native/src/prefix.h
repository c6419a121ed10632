#pragma once
/* The prefix cache (prefix.c): a trie of full KV blocks over the KV pool
 * (kv.h), and the KV reservation that may evict from it. */

#include "runtime.h"

#include <stdint.h>

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
/* Make room for every lane's new tokens: fresh blocks, a private copy of a
 * shared block about to be written. Evicts unlocked cached prefixes when that
 * makes the step fit (and leaves the cache alone when nothing would). All or
 * nothing: on OUT_OF_MEMORY no sequence has changed. Works without a cache
 * too (nothing to evict). */
int rt_prefix_reserve_kv(rt_model *m, const rt_lane *lanes, int n_lanes, const char *fn);
