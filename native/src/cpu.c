/* The SIMD level the kernels may use (cpu.h). */

#include "cpu.h"

#include <stdlib.h>
#include <string.h>

int rt_simd_level(const char *cap_env) {
#if defined(__x86_64__) && defined(__GNUC__)
    const char *env = cap_env ? getenv(cap_env) : NULL;
    if (!env || !*env) env = getenv("BASERT_REF_SIMD");
    const char *cap = env && *env ? env : "";
    if (strcmp(cap, "0") == 0 || strcmp(cap, "generic") == 0) return RT_SIMD_GENERIC;
    __builtin_cpu_init();
    if (!__builtin_cpu_supports("avx2") || !__builtin_cpu_supports("fma") || !__builtin_cpu_supports("f16c"))
        return RT_SIMD_GENERIC;
    if (strcmp(cap, "avx2") == 0 || !__builtin_cpu_supports("avx512f")) return RT_SIMD_AVX2;
    if (__builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
        __builtin_cpu_supports("avx512vnni"))
        return RT_SIMD_AVX512_VNNI;
    return RT_SIMD_AVX512;
#else
    (void)cap_env;
    return RT_SIMD_GENERIC;
#endif
}
