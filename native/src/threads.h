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
/* The threads `auto` means: the physical cores of the affinity mask (one thread per core, SMT siblings
 * left out: topology.h), capped by the cgroup quota. */
int rt_auto_threads(void);
/* Threads to use: $BASERT_REF_THREADS (a count, or "auto"), else rt_auto_threads(); 1..64. */
int rt_default_threads(void);
/* The process-wide pool every model shares (created by the first acquire,
 * freed by the last release); NULL when no thread could be created. */
rt_threads *rt_threads_acquire(void);
void rt_threads_release(rt_threads *t);
/* Pools alive in the process, the shared pool's size and the most threads one
 * of its runs takes (its size capped by the usable CPUs unless
 * $BASERT_REF_POOL_OVERSUBSCRIBE lifts the cap; threads.c); 0 when none. */
int rt_threads_pools_alive(void);
int rt_threads_shared_size(void);
int rt_threads_shared_max_run(void);
/* A pool of n_threads (the caller counts as thread 0; tids index per-thread
 * scratch, so size it by rt_threads_count). NULL on failure. */
rt_threads *rt_threads_create(int n_threads);
void rt_threads_free(rt_threads *t);
int rt_threads_count(const rt_threads *t);
/* How many threads a parallel op deserves: the pool's size, but no more than
 * one per `min_work` of its `work` (bytes streamed, multiply-adds: the caller's
 * unit) and one per claimable item; at least 1. A wake-up and a join cost
 * about a microsecond each: an op too small to pay for them runs on fewer
 * threads (and the threads left out are not woken). */
int rt_threads_for_work(const rt_threads *t, double work, double min_work, int items);
/* Run fn on the caller and on up to n_threads - 1 workers (tids 1..n_threads-1,
 * only those are woken) that join in time; returns once fn has returned on
 * every thread that joined. t may be NULL (runs inline). */
void rt_threads_run(rt_threads *t, rt_task_fn fn, void *ctx, int n_threads);
