/* The thread pool the kernels split their work over, sized from the CPUs the
 * process may use, one pool shared by every model of the process. */

#include "threads.h"
#include "cgroup.h"

#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* ---- thread pool ---------------------------------------------------------------
 * Persistent workers. A run is open from the moment it is posted until the
 * caller has finished its own share; a worker joins only while it is open
 * (one atomic word holds the open bit and the join count), and the caller
 * waits only for the workers that joined. A worker the OS has not scheduled
 * yet therefore never delays a step: it finds the run closed and goes back to
 * waiting. Between runs workers spin briefly (a decode step posts a few
 * hundred runs back to back) and then sleep on a condition variable. */

#if defined(__x86_64__) || defined(__i386__)
#define CPU_RELAX() __builtin_ia32_pause()
#else
#define CPU_RELAX() ((void)0)
#endif

enum {
    RUN_OPEN = 1 << 30,     /* state: the run accepts workers */
    RUN_JOINED = RUN_OPEN - 1,
    WORKER_SPIN = 1 << 12,  /* pauses before a worker sleeps (~0.2-0.5 ms) */
    CALLER_SPIN = 1 << 10,  /* pauses before the caller starts yielding */
};

struct rt_threads {
    int n; /* threads including the caller */
    pthread_t *th;
    /* The current run: written before `state` opens it, read by a worker
     * only after it joined through `state`. */
    rt_task_fn fn;
    void *ctx;
    atomic_int max_joined; /* read by workers that may be racing the next post */
    atomic_ulong generation;
    atomic_int state;    /* RUN_OPEN | workers joined */
    atomic_int finished; /* joined workers that returned */
    atomic_int sleepers;
    atomic_bool stop;
    atomic_bool busy; /* a run is in progress (models on other threads share the pool) */
    pthread_mutex_t mu;
    pthread_cond_t cv;
};

typedef struct {
    rt_threads *pool;
    int tid;
} worker_arg;

static void worker_wait(rt_threads *p, unsigned long seen) {
    for (int i = 0; i < WORKER_SPIN; i++) {
        if (atomic_load(&p->generation) != seen || atomic_load(&p->stop)) return;
        CPU_RELAX();
    }
    pthread_mutex_lock(&p->mu);
    atomic_fetch_add(&p->sleepers, 1);
    while (atomic_load(&p->generation) == seen && !atomic_load(&p->stop)) pthread_cond_wait(&p->cv, &p->mu);
    atomic_fetch_sub(&p->sleepers, 1);
    pthread_mutex_unlock(&p->mu);
}

static void *worker_main(void *arg) {
    worker_arg wa = *(worker_arg *)arg;
    free(arg);
    rt_threads *p = wa.pool;
    unsigned long seen = 0;
    for (;;) {
        worker_wait(p, seen);
        if (atomic_load(&p->stop)) break;
        seen = atomic_load(&p->generation);
        int st = atomic_load(&p->state);
        bool joined = false;
        while ((st & RUN_OPEN) && (st & RUN_JOINED) < atomic_load(&p->max_joined))
            if ((joined = atomic_compare_exchange_weak(&p->state, &st, st + 1))) break;
        if (!joined) continue;
        /* Joining synchronised with the post: fn and ctx are this run's. */
        p->fn(p->ctx, wa.tid);
        atomic_fetch_add(&p->finished, 1);
    }
    return NULL;
}

int rt_usable_cpus(void) {
    int n = 0;
#ifdef CPU_COUNT
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof set, &set) == 0) n = CPU_COUNT(&set);
#endif
    if (n <= 0) n = (int)sysconf(_SC_NPROCESSORS_ONLN);
    long long quota = rt_cgroup_limit(RT_CGROUP_CPUS);
    if (quota > 0 && quota < n) n = (int)quota;
    return n < 1 ? 1 : n;
}

int rt_default_threads(void) {
    const char *env = getenv("BASERT_REF_THREADS");
    long n = 0;
    if (env && *env) n = strtol(env, NULL, 10);
    if (n <= 0) n = rt_usable_cpus();
    if (n < 1) n = 1;
    if (n > 64) n = 64;
    return (int)n;
}

/* ---- the process-wide pool ------------------------------------------------------
 * Every model handle shares one pool sized to the usable CPUs: two handles
 * must not each spin up a full set of workers and oversubscribe the cores.
 * The pool lives while any model holds it. A run that finds it busy (another
 * model stepping on another thread) executes on its caller alone. */

static pthread_mutex_t g_pool_lock = PTHREAD_MUTEX_INITIALIZER;
static rt_threads *g_pool;
static int g_pool_users;
static atomic_int g_pools_alive;

rt_threads *rt_threads_acquire(void) {
    pthread_mutex_lock(&g_pool_lock);
    if (!g_pool) g_pool = rt_threads_create(rt_default_threads());
    if (g_pool) g_pool_users++;
    rt_threads *p = g_pool;
    pthread_mutex_unlock(&g_pool_lock);
    return p;
}

void rt_threads_release(rt_threads *p) {
    if (!p) return;
    pthread_mutex_lock(&g_pool_lock);
    rt_threads *dead = NULL;
    if (p == g_pool && --g_pool_users == 0) {
        dead = g_pool;
        g_pool = NULL;
    }
    pthread_mutex_unlock(&g_pool_lock);
    rt_threads_free(dead);
}

int rt_threads_pools_alive(void) { return atomic_load(&g_pools_alive); }

int rt_threads_shared_size(void) {
    pthread_mutex_lock(&g_pool_lock);
    int n = g_pool ? rt_threads_count(g_pool) : 0;
    pthread_mutex_unlock(&g_pool_lock);
    return n;
}

rt_threads *rt_threads_create(int n_threads) {
    rt_threads *p = calloc(1, sizeof *p);
    if (!p) return NULL;
    p->n = n_threads < 1 ? 1 : n_threads;
    atomic_fetch_add(&g_pools_alive, 1);
    pthread_mutex_init(&p->mu, NULL);
    pthread_cond_init(&p->cv, NULL);
    if (p->n > 1) {
        p->th = calloc((size_t)p->n - 1, sizeof *p->th);
        if (!p->th) {
            rt_threads_free(p);
            return NULL;
        }
        for (int i = 1; i < p->n; i++) {
            worker_arg *wa = malloc(sizeof *wa);
            if (wa) {
                wa->pool = p;
                wa->tid = i;
            }
            if (!wa || pthread_create(&p->th[i - 1], NULL, worker_main, wa) != 0) {
                free(wa);
                p->n = i; /* keep the workers that did start; free() joins them */
                rt_threads_free(p);
                return NULL;
            }
        }
    }
    return p;
}

void rt_threads_free(rt_threads *p) {
    if (!p) return;
    if (p->th) {
        pthread_mutex_lock(&p->mu);
        atomic_store(&p->stop, true);
        pthread_cond_broadcast(&p->cv);
        pthread_mutex_unlock(&p->mu);
        for (int i = 1; i < p->n; i++) pthread_join(p->th[i - 1], NULL);
        free(p->th);
    }
    pthread_mutex_destroy(&p->mu);
    pthread_cond_destroy(&p->cv);
    atomic_fetch_sub(&g_pools_alive, 1);
    free(p);
}

int rt_threads_count(const rt_threads *p) { return p ? p->n : 1; }

void rt_threads_run(rt_threads *p, rt_task_fn fn, void *ctx, int n_threads) {
    bool idle = false;
    if (!p || p->n <= 1 || n_threads <= 1 || !atomic_compare_exchange_strong(&p->busy, &idle, true)) {
        fn(ctx, 0); /* tid 0 is always the caller's: per-model scratch indexed by tid stays private */
        return;
    }
    p->fn = fn;
    p->ctx = ctx;
    atomic_store(&p->max_joined, (n_threads < p->n ? n_threads : p->n) - 1);
    atomic_store(&p->finished, 0);
    atomic_store(&p->state, RUN_OPEN);
    atomic_fetch_add(&p->generation, 1);
    /* Sequentially consistent: a worker that registered as a sleeper before
     * this load is woken; one registering after it sees the new generation. */
    if (atomic_load(&p->sleepers) > 0) {
        pthread_mutex_lock(&p->mu);
        pthread_cond_broadcast(&p->cv);
        pthread_mutex_unlock(&p->mu);
    }
    fn(ctx, 0);
    int joined = atomic_exchange(&p->state, 0) & RUN_JOINED;
    for (int i = 0; atomic_load(&p->finished) < joined; i++) {
        if (i < CALLER_SPIN)
            CPU_RELAX();
        else
            sched_yield(); /* a joined worker was descheduled: let it run */
    }
    atomic_store(&p->busy, false);
}
