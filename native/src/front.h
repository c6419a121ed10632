#pragma once
/* Private declarations shared by the front files (loader.c, api_model.c,
 * api_tokenizer.c, sampling.c). Not used by the runtime or the tokenizer. */

#include "internal.h"

/* rt_model_check without touching the error state (pure queries). */
rt_model *rt_model_lookup(baseRT_model_t model);

/* ---- loader (loader.c) -------------------------------------------------- */
/* Load a bundle for entry point `fn`. opts may be NULL (defaults). Returns
 * NULL with the error set. */
rt_model *rt_load(const char *fn, const char *path, int max_context, const BaseRTLoadOptions *opts,
                  bool tokenizer_only);
/* Free everything the loader allocated (not the runtime state). NULL-safe. */
void rt_model_destroy(rt_model *m);

/* What suggest_max_context needs from a bundle, from its header alone. */
typedef struct {
    int trained_context;
    uint64_t weight_bytes;        /* resident weights (f16 matrices stay f16) */
    uint64_t kv_bytes_per_token;  /* one lane: n_layers * 2 * kv_dim * sizeof(float) */
} rt_bundle_budget;
/* BASERT_OK, or the error code (error state set). */
int rt_bundle_read_budget(const char *fn, const char *path, rt_bundle_budget *out);

/* ---- model API (api_model.c) -------------------------------------------- */
/* The capability descriptor JSON for a loaded model; NULL on allocation failure. */
char *rt_build_capability_descriptor(const rt_model *m);

/* ---- sampling (sampling.c) ---------------------------------------------- */
/* Validate a BaseRTSamplingConfig as baseRT_sample_logits_row does: temperature
 * >= 0, top_k >= 0, top_p in (0, 1], min_p in [0, 1], repeat_penalty >= 0,
 * finite penalties, logit_bias ids inside the vocabulary and no NaN values.
 * Sets INVALID_ARGUMENT naming `fn` and returns false when bad. */
bool rt_sampling_config_check(const char *fn, const BaseRTSamplingConfig *c, int vocab);
