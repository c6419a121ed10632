#pragma once
/* Numeric kernels of the reference engine (runtime-private).
 *
 * Determinism contract: every value rt_matmul() / rt_dots() produce for one
 * (input row, weight row) pair is the same fixed sequence of floating-point
 * operations on those two rows -- whatever the number of rows, the other
 * rows, the tile it lands in or the thread that computes it. Batched, chunked
 * and prefix-seeded forwards are therefore bit-identical to their one-row,
 * one-shot, cold equivalents. The instruction set (AVX-512, AVX2+FMA or the
 * portable vector path) is chosen once per process. */

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* ---- thread pool --------------------------------------------------------- */
typedef struct rt_threads rt_threads;

/* Work function, run by every participating thread (`tid` 0 is the caller,
 * tids are distinct and < the pool size). Work is claimed dynamically through
 * a counter in ctx: a thread that is descheduled just does less of it, and
 * since every item is computed the same way whoever claims it, results never
 * depend on which thread ran what. */
typedef void (*rt_task_fn)(void *ctx, int tid);

/* CPUs the process may use: sched_getaffinity, capped by the cgroup v2
 * quota (/sys/fs/cgroup/cpu.max). */
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

/* ---- matmul -------------------------------------------------------------- */
/* A weight matrix as the loader keeps it: row-major [out][in], f32 or f16
 * (f16 stays f16 in memory and is widened in registers, exactly), or
 * quantized (q8 / q4, repacked at load: quant.h). */
enum { RT_W_F32 = 0, RT_W_F16 = 1, RT_W_Q8 = 2, RT_W_Q4 = 3 };
enum { RT_WF_SCALES_F32 = 1, RT_WF_SYMMETRIC = 2 }; /* rt_weight.flags of quantized weights */
typedef struct {
    void *p;
    int type;  /* RT_W_* */
    int flags; /* RT_WF_*: how a quantized matrix is stored (quant.h) */
} rt_weight;

/* Repack a base_q8 / base_q4 tensor [rows][cols] (groups of gs values along a
 * row, gs % 32 == 0; f16 or bf16 scales / biases, one per group; symmetric:
 * biases NULL and value = (u - 2^(bits-1)) * scale) into out. Returns the
 * bytes allocated, 0 when out of memory. */
size_t rt_weight_from_groups(rt_weight *out, bool q4, const uint8_t *packed, const uint8_t *scales,
                             const uint8_t *biases, bool bf16_scales, bool symmetric, size_t rows, size_t cols,
                             int gs);

/* Row `row` of W (`n` elements) widened to f32 into out. */
void rt_weight_row(const rt_weight *w, size_t row, int n, float *out);
/* Bytes per element of a weight type. */
size_t rt_weight_elem_size(int type);

/* One weight matrix W and its output y, with
 * y[r * ldy + o] = dot(x[r * ldx ..], W[o]). */
typedef struct {
    rt_weight w;
    float *y;
    int out;
    size_t ldy;
} rt_mm_target;

/* Multiply `rows` input rows (stride ldx, length in) by every target's weight
 * matrix: one parallel dispatch for all of them (q/k/v, gate/up share one).
 * Threads split output columns, never the reduction. xq: scratch of
 * rt_matmul_scratch_bytes(rows, in), used (x quantized into it once) when a
 * target is quantized; may be NULL otherwise. */
void rt_matmul(rt_threads *t, const float *x, size_t ldx, int rows, int in, const rt_mm_target *targets,
               int n_targets, void *xq);
/* Scratch bytes rt_matmul needs for `rows` rows of `in` values (in % 32 == 0). */
size_t rt_matmul_scratch_bytes(int rows, int in);

/* The same dot products on the calling thread, any weight-row stride:
 * y[r * ldy + o] = dot(x[r * ldx ..], w[o * ldw ..], n) for r < rows, o < out.
 * (Attention scores: query heads against a block of cached keys.) */
void rt_dots(const float *x, size_t ldx, int rows, const rt_weight *w, size_t ldw, int out, float *y, size_t ldy,
             int n);
/* y[k] += p[t] * v[t * ldv + k] for t = 0, 1, ..., n - 1 in that order, for
 * every k < d (attention: probabilities times a block of cached values; v f32
 * or f16, widened exactly). Each y[k] sees the same operations whatever d or
 * the other elements. */
void rt_axpy_rows(const float *p, int n, const rt_weight *v, size_t ldv, float *y, int d);

/* Name of the float kernel set in use ("avx512", "avx2-fma" or "generic"), for diagnostics. */
const char *rt_mathops_isa(void);
