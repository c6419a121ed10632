#pragma once
/* A model's runtime state (created in generate.c, beside the single-sequence
 * API it serves): lifecycle.c creates it after loading and frees it with the
 * model. */

#include "model.h"

/* Called after weights and config are in place. Allocates the KV pool
 * (max_batch_size lanes x max_seq_len tokens, paged in blocks), scratch
 * buffers, the prefix cache and the default sequence. Returns BASERT_OK or
 * sets the error and returns its code. */
int rt_runtime_init(rt_model *m);
void rt_runtime_free(rt_model *m);
