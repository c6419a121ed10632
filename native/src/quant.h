#pragma once
/* Quantized weights (base_q8 / base_q4) and their integer matmul kernels:
 * the part of the math layer behind rt_matmul() for RT_W_Q8 / RT_W_Q4
 * targets (mathops.c drives the kernels; the loader repacks through
 * rt_weight_from_groups).
 *
 * Layout. A matrix [rows][in] is repacked at load into blocks of 32 values
 * along a row, value = d * u + m with u unsigned (q8: 0..255, q4: 0..15), one
 * (d, m) per block. Blocks are grouped in chunks of 4 (the last chunk of a
 * row may be short); a row is stored as
 *     q bytes | d[nb] | m[nb]   (m omitted for symmetric q8: m = -128 d)
 * with d, m as f16 when every one converts exactly (the GGUF / base-convert
 * case), else as f32 (RT_WF_SCALES_F32). q4 chunk bytes: byte 16 b + j of a
 * chunk holds value j (low nibble) and j + 16 (high) of its block b, as in
 * GGML's Q4_1. q8 chunk bytes (n blocks): first the values 0..15 of each
 * block (16 b + j), then the values 16..31 (16 n + 16 b + j).
 *
 * Activations are quantized per row and block of 32 (x ~= xd * q, q in
 * [-127, 127]) into the same chunk order: per chunk 64 bytes of first halves,
 * 64 bytes of second halves (zero past the row), so one integer dot of a
 * chunk leaves block b's sum in int32 lanes 4b..4b+3 for both weight kinds.
 *
 * Determinism: every output is one fixed sequence of operations on its
 * (activation row, weight row) pair -- per chunk isum = dot(lows) + dot(highs)
 * (exact integers), acc += float(isum) * (wd * xd) lane-wise; then a
 * fixed-order horizontal sum plus the bias sum over blocks of m * xs -- so
 * batched, chunked and single-row products are bit-identical. */

#include "weight.h"

#include <stdbool.h>

#include <stddef.h>
#include <stdint.h>

/* Repack a base_q8 / base_q4 tensor [rows][cols] (groups of gs values along a
 * row, gs % 32 == 0; f16 or bf16 scales / biases, one per group; symmetric:
 * biases NULL and value = (u - 2^(bits-1)) * scale) into out. Returns the
 * bytes allocated, 0 when out of memory. */
size_t rt_weight_from_groups(rt_weight *out, bool q4, const uint8_t *packed, const uint8_t *scales,
                             const uint8_t *biases, bool bf16_scales, bool symmetric, size_t rows, size_t cols,
                             int gs);

/* Bytes of one quantized activation row of `in` values (in % 32 == 0). */
size_t rt_qx_row_bytes(int in);
/* Quantize `rows` rows of x (stride ldx) into xq (rows * rt_qx_row_bytes(in)). */
void rt_qx_quantize(const float *x, size_t ldx, int rows, int in, uint8_t *xq);
/* y[r * ldy + o] = dot(x row r, W row o) for r < rows, o0 <= o < o1, on the calling thread. */
void rt_qmatmul_range(const rt_weight *w, int in, const uint8_t *xq, int rows, float *y, size_t ldy, int o0, int o1);
/* Row `row` of a quantized W, dequantized into out[0..n). */
void rt_qweight_row(const rt_weight *w, size_t row, int n, float *out);
/* The integer kernel set in use ("avx512-vnni", "avx2" or "generic"). */
const char *rt_quant_isa(void);
