#pragma once
/* f16 / bf16 conversions, defined in mathops.c. They sit in this header rather
 * than mathops.h because mathops.c takes its own prototypes from here (it
 * includes "internal.h"); the name is historical. Nothing else lives here: the
 * engine's shared declarations are in the concept headers (errors.h, model.h,
 * runtime.h, ...), and this header includes no project file, so mathops.c's
 * include of it cannot close a cycle. */

#include <stdint.h>

uint16_t rt_f32_to_f16(float f); /* round to nearest even */
float rt_f16_to_f32(uint16_t h);
float rt_bf16_to_f32(uint16_t h);
