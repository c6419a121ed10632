#pragma once
/* What SIMD the CPU offers the kernels, capped by the environment (cpu.c): the
 * one place the float (mathops.c) and integer (quant.c) kernel sets are chosen from. */

/* Levels, each including the ones below. */
enum {
    RT_SIMD_GENERIC = 0,     /* portable C */
    RT_SIMD_AVX2 = 1,        /* AVX2 + FMA + F16C */
    RT_SIMD_AVX512 = 2,      /* + AVX-512F */
    RT_SIMD_AVX512_VNNI = 3, /* + AVX-512 BW, VL and VNNI */
};

/* The CPU's level, capped by $cap_env when set, else by $BASERT_REF_SIMD: "generic" (or "0") or "avx2";
 * anything else leaves the CPU's level. Read afresh on each call: callers choose once and keep it. */
int rt_simd_level(const char *cap_env);
