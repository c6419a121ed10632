#pragma once
/* Quantized weights (base_q8 / base_q5 / base_q4, GGML Q4_K / Q5_K / Q6_K) and their integer matmul
 * kernels: the part of the math layer behind rt_matmul() for the RT_W_Q* targets (mathops.c drives the
 * kernels; the loader repacks through rt_weight_from_groups / rt_weight_from_ggml).
 *
 * Layout. A matrix [rows][in] is repacked at load into panels of 16 rows;
 * along a row, blocks of 32 values, value = d * u + m with u unsigned (q8:
 * 0..255, q5: 0..31, q4: 0..15), one (d, m) per row and block. A panel stores, block
 * after block: the 16 rows' values interleaved 4 bytes at a time (q8: 8
 * groups of 64 bytes, group s holding values 4s..4s+3 of row L at 4L; q4: 4
 * groups whose low nibbles hold values 4s..4s+3 and high nibbles values
 * 16+4s..16+4s+3; q5: q4's 4 groups, then 8 masks of 64 bits, mask 2s / 2s+1 bit j
 * the fifth bit of byte j's low / high nibble in group s), then the 16 rows' d, then their m (omitted for a
 * symmetric matrix, RT_WF_SYMMETRIC: q8 m = -128 d, q5 (GGML Q5_0) -16 d, q4 (Q4_0) -8 d; so Q5_0 / Q4_0 keep
 * GGML's 22 / 18 bytes per row and 32 values). d, m are f16 when every one converts exactly (the
 * base-convert case), else f32 (RT_WF_SCALES_F32). Rows past the matrix in
 * the last panel are zero. One 64-byte load thus feeds one integer dot step
 * of 16 rows against 4 activation bytes broadcast, and an int32 lane ends a
 * block holding one row's whole block sum.
 *
 * GGML K-quants (RT_W_Q4K / RT_W_Q5K / RT_W_Q6K) keep GGML's scale structure, so they stay about their
 * GGUF size: per panel and 256-value super-block a header, the 16 rows' f16 d (then, Q4_K / Q5_K, their
 * f16 dmin), then the super-block's 8 blocks, each the values (Q4_K: q4's groups, Q5_K: q5's; Q6_K: q4's
 * nibbles for u's low 4 bits plus 2 planes of 64 bytes, plane p byte j holding the high 2 bits of group
 * 2p's low / high nibble and group 2p + 1's low / high nibble at byte j, 2 bits each from bit 0), then 16
 * bytes of the rows' sub-block scales and 16 of their mins (Q6_K: the int8 scales of the block's first
 * and second 16-value halves). Per row and 32 values: Q4_K 18.5 bytes (GGML 18), Q5_K 22.5 (22), Q6_K
 * 26.25 (26.25). The kernels form GGML's own products in registers: d = f16 d * sc and m = -(f16 dmin
 * * mn) (Q6_K: each half's f16 d * sc, value = scale * (u - 32), no bias), exact in f32 (an f16 times an
 * integer below 64 or an int8), so the arithmetic below is unchanged.
 *
 * Activations are quantized per row and block of 32 (x ~= xd * q, q in
 * [-127, 127]), stored in order with per block xd, xs = xd * sum(q) and
 * corr = -128 * sum(q) (the term between a dot with u and one with u - 128).
 *
 * Determinism: every output is one fixed sequence of operations on its
 * (activation row, weight row) pair, the same in every kernel set (AVX-512
 * VNNI, AVX2, portable): per block in order isum = the exact integer dot,
 * acc = fma(float(isum), d * xd, acc) and bias = fma(m, xs, bias) (Q6_K: per half,
 * acc = fma(float(isum_half - 32 * sum(q_half)), d_half * xd, acc)); then
 * y = acc + bias. So batched, chunked and single-row products, and the
 * kernel sets, are bit-identical. Symmetric q4 / q5 run the same sequence with m = d * -8 (-16), formed
 * in registers and exact in f32: what an asymmetric panel storing that m computes, bit for bit. (Symmetric
 * q8 instead folds its offset into the integer sum: isum += corr, no bias term.) */

#include "weight.h"

#include <stdbool.h>

#include <stddef.h>
#include <stdint.h>

/* How a bundle stores a quantized tensor's scales and biases. f32 holds what a GGUF K-quant converted to
 * base_q8 / base_q4 makes exactly: d (f16) times a 6- or 8-bit sub-block scale. */
enum { RT_SCALE_F16 = 0, RT_SCALE_BF16 = 1, RT_SCALE_F32 = 2 };

/* Repack a base_q8 / base_q5 / base_q4 tensor (bits 8 / 5 / 4) [rows][cols] (groups of gs values along a
 * row, gs % 32 == 0; scales / biases of type scale_type (RT_SCALE_*), one per group; symmetric:
 * biases NULL and value = (u - 2^(bits-1)) * scale) into out, calling done(ctx, rows_done) (when not NULL)
 * after every chunk of rows, as rt_weight_from_ggml. Returns the bytes allocated, 0 when out of memory. */
size_t rt_weight_from_groups(rt_weight *out, int bits, const uint8_t *packed, const uint8_t *scales,
                             const uint8_t *biases, int scale_type, bool symmetric, size_t rows, size_t cols,
                             int gs, void (*done)(void *ctx, size_t rows_done), void *ctx);

/* GGML K-quant blocks a bundle may carry as they are (bundle dtypes ggml_q4_k / ggml_q5_k): 256-value
 * super-blocks (ggml-common.h), rows of cols / 256 blocks. */
enum { RT_GGML_Q4_K = 12, RT_GGML_Q5_K = 13, RT_GGML_Q6_K = 14 }; /* GGML's type numbers */
/* Repack such a tensor [rows][cols] (cols % 256 == 0) into the K panels (RT_W_Q4K / RT_W_Q5K / RT_W_Q6K:
 * GGML's own super-block scales, layout above), calling done(ctx, rows_done) (when not NULL) after every
 * chunk of whole panels (about 2 MB of blocks) and at the end: the caller may release the source rows read
 * so far. Returns the bytes allocated, 0 when out of memory or not a K type. */
/* bad (when not NULL): set when a super-block's d or dmin is NaN / Inf, which returns 0 as well (its
 * `field` is then not NULL). */
typedef struct {
    size_t block;      /* super-block index, row-major */
    const char *field; /* "d" / "dmin", NULL when none was */
    const char *what;  /* "NaN" / "Inf" */
} rt_ggml_bad;
size_t rt_weight_from_ggml(rt_weight *out, int ggml_type, const uint8_t *blocks, size_t rows, size_t cols,
                           void (*done)(void *ctx, size_t rows_done), void *ctx, rt_ggml_bad *bad);

/* Bytes of one quantized activation row of `in` values (in % 32 == 0). */
size_t rt_qx_row_bytes(int in);
/* Quantize `rows` rows of x (stride ldx) into xq (rows * rt_qx_row_bytes(in)). */
void rt_qx_quantize(const float *x, size_t ldx, int rows, int in, uint8_t *xq);
/* y[r * ldy + o] = dot(x row r, W row o) for r < rows, o0 <= o < o1, on the calling thread. */
void rt_qmatmul_range(const rt_weight *w, int in, const uint8_t *xq, int rows, float *y, size_t ldy, int o0, int o1);
/* Bytes a quantized W stores per row of `in` values (its panels' share: values, scales, offsets). */
size_t rt_qweight_row_bytes(const rt_weight *w, int in);
/* Row `row` of a quantized W, dequantized into out[0..n). */
void rt_qweight_row(const rt_weight *w, size_t row, int n, float *out);
/* The integer kernel set in use ("avx512-vnni", "avx2" or "generic"). */
const char *rt_quant_isa(void);
