#pragma once
/* Error state and fault injection (errors.c). The bottom of the engine: every
 * other file reports through these, and errors.c uses no other project file. */

#include "baseRT/baseRT.h"

#include <stdbool.h>

/* Thread-local error state. Every public entry point that succeeds calls
 * rt_clear_error(); every failure calls rt_set_error() with a message that
 * names the function and the bad value. */
void rt_set_error(BaseRTErrorCode code, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
void rt_clear_error(void);
BaseRTErrorCode rt_last_error_code(void);

/* ---- fault injection ---------------------------------------------------- */
/* Test-only switch (not part of the baseRT ABI), read from the environment at
 * load and settable at run time through baseRT_ref_inject_fault():
 *   kind 1: fail the Nth fused batch step (GENERATION_FAILED)
 *   kind 2: fail the Nth baseRT_sequence_create (OUT_OF_MEMORY)
 * n counts calls from the moment it is set (1 = the next call); 0 disarms. */
enum { RT_FAULT_STEP = 1, RT_FAULT_SEQ_CREATE = 2 };
bool rt_fault_should_fail(int kind);
