#pragma once
/* A weight matrix as the engine keeps it (header only: the type the kernels,
 * the loader and the forward pass share). */

/* A weight matrix as the loader keeps it: row-major [out][in], f32 or f16
 * (f16 stays f16 in memory and is widened in registers, exactly), or
 * quantized (q8 / q5 / q4, repacked at load; GGML's Q4_K / Q5_K / Q6_K in
 * panels that keep their super-block scales: quant.h). */
enum { RT_W_F32 = 0, RT_W_F16 = 1, RT_W_Q8 = 2, RT_W_Q4 = 3, RT_W_Q5 = 4, RT_W_Q6K = 5, RT_W_Q4K = 6, RT_W_Q5K = 7 };
/* The integer-kernel types (quant.h). */
#define RT_W_IS_QUANT(type) ((type) >= RT_W_Q8 && (type) <= RT_W_Q5K)
enum { RT_WF_SCALES_F32 = 1, RT_WF_SYMMETRIC = 2 }; /* rt_weight.flags of quantized weights */
typedef struct {
    void *p;
    int type;  /* RT_W_* */
    int flags; /* RT_WF_*: how a quantized matrix is stored (quant.h) */
} rt_weight;
