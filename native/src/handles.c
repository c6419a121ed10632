/* Generational handle table for model and sequence handles.
 *
 * A handle given to a caller is not a pointer: it encodes a slot of this
 * table, the slot's generation and the handle kind. Looking a handle up never
 * dereferences caller-supplied memory, and freeing an object bumps its slot's
 * generation, so a stale handle stays stale even after the slot (or the
 * object's old address) is reused: a freed, foreign or reused handle is
 * reported, never followed. One process-wide table behind a mutex: sequence
 * calls (baseRT_sequence_free, _rollback, _seed_prefix) take no model, and
 * different models may be driven from different threads. */

#include "handles.h"

#include "baseRT/reference.h"
#include "errors.h"
#include "mathops.h"

#include <pthread.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    void *obj;    /* NULL when free */
    uint32_t gen; /* bumped on every release */
    uint8_t kind;
    uint32_t next_free; /* free list link (index + 1; 0 = end) */
} hslot;

static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;
static hslot *g_slots;
static uint32_t g_n, g_cap;
/* FIFO of free slots (index + 1; 0 = none) and its length. */
static uint32_t g_free_head, g_free_tail, g_n_free;

/* Free slots are reused only once this many are queued: a freed handle's slot
 * is not handed out again until many frees later (its generation differs
 * anyway; this keeps even a 32-bit build's short generation far from wrapping). */
enum { REUSE_AFTER = 256 };

/* Layout of a handle value (64-bit): generation in the high 32 bits, slot
 * index in bits 3..31, kind in bits 0..2 (never 0, so a handle is never NULL).
 * 32-bit platforms keep 12 generation bits. */
#if UINTPTR_MAX > 0xffffffffu
#define GEN_SHIFT 32
#define GEN_MASK 0xffffffffu
#define INDEX_MAX ((1u << 29) - 1)
#else
#define GEN_SHIFT 20
#define GEN_MASK 0xfffu
#define INDEX_MAX ((1u << 17) - 1)
#endif

static void *encode(uint32_t index, uint32_t gen, int kind) {
    uintptr_t v = ((uintptr_t)(gen & GEN_MASK) << GEN_SHIFT) | ((uintptr_t)index << 3) | (uintptr_t)kind;
    return (void *)v;
}

static void decode(const void *h, uint32_t *index, uint32_t *gen, int *kind) {
    uintptr_t v = (uintptr_t)h;
    *kind = (int)(v & 7u);
    *index = (uint32_t)((v >> 3) & INDEX_MAX);
    *gen = (uint32_t)((v >> GEN_SHIFT) & GEN_MASK);
}

void *rt_handle_new(int kind, void *obj) {
    pthread_mutex_lock(&g_lock);
    uint32_t idx;
    if (g_free_head && (g_n_free > REUSE_AFTER || g_n >= INDEX_MAX)) {
        idx = g_free_head - 1;
        g_free_head = g_slots[idx].next_free;
        if (!g_free_head) g_free_tail = 0;
        g_n_free--;
    } else if (g_n < INDEX_MAX) {
        if (g_n == g_cap) {
            uint32_t cap = g_cap ? g_cap * 2 : 64;
            hslot *ns = realloc(g_slots, (size_t)cap * sizeof *ns);
            if (!ns) {
                pthread_mutex_unlock(&g_lock);
                return NULL;
            }
            g_slots = ns;
            g_cap = cap;
        }
        idx = g_n++;
        g_slots[idx] = (hslot){0};
    } else {
        pthread_mutex_unlock(&g_lock);
        return NULL;
    }
    g_slots[idx].obj = obj;
    g_slots[idx].kind = (uint8_t)kind;
    g_slots[idx].next_free = 0;
    void *h = encode(idx, g_slots[idx].gen, kind);
    pthread_mutex_unlock(&g_lock);
    return h;
}

void rt_handle_release(const void *h) {
    uint32_t idx, gen;
    int kind;
    decode(h, &idx, &gen, &kind);
    pthread_mutex_lock(&g_lock);
    if (idx < g_n && g_slots[idx].obj && g_slots[idx].gen == gen && g_slots[idx].kind == kind) {
        g_slots[idx].obj = NULL;
        g_slots[idx].gen = (g_slots[idx].gen + 1) & GEN_MASK;
        g_slots[idx].next_free = 0;
        if (g_free_tail) g_slots[g_free_tail - 1].next_free = idx + 1;
        else g_free_head = idx + 1;
        g_free_tail = idx + 1;
        g_n_free++;
    }
    pthread_mutex_unlock(&g_lock);
}

void *rt_handle_get(const void *h, int kind, int *why) {
    uint32_t idx, gen;
    int k;
    decode(h, &idx, &gen, &k);
    void *obj = NULL;
    int reason = RT_HANDLE_FOREIGN;
    if (h && k == kind) {
        pthread_mutex_lock(&g_lock);
        if (idx < g_n) {
            if (g_slots[idx].obj && g_slots[idx].gen == gen && g_slots[idx].kind == kind) {
                obj = g_slots[idx].obj;
                reason = RT_HANDLE_OK;
            } else if (gen != g_slots[idx].gen) {
                reason = RT_HANDLE_STALE; /* this slot's object was freed since */
            }
        }
        pthread_mutex_unlock(&g_lock);
    }
    if (why) *why = reason;
    return obj;
}

int rt_handle_live_count(int kind) {
    pthread_mutex_lock(&g_lock);
    int n = 0;
    for (uint32_t i = 0; i < g_n; i++) n += g_slots[i].obj && g_slots[i].kind == kind;
    pthread_mutex_unlock(&g_lock);
    return n;
}

long baseRT_ref_counter(const char *name) {
    long v = -1;
    if (name && strcmp(name, "models") == 0) v = rt_handle_live_count(RT_KIND_MODEL);
    else if (name && strcmp(name, "sequences") == 0) v = rt_handle_live_count(RT_KIND_SEQ);
    else if (name && strcmp(name, "thread_pools") == 0) v = rt_threads_pools_alive();
    else if (name && strcmp(name, "pool_threads") == 0) v = rt_threads_shared_size();
    else if (name && strcmp(name, "pool_run_threads") == 0) v = rt_threads_shared_max_run();
    else if (name && strcmp(name, "usable_cpus") == 0) v = rt_usable_cpus();
    else if (name && strcmp(name, "auto_threads") == 0) v = rt_auto_threads();
    if (v < 0) {
        rt_set_error(BASERT_ERR_INVALID_ARGUMENT, "baseRT_ref_counter: unknown counter '%s'", name ? name : "(null)");
        return -1;
    }
    rt_clear_error();
    return v;
}
