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

#include "threads.h"
#include "weight.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* ---- matmul -------------------------------------------------------------- */
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

/* ---- activations (scalar, one fixed formula each) ------------------------- */
#include <math.h>
static inline float rt_silu(float x) { return x / (1.0f + expf(-x)); }
/* GELU's tanh approximation, in f32. (ggml's CPU backend looks it up in an f16 table instead:
 * input and output rounded to f16; the exact formula keeps the oracle's bound, and ggml's other
 * roundings -- its 8-bit activations in quantized matmuls -- are larger.) */
static inline float rt_gelu_tanh(float x) {
    return 0.5f * x * (1.0f + tanhf(0.7978845608028654f * x * (1.0f + 0.044715f * x * x)));
}

/* Name of the float kernel set in use ("avx512", "avx2-fma" or "generic"), for diagnostics. */
const char *rt_mathops_isa(void);
