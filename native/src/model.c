/* The model object: handle checks and teardown. Everything that takes a
 * model handle turns it into an rt_model here; the fields are filled by the
 * loader (loader.c) and by the model API (lifecycle.c). */

#include "model.h"

#include "errors.h"
#include "handles.h"

#include <stdlib.h>

rt_model *rt_model_lookup(baseRT_model_t model) {
    rt_model *m = rt_handle_get(model, RT_KIND_MODEL, NULL);
    return m && m->magic == RT_MODEL_MAGIC ? m : NULL;
}

rt_model *rt_model_check(baseRT_model_t model, const char *fn) {
    if (!model) {
        rt_set_error(BASERT_ERR_INVALID_ARGUMENT, "%s: model handle is NULL", fn);
        return NULL;
    }
    int why = RT_HANDLE_FOREIGN;
    rt_model *m = rt_handle_get(model, RT_KIND_MODEL, &why);
    if (!m)
        rt_set_error(BASERT_ERR_INVALID_ARGUMENT, "%s: %p is not a live model handle (%s)", fn, model,
                     why == RT_HANDLE_STALE ? "freed" : "foreign or corrupt");
    return m;
}

bool rt_model_busy(const rt_model *m, const char *fn) {
    if (!m->in_callback) return false;
    rt_set_error(BASERT_ERR_INVALID_ARGUMENT,
                 "%s: refused inside %s's token callback on the same model (return false from the callback to stop, "
                 "then call)",
                 fn, m->in_callback);
    return true;
}

rt_model *rt_runtime_model(baseRT_model_t model, const char *fn) {
    rt_model *m = rt_model_check(model, fn);
    if (!m || rt_model_busy(m, fn)) return NULL;
    if (!m->rt) {
        rt_set_error(BASERT_ERR_INVALID_ARGUMENT, "%s: the model was loaded tokenizer-only (no runtime state)", fn);
        return NULL;
    }
    return m;
}

void rt_model_destroy(rt_model *m) {
    if (!m) return;
    m->magic = 0;
    if (m->layers) {
        for (uint32_t l = 0; l < m->cfg.n_layers; l++) {
            rt_layer *L = &m->layers[l];
            free(L->attn_norm);
            free(L->wq.p);
            free(L->wk.p);
            free(L->wv.p);
            free(L->wo.p);
            free(L->ffn_norm);
            free(L->w_gate.p);
            free(L->w_up.p);
            free(L->w_down.p);
            free(L->bq);
            free(L->bk);
            free(L->bv);
            free(L->q_norm);
            free(L->k_norm);
            free(L->attn_out_norm);
            free(L->ffn_out_norm);
        }
        free(m->layers);
    }
    if (m->lm_head.p != m->tok_embd.p) free(m->lm_head.p);
    free(m->tok_embd.p);
    free(m->final_norm);
    free(m->rope_freqs);
    if (m->tok) bpe_free(m->tok);
    free(m->eos_ids);
    free(m->special_ids);
    free(m->bos_str);
    free(m->eos_str);
    free(m->chat_template);
    free(m->capability_descriptor);
    free(m->path);
    free(m);
}
