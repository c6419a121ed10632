#pragma once
/* BaseRT C ABI 1: the type layouts the seed header uses (shared/ABI-FACTS.md).
 * Field order and C types are the ABI; the reference engine and the ctypes
 * mirrors in aiobasert/_ffi.py must agree with the real engine byte for byte. */

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef enum {
    BASERT_OK = 0,
    BASERT_ERR_UNKNOWN = 1,
    BASERT_ERR_INVALID_ARGUMENT = 2,
    BASERT_ERR_FILE_NOT_FOUND = 3,
    BASERT_ERR_INVALID_FORMAT = 4,
    BASERT_ERR_UNSUPPORTED = 5,
    BASERT_ERR_OUT_OF_MEMORY = 6,
    BASERT_ERR_GPU = 7,
    BASERT_ERR_GENERATION_FAILED = 8,
} BaseRTErrorCode;

/* Only the documented prefix: the real engine appends many more fields, and a
 * caller reads it by size through baseRT_get_config_into(). */
typedef struct {
    uint32_t dim;
    uint32_t n_layers;
    uint32_t n_heads;
    uint32_t n_kv_heads;
    uint32_t head_dim;
    uint32_t q_dim;
    uint32_t kv_dim;
    uint32_t ffn_dim;
    uint32_t vocab_size;
    uint32_t max_seq_len;
    float norm_eps;
    float rope_theta;
    uint32_t sliding_window_pattern;
    uint32_t sliding_window;
    float rope_local_theta;
    char architecture[32];
} BaseRTModelConfig;

typedef struct {
    int n_tokens;
    float audio_ms;
    float encode_ms;
    float decode_ms;
    float total_ms;
} BaseRTTranscribeStats;

typedef struct {
    float temperature; /* 0 = greedy */
    int top_k;
    float top_p;
    float min_p;
    float repeat_penalty;
    float presence_penalty;
    float frequency_penalty;
    uint32_t seed;
    int32_t n_logit_bias;
    const int32_t *logit_bias_tokens;
    const float *logit_bias_values;
} BaseRTSamplingConfig;

typedef struct {
    int prompt_tokens;
    int generated_tokens;
    float prefill_time_ms;
    float decode_time_ms;
    float prefill_tokens_per_sec;
    float decode_tokens_per_sec;
} BaseRTGenerationStats;

typedef struct {
    size_t struct_size; /* must be sizeof(BaseRTLoadOptions): ABI guard */
    int kv_bits;        /* 0 / 4 / 8 / 16 / 84 */
    int paged_kv;
    int max_batch_size; /* 0 = 1 */
    int prefix_cache;   /* needs paged_kv */
    int prefill_chunk;  /* 0 = default */
    int paged_weights_mode;
} BaseRTLoadOptions;

#ifdef __cplusplus
}
#endif
