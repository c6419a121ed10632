#pragma once
/* The bundle reader (loader.c): a .base file (docs/BUNDLE.md) into a model
 * object. It reads and validates; it creates no handle and no runtime state
 * (the model API does, lifecycle.c). */

#include "model.h"

#include <stdbool.h>
#include <stdint.h>

/* Load a bundle for entry point `fn`. opts may be NULL (defaults). Returns
 * NULL with the error set; on success the model has neither magic, handle,
 * capability descriptor nor runtime yet. */
rt_model *rt_load(const char *fn, const char *path, int max_context, const BaseRTLoadOptions *opts,
                  bool tokenizer_only);

/* What suggest_max_context needs from a bundle, from its header alone. */
typedef struct {
    int trained_context;
    uint64_t weight_bytes;        /* resident weights (f16 matrices stay f16) */
    uint64_t kv_bytes_per_token;  /* one lane: n_layers * 2 * kv_dim * sizeof(float) */
} rt_bundle_budget;
/* BASERT_OK, or the error code (error state set). */
int rt_bundle_read_budget(const char *fn, const char *path, rt_bundle_budget *out);
