#pragma once
/* f16 / bf16 conversions (f16.c). */

#include <stdint.h>

uint16_t rt_f32_to_f16(float f); /* round to nearest even */
float rt_f16_to_f32(uint16_t h);
float rt_bf16_to_f32(uint16_t h);
