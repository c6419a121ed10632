/* The thread pool the kernels split their work over, sized from the CPUs the
 * process may use, one pool shared by every model of the process. */

#include "threads.h"

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

/* ---- cgroup CPU quota ------------------------------------------------------------
 * The quota that applies to this process is the smallest one on the path from
 * its own cgroup up to the hierarchy's root: cgroup v2 `cpu.max` ("quota
 * period" or "max period") at every level, and the v1 cpu controller's
 * cpu.cfs_quota_us / cpu.cfs_period_us (-1 = none). The process's cgroup is
 * read from /proc/self/cgroup and the hierarchies' mount points (and mount
 * roots, for a container that sees only part of the tree) from
 * /proc/self/mountinfo. $BASERT_REF_CGROUP_ROOT, when set, is prefixed to all
 * of these paths (tests point it at a fake tree). */

enum { CG_PATH = 4096 };

/* ceil(quota / period) CPUs; 0 for no limit or an unreadable one. */
static int quota_cpus(long long quota, long long period) {
    if (quota <= 0 || period <= 0) return 0;
    long long cpus = quota / period + (quota % period != 0);
    return cpus > 1024 ? 1024 : (int)cpus;
}

static bool read_first_line(const char *path, char *buf, int n) {
    FILE *f = fopen(path, "r");
    if (!f) return false;
    bool ok = fgets(buf, n, f) != NULL;
    fclose(f);
    return ok;
}

static int v2_limit(const char *dir) {
    char path[CG_PATH + 16], line[128], quota[32];
    long long period = 0;
    snprintf(path, sizeof path, "%s/cpu.max", dir);
    if (!read_first_line(path, line, (int)sizeof line) || sscanf(line, "%31s %lld", quota, &period) != 2 ||
        strcmp(quota, "max") == 0)
        return 0;
    return quota_cpus(strtoll(quota, NULL, 10), period);
}

static long long v1_value(const char *dir, const char *name) {
    char path[CG_PATH + 32], line[64];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    return read_first_line(path, line, (int)sizeof line) ? strtoll(line, NULL, 10) : -1;
}

static int v1_limit(const char *dir) {
    return quota_cpus(v1_value(dir, "cpu.cfs_quota_us"), v1_value(dir, "cpu.cfs_period_us"));
}

/* The smallest limit from dir up to its first stop_len characters (the
 * hierarchy's mount point); 0 when no level sets one. dir is consumed. */
static int smallest_limit_up(char *dir, size_t stop_len, int (*limit)(const char *)) {
    int best = 0;
    for (;;) {
        int l = limit(dir);
        if (l > 0 && (best == 0 || l < best)) best = l;
        char *slash = strrchr(dir, '/');
        if (strlen(dir) <= stop_len || !slash || (size_t)(slash - dir) < stop_len) break;
        *slash = '\0';
    }
    return best;
}

/* Is `word` one of the comma-separated items of list? */
static bool has_item(const char *list, const char *word) {
    size_t n = strlen(word);
    for (const char *p = list; p && *p; p = strchr(p, ',') ? strchr(p, ',') + 1 : NULL)
        if (strncmp(p, word, n) == 0 && (p[n] == ',' || p[n] == '\0' || p[n] == '\n')) return true;
    return false;
}

typedef struct {
    bool found;
    char cgroup[CG_PATH]; /* the process's cgroup in this hierarchy */
    char mount[CG_PATH];  /* its mount point */
    char mroot[CG_PATH];  /* the part of the hierarchy mounted there */
} cg_hier;

/* The limit of one hierarchy: its levels from root + mount + (cgroup minus mroot) up to the mount. */
static int hierarchy_limit(const char *root, const cg_hier *h, int (*limit)(const char *)) {
    const char *rel = h->cgroup;
    size_t mr = strlen(h->mroot);
    if (strcmp(h->mroot, "/") != 0) /* a container's view: the cgroup path is under its mount root */
        rel = strncmp(rel, h->mroot, mr) == 0 && (rel[mr] == '/' || rel[mr] == '\0') ? rel + mr : "";
    char dir[3 * CG_PATH];
    int base = snprintf(dir, sizeof dir, "%s%s", root, strcmp(h->mount, "/") == 0 ? "" : h->mount);
    if (base < 0 || (size_t)base >= sizeof dir) return 0;
    int n = snprintf(dir + base, sizeof dir - (size_t)base, "%s", rel);
    if (n < 0 || (size_t)(base + n) >= sizeof dir) return 0;
    size_t len = strlen(dir);
    while (len > (size_t)base && dir[len - 1] == '/') dir[--len] = '\0';
    return smallest_limit_up(dir, (size_t)base, limit);
}

static int cgroup_cpu_limit(void) {
    const char *root = getenv("BASERT_REF_CGROUP_ROOT");
    if (!root) root = "";
    char path[CG_PATH + 32];
    cg_hier v2 = {0}, v1 = {0};
    snprintf(path, sizeof path, "%s/proc/self/cgroup", root);
    FILE *f = fopen(path, "r");
    if (!f) return 0;
    char *line = NULL;
    size_t cap = 0;
    while (getline(&line, &cap, f) > 0) {
        line[strcspn(line, "\n")] = '\0';
        char *c1 = strchr(line, ':'), *c2 = c1 ? strchr(c1 + 1, ':') : NULL;
        if (!c2 || strlen(c2 + 1) >= CG_PATH) continue;
        *c1 = *c2 = '\0'; /* line: hierarchy id, c1 + 1: controllers, c2 + 1: path */
        cg_hier *h = strcmp(line, "0") == 0 && c1[1] == '\0' ? &v2 : has_item(c1 + 1, "cpu") ? &v1 : NULL;
        if (h) {
            h->found = true;
            strcpy(h->cgroup, c2 + 1);
        }
    }
    fclose(f);
    /* Mount points, by default where systemd and Docker put them. */
    strcpy(v2.mount, "/sys/fs/cgroup");
    strcpy(v1.mount, "/sys/fs/cgroup/cpu");
    strcpy(v2.mroot, "/");
    strcpy(v1.mroot, "/");
    snprintf(path, sizeof path, "%s/proc/self/mountinfo", root);
    if ((f = fopen(path, "r"))) {
        char mroot[CG_PATH], mount[CG_PATH], fstype[64], opts[1024];
        while (getline(&line, &cap, f) > 0) {
            const char *dash = strstr(line, " - ");
            if (!dash || sscanf(line, "%*s %*s %*s %4095s %4095s", mroot, mount) != 2 ||
                sscanf(dash + 3, "%63s %*s %1023s", fstype, opts) != 2)
                continue;
            cg_hier *h = strcmp(fstype, "cgroup2") == 0 ? &v2
                         : strcmp(fstype, "cgroup") == 0 && has_item(opts, "cpu") ? &v1
                                                                                   : NULL;
            if (h) {
                strcpy(h->mroot, mroot);
                strcpy(h->mount, mount);
            }
        }
        fclose(f);
    }
    free(line);
    int a = v2.found ? hierarchy_limit(root, &v2, v2_limit) : 0;
    int b = v1.found ? hierarchy_limit(root, &v1, v1_limit) : 0;
    return a && b ? (a < b ? a : b) : a ? a : b;
}

int rt_usable_cpus(void) {
    int n = 0;
#ifdef CPU_COUNT
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof set, &set) == 0) n = CPU_COUNT(&set);
#endif
    if (n <= 0) n = (int)sysconf(_SC_NPROCESSORS_ONLN);
    int quota = cgroup_cpu_limit();
    if (quota > 0 && quota < n) n = quota;
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
