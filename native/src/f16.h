#pragma once
/* f16 / bf16 conversions (f16.c). */

#include <stddef.h>
#include <stdint.h>

uint16_t rt_f32_to_f16(float f); /* round to nearest even */
float rt_f16_to_f32(uint16_t h);
float rt_bf16_to_f32(uint16_t h);
/* x[i] = the f32 value of x[i] rounded to f16, and f16[i] its bits (f16 may be NULL): the scalar
 * conversions' exact results, 8 at a time with F16C where the CPU has it (a logits row is 49152). */
void rt_round_f16_n(float *x, uint16_t *f16, size_t n);
/* dst[i] = rt_f32_to_f16(src[i]), 8 at a time with F16C (KV rows, hidden-state taps). */
void rt_f32_to_f16_n(const float *src, uint16_t *dst, size_t n);
