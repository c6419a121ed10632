/* f16 / bf16 <-> f32 conversions, bit-exact and portable (no F16C needed):
 * the loader, the kernels' scalar tails and the KV pool use them. */

#include "f16.h"

#include <pthread.h>
#include <stdbool.h>
#include <string.h>

uint16_t rt_f32_to_f16(float f) {
    uint32_t x;
    memcpy(&x, &f, sizeof x);
    uint16_t sign = (uint16_t)((x >> 16) & 0x8000u);
    uint32_t abs = x & 0x7fffffffu;
    if (abs >= 0x7f800000u) { /* inf, or NaN kept quiet with its top payload bits */
        if (abs == 0x7f800000u) return (uint16_t)(sign | 0x7c00u);
        return (uint16_t)(sign | 0x7e00u | ((abs & 0x7fffffu) >> 13));
    }
    if (abs >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u); /* >= 65520 rounds to inf */
    if (abs >= 0x38800000u) {                                  /* normal half */
        /* Rebias 127 -> 15 and round the 13 dropped bits to nearest even; a
         * mantissa carry correctly bumps the exponent. */
        uint32_t r = abs + 0xfffu + ((abs >> 13) & 1u);
        r -= 112u << 23;
        return (uint16_t)(sign | (r >> 13));
    }
    /* Subnormal half (or zero): adding 0.5f leaves an ulp of 2^-24, so the FPU's
     * round-to-nearest-even does the rounding; the low bits are the mantissa. */
    float a;
    memcpy(&a, &abs, sizeof a);
    float v = a + 0.5f;
    uint32_t vb;
    memcpy(&vb, &v, sizeof vb);
    return (uint16_t)(sign | (vb - 0x3f000000u));
}

float rt_f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu;
    uint32_t mant = h & 0x3ffu;
    uint32_t bits;
    if (exp == 0) {
        float v = (float)mant * 5.9604644775390625e-8f; /* mant * 2^-24, exact */
        memcpy(&bits, &v, sizeof bits);
        bits |= sign;
    } else if (exp == 0x1f) {
        bits = sign | 0x7f800000u | (mant << 13);
    } else {
        bits = sign | ((exp + 112u) << 23) | (mant << 13);
    }
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

float rt_bf16_to_f32(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* F16C's conversions round to nearest even, keep NaNs quiet with their top payload bits and make f16
 * subnormals exactly as the scalar code does (DAZ is off: C programs never set it). */
#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>

/* The first n - n % 8 values; returns how many were done (the scalar loops finish the rest). */
__attribute__((target("avx,f16c"))) static size_t round_f16_f16c(float *x, uint16_t *f16, size_t n) {
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m128i h = _mm256_cvtps_ph(_mm256_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        if (f16) _mm_storeu_si128((__m128i *)(void *)(f16 + i), h);
        _mm256_storeu_ps(x + i, _mm256_cvtph_ps(h));
    }
    _mm256_zeroupper();
    return i;
}

__attribute__((target("avx,f16c"))) static size_t to_f16_f16c(const float *src, uint16_t *dst, size_t n) {
    size_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm_storeu_si128((__m128i *)(void *)(dst + i),
                         _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    _mm256_zeroupper();
    return i;
}

static bool g_f16c;
static pthread_once_t g_f16c_once = PTHREAD_ONCE_INIT;
static void probe_f16c(void) {
    __builtin_cpu_init();
    g_f16c = __builtin_cpu_supports("avx") && __builtin_cpu_supports("f16c");
}
static bool have_f16c(void) {
    pthread_once(&g_f16c_once, probe_f16c);
    return g_f16c;
}
#endif

void rt_round_f16_n(float *x, uint16_t *f16, size_t n) {
    size_t i = 0;
#if defined(__x86_64__) && defined(__GNUC__)
    if (have_f16c()) i = round_f16_f16c(x, f16, n);
#endif
    for (; i < n; i++) {
        uint16_t h = rt_f32_to_f16(x[i]);
        if (f16) f16[i] = h;
        x[i] = rt_f16_to_f32(h);
    }
}

void rt_f32_to_f16_n(const float *src, uint16_t *dst, size_t n) {
    size_t i = 0;
#if defined(__x86_64__) && defined(__GNUC__)
    if (have_f16c()) i = to_f16_f16c(src, dst, n);
#endif
    for (; i < n; i++) dst[i] = rt_f32_to_f16(src[i]);
}
