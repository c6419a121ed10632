#pragma once
/* Thread pool (threads.c): persistent workers, one pool per process. */

/* ---- thread pool --------------------------------------------------------- */
typedef struct rt_threads rt_threads;

/* Work function, run by every participating thread (`tid` 0 is the caller,
 * tids are distinct and < the pool size). Work is claimed dynamically through
 * a counter in ctx: a thread that is descheduled just does less of it, and
 * since every item is computed the same way whoever claims it, results never
 * depend on which thread ran what. */
typedef void (*rt_task_fn)(void *ctx, int tid);

/* CPUs the process may use: sched_getaffinity, capped by the smallest CPU
 * quota on the path from the process's own cgroup to the root (v2 cpu.max,
 * v1 cpu.cfs_quota_us / cpu.cfs_period_us). $BASERT_REF_CGROUP_ROOT prefixes
 * /proc/self/{cgroup,mountinfo} and the cgroup mounts (tests). */
int rt_usable_cpus(void);
/* Threads to use: $BASERT_REF_THREADS, else rt_usable_cpus(); 1..64. */
int rt_default_threads(void);
/* The process-wide pool every model shares (created by the first acquire,
 * freed by the last release); NULL when no thread could be created. */
rt_threads *rt_threads_acquire(void);
void rt_threads_release(rt_threads *t);
/* Pools alive in the process, and the shared pool's size (0 when none). */
int rt_threads_pools_alive(void);
int rt_threads_shared_size(void);
/* A pool of n_threads (the caller counts as thread 0). NULL on failure. */
rt_threads *rt_threads_create(int n_threads);
void rt_threads_free(rt_threads *t);
int rt_threads_count(const rt_threads *t);
/* Run fn on the caller and on up to n_threads - 1 workers that wake in time;
 * returns once fn has returned on every thread that joined. t may be NULL
 * (runs inline). */
void rt_threads_run(rt_threads *t, rt_task_fn fn, void *ctx, int n_threads);
