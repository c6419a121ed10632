/* Paged KV pool and sequences.
 *
 * The pool is a fixed array of RT_PAGE_SIZE-token blocks holding f32 K and V
 * for every layer, with a refcount per block and a free list. Sequences own
 * block lists; the prefix cache and pending matches hold extra references to
 * shared (always full) blocks. Freed user handles are retired rather than
 * released, so a stale handle is caught by its DEAD magic instead of being a
 * use-after-free; the oldest retired headers are recycled once there are
 * many of them. */

#include "runtime.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum { RETIRED_KEEP = 256 };

static void list_init(rt_seq *sentinel) { sentinel->prev = sentinel->next = sentinel; }

static void list_unlink(rt_seq *s) {
    s->prev->next = s->next;
    s->next->prev = s->prev;
    s->prev = s->next = NULL;
}

static void list_push_back(rt_seq *sentinel, rt_seq *s) {
    s->prev = sentinel->prev;
    s->next = sentinel;
    sentinel->prev->next = s;
    sentinel->prev = s;
}

size_t rt_kv_block_bytes(const rt_model *m) {
    return 2u * (size_t)m->cfg.n_layers * RT_PAGE_SIZE * m->cfg.kv_dim * sizeof(float);
}

int rt_kv_init(rt_model *m) {
    rt_runtime *rt = m->rt;
    int per_seq = (int)((m->cfg.max_seq_len + RT_PAGE_SIZE - 1) / RT_PAGE_SIZE);
    rt->max_blocks_per_seq = per_seq;
    /* Paged: max_batch_size lanes plus the default sequence. Contiguous: the
     * default sequence plus room for baseRT_embed's scratch sequence. */
    rt->n_blocks = m->paged_kv ? per_seq * m->max_batch_size + per_seq : 2 * per_seq;
    rt->layer_stride = (size_t)rt->n_blocks * RT_PAGE_SIZE * m->cfg.kv_dim;
    size_t pool_floats = rt->layer_stride * m->cfg.n_layers;
    /* Untouched pages of these large allocations are never committed. */
    rt->k_pool = malloc(pool_floats * sizeof(float));
    rt->v_pool = malloc(pool_floats * sizeof(float));
    rt->ref = calloc((size_t)rt->n_blocks, sizeof(int));
    rt->free_stack = malloc((size_t)rt->n_blocks * sizeof(int));
    if (!rt->k_pool || !rt->v_pool || !rt->ref || !rt->free_stack) {
        rt_set_error(BASERT_ERR_OUT_OF_MEMORY, "KV pool: cannot allocate %d blocks (%zu bytes)", rt->n_blocks,
                     (size_t)rt->n_blocks * rt_kv_block_bytes(m));
        return BASERT_ERR_OUT_OF_MEMORY;
    }
    rt->bytes += 2 * pool_floats * sizeof(float) + (size_t)rt->n_blocks * 2 * sizeof(int);
    /* Low ids on top of the stack: the first blocks handed out are 0, 1, ... */
    for (int i = 0; i < rt->n_blocks; i++) rt->free_stack[i] = rt->n_blocks - 1 - i;
    rt->n_free = rt->n_blocks;
    list_init(&rt->live);
    list_init(&rt->retired);
    return BASERT_OK;
}

void rt_kv_free(rt_model *m) {
    rt_runtime *rt = m->rt;
    if (rt->live.next) {
        while (rt->live.next != &rt->live) {
            rt_seq *s = rt->live.next;
            list_unlink(s);
            free(s->blocks);
            free(s);
        }
        while (rt->retired.next != &rt->retired) {
            rt_seq *s = rt->retired.next;
            list_unlink(s);
            free(s);
        }
    }
    free(rt->k_pool);
    free(rt->v_pool);
    free(rt->ref);
    free(rt->free_stack);
    rt->k_pool = rt->v_pool = NULL;
    rt->ref = rt->free_stack = NULL;
}

void rt_block_incref(rt_runtime *rt, int block) { rt->ref[block]++; }

bool rt_block_decref(rt_runtime *rt, int block) {
    if (--rt->ref[block] > 0) return false;
    rt->free_stack[rt->n_free++] = block;
    return true;
}

static int block_alloc(rt_runtime *rt) {
    int b = rt->free_stack[--rt->n_free];
    rt->ref[b] = 1;
    return b;
}

rt_seq *rt_seq_new(rt_model *m, bool user) {
    rt_runtime *rt = m->rt;
    rt_seq *s = NULL;
    if (rt->n_retired > RETIRED_KEEP) {
        s = rt->retired.next;
        list_unlink(s);
        rt->n_retired--;
    } else {
        s = malloc(sizeof *s);
    }
    int *blocks = malloc((size_t)rt->max_blocks_per_seq * sizeof(int));
    if (!s || !blocks) {
        free(s);
        free(blocks);
        rt_set_error(BASERT_ERR_OUT_OF_MEMORY, "cannot allocate a sequence");
        return NULL;
    }
    *s = (rt_seq){.magic = RT_SEQ_MAGIC, .m = m, .blocks = blocks, .user = user};
    list_push_back(&rt->live, s);
    return s;
}

void rt_seq_truncate(rt_seq *s, int length) {
    rt_runtime *rt = s->m->rt;
    int keep = (length + RT_PAGE_SIZE - 1) / RT_PAGE_SIZE;
    while (s->n_blocks > keep) rt_block_decref(rt, s->blocks[--s->n_blocks]);
    s->length = length;
}

void rt_seq_delete(rt_seq *s) {
    rt_runtime *rt = s->m->rt;
    rt_seq_truncate(s, 0);
    list_unlink(s);
    free(s->blocks);
    s->blocks = NULL;
    s->magic = RT_SEQ_DEAD;
    if (s->user) {
        list_push_back(&rt->retired, s);
        rt->n_retired++;
    } else {
        free(s);
    }
}

int rt_seq_check(const rt_model *m, baseRT_sequence_t h, const char *fn, int lane) {
    char where[32] = "";
    if (lane >= 0) snprintf(where, sizeof where, " (lane %d)", lane);
    if (!h) {
        rt_set_error(BASERT_ERR_INVALID_ARGUMENT, "%s: sequence%s is NULL", fn, where);
        return BASERT_ERR_INVALID_ARGUMENT;
    }
    if (h->magic != RT_SEQ_MAGIC) {
        rt_set_error(BASERT_ERR_INVALID_ARGUMENT, "%s: sequence%s %p is %s", fn, where, (void *)h,
                     h->magic == RT_SEQ_DEAD ? "freed" : "not a sequence handle");
        return BASERT_ERR_INVALID_ARGUMENT;
    }
    if (m && h->m != m) {
        rt_set_error(BASERT_ERR_INVALID_ARGUMENT, "%s: sequence%s %p belongs to another model", fn, where,
                     (void *)h);
        return BASERT_ERR_INVALID_ARGUMENT;
    }
    return BASERT_OK;
}

int rt_kv_check_lengths(const rt_model *m, const rt_lane *lanes, int n_lanes, const char *fn) {
    int limit = (int)m->cfg.max_seq_len;
    for (int i = 0; i < n_lanes; i++) {
        if ((int64_t)lanes[i].seq->length + lanes[i].n > limit) {
            rt_set_error(BASERT_ERR_INVALID_ARGUMENT,
                         "%s: lane %d: %d tokens at length %d would exceed the context limit of %d tokens", fn, i,
                         lanes[i].n, lanes[i].seq->length, limit);
            return BASERT_ERR_INVALID_ARGUMENT;
        }
    }
    return BASERT_OK;
}

/* Does writing at the sequence's current length hit a shared block? */
static bool needs_private_copy(const rt_runtime *rt, const rt_seq *s) {
    if (s->length % RT_PAGE_SIZE == 0) return false;
    return rt->ref[s->blocks[s->length / RT_PAGE_SIZE]] > 1;
}

static void copy_block(rt_model *m, int dst, int src) {
    rt_runtime *rt = m->rt;
    size_t n = (size_t)RT_PAGE_SIZE * m->cfg.kv_dim;
    for (uint32_t l = 0; l < m->cfg.n_layers; l++) {
        size_t base = l * rt->layer_stride;
        memcpy(rt->k_pool + base + (size_t)dst * n, rt->k_pool + base + (size_t)src * n, n * sizeof(float));
        memcpy(rt->v_pool + base + (size_t)dst * n, rt->v_pool + base + (size_t)src * n, n * sizeof(float));
    }
}

int rt_kv_reserve(rt_model *m, const rt_lane *lanes, int n_lanes, const char *fn) {
    rt_runtime *rt = m->rt;
    int64_t need = 0;
    for (int i = 0; i < n_lanes; i++) {
        const rt_seq *s = lanes[i].seq;
        int blocks_after = (s->length + lanes[i].n + RT_PAGE_SIZE - 1) / RT_PAGE_SIZE;
        need += blocks_after - s->n_blocks;
        if (needs_private_copy(rt, s)) need++;
    }
    if (need > rt->n_free && need <= (int64_t)rt->n_free + rt_prefix_evictable_blocks(m))
        rt_prefix_evict_blocks(m, (int)(need - rt->n_free));
    if (need > rt->n_free) {
        rt_set_error(BASERT_ERR_OUT_OF_MEMORY,
                     "%s: KV pool exhausted: the step needs %lld free blocks of %d tokens, %d of %d are free "
                     "and %d more could be evicted from the prefix cache",
                     fn, (long long)need, RT_PAGE_SIZE, rt->n_free, rt->n_blocks, rt_prefix_evictable_blocks(m));
        return BASERT_ERR_OUT_OF_MEMORY;
    }
    for (int i = 0; i < n_lanes; i++) {
        rt_seq *s = lanes[i].seq;
        if (needs_private_copy(rt, s)) {
            int idx = s->length / RT_PAGE_SIZE;
            int copy = block_alloc(rt);
            copy_block(m, copy, s->blocks[idx]);
            rt_block_decref(rt, s->blocks[idx]);
            s->blocks[idx] = copy;
        }
        int blocks_after = (s->length + lanes[i].n + RT_PAGE_SIZE - 1) / RT_PAGE_SIZE;
        while (s->n_blocks < blocks_after) s->blocks[s->n_blocks++] = block_alloc(rt);
    }
    return BASERT_OK;
}

/* ---- public API ------------------------------------------------------------ */

baseRT_sequence_t baseRT_sequence_create(baseRT_model_t model) {
    rt_model *m = rt_runtime_model(model, "baseRT_sequence_create");
    if (!m) return NULL;
    if (!m->paged_kv) {
        rt_set_error(BASERT_ERR_UNSUPPORTED,
                     "baseRT_sequence_create: the model was loaded without paged KV (BaseRTLoadOptions.paged_kv)");
        return NULL;
    }
    if (rt_fault_should_fail(RT_FAULT_SEQ_CREATE)) {
        rt_set_error(BASERT_ERR_OUT_OF_MEMORY, "baseRT_sequence_create: injected fault (sequence allocation failed)");
        return NULL;
    }
    rt_seq *s = rt_seq_new(m, true);
    if (!s) return NULL;
    rt_clear_error();
    return s;
}

void baseRT_sequence_free(baseRT_sequence_t seq) {
    if (!seq) return;
    if (rt_seq_check(NULL, seq, "baseRT_sequence_free", -1) != BASERT_OK || !seq->user) return;
    rt_seq_delete(seq);
    rt_clear_error();
}

int baseRT_sequence_rollback(baseRT_sequence_t seq, int length) {
    int rc = rt_seq_check(NULL, seq, "baseRT_sequence_rollback", -1);
    if (rc != BASERT_OK) return rc;
    if (length < 0 || length > seq->length) {
        rt_set_error(BASERT_ERR_INVALID_ARGUMENT,
                     "baseRT_sequence_rollback: length %d is outside [0, %d] (the sequence's current length)",
                     length, seq->length);
        return BASERT_ERR_INVALID_ARGUMENT;
    }
    rt_seq_truncate(seq, length);
    rt_clear_error();
    return BASERT_OK;
}

int baseRT_page_size(baseRT_model_t model) {
    rt_model *m = rt_runtime_model(model, "baseRT_page_size");
    if (!m) return 0;
    rt_clear_error();
    return m->paged_kv ? RT_PAGE_SIZE : 0;
}

int baseRT_max_prefill_chunk(baseRT_model_t model) {
    rt_model *m = rt_runtime_model(model, "baseRT_max_prefill_chunk");
    if (!m) return 0;
    rt_clear_error();
    return m->prefill_chunk;
}

bool baseRT_model_memory_stats(baseRT_model_t model, BaseRTMemoryStats *out) {
    rt_model *m = rt_model_check(model, "baseRT_model_memory_stats");
    if (!m) return false;
    if (!out) {
        rt_set_error(BASERT_ERR_INVALID_ARGUMENT, "baseRT_model_memory_stats: out_stats is NULL");
        return false;
    }
    memset(out, 0, sizeof *out);
    out->runtime_allocated_bytes = m->weight_bytes;
    out->kv_cache_layout = BASERT_KV_CACHE_NONE;
    const rt_runtime *rt = m->rt;
    if (rt) {
        size_t block_bytes = rt_kv_block_bytes(m);
        uint64_t used = (uint64_t)(rt->n_blocks - rt->n_free);
        out->runtime_allocated_bytes += rt->bytes;
        out->kv_cache_capacity_bytes = (uint64_t)rt->n_blocks * block_bytes;
        out->kv_cache_blocks_total = (uint64_t)rt->n_blocks;
        out->kv_cache_blocks_used = used;
        if (m->paged_kv) {
            out->kv_cache_layout = BASERT_KV_CACHE_PAGED;
            out->kv_cache_used_bytes = used * block_bytes;
            out->kv_cache_tokens_used = used * RT_PAGE_SIZE;
        } else {
            /* One history, reported exactly. */
            out->kv_cache_layout = BASERT_KV_CACHE_CONTIGUOUS;
            out->kv_cache_tokens_used = (uint64_t)rt->def->length;
            out->kv_cache_used_bytes = (uint64_t)rt->def->length * (block_bytes / RT_PAGE_SIZE);
        }
    }
    rt_clear_error();
    return true;
}
