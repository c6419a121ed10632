/* Paged KV pool and sequences.
 *
 * The pool is a fixed array of RT_PAGE_SIZE-token blocks holding f32 K and V
 * for every layer, with a refcount per block and a free list. Sequences own
 * block lists; the prefix cache and pending matches hold extra references to
 * shared (always full) blocks. User sequences are reached only through their
 * generational handles (handles.c): a freed sequence's memory goes back at
 * once, and its handle -- or any handle after its model was freed -- is
 * reported stale instead of followed. */

#include "kv.h"

#include "errors.h"
#include "handles.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

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

/* The pool's element type from the effective kv_bits (loader: 32 or 16). */
int rt_kv_type(const rt_model *m) { return m->kv_bits == 8 ? RT_KV_Q8 : m->kv_bits == 16 ? RT_KV_F16 : RT_KV_F32; }

size_t rt_kv_row_bytes(const rt_model *m) {
    int t = rt_kv_type(m);
    if (t == RT_KV_Q8) return (size_t)m->cfg.kv_dim / 32 * RT_KV_Q8_BLOCK;
    return (size_t)m->cfg.kv_dim * (t == RT_KV_F16 ? 2 : 4);
}

size_t rt_kv_block_bytes(const rt_model *m) {
    return 2u * (size_t)m->cfg.n_layers * RT_PAGE_SIZE * rt_kv_row_bytes(m);
}

int rt_kv_init(rt_model *m) {
    rt_runtime *rt = m->rt;
    int64_t per_seq = ((int64_t)m->cfg.max_seq_len + RT_PAGE_SIZE - 1) / RT_PAGE_SIZE;
    rt->max_blocks_per_seq = (int)per_seq;
    list_init(&rt->live);
    /* Paged: max_batch_size lanes plus the default sequence. Contiguous: the
     * default sequence plus room for baseRT_embed's scratch sequence. In 64
     * bits: context x batch can exceed an int (block ids are ints). */
    int64_t n_blocks = m->paged_kv ? per_seq * ((int64_t)m->max_batch_size + 1) : 2 * per_seq;
    size_t pool_floats = 0, pool_bytes = 0;
    if (n_blocks > INT32_MAX / 2 ||
        __builtin_mul_overflow((size_t)n_blocks, (size_t)RT_PAGE_SIZE * rt_kv_row_bytes(m), &rt->layer_bytes) ||
        __builtin_mul_overflow(rt->layer_bytes, (size_t)m->cfg.n_layers, &pool_floats) ||
        __builtin_mul_overflow(pool_floats, (size_t)2, &pool_bytes)) {
        rt_set_error(BASERT_ERR_INVALID_ARGUMENT,
                     "KV pool: a context of %u tokens x %d lanes needs %lld blocks of %d tokens, more than this "
                     "engine can address; lower max_context or max_batch_size",
                     m->cfg.max_seq_len, m->paged_kv ? m->max_batch_size + 1 : 2, (long long)n_blocks,
                     RT_PAGE_SIZE);
        return BASERT_ERR_INVALID_ARGUMENT;
    }
    rt->n_blocks = (int)n_blocks;
    /* Untouched pages of these large allocations are never committed. */
    rt->kv_type = rt_kv_type(m);
    rt->kv_row_bytes = rt_kv_row_bytes(m);
    rt->k_pool = malloc(pool_bytes / 2);
    rt->v_pool = malloc(pool_bytes / 2);
    rt->ref = calloc((size_t)rt->n_blocks, sizeof(int));
    rt->free_stack = malloc((size_t)rt->n_blocks * sizeof(int));
    if (!rt->k_pool || !rt->v_pool || !rt->ref || !rt->free_stack) {
        rt_set_error(BASERT_ERR_OUT_OF_MEMORY, "KV pool: cannot allocate %d blocks (%zu bytes)", rt->n_blocks,
                     (size_t)rt->n_blocks * rt_kv_block_bytes(m));
        return BASERT_ERR_OUT_OF_MEMORY;
    }
    rt->bytes += pool_bytes + (size_t)rt->n_blocks * 2 * sizeof(int);
    /* Low ids on top of the stack: the first blocks handed out are 0, 1, ... */
    for (int i = 0; i < rt->n_blocks; i++) rt->free_stack[i] = rt->n_blocks - 1 - i;
    rt->n_free = rt->n_blocks;
    return BASERT_OK;
}

void rt_kv_free(rt_model *m) {
    rt_runtime *rt = m->rt;
    if (rt->live.next) {
        while (rt->live.next != &rt->live) {
            rt_seq *s = rt->live.next;
            list_unlink(s);
            if (s->handle) rt_handle_release(s->handle); /* stale from now on */
            free(s->blocks);
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
    rt_seq *s = malloc(sizeof *s);
    int *blocks = malloc((size_t)rt->max_blocks_per_seq * sizeof(int));
    void *h = s && blocks && user ? rt_handle_new(RT_KIND_SEQ, s) : NULL;
    if (!s || !blocks || (user && !h)) {
        free(s);
        free(blocks);
        rt_set_error(BASERT_ERR_OUT_OF_MEMORY, "cannot allocate a sequence");
        return NULL;
    }
    *s = (rt_seq){.magic = RT_SEQ_MAGIC, .m = m, .blocks = blocks, .user = user, .handle = h};
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
    (void)rt;
    list_unlink(s);
    if (s->handle) rt_handle_release(s->handle);
    free(s->blocks);
    s->magic = RT_SEQ_DEAD;
    free(s);
}

rt_seq *rt_seq_get(const rt_model *m, baseRT_sequence_t h, const char *fn, int lane) {
    char where[32] = "";
    if (lane >= 0) snprintf(where, sizeof where, " (lane %d)", lane);
    if (!h) {
        rt_set_error(BASERT_ERR_INVALID_ARGUMENT, "%s: sequence%s is NULL", fn, where);
        return NULL;
    }
    int why = RT_HANDLE_FOREIGN;
    rt_seq *s = rt_handle_get(h, RT_KIND_SEQ, &why);
    if (!s) {
        rt_set_error(BASERT_ERR_INVALID_ARGUMENT, "%s: sequence%s %p is %s", fn, where, (void *)h,
                     why == RT_HANDLE_STALE ? "freed (or its model was)" : "not a sequence handle");
        return NULL;
    }
    if (m && s->m != m) {
        rt_set_error(BASERT_ERR_INVALID_ARGUMENT, "%s: sequence%s %p belongs to another model", fn, where,
                     (void *)h);
        return NULL;
    }
    return rt_model_busy(s->m, fn) ? NULL : s;
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
    size_t n = (size_t)RT_PAGE_SIZE * rt->kv_row_bytes; /* bytes of one block in one layer */
    char *k = rt->k_pool, *v = rt->v_pool;
    for (uint32_t l = 0; l < m->cfg.n_layers; l++) {
        size_t base = l * rt->layer_bytes;
        memcpy(k + base + (size_t)dst * n, k + base + (size_t)src * n, n);
        memcpy(v + base + (size_t)dst * n, v + base + (size_t)src * n, n);
    }
}

int64_t rt_kv_blocks_needed(const rt_model *m, const rt_lane *lanes, int n_lanes) {
    const rt_runtime *rt = m->rt;
    int64_t need = 0;
    for (int i = 0; i < n_lanes; i++) {
        const rt_seq *s = lanes[i].seq;
        int blocks_after = (s->length + lanes[i].n + RT_PAGE_SIZE - 1) / RT_PAGE_SIZE;
        need += blocks_after - s->n_blocks;
        if (needs_private_copy(rt, s)) need++;
    }
    return need;
}

void rt_kv_take_blocks(rt_model *m, const rt_lane *lanes, int n_lanes) {
    rt_runtime *rt = m->rt;
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
    return s->handle;
}

void baseRT_sequence_free(baseRT_sequence_t handle) {
    if (!handle) return;
    rt_seq *seq = rt_seq_get(NULL, handle, "baseRT_sequence_free", -1);
    if (!seq) return;
    rt_seq_delete(seq);
    rt_clear_error();
}

int baseRT_sequence_rollback(baseRT_sequence_t handle, int length) {
    rt_seq *seq = rt_seq_get(NULL, handle, "baseRT_sequence_rollback", -1);
    if (!seq) return rt_last_error_code();
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
