/* f16 / bf16 <-> f32 conversions, bit-exact and portable (no F16C needed):
 * the loader, the kernels' scalar tails and the KV pool use them. */

#include "f16.h"

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

