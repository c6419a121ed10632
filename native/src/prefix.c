/* Prefix cache: a trie over full RT_PAGE_SIZE-token blocks of prompts. Each
 * node is one block of tokens (children matched by exact content) and holds a
 * reference on the KV block a sequence computed for it. A match increfs the
 * blocks of its path and locks the path against eviction until the match is
 * settled (unlock / release / discard). Eviction drops LRU unlocked leaves
 * whose block the trie alone still holds, so every eviction returns a block
 * to the pool.
 *
 * Ownership is never transferred implicitly: baseRT_sequence_seed_prefix
 * takes the sequence's own reference on each block (and accepts only blocks
 * that form a path of the trie, i.e. full, immutable cached blocks), and
 * settling a match always drops the match's references. The documented
 * protocol (match, seed, unlock -- or match, release) ends with the same
 * counts as an adopting seed would, and a caller that seeds twice, seeds a
 * block it does not hold, or releases after seeding cannot double-free a
 * block or make a sequence share another one's private KV.
 *
 * The cache sits above the KV pool (kv.c), which never calls it: reserving KV
 * for a step (evicting when that makes it fit) and the pool's consistency
 * check (which counts the cache's references) live here for that reason. */

#include "prefix.h"

#include "baseRT/reference.h"
#include "errors.h"
#include "kv.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct rt_pnode {
    uint32_t tokens[RT_PAGE_SIZE];
    int block;
    uint64_t stamp; /* LRU clock at the last match / insert through this node */
    int locks;      /* unsettled matches whose path includes this node */
    struct rt_pnode *parent;
    struct rt_pnode **child;
    int n_child, cap_child;
} rt_pnode;

typedef struct rt_pmatch {
    uint64_t handle;
    int n_blocks;
    int *blocks;
    rt_pnode **path;
    struct rt_pmatch *next;
} rt_pmatch;

struct rt_prefix_cache {
    rt_pnode root; /* no block */
    int n_nodes;
    uint64_t clock, next_handle;
    rt_pmatch *matches;
    uint64_t hits, misses, reused_tokens;
    /* [n_blocks] the trie node holding each block, NULL if none. A block is
     * cached under one token path at most: a second node would hold a second
     * reference that eviction (which frees only blocks the trie alone holds,
     * refcount 1) could never drop. */
    rt_pnode **owner;
};

int rt_prefix_init(rt_model *m) {
    if (!m->paged_kv || !m->prefix_cache) return BASERT_OK;
    rt_prefix_cache *pc = calloc(1, sizeof *pc);
    if (!pc) {
        rt_set_error(BASERT_ERR_OUT_OF_MEMORY, "prefix cache: out of memory");
        return BASERT_ERR_OUT_OF_MEMORY;
    }
    pc->owner = calloc((size_t)m->rt->n_blocks, sizeof *pc->owner);
    if (!pc->owner) {
        free(pc);
        rt_set_error(BASERT_ERR_OUT_OF_MEMORY, "prefix cache: out of memory");
        return BASERT_ERR_OUT_OF_MEMORY;
    }
    pc->root.block = -1;
    pc->next_handle = 1;
    m->rt->prefix = pc;
    return BASERT_OK;
}

static void free_subtree(rt_pnode *n) {
    for (int i = 0; i < n->n_child; i++) {
        free_subtree(n->child[i]);
        free(n->child[i]);
    }
    free(n->child);
}

void rt_prefix_free(rt_model *m) {
    rt_prefix_cache *pc = m->rt->prefix;
    if (!pc) return;
    free_subtree(&pc->root);
    while (pc->matches) {
        rt_pmatch *mt = pc->matches;
        pc->matches = mt->next;
        free(mt->blocks);
        free(mt->path);
        free(mt);
    }
    free(pc->owner);
    free(pc);
    m->rt->prefix = NULL;
}

int rt_prefix_cached_blocks(const rt_model *m) { return m->rt->prefix ? m->rt->prefix->n_nodes : 0; }

static rt_pnode *find_child(const rt_pnode *n, const uint32_t *tokens) {
    for (int i = 0; i < n->n_child; i++)
        if (memcmp(n->child[i]->tokens, tokens, sizeof n->child[i]->tokens) == 0) return n->child[i];
    return NULL;
}

static void remove_leaf(rt_prefix_cache *pc, rt_pnode *n) {
    rt_pnode *p = n->parent;
    for (int i = 0; i < p->n_child; i++) {
        if (p->child[i] == n) {
            p->child[i] = p->child[--p->n_child];
            break;
        }
    }
    pc->owner[n->block] = NULL;
    free(n->child);
    free(n);
    pc->n_nodes--;
}

/* ---- consistency (baseRT_ref_check_kv) ------------------------------------ */

static void count_node_refs(const rt_pnode *n, int *counts, int n_blocks, int *bad) {
    for (int i = 0; i < n->n_child; i++) {
        const rt_pnode *c = n->child[i];
        if (c->block < 0 || c->block >= n_blocks) (*bad)++;
        else counts[c->block]++;
        count_node_refs(c, counts, n_blocks, bad);
    }
}

int rt_prefix_count_refs(const rt_model *m, int *counts) {
    const rt_prefix_cache *pc = m->rt->prefix;
    int bad = 0;
    if (!pc) return 0;
    count_node_refs(&pc->root, counts, m->rt->n_blocks, &bad);
    for (const rt_pmatch *mt = pc->matches; mt; mt = mt->next) {
        for (int d = 0; d < mt->n_blocks; d++) {
            if (mt->blocks[d] < 0 || mt->blocks[d] >= m->rt->n_blocks) bad++;
            else counts[mt->blocks[d]]++;
        }
    }
    return bad;
}

/* ---- eviction ---------------------------------------------------------------- */

typedef struct {
    rt_pnode **v;
    int n, cap;
} node_vec;

static void collect_evictable(const rt_runtime *rt, rt_pnode *n, node_vec *out) {
    for (int i = 0; i < n->n_child; i++) {
        rt_pnode *c = n->child[i];
        if (c->n_child > 0) {
            collect_evictable(rt, c, out);
        } else if (c->locks == 0 && rt->ref[c->block] == 1 && out->n < out->cap) {
            out->v[out->n++] = c;
        }
    }
}

/* Nodes eviction could free: unlocked, held by the trie alone, and with an
 * evictable subtree (a node is only evicted once it is a leaf). */
static int count_evictable(const rt_runtime *rt, const rt_pnode *n, bool *all) {
    int count = 0;
    *all = true;
    for (int i = 0; i < n->n_child; i++) {
        bool sub;
        count += count_evictable(rt, n->child[i], &sub);
        if (!sub) *all = false;
    }
    if (n->block >= 0) { /* not the root */
        if (*all && n->locks == 0 && rt->ref[n->block] == 1)
            count++;
        else
            *all = false;
    }
    return count;
}

int rt_prefix_evictable_blocks(const rt_model *m) {
    const rt_prefix_cache *pc = m->rt->prefix;
    bool all;
    return pc ? count_evictable(m->rt, &pc->root, &all) : 0;
}

static int by_stamp(const void *a, const void *b) {
    uint64_t x = (*(rt_pnode *const *)a)->stamp, y = (*(rt_pnode *const *)b)->stamp;
    return x < y ? -1 : x > y;
}

int rt_prefix_evict_blocks(rt_model *m, int n_blocks) {
    rt_runtime *rt = m->rt;
    rt_prefix_cache *pc = rt->prefix;
    if (!pc || n_blocks <= 0 || pc->n_nodes == 0) return 0;
    node_vec vec = {malloc((size_t)pc->n_nodes * sizeof(rt_pnode *)), 0, pc->n_nodes};
    if (!vec.v) return 0;
    int freed = 0;
    /* Each round takes the current evictable leaves oldest first; a parent
     * left childless becomes a candidate of the next round. */
    while (freed < n_blocks) {
        vec.n = 0;
        collect_evictable(rt, &pc->root, &vec);
        if (vec.n == 0) break;
        qsort(vec.v, (size_t)vec.n, sizeof vec.v[0], by_stamp);
        for (int i = 0; i < vec.n && freed < n_blocks; i++) {
            if (rt_block_decref(rt, vec.v[i]->block)) freed++;
            remove_leaf(pc, vec.v[i]);
        }
    }
    free(vec.v);
    return freed;
}

/* ---- KV reservation ------------------------------------------------------------ */

/* Here rather than in kv.c: only the cache can give blocks back, and the pool
 * below it must not call up into it. */
int rt_prefix_reserve_kv(rt_model *m, const rt_lane *lanes, int n_lanes, const char *fn) {
    rt_runtime *rt = m->rt;
    int64_t need = rt_kv_blocks_needed(m, lanes, n_lanes);
    if (need > rt->n_free && need <= (int64_t)rt->n_free + rt_prefix_evictable_blocks(m))
        rt_prefix_evict_blocks(m, (int)(need - rt->n_free));
    if (need > rt->n_free) {
        rt_set_error(BASERT_ERR_OUT_OF_MEMORY,
                     "%s: KV pool exhausted: the step needs %lld free blocks of %d tokens, %d of %d are free "
                     "and %d more could be evicted from the prefix cache",
                     fn, (long long)need, RT_PAGE_SIZE, rt->n_free, rt->n_blocks, rt_prefix_evictable_blocks(m));
        return BASERT_ERR_OUT_OF_MEMORY;
    }
    rt_kv_take_blocks(m, lanes, n_lanes);
    return BASERT_OK;
}

/* ---- pool consistency check (reference-only ABI) ----------------------------- */

/* Every block's refcount equals its owners (sequences, trie nodes, pending
 * matches); the free stack holds exactly the blocks nobody owns, once each. */
int baseRT_ref_check_kv(baseRT_model_t model) {
    static const char fn[] = "baseRT_ref_check_kv";
    rt_model *m = rt_runtime_model(model, fn);
    if (!m) return rt_last_error_code();
    rt_runtime *rt = m->rt;
    int *owners = calloc((size_t)rt->n_blocks, sizeof(int));
    int *in_free = calloc((size_t)rt->n_blocks, sizeof(int));
    if (!owners || !in_free) {
        free(owners);
        free(in_free);
        rt_set_error(BASERT_ERR_OUT_OF_MEMORY, "%s: out of memory", fn);
        return BASERT_ERR_OUT_OF_MEMORY;
    }
    char what[200] = "";
    for (const rt_seq *s = rt->live.next; s != &rt->live && !what[0]; s = s->next) {
        int need = (s->length + RT_PAGE_SIZE - 1) / RT_PAGE_SIZE;
        if (s->n_blocks != need || s->length < 0 || s->length > (int)m->cfg.max_seq_len)
            snprintf(what, sizeof what, "a sequence of length %d holds %d blocks", s->length, s->n_blocks);
        for (int i = 0; i < s->n_blocks && !what[0]; i++) {
            if (s->blocks[i] < 0 || s->blocks[i] >= rt->n_blocks)
                snprintf(what, sizeof what, "a sequence holds block id %d", s->blocks[i]);
            else
                owners[s->blocks[i]]++;
        }
    }
    if (!what[0] && rt_prefix_count_refs(m, owners)) snprintf(what, sizeof what, "the prefix cache holds a bad block id");
    if (!what[0] && (rt->n_free < 0 || rt->n_free > rt->n_blocks))
        snprintf(what, sizeof what, "%d free blocks of %d", rt->n_free, rt->n_blocks);
    for (int i = 0; i < rt->n_free && !what[0]; i++) {
        int b = rt->free_stack[i];
        if (b < 0 || b >= rt->n_blocks || in_free[b]++)
            snprintf(what, sizeof what, "free list entry %d (block %d) is bad or repeated", i, b);
    }
    for (int b = 0; b < rt->n_blocks && !what[0]; b++) {
        if (rt->ref[b] != owners[b])
            snprintf(what, sizeof what, "block %d has refcount %d but %d owners", b, rt->ref[b], owners[b]);
        else if ((owners[b] == 0) != (in_free[b] == 1))
            snprintf(what, sizeof what, "block %d with %d owners is %son the free list", b, owners[b],
                     in_free[b] ? "" : "not ");
    }
    free(owners);
    free(in_free);
    if (what[0]) {
        rt_set_error(BASERT_ERR_UNKNOWN, "%s: KV pool inconsistent: %s", fn, what);
        return BASERT_ERR_UNKNOWN;
    }
    rt_clear_error();
    return BASERT_OK;
}

/* ---- public API -------------------------------------------------------------- */

BaseRTPrefixMatch baseRT_prefix_match(baseRT_model_t model, const uint32_t *tokens, int n_tokens) {
    BaseRTPrefixMatch res = {0, 0, NULL, 0};
    rt_model *m = rt_runtime_model(model, "baseRT_prefix_match");
    if (!m) return res;
    if (n_tokens < 0 || (!tokens && n_tokens > 0)) {
        rt_set_error(BASERT_ERR_INVALID_ARGUMENT, "baseRT_prefix_match: invalid prompt (tokens=%p, n_tokens=%d)",
                     (const void *)tokens, n_tokens);
        return res;
    }
    rt_runtime *rt = m->rt;
    rt_prefix_cache *pc = rt->prefix;
    if (!pc) {
        rt_clear_error();
        return res;
    }
    /* Whole blocks only, and never the whole prompt: one token must remain. */
    int max_depth = n_tokens > 0 ? (n_tokens - 1) / RT_PAGE_SIZE : 0;
    int depth = 0;
    for (rt_pnode *n = &pc->root; depth < max_depth; depth++) {
        n = find_child(n, tokens + (size_t)depth * RT_PAGE_SIZE);
        if (!n) break;
    }
    if (depth == 0) {
        pc->misses++;
        rt_clear_error();
        return res;
    }
    rt_pmatch *mt = calloc(1, sizeof *mt);
    if (mt) {
        mt->blocks = malloc((size_t)depth * sizeof(int));
        mt->path = malloc((size_t)depth * sizeof(rt_pnode *));
    }
    if (!mt || !mt->blocks || !mt->path) {
        if (mt) {
            free(mt->blocks);
            free(mt->path);
        }
        free(mt);
        rt_set_error(BASERT_ERR_OUT_OF_MEMORY, "baseRT_prefix_match: out of memory");
        return res;
    }
    uint64_t stamp = ++pc->clock;
    rt_pnode *n = &pc->root;
    for (int d = 0; d < depth; d++) {
        n = find_child(n, tokens + (size_t)d * RT_PAGE_SIZE);
        n->locks++;
        n->stamp = stamp;
        rt_block_incref(rt, n->block);
        mt->path[d] = n;
        mt->blocks[d] = n->block;
    }
    mt->n_blocks = depth;
    mt->handle = pc->next_handle++;
    mt->next = pc->matches;
    pc->matches = mt;
    res.matched_tokens = depth * RT_PAGE_SIZE;
    res.n_blocks = depth;
    res.blocks = mt->blocks;
    res.handle = mt->handle;
    rt_clear_error();
    return res;
}

enum settle { SETTLE_HIT, SETTLE_MISS, SETTLE_NONE };

/* Unlock a match's path and drop the references it took. */
static void settle(baseRT_model_t model, uint64_t handle, enum settle how, const char *fn) {
    rt_model *m = rt_runtime_model(model, fn);
    if (!m) return;
    rt_prefix_cache *pc = m->rt->prefix;
    if (handle == 0) {
        rt_clear_error();
        return;
    }
    rt_pmatch **pp = pc ? &pc->matches : NULL;
    while (pp && *pp && (*pp)->handle != handle) pp = &(*pp)->next;
    if (!pp || !*pp) {
        rt_set_error(BASERT_ERR_INVALID_ARGUMENT, "%s: unknown or already settled match handle %llu", fn,
                     (unsigned long long)handle);
        return;
    }
    rt_pmatch *mt = *pp;
    *pp = mt->next;
    for (int d = 0; d < mt->n_blocks; d++) {
        mt->path[d]->locks--;
        rt_block_decref(m->rt, mt->blocks[d]); /* a seeded sequence holds its own reference */
    }
    if (how == SETTLE_HIT) {
        pc->hits++;
        pc->reused_tokens += (uint64_t)mt->n_blocks * RT_PAGE_SIZE;
    } else if (how == SETTLE_MISS) {
        pc->misses++;
    }
    free(mt->blocks);
    free(mt->path);
    free(mt);
    rt_clear_error();
}

void baseRT_prefix_unlock(baseRT_model_t model, uint64_t handle) {
    settle(model, handle, SETTLE_HIT, "baseRT_prefix_unlock");
}

void baseRT_prefix_release(baseRT_model_t model, uint64_t handle) {
    settle(model, handle, SETTLE_MISS, "baseRT_prefix_release");
}

void baseRT_prefix_discard(baseRT_model_t model, uint64_t handle) {
    settle(model, handle, SETTLE_NONE, "baseRT_prefix_discard");
}

/* Do blocks[0..n) form a path of the trie from its root? Only such blocks
 * may be seeded: they are full and shared read-only (a sequence that writes
 * into one copies it first), and the trie's reference keeps them allocated. */
static bool is_trie_path(const rt_prefix_cache *pc, const int *blocks, int n) {
    const rt_pnode *node = &pc->root;
    for (int d = 0; d < n; d++) {
        const rt_pnode *next = NULL;
        for (int i = 0; i < node->n_child && !next; i++)
            if (node->child[i]->block == blocks[d]) next = node->child[i];
        if (!next) return false;
        node = next;
    }
    return true;
}

int baseRT_sequence_seed_prefix(baseRT_sequence_t handle, const int *blocks, int n_blocks, int n_tokens) {
    static const char fn[] = "baseRT_sequence_seed_prefix";
    rt_seq *seq = rt_seq_get(NULL, handle, fn, -1);
    if (!seq) return rt_last_error_code();
    rt_model *m = seq->m;
    rt_runtime *rt = m->rt;
    if (!m->paged_kv) {
        rt_set_error(BASERT_ERR_UNSUPPORTED, "%s: the model was loaded without paged KV", fn);
        return BASERT_ERR_UNSUPPORTED;
    }
    if (n_blocks == 0 && n_tokens == 0) {
        rt_clear_error();
        return BASERT_OK;
    }
    if (n_blocks <= 0 || !blocks || (int64_t)n_blocks * RT_PAGE_SIZE != n_tokens) {
        rt_set_error(BASERT_ERR_INVALID_ARGUMENT,
                     "%s: n_tokens (%d) must equal n_blocks (%d) * page size (%d) with a non-NULL block list", fn,
                     n_tokens, n_blocks, RT_PAGE_SIZE);
        return BASERT_ERR_INVALID_ARGUMENT;
    }
    if (seq->length != 0 || seq->n_blocks != 0) {
        rt_set_error(BASERT_ERR_INVALID_ARGUMENT, "%s: the sequence is not empty (length %d)", fn, seq->length);
        return BASERT_ERR_INVALID_ARGUMENT;
    }
    if (n_tokens > (int)m->cfg.max_seq_len) {
        rt_set_error(BASERT_ERR_INVALID_ARGUMENT, "%s: %d tokens exceed the context limit of %d", fn, n_tokens,
                     (int)m->cfg.max_seq_len);
        return BASERT_ERR_INVALID_ARGUMENT;
    }
    for (int i = 0; i < n_blocks; i++) {
        if (blocks[i] < 0 || blocks[i] >= rt->n_blocks || rt->ref[blocks[i]] <= 0) {
            rt_set_error(BASERT_ERR_INVALID_ARGUMENT, "%s: blocks[%d] = %d is not a live KV block", fn, i,
                         blocks[i]);
            return BASERT_ERR_INVALID_ARGUMENT;
        }
    }
    if (!rt->prefix || !is_trie_path(rt->prefix, blocks, n_blocks)) {
        rt_set_error(BASERT_ERR_INVALID_ARGUMENT,
                     "%s: the %d blocks are not a cached prefix (seed only the blocks of a baseRT_prefix_match)", fn,
                     n_blocks);
        return BASERT_ERR_INVALID_ARGUMENT;
    }
    /* The sequence's own references; the match keeps (and later drops) its own. */
    for (int i = 0; i < n_blocks; i++) rt_block_incref(rt, blocks[i]);
    memcpy(seq->blocks, blocks, (size_t)n_blocks * sizeof(int));
    seq->n_blocks = n_blocks;
    seq->length = n_tokens;
    rt_clear_error();
    return BASERT_OK;
}

int baseRT_prefix_insert(baseRT_model_t model, const uint32_t *tokens, int n_tokens, baseRT_sequence_t handle) {
    static const char fn[] = "baseRT_prefix_insert";
    rt_model *m = rt_runtime_model(model, fn);
    if (!m) return rt_last_error_code();
    if (n_tokens < 0 || (!tokens && n_tokens > 0)) {
        rt_set_error(BASERT_ERR_INVALID_ARGUMENT, "%s: invalid prompt (tokens=%p, n_tokens=%d)", fn,
                     (const void *)tokens, n_tokens);
        return BASERT_ERR_INVALID_ARGUMENT;
    }
    rt_seq *seq = rt_seq_get(m, handle, fn, -1);
    if (!seq) return rt_last_error_code();
    rt_runtime *rt = m->rt;
    rt_prefix_cache *pc = rt->prefix;
    if (!pc) {
        rt_clear_error();
        return BASERT_OK;
    }
    /* Only blocks the sequence has filled: its KV for those tokens is final. */
    int covered = n_tokens < seq->length ? n_tokens : seq->length;
    int depth = covered / RT_PAGE_SIZE;
    uint64_t stamp = ++pc->clock;
    rt_pnode *n = &pc->root;
    for (int d = 0; d < depth; d++) {
        const uint32_t *tk = tokens + (size_t)d * RT_PAGE_SIZE;
        rt_pnode *c = find_child(n, tk);
        /* The sequence's block already cached under other tokens: its KV is
         * not these tokens' KV (the caller passed another prompt), and a
         * second node would pin it forever. The path ends here. */
        if (!c && pc->owner[seq->blocks[d]]) break;
        if (!c) {
            if (n->n_child == n->cap_child) {
                int cap = n->cap_child ? 2 * n->cap_child : 2;
                rt_pnode **grown = realloc(n->child, (size_t)cap * sizeof *grown);
                if (!grown) goto oom;
                n->child = grown;
                n->cap_child = cap;
            }
            c = calloc(1, sizeof *c);
            if (!c) goto oom;
            memcpy(c->tokens, tk, sizeof c->tokens);
            c->block = seq->blocks[d];
            c->parent = n;
            rt_block_incref(rt, c->block);
            pc->owner[c->block] = c;
            n->child[n->n_child++] = c;
            pc->n_nodes++;
        }
        c->stamp = stamp;
        n = c;
    }
    rt_clear_error();
    return BASERT_OK;
oom:
    rt_set_error(BASERT_ERR_OUT_OF_MEMORY, "%s: out of memory growing the prefix trie", fn);
    return BASERT_ERR_OUT_OF_MEMORY;
}

int baseRT_prefix_evict(baseRT_model_t model, int n_blocks) {
    rt_model *m = rt_runtime_model(model, "baseRT_prefix_evict");
    if (!m) return 0;
    int freed = rt_prefix_evict_blocks(m, n_blocks);
    rt_clear_error();
    return freed;
}

void baseRT_prefix_cache_stats(baseRT_model_t model, uint64_t *out_hits, uint64_t *out_misses,
                               uint64_t *out_reused_tokens, int *out_blocks_cached) {
    if (out_hits) *out_hits = 0;
    if (out_misses) *out_misses = 0;
    if (out_reused_tokens) *out_reused_tokens = 0;
    if (out_blocks_cached) *out_blocks_cached = 0;
    rt_model *m = rt_runtime_model(model, "baseRT_prefix_cache_stats");
    if (!m) return;
    const rt_prefix_cache *pc = m->rt->prefix;
    if (pc) {
        if (out_hits) *out_hits = pc->hits;
        if (out_misses) *out_misses = pc->misses;
        if (out_reused_tokens) *out_reused_tokens = pc->reused_tokens;
        if (out_blocks_cached) *out_blocks_cached = pc->n_nodes;
    }
    rt_clear_error();
}
