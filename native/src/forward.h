#pragma once
/* The llama forward pass (forward.c): its scratch buffers and one batched
 * forward over lanes whose KV was reserved (kv.h / prefix.h). */

#include "runtime.h"

int rt_forward_init(rt_model *m);
void rt_forward_free(rt_model *m);
/* Most hidden-state taps one step may request (baseRT.h). */
#define RT_MAX_TAPS 8
/* What a multi-row step returns besides KV: per lane its LAST out_rows[i]
 * rows' logits (>= 1, lanes in order, rows ascending) and, for each of the
 * n_taps hidden_states indices in tap_layers (0 = embedding output, k = the
 * residual after layer k-1, n_layers = final pre-norm hidden), its LAST
 * tap_rows[i] rows (>= 0) into tap block j of rt->tap_buf. Validated by the
 * caller, buffers sized by the caller. */
typedef struct {
    const int *out_rows;
    const int *tap_layers;
    int n_taps;
    const int *tap_rows;
} rt_rows;
/* Run the lanes (validated and reserved) and advance their lengths. logits
 * (may be NULL): f32 [rows][vocab] of each lane's last row (rows NULL), or of
 * the rows `rows` asks for. pooled (may be NULL): [dim] sum over all rows of
 * the final-normed hidden state. */
void rt_forward(rt_model *m, const rt_lane *lanes, int n_lanes, float *logits, double *pooled, const rt_rows *rows);

