/* The thread pool the kernels split their work over, sized from the CPUs the
 * process may use, one pool shared by every model of the process. */

#include "threads.h"
#include "cgroup.h"
#include "topology.h"

#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <limits.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

/* ---- thread pool ---------------------------------------------------------------
 * Persistent workers. A run is posted with the number of threads it deserves
 * (the caller's choice per op, rt_threads_for_work): only workers 1..n-1 are
 * invited, the rest stay where they are (spinning, yielding or asleep) and
 * are never woken for it. A run is open from the moment it is posted until the
 * caller has finished its own share; a worker joins only while it is open (one
 * fetch_add on a word holding the open bit and the join count: no retry loop
 * for a crowd of workers to contend on), and the caller waits only for the
 * workers that joined. A worker the OS has not scheduled yet therefore never
 * delays a step: it finds the run closed and goes back to waiting, and since
 * work is claimed item by item (threads.h), what it would have done is done by
 * the others.
 *
 * Waiting, between runs (a decode step posts a few hundred back to back): a
 * worker spins on the run counter with `pause` for SPIN_NS, then calls
 * sched_yield() until YIELD_NS have passed (a core that another thread needs
 * is handed over; an idle one comes straight back), then sleeps on its own
 * condition variable, which the caller signals only when it invites a worker
 * that sleeps. The caller, waiting for joined workers to finish, does the
 * same: pause, then yield.
 *
 * Oversubscription. A run never takes more threads than the process has
 * CPUs (affinity and cgroup quota, rt_usable_cpus): on 2 CPUs a pool of 16
 * runs every op on at most 2, since a joined worker that the OS preempts
 * holds its item for a whole time slice while the caller waits for it.
 * $BASERT_REF_POOL_OVERSUBSCRIBE=1 (read when the pool is made) lifts the cap,
 * for tests that must see 16 threads split an op on a small machine and for
 * benchmarks of the barrier itself; such a pool skips the `pause` phase, as a
 * spinning thread would hold the core that the caller or a joined worker needs.
 *
 * The words every worker polls (the run counter, the invitation, the task),
 * the join word, the finish counter and each worker's sleep slot sit on cache
 * lines of their own: a join or a finish must not invalidate the line fifteen
 * spinning workers are reading. */

#if defined(__x86_64__) || defined(__i386__)
#define CPU_RELAX() __builtin_ia32_pause()
#else
#define CPU_RELAX() ((void)0)
#endif

#define CACHE_LINE 64
#define ALIGNED_LINE __attribute__((aligned(CACHE_LINE)))

enum {
    RUN_OPEN = 1 << 30, /* state: the run accepts workers */
    RUN_JOINED = RUN_OPEN - 1,
    CLOCK_EVERY = 64, /* pauses (or yields) between two reads of the clock */
};

/* How long a waiting thread spins, then yields, before it sleeps (ns). */
static const long long SPIN_NS = 50 * 1000, YIELD_NS = 2000 * 1000;

typedef struct {
    atomic_int sleeping; /* the worker is (about to be) waiting on cv */
    pthread_mutex_t mu;
    pthread_cond_t cv;
} ALIGNED_LINE worker_slot;

struct rt_threads {
    /* Read by every waiting worker, written by the caller once per run. */
    struct {
        atomic_ulong generation;
        atomic_int invited; /* workers with tid < invited take part in the current run */
        rt_task_fn fn;      /* the current run: written before `state` opens it, read by a worker */
        void *ctx;          /* only after it joined through `state` */
        atomic_bool stop;
    } ALIGNED_LINE post;
    atomic_int state ALIGNED_LINE;    /* RUN_OPEN | workers joined */
    atomic_int finished ALIGNED_LINE; /* joined workers that returned */
    atomic_bool busy ALIGNED_LINE;    /* a run is in progress (models on other threads share the pool) */
    int n;                            /* threads including the caller */
    int max_run;                      /* the most threads one run takes: n, capped by the usable CPUs */
    int started;                      /* threads running (the caller counts): what free() joins */
    bool oversubscribed;              /* more threads than usable CPUs: yield, never spin */
    pthread_t *th;
    worker_slot *slots; /* [n]; slot 0 (the caller's) unused */
};

typedef struct {
    rt_threads *pool;
    int tid;
} worker_arg;

static long long now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (long long)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

/* A bounded wait: `pause` for SPIN_NS (unless told to yield from the start),
 * then sched_yield() until the deadline. */
typedef struct {
    long long start;
    int i;
    bool yielding;
} waiter;

static void waiter_init(waiter *w, bool spin) {
    w->start = now_ns();
    w->i = 0;
    w->yielding = !spin;
}

/* One step of the wait; false once `limit_ns` have passed since waiter_init. */
static bool waiter_step(waiter *w, long long limit_ns) {
    if (++w->i % CLOCK_EVERY == 0) {
        long long dt = now_ns() - w->start;
        if (dt >= limit_ns) return false;
        if (dt >= SPIN_NS) w->yielding = true;
    }
    if (w->yielding) sched_yield();
    else CPU_RELAX();
    return true;
}

/* Wait for a run this worker is invited to (its generation returned), or for stop (0). Runs for others
 * do not restart the wait: a worker that small ops leave out goes to sleep as if idle, and one that no run
 * can invite (tid beyond the CPU cap) sleeps at once, until the pool is freed. */
static unsigned long worker_wait(rt_threads *p, int tid, unsigned long seen) {
    worker_slot *me = &p->slots[tid];
    waiter w;
    waiter_init(&w, !p->oversubscribed);
    bool never = tid >= p->max_run;
    for (;;) {
        unsigned long g = atomic_load(&p->post.generation);
        if (atomic_load(&p->post.stop)) return 0;
        if (g != seen) {
            seen = g;
            if (tid < atomic_load(&p->post.invited)) return g;
            continue; /* a run for others */
        }
        if (!never && waiter_step(&w, YIELD_NS)) continue;
        /* Sleep. Sequentially consistent with the caller's post: either it sees
         * `sleeping` and signals, or this thread sees the new generation. */
        pthread_mutex_lock(&me->mu);
        atomic_store(&me->sleeping, 1);
        while (atomic_load(&p->post.generation) == seen && !atomic_load(&p->post.stop))
            pthread_cond_wait(&me->cv, &me->mu);
        atomic_store(&me->sleeping, 0);
        pthread_mutex_unlock(&me->mu);
        waiter_init(&w, !p->oversubscribed);
    }
}

static void *worker_main(void *arg) {
    worker_arg wa = *(worker_arg *)arg;
    free(arg);
    rt_threads *p = wa.pool;
    unsigned long seen = 0;
    for (;;) {
        seen = worker_wait(p, wa.tid, seen);
        if (!seen) break;
        if (!(atomic_fetch_add(&p->state, 1) & RUN_OPEN)) continue; /* closed: the caller did it all */
        /* Joining synchronised with the post: fn and ctx are this run's. */
        p->post.fn(p->post.ctx, wa.tid);
        atomic_fetch_add(&p->finished, 1);
    }
    return NULL;
}

/* The CPUs of the process's affinity mask (all online ones when it cannot be read). */
static int affinity_mask(cpu_set_t *set) {
    if (sched_getaffinity(0, sizeof *set, set) == 0 && CPU_COUNT(set) > 0) return CPU_COUNT(set);
    long n = sysconf(_SC_NPROCESSORS_ONLN);
    CPU_ZERO(set);
    for (long i = 0; i < n && i < CPU_SETSIZE; i++) CPU_SET((int)i, set);
    return n < 1 ? 1 : (int)n;
}

/* n capped by the cgroup CPU quota. */
static int within_quota(int n) {
    long long quota = rt_cgroup_limit(RT_CGROUP_CPUS);
    if (quota > 0 && quota < n) n = (int)quota;
    return n < 1 ? 1 : n;
}

int rt_usable_cpus(void) {
    cpu_set_t set;
    return within_quota(affinity_mask(&set));
}

int rt_auto_threads(void) {
    cpu_set_t set;
    affinity_mask(&set);
    return within_quota(rt_physical_cores(&set));
}

int rt_default_threads(void) {
    const char *env = getenv("BASERT_REF_THREADS");
    long n = 0;
    if (env && *env && strcmp(env, "auto") != 0) n = strtol(env, NULL, 10);
    if (n <= 0) n = rt_auto_threads();
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

int rt_threads_shared_max_run(void) {
    pthread_mutex_lock(&g_pool_lock);
    int n = g_pool ? g_pool->max_run : 0;
    pthread_mutex_unlock(&g_pool_lock);
    return n;
}

/* Zeroed memory aligned to a cache line (the pool's hot words each own one). */
static void *alloc_lines(size_t bytes) {
    void *p = NULL;
    bytes = (bytes + CACHE_LINE - 1) / CACHE_LINE * CACHE_LINE;
    if (posix_memalign(&p, CACHE_LINE, bytes ? bytes : CACHE_LINE) != 0) return NULL;
    memset(p, 0, bytes);
    return p;
}

rt_threads *rt_threads_create(int n_threads) {
    rt_threads *p = alloc_lines(sizeof *p);
    if (!p) return NULL;
    p->n = n_threads < 1 ? 1 : n_threads;
    int cpus = rt_usable_cpus();
    const char *over = getenv("BASERT_REF_POOL_OVERSUBSCRIBE");
    p->max_run = over && *over && strcmp(over, "0") != 0 ? p->n : p->n < cpus ? p->n : cpus;
    p->oversubscribed = p->max_run > cpus;
    atomic_fetch_add(&g_pools_alive, 1);
    p->slots = alloc_lines((size_t)p->n * sizeof *p->slots);
    if (!p->slots) {
        p->n = 1;
        rt_threads_free(p);
        return NULL;
    }
    for (int i = 0; i < p->n; i++) {
        pthread_mutex_init(&p->slots[i].mu, NULL);
        pthread_cond_init(&p->slots[i].cv, NULL);
    }
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
                p->started = i; /* keep the workers that did start; free() joins them */
                rt_threads_free(p);
                return NULL;
            }
        }
    }
    p->started = p->n;
    return p;
}

void rt_threads_free(rt_threads *p) {
    if (!p) return;
    atomic_store(&p->post.stop, true);
    for (int i = 1; i < p->started; i++) { /* wake every sleeper: stop is set, so none goes back to sleep */
        pthread_mutex_lock(&p->slots[i].mu);
        pthread_cond_signal(&p->slots[i].cv);
        pthread_mutex_unlock(&p->slots[i].mu);
    }
    for (int i = 1; i < p->started; i++) pthread_join(p->th[i - 1], NULL);
    free(p->th);
    if (p->slots)
        for (int i = 0; i < p->n; i++) {
            pthread_mutex_destroy(&p->slots[i].mu);
            pthread_cond_destroy(&p->slots[i].cv);
        }
    free(p->slots);
    atomic_fetch_sub(&g_pools_alive, 1);
    free(p);
}

int rt_threads_count(const rt_threads *p) { return p ? p->n : 1; }

int rt_threads_for_work(const rt_threads *p, double work, double min_work, int items) {
    int n = p ? p->max_run : 1;
    double want = min_work > 0 ? work / min_work : n;
    if (want < n) n = want < 1 ? 1 : (int)want;
    if (items < n) n = items < 1 ? 1 : items;
    return n;
}

void rt_threads_run(rt_threads *p, rt_task_fn fn, void *ctx, int n_threads) {
    bool idle = false;
    if (!p || p->max_run <= 1 || n_threads <= 1 || !atomic_compare_exchange_strong(&p->busy, &idle, true)) {
        fn(ctx, 0); /* tid 0 is always the caller's: per-model scratch indexed by tid stays private */
        return;
    }
    int invited = n_threads < p->max_run ? n_threads : p->max_run;
    p->post.fn = fn;
    p->post.ctx = ctx;
    atomic_store(&p->post.invited, invited);
    atomic_store(&p->finished, 0);
    atomic_store(&p->state, RUN_OPEN);
    atomic_fetch_add(&p->post.generation, 1);
    /* Sequentially consistent: a worker that said it sleeps before this load
     * is signalled; one saying it after it sees the new generation. */
    for (int i = 1; i < invited; i++)
        if (atomic_load(&p->slots[i].sleeping)) {
            pthread_mutex_lock(&p->slots[i].mu);
            pthread_cond_signal(&p->slots[i].cv);
            pthread_mutex_unlock(&p->slots[i].mu);
        }
    fn(ctx, 0);
    int joined = atomic_exchange(&p->state, 0) & RUN_JOINED;
    if (atomic_load(&p->finished) < joined) { /* a joined worker is still at its last item */
        waiter w;
        waiter_init(&w, !p->oversubscribed);
        while (atomic_load(&p->finished) < joined) waiter_step(&w, LLONG_MAX); /* a descheduled one: yield to it */
    }
    atomic_store(&p->busy, false);
}
