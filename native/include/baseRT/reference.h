#pragma once
/* Extras exported only by the CPU reference engine (aiobasert/_native/libbaseRT.so).
 * Not part of the baseRT ABI: a binding must look these up optionally (a real
 * engine does not have them). */

#include "baseRT/baseRT.h"

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

/* Consistency check of a model's paged KV pool, for tests and fuzzers: every
 * block's refcount equals its owners (live sequences, prefix-cache nodes,
 * pending prefix matches) and the free list holds exactly the unowned blocks,
 * once each. BASERT_OK, or BASERT_ERR_UNKNOWN with a message naming the first
 * inconsistency (INVALID_ARGUMENT for a bad handle). */
int baseRT_ref_check_kv(baseRT_model_t model);

/* Process-wide counters, for tests: "models" and "sequences" (live handles),
 * "thread_pools" (worker pools alive) and "pool_threads" (threads of the
 * shared pool, the caller included; 0 before the first model),
 * "pool_run_threads" (the most threads one run of it takes: pool_threads capped
 * by usable_cpus, unless $BASERT_REF_POOL_OVERSUBSCRIBE=1 lifts the cap),
 * "usable_cpus" (affinity capped by the cgroup quota), "auto_threads" (the
 * pool size $BASERT_REF_THREADS unset or "auto" gives: the affinity mask's
 * physical cores, SMT siblings counted once, capped by the quota). -1 with
 * INVALID_ARGUMENT for an unknown name. */
long baseRT_ref_counter(const char *name);

/* The kernel sets this process chose (once, at first use, from the CPU and
 * $BASERT_REF_SIMD = generic | avx2 capping it; $BASERT_REF_QUANT_SIMD caps the
 * integer kernels alone), for tests and benchmarks:
 * "float=<set> quant=<set>", e.g. "float=avx512 quant=avx512-vnni". */
const char *baseRT_ref_kernels(void);

#ifdef __cplusplus
}
#endif
