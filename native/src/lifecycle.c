/* Model lifecycle and inspection ABI: version, load / free, config,
 * capabilities and their descriptor, context sizing, identity. */

#include "generate.h"
#include "cgroup.h"
#include "errors.h"
#include "handles.h"
#include "json.h"
#include "loader.h"
#include "model.h"

#include <dlfcn.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* ---- versioning ---------------------------------------------------------------- */

const char *baseRT_version_string(void) { return "0.4.6-ref"; }

unsigned int baseRT_abi_version(void) { return BASERT_ABI_VERSION; }

/* ---- load / free --------------------------------------------------------------- */

/* The legacy process-wide pre-load setters; baseRT_load_model reads them. */
static atomic_int g_set_kv_bits, g_set_paged_kv, g_set_max_batch, g_set_prefix_cache, g_set_prefill_chunk;
static pthread_mutex_t g_load_lock = PTHREAD_MUTEX_INITIALIZER;

void baseRT_set_kv_bits(int bits) {
    if (bits == 0 || bits == 4 || bits == 8 || bits == 16 || bits == 84) atomic_store(&g_set_kv_bits, bits);
}
void baseRT_set_paged_kv(int enable) { atomic_store(&g_set_paged_kv, enable != 0); }
void baseRT_set_max_batch_size(int n) { atomic_store(&g_set_max_batch, n > 0 ? n : 0); }
void baseRT_set_prefix_cache(int enable) { atomic_store(&g_set_prefix_cache, enable != 0); }
void baseRT_set_prefill_chunk(int n) { atomic_store(&g_set_prefill_chunk, n); }

static char *rt_build_capability_descriptor(const rt_model *m);

/* What makes a bundle the loader read a live model: its capability
 * descriptor, its handle and (unless tokenizer-only) its runtime state. Here,
 * not in the loader, so the loader needs neither this file nor the runtime.
 * NULL with the error set (m freed). */
static rt_model *open_model(const char *fn, const char *path, rt_model *m, bool tokenizer_only) {
    m->capability_descriptor = rt_build_capability_descriptor(m);
    if (!m->capability_descriptor) {
        rt_set_error(BASERT_ERR_OUT_OF_MEMORY, "%s: %s: out of memory", fn, path);
        rt_model_destroy(m);
        return NULL;
    }
    m->magic = RT_MODEL_MAGIC;
    if (!(m->handle = rt_handle_new(RT_KIND_MODEL, m))) {
        rt_set_error(BASERT_ERR_OUT_OF_MEMORY, "%s: %s: out of memory", fn, path);
        rt_model_destroy(m);
        return NULL;
    }
    if (!tokenizer_only && rt_runtime_init(m) != BASERT_OK) {
        /* rt_runtime_init set the error; it leaves m->rt NULL or freeable. */
        rt_handle_release(m->handle);
        if (m->rt) rt_runtime_free(m);
        rt_model_destroy(m);
        return NULL;
    }
    rt_clear_error();
    return m;
}

static rt_model *load_locked(const char *fn, const char *path, int max_context, const BaseRTLoadOptions *opts,
                             bool tokenizer_only) {
    pthread_mutex_lock(&g_load_lock);
    rt_model *m = rt_load(fn, path, max_context, opts, tokenizer_only);
    if (m) m = open_model(fn, path, m, tokenizer_only);
    pthread_mutex_unlock(&g_load_lock);
    return m ? m->handle : NULL;
}

baseRT_model_t baseRT_load_model(const char *model_path, const char *kernel_library_path, int max_context) {
    (void)kernel_library_path; /* no GPU kernels on the CPU reference */
    BaseRTLoadOptions o = {
        .struct_size = sizeof o,
        .kv_bits = atomic_load(&g_set_kv_bits),
        .paged_kv = atomic_load(&g_set_paged_kv),
        .max_batch_size = atomic_load(&g_set_max_batch),
        .prefix_cache = atomic_load(&g_set_prefix_cache),
        .prefill_chunk = atomic_load(&g_set_prefill_chunk),
    };
    return load_locked("baseRT_load_model", model_path, max_context, &o, false);
}

baseRT_model_t baseRT_load_model_ex(const char *model_path, const char *kernel_library_path, int max_context,
                                    const BaseRTLoadOptions *opts) {
    if (!opts) return baseRT_load_model(model_path, kernel_library_path, max_context);
    if (opts->struct_size != sizeof(BaseRTLoadOptions)) {
        rt_set_error(BASERT_ERR_INVALID_ARGUMENT,
                     "baseRT_load_model_ex: opts->struct_size is %zu, this library's BaseRTLoadOptions is %zu bytes",
                     opts->struct_size, sizeof(BaseRTLoadOptions));
        return NULL;
    }
    return load_locked("baseRT_load_model_ex", model_path, max_context, opts, false);
}

baseRT_model_t baseRT_load_tokenizer_only(const char *model_path) {
    return load_locked("baseRT_load_tokenizer_only", model_path, 0, NULL, true);
}

void baseRT_free_model(baseRT_model_t model) {
    if (!model) return;
    rt_model *m = rt_model_check(model, "baseRT_free_model");
    if (!m || rt_model_busy(m, "baseRT_free_model")) return;
    rt_handle_release(m->handle);
    if (!m->tokenizer_only) rt_runtime_free(m); /* releases its sequences' handles too */
    rt_model_destroy(m); /* poisons the magic before freeing */
    rt_clear_error();
}

/* ---- config -------------------------------------------------------------------- */

BaseRTModelConfig baseRT_get_config(baseRT_model_t model) {
    BaseRTModelConfig cfg;
    memset(&cfg, 0, sizeof cfg);
    rt_model *m = rt_model_check(model, "baseRT_get_config");
    if (!m) return cfg;
    rt_clear_error();
    return m->cfg;
}

size_t baseRT_get_config_into(baseRT_model_t model, void *out, size_t out_size) {
    BaseRTModelConfig cfg;
    memset(&cfg, 0, sizeof cfg);
    rt_model *m = rt_model_check(model, "baseRT_get_config_into");
    if (m) {
        cfg = m->cfg;
        rt_clear_error();
    }
    if (out && out_size) {
        size_t n = out_size < sizeof cfg ? out_size : sizeof cfg;
        memcpy(out, &cfg, n);
        if (out_size > n) memset((char *)out + n, 0, out_size - n);
    }
    return sizeof(BaseRTModelConfig);
}

size_t baseRT_model_config_sizeof(void) { return sizeof(BaseRTModelConfig); }

/* ---- capabilities --------------------------------------------------------------- */

uint32_t baseRT_capabilities(baseRT_model_t model) {
    const rt_model *m = rt_model_lookup(model);
    if (!m || m->tokenizer_only || !m->paged_kv) return 0;
    uint32_t caps = BASERT_CAP_PAGED_KV | BASERT_CAP_SEQUENCES | BASERT_CAP_HOST_LOGITS;
    if (m->prefix_cache) caps |= BASERT_CAP_PREFIX_CACHE;
    return caps;
}

const char *baseRT_capability_descriptor(baseRT_model_t model) {
    const rt_model *m = rt_model_lookup(model);
    return m ? m->capability_descriptor : NULL;
}

/* Every function baseRT.h declares, in header order (generated from the
 * header); the descriptor lists those this library actually exports. */
static const char *const ABI_FUNCTIONS[] = {
    "baseRT_load_model", "baseRT_encode", "baseRT_generate", "baseRT_free_model", "baseRT_get_error",
    "baseRT_get_error_code", "baseRT_set_kv_bits", "baseRT_version_string", "baseRT_get_config_into",
    "baseRT_abi_version", "baseRT_suggest_max_context", "baseRT_load_tokenizer_only", "baseRT_load_model_ex",
    "baseRT_capabilities", "baseRT_reload_metallib", "baseRT_capability_descriptor", "baseRT_kv_bits_effective",
    "baseRT_set_verbose", "baseRT_set_paged_kv", "baseRT_set_max_batch_size", "baseRT_set_prefix_cache",
    "baseRT_set_prefill_chunk", "baseRT_set_paged_weights", "baseRT_set_baked_decode", "baseRT_set_decode_replay",
    "baseRT_set_gpu_wait_timeout_ms", "baseRT_get_config", "baseRT_model_config_sizeof", "baseRT_model_memory",
    "baseRT_device_memory_budget", "baseRT_suggest_max_context_multi", "baseRT_suggest_max_context_spec",
    "baseRT_context_window_fits", "baseRT_model_memory_stats", "baseRT_strerror", "baseRT_encode_plain",
    "baseRT_encode_pieces", "baseRT_decode_token", "baseRT_decode_token_static", "baseRT_decode_stream_create",
    "baseRT_decode_stream_reset", "baseRT_decode_stream_reset_for_prompt", "baseRT_decode_stream_token",
    "baseRT_decode_stream_free", "baseRT_decode_token_raw", "baseRT_generate_cached", "baseRT_sequence_create",
    "baseRT_sequence_generate", "baseRT_sequence_generate_continue", "baseRT_sequence_free",
    "baseRT_batch_decode_step", "baseRT_batch_decode_loop", "baseRT_batch_step", "baseRT_batch_step_fused",
    "baseRT_batch_step_fused_pads", "baseRT_batch_warmup", "baseRT_max_prefill_chunk", "baseRT_sequence_rollback",
    "baseRT_batch_step_fused_loop", "baseRT_batch_step_fused_logits", "baseRT_batch_step_fused_sample",
    "baseRT_sample_logits_rows", "baseRT_read_batch_logits", "baseRT_batch_step_fused_logits_rows",
    "baseRT_tap_rows_capacity", "baseRT_batch_step_fused_rows_argmax", "baseRT_batch_step_fused_logits_rows_taps",
    "baseRT_batch_step_fused_logits_rows_taps_input", "baseRT_has_speculator", "baseRT_speculator_kind",
    "baseRT_speculator_head_supported", "baseRT_model_supports_taps", "baseRT_load_speculator_head",
    "baseRT_mtp_prologue", "baseRT_mtp_chain", "baseRT_read_tap_rows", "baseRT_load_drafter", "baseRT_drafter_info",
    "baseRT_drafter_step", "baseRT_drafter_heads", "baseRT_drafter_markov_argmax", "baseRT_drafter_confidence",
    "baseRT_eagle3_info", "baseRT_eagle3_step", "baseRT_eagle3_read", "baseRT_eagle3_draft", "baseRT_eagle3_chain",
    "baseRT_batch_step_fused_logits_media", "baseRT_batch_logits_stride", "baseRT_mask_logits_row",
    "baseRT_sample_logits_row", "baseRT_argmax_logits_row", "baseRT_logits_row_logprobs", "baseRT_prefix_match",
    "baseRT_sequence_seed_prefix", "baseRT_prefix_insert", "baseRT_prefix_unlock", "baseRT_page_size",
    "baseRT_prefix_release", "baseRT_prefix_discard", "baseRT_prefix_evict", "baseRT_prefix_cache_save",
    "baseRT_prefix_cache_load", "baseRT_prefix_cache_stats", "baseRT_prefix_attach_blob",
    "baseRT_prefix_blob_match", "baseRT_prefix_blob_fetch", "baseRT_grammar_create",
    "baseRT_grammar_create_from_schema", "baseRT_grammar_create_from_structural_tag", "baseRT_grammar_create_json",
    "baseRT_grammar_free", "baseRT_grammar_reset", "baseRT_grammar_bitmask_size", "baseRT_grammar_fill_bitmask",
    "baseRT_grammar_accept_token", "baseRT_grammar_is_terminated", "baseRT_grammar_is_completed",
    "baseRT_generate_grammar", "baseRT_generate_grammar_continue", "baseRT_generate_grammar_resume",
    "baseRT_profile_batched_label", "baseRT_profile_batched_decode", "baseRT_profile_decode_step",
    "baseRT_profile_label", "baseRT_gpu_temperature_scale", "baseRT_gpu_repetition_penalty", "baseRT_tensor_count",
    "baseRT_tensor_name", "baseRT_tensor_dtype", "baseRT_tensor_raw_dtype", "baseRT_tensor_nbytes",
    "baseRT_has_mmproj", "baseRT_mmproj_arch", "baseRT_profile_prefill", "baseRT_prefill_profile_phase_count",
    "baseRT_prefill_profile_label", "baseRT_prefill_profile_total_ms", "baseRT_prefill_profile_count",
    "baseRT_calibrate_begin", "baseRT_calibrate_prefill", "baseRT_calibrate_save", "baseRT_calibrate_end",
    "baseRT_mmproj_tensor_count", "baseRT_mmproj_tensor_name", "baseRT_mmproj_tensor_raw_dtype", "baseRT_prefill",
    "baseRT_read_logits", "baseRT_perplexity", "baseRT_prefill_image", "baseRT_image_num_tokens",
    "baseRT_prefill_audio", "baseRT_audio_num_tokens", "baseRT_decode_step", "baseRT_chain_decode",
    "baseRT_get_position", "baseRT_set_speculation", "baseRT_get_speculation", "baseRT_reset", "baseRT_save_state",
    "baseRT_load_state", "baseRT_lora_load", "baseRT_lora_unload", "baseRT_lora_id", "baseRT_rollback",
    "baseRT_try_rollback", "baseRT_set_prefill_snapshot", "baseRT_gdn_snapshot_size", "baseRT_gdn_snapshot_capture",
    "baseRT_gdn_snapshot_load", "baseRT_sequence_gdn_capture", "baseRT_sequence_gdn_restore",
    "baseRT_generate_continue", "baseRT_generate_resume", "baseRT_embed", "baseRT_embed_text",
    "baseRT_embedding_dim", "baseRT_is_embedding_model", "baseRT_format_chat", "baseRT_chat_template",
    "baseRT_chat_template_jinja", "baseRT_special_token_count", "baseRT_special_token", "baseRT_bos_token",
    "baseRT_bos_id", "baseRT_add_bos", "baseRT_eos_token", "baseRT_eos_token_id", "baseRT_weights_identity",
    "baseRT_is_eos_token", "baseRT_token_count", "baseRT_transcribe_pcm", "baseRT_transcribe_pcm_stream",
    "baseRT_transcribe", "baseRT_transcribe_stream", "baseRT_set_timestamps", "baseRT_set_task",
    "baseRT_set_initial_prompt", "baseRT_set_condition_on_previous_text", "baseRT_transcribe_language",
    "baseRT_transcribe_audio_duration_ms", "baseRT_transcribe_segment_count", "baseRT_transcribe_segment",
    "baseRT_is_whisper",
};

static char *g_implemented_json; /* JSON array, built once */
static pthread_once_t g_implemented_once = PTHREAD_ONCE_INIT;

static void build_implemented(void) {
    /* Look the names up in THIS library (it may have been opened RTLD_LOCAL,
     * so the global scope would not see it). */
    Dl_info info;
    void *self = NULL;
    if (dladdr(&g_implemented_json, &info) && info.dli_fname)
        self = dlopen(info.dli_fname, RTLD_LAZY | RTLD_NOLOAD);
    if (!self) self = dlopen(NULL, RTLD_LAZY);
    json_buf b = {0};
    json_buf_puts(&b, "[");
    int n = 0;
    for (size_t i = 0; self && i < sizeof ABI_FUNCTIONS / sizeof *ABI_FUNCTIONS; i++) {
        if (!dlsym(self, ABI_FUNCTIONS[i])) continue;
        if (n++) json_buf_puts(&b, ",");
        json_buf_put_string(&b, ABI_FUNCTIONS[i]);
    }
    json_buf_puts(&b, "]");
    if (self) dlclose(self);
    g_implemented_json = json_buf_take(&b);
}

static void put_capability(json_buf *b, const char *key, const char *reason_or_null) {
    json_buf_puts(b, ",");
    json_buf_put_string(b, key);
    json_buf_puts(b, ":");
    if (reason_or_null) json_buf_put_string(b, reason_or_null);
    else json_buf_puts(b, "true");
}

static char *rt_build_capability_descriptor(const rt_model *m) {
    pthread_once(&g_implemented_once, build_implemented);
    if (!g_implemented_json) return NULL;
    const char *tok_only = "unavailable: tokenizer-only handle";
    const char *no_paged = "unavailable: the model was loaded without paged_kv";
    const char *paged = m->tokenizer_only ? tok_only : (m->paged_kv ? NULL : no_paged);
    const char *prefix = paged ? paged
                         : m->prefix_cache ? NULL
                                           : "unavailable: the model was loaded without prefix_cache";
    json_buf b = {0};
    json_buf_printf(&b, "{\"descriptor_version\":1,\"engine\":\"reference-cpu\",\"version\":");
    json_buf_put_string(&b, baseRT_version_string());
    json_buf_printf(&b, ",\"abi_version\":%u,\"arch\":\"llama\",\"tokenizer_only\":%s", BASERT_ABI_VERSION,
                    m->tokenizer_only ? "true" : "false");
    json_buf_printf(&b, ",\"max_context\":%u,\"trained_context\":%d,\"max_batch_size\":%d,\"kv_bits\":%d",
                    m->cfg.max_seq_len, m->trained_context, m->tokenizer_only ? 0 : m->max_batch_size,
                    m->tokenizer_only ? 0 : m->kv_bits);
    json_buf_puts(&b, ",\"capabilities\":{\"text_generation\":");
    if (m->tokenizer_only) json_buf_put_string(&b, tok_only);
    else json_buf_puts(&b, "true");
    put_capability(&b, "paged_kv", paged);
    put_capability(&b, "sequences", paged);
    put_capability(&b, "host_logits", paged);
    put_capability(&b, "fused_sample", paged);
    put_capability(&b, "prefix_cache", prefix);
    /* grammar.c: generic JSON, {"type": X} and one-level properties/required schemas; triggered_tags,
     * tags_with_separator and any_text structural tags; other keywords, formats and GBNF are UNSUPPORTED */
    put_capability(&b, "grammar", NULL);
    /* Speculative VERIFICATION is served (multi-row steps, rows_argmax: "verify_rows"); what
     * "speculation" names -- the engine predicting drafts itself inside its generate calls
     * (baseRT_set_speculation's n-gram mode) -- is not: the flag is stored and reported only. */
    put_capability(&b, "speculation",
                   "unsupported: the reference engine predicts no drafts of its own (baseRT_set_speculation is "
                   "stored and reported, its generate calls are unchanged); drafts a caller feeds are verified by "
                   "baseRT_batch_step_fused_logits_rows and baseRT_batch_step_fused_rows_argmax");
    put_capability(&b, "verify_rows", paged);
    put_capability(&b, "lora", "unsupported: the reference engine does not load adapters");
    put_capability(&b, "vision", "unsupported: text-only llama architecture");
    put_capability(&b, "audio", "unsupported: text-only llama architecture");
    put_capability(&b, "gdn_snapshot", "unsupported: not a hybrid recurrent architecture");
    json_buf_puts(&b, "},\"implemented\":");
    json_buf_puts(&b, g_implemented_json);
    json_buf_puts(&b, "}");
    return json_buf_take(&b);
}

/* ---- context sizing and memory ------------------------------------------------- */

size_t baseRT_device_memory_budget(void) {
    /* The CPU reference plans within half of the memory the process may use: physical RAM, or its
     * cgroup's limit where that is lower (a container's memory.max). */
    long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGESIZE);
    if (pages <= 0 || page <= 0) return 0;
    unsigned long long ram = (unsigned long long)pages * (unsigned long long)page;
    long long limit = rt_cgroup_limit(RT_CGROUP_MEMORY);
    if (limit > 0 && (unsigned long long)limit < ram) ram = (unsigned long long)limit;
    return (size_t)(ram / 2);
}

int baseRT_suggest_max_context(const char *model_path, int max_batch, int kv_bits, int paged_kv) {

    rt_bundle_budget bb;
    if (rt_bundle_read_budget("baseRT_suggest_max_context", model_path, &bb) != BASERT_OK) return 0;
    uint64_t budget = baseRT_device_memory_budget();
    if (budget == 0) {
        rt_set_error(BASERT_ERR_UNKNOWN, "baseRT_suggest_max_context: the device memory budget is unknown");
        return 0;
    }
    /* Lanes multiply only on a paged pool; a contiguous cache holds one history. */
    uint64_t lanes = paged_kv && max_batch > 1 ? (uint64_t)max_batch : 1;
    /* f32 at kv_bits 0, f16 at 16, Q8_0 (34 bytes per 32 values) otherwise */
    uint64_t per_token = kv_bits == 0    ? bb.kv_bytes_per_token * lanes
                         : kv_bits == 16 ? bb.kv_bytes_per_token * lanes / 2
                                         : bb.kv_bytes_per_token * lanes * 34 / 128;
    uint64_t fit = budget > bb.weight_bytes && per_token ? (budget - bb.weight_bytes) / per_token : 0;
    fit = fit / 1024 * 1024;
    if (fit < BASERT_AUTO_CONTEXT_MIN) fit = BASERT_AUTO_CONTEXT_MIN;
    if (fit > (uint64_t)bb.trained_context) fit = (uint64_t)bb.trained_context;
    rt_clear_error();
    return (int)fit;
}

size_t baseRT_model_memory(baseRT_model_t model) {
    rt_model *m = rt_model_check(model, "baseRT_model_memory");
    if (!m) return 0;
    size_t total = m->weight_bytes;
    BaseRTMemoryStats st;
    if (m->rt && baseRT_model_memory_stats(model, &st)) total += (size_t)st.kv_cache_capacity_bytes;
    rt_clear_error();
    return total;
}

uint64_t baseRT_weights_identity(baseRT_model_t model) {
    rt_model *m = rt_model_check(model, "baseRT_weights_identity");
    if (!m) return 0;
    rt_clear_error();
    return m->weights_identity;
}

int baseRT_kv_bits_effective(baseRT_model_t model) {
    rt_model *m = rt_model_check(model, "baseRT_kv_bits_effective");
    if (!m) return 0;
    rt_clear_error();
    /* 32 for the exact f32 pool (kv_bits 0), 16 for f16, 8 for Q8_0 (see apply_options). */
    return m->tokenizer_only ? 0 : m->kv_bits;
}
