#pragma once
/* Extras exported only by the CPU reference engine (aiobasert/_native/libbaseRT.so).
 * Not part of the baseRT ABI: a binding must look these up optionally (a real
 * engine does not have them). */

#ifdef __cplusplus
extern "C" {
#endif

/* Fault injection, for tests of the SDK's failure paths. */
enum {
    BASERT_REF_FAULT_STEP = 1,       /* the Nth fused batch step fails with GENERATION_FAILED */
    BASERT_REF_FAULT_SEQ_CREATE = 2, /* the Nth baseRT_sequence_create fails with OUT_OF_MEMORY */
};

/* Arm fault `kind` to fire on the n-th matching call from now (1 = the next
 * call); n = 0 disarms it. A fault fires once, then disarms itself. The
 * counters are process-wide. The environment can arm them too, read once at
 * the first use of either counter: BASERT_REF_FAIL_STEP=N and
 * BASERT_REF_FAIL_SEQ_CREATE=N. Returns BASERT_OK, or
 * BASERT_ERR_INVALID_ARGUMENT for an unknown kind or a negative n. */
int baseRT_ref_inject_fault(int kind, int n);

#ifdef __cplusplus
}
#endif
