#pragma once
/* Host-side logits-row ops (sampling.c): f16 rounding, argmax and the
 * sampling pipeline over f32 rows of length vocab. Needs no runtime state:
 * the single-sequence path, the batched steps and the baseRT_*_logits_row
 * entry points all choose tokens through these. */

#include "baseRT/baseRT.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* Round rows of f32 logits to f16 in place (the values every greedy/sampled
 * choice is made on), writing the halves to f16 when not NULL. */
void rt_logits_round_f16(float *logits, uint16_t *f16, size_t n);
uint32_t rt_argmax_f32(const float *row, int vocab); /* lowest index wins ties */
/* Full CPU pipeline of baseRT_sample_logits_row over a scratch copy. */
uint32_t rt_sample_cfg_f32(const float *row, int vocab, const BaseRTSamplingConfig *cfg, const uint32_t *prev,
                           int n_prev, int repeat_window, uint32_t seed_offset, float *scratch);
/* Gumbel-max sampling of baseRT_batch_step_fused_sample for one row
 * (temperature <= 0: argmax). Deterministic in (row values, rs->seed). */
uint32_t rt_sample_row_f32(const float *row, int vocab, const BaseRTRowSampling *rs, float *scratch);
/* Validate a BaseRTSamplingConfig as baseRT_sample_logits_row does: temperature
 * >= 0, top_k >= 0, top_p in (0, 1], min_p in [0, 1], repeat_penalty >= 0,
 * finite penalties, logit_bias ids inside the vocabulary and no NaN values.
 * Sets INVALID_ARGUMENT naming `fn` and returns false when bad. */
bool rt_sampling_config_check(const char *fn, const BaseRTSamplingConfig *c, int vocab);
