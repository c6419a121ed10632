/* The .base reader (docs/BUNDLE.md): preamble, header JSON, config, tensor
 * table, tokenizer metadata, and f32 weights. Every field is validated
 * against the file before use: a missing, truncated, corrupt or foreign
 * bundle is an error naming the path and the reason, never a crash. */

#include "loader.h"

#include "errors.h"
#include "f16.h"
#include "quant.h"
#include "json.h"
#include "mathops.h"
#include "tokenizer.h"

#include <errno.h>
#ifdef __GLIBC__
#include <malloc.h>
#endif
#include <float.h>
#include <fcntl.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#define BASE_PREAMBLE 16
#define BASE_BLOB_ALIGN ((uint64_t)64 * 1024)
#define BASE_MAX_TENSORS (1 << 20)
#define RT_DEFAULT_CONTEXT 2048
#define RT_DEFAULT_PREFILL_CHUNK 256
#define RT_MIN_PREFILL_CHUNK 16
#define RT_MAX_PREFILL_CHUNK 4096
#define IDENTITY_BYTES ((size_t)1 << 20)

enum { DT_F32, DT_F16, DT_BF16, DT_Q8, DT_Q4, DT_Q5, DT_GGML_Q4_K, DT_GGML_Q5_K, DT_GGML_Q6_K };

typedef struct {
    const char *name;
    int dtype;
    int ndim;
    int64_t shape[4];
    uint64_t n_elems;
    uint64_t offset, length; /* offset relative to the blob */
    /* base_q8 / base_q4 (CANONICAL_QUANT_SPEC.md): groups along each row */
    uint32_t group_size;
    bool symmetric;
    int scale_type; /* RT_SCALE_* */
    uint64_t scale_offset, bias_offset; /* blob-relative, validated like offset */
} tensor_entry;

typedef struct {
    const char *fn, *path;
    const unsigned char *map;
    size_t size;
    uint64_t blob_start;
    json_doc *doc;
    const json_value *hdr;
    uint64_t file_id[4]; /* device, inode, mtime and ctime (ns): which file this is, for sharing */
} bundle;

/* The tensor layout: slot 0 embed, 1 final norm, 2 lm_head, 3 rope_freqs, then
 * LAYER_SLOTS per layer: the llama nine, then what other architectures add. */
enum { SLOT_EMBED, SLOT_FINAL_NORM, SLOT_LM_HEAD, SLOT_ROPE_FREQS, SLOT_LAYER0 };
enum {
    L_ATTN_NORM, L_WQ, L_WK, L_WV, L_WO, L_FFN_NORM, L_GATE, L_UP, L_DOWN,
    L_BQ, L_BK, L_BV, L_Q_NORM, L_K_NORM, L_ATTN_OUT_NORM, L_FFN_OUT_NORM, LAYER_SLOTS
};
static const char *const LAYER_SUFFIX[LAYER_SLOTS] = {
    "input_norm.weight",       "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
    "self_attn.o_proj.weight", "post_attn_norm.weight",   "mlp.gate_proj.weight",    "mlp.up_proj.weight",
    "mlp.down_proj.weight",    "self_attn.q_proj.bias",   "self_attn.k_proj.bias",   "self_attn.v_proj.bias",
    "self_attn.q_norm.weight", "self_attn.k_norm.weight", "self_attn.out_norm.weight", "mlp.out_norm.weight",
};

/* ---- architectures --------------------------------------------------------------- */

/* The one place that says what each architecture is (docs/models.md): its fixed
 * traits. Numbers (RoPE bases and scaling, window, soft-cap) come from the
 * bundle's config; the forward pass reads only the resulting rt_arch. */
typedef struct {
    const char *name;
    rt_rope_pairs rope_pairs;
    rt_activation act;
    bool qkv_bias, qk_norm, out_norms;
    bool embed_scaled;   /* embedding times sqrt(dim) */
    bool sliding_layers; /* interleaved sliding-window layers (config.layer_types / sliding_window_pattern) */
    bool rope_freqs;     /* may carry rope_freqs.weight (Llama 3.1's llama3 scaling) */
} arch_traits;

static const arch_traits ARCHS[] = {
    /* Llama 1-3, SmolLM2, Mistral-style: the GGUF permuted q/k rows for adjacent-pair RoPE. */
    {"llama", RT_ROPE_ADJACENT, RT_ACT_SILU, false, false, false, false, false, true},
    {"qwen2", RT_ROPE_NEOX, RT_ACT_SILU, true, false, false, false, false, false},
    {"qwen3", RT_ROPE_NEOX, RT_ACT_SILU, false, true, false, false, false, false},
    /* Gemma 3: GGUF norm weights already hold Gemma's 1 + w (convert_hf_to_gguf adds the 1). */
    {"gemma3", RT_ROPE_NEOX, RT_ACT_GELU_TANH, false, true, true, true, true, false},
    /* Phi-3 / 3.5: llama's layers with NeoX RoPE; the converter splits its fused qkv and gate|up
     * matrices. llama.cpp disables its sliding window (phi3.cpp), so none here either. The 128k
     * variants' LongRoPE factors become the frequency divisors (rope_scaling "longrope"). */
    {"phi3", RT_ROPE_NEOX, RT_ACT_SILU, false, false, false, false, false, true},
};

static const arch_traits *find_arch(const char *name) {
    for (size_t i = 0; name && i < sizeof ARCHS / sizeof ARCHS[0]; i++)
        if (strcmp(ARCHS[i].name, name) == 0) return &ARCHS[i];
    return NULL;
}

/* Which optional per-layer tensors an architecture has. */
static bool layer_slot_used(const arch_traits *a, int k) {
    if (k < L_BQ) return true;
    if (k <= L_BV) return a->qkv_bias;
    if (k <= L_K_NORM) return a->qk_norm;
    return a->out_norms;
}

static __attribute__((format(printf, 3, 4))) int bundle_fail(const bundle *b, BaseRTErrorCode code,
                                                             const char *fmt, ...) {
    char msg[768];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    rt_set_error(code, "%s: %s: %s", b->fn, b->path, msg);
    return code;
}

static void bundle_close(bundle *b) {
    json_free(b->doc);
    b->doc = NULL;
    if (b->map) munmap((void *)b->map, b->size);
    b->map = NULL;
}

/* Map the file and parse the preamble and header JSON. */
static int bundle_open(bundle *b, const char *fn, const char *path) {
    memset(b, 0, sizeof *b);
    b->fn = fn;
    b->path = path;
    /* O_NONBLOCK: opening a FIFO must not hang (it is rejected as not a regular file). */
    int fd = open(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK);
    if (fd < 0) {
        int e = errno;
        BaseRTErrorCode code = (e == ENOENT || e == ENOTDIR || e == ENAMETOOLONG || e == ELOOP || e == EACCES ||
                                e == EPERM)
                                   ? BASERT_ERR_FILE_NOT_FOUND
                                   : BASERT_ERR_UNKNOWN;
        return bundle_fail(b, code, "cannot open: %s", strerror(e));
    }
    struct stat st;
    if (fstat(fd, &st) != 0) {
        int e = errno;
        close(fd);
        return bundle_fail(b, BASERT_ERR_UNKNOWN, "cannot stat: %s", strerror(e));
    }
    if (S_ISDIR(st.st_mode)) {
        close(fd);
        return bundle_fail(b, BASERT_ERR_INVALID_FORMAT, "is a directory, not a .base bundle");
    }
    if (!S_ISREG(st.st_mode)) {
        close(fd);
        return bundle_fail(b, BASERT_ERR_INVALID_FORMAT, "not a regular file");
    }
    if (st.st_size == 0) {
        close(fd);
        return bundle_fail(b, BASERT_ERR_INVALID_FORMAT, "empty file, not a .base bundle");
    }
    if ((uint64_t)st.st_size < BASE_PREAMBLE) {
        close(fd);
        return bundle_fail(b, BASERT_ERR_INVALID_FORMAT, "truncated: %lld bytes, shorter than the 16-byte preamble",
                           (long long)st.st_size);
    }
    if ((uint64_t)st.st_size > SIZE_MAX) {
        close(fd);
        return bundle_fail(b, BASERT_ERR_UNSUPPORTED, "file too large to map");
    }
    b->size = (size_t)st.st_size;
    b->file_id[0] = (uint64_t)st.st_dev;
    b->file_id[1] = (uint64_t)st.st_ino;
    b->file_id[2] = (uint64_t)st.st_mtim.tv_sec * 1000000000u + (uint64_t)st.st_mtim.tv_nsec;
    b->file_id[3] = (uint64_t)st.st_ctim.tv_sec * 1000000000u + (uint64_t)st.st_ctim.tv_nsec;
    void *map = mmap(NULL, b->size, PROT_READ, MAP_PRIVATE, fd, 0);
    int e = errno;
    close(fd);
    if (map == MAP_FAILED) {
        b->size = 0;
        return bundle_fail(b, BASERT_ERR_OUT_OF_MEMORY, "cannot map the file: %s", strerror(e));
    }
    b->map = map;

    if (memcmp(b->map, "BASE", 4) != 0) return bundle_fail(b, BASERT_ERR_INVALID_FORMAT, "bad magic: not a .base bundle");
    uint32_t version = (uint32_t)b->map[4] | (uint32_t)b->map[5] << 8 | (uint32_t)b->map[6] << 16 |
                       (uint32_t)b->map[7] << 24;
    if (version != 1)
        return bundle_fail(b, BASERT_ERR_INVALID_FORMAT, "format_version %u is not supported (expected 1)", version);
    uint64_t header_len = 0;
    for (int i = 0; i < 8; i++) header_len |= (uint64_t)b->map[8 + i] << (8 * i);
    if (header_len == 0) return bundle_fail(b, BASERT_ERR_INVALID_FORMAT, "header_len is 0");
    if (header_len > b->size - BASE_PREAMBLE)
        return bundle_fail(b, BASERT_ERR_INVALID_FORMAT,
                           "truncated: the header needs %llu bytes after the preamble, the file has %zu",
                           (unsigned long long)header_len, b->size - BASE_PREAMBLE);
    char jerr[160];
    b->doc = json_parse((const char *)b->map + BASE_PREAMBLE, (size_t)header_len, jerr, sizeof jerr);
    if (!b->doc) return bundle_fail(b, BASERT_ERR_INVALID_FORMAT, "corrupt header JSON: %s", jerr);
    b->hdr = json_root(b->doc);
    if (b->hdr->type != JSON_OBJECT)
        return bundle_fail(b, BASERT_ERR_INVALID_FORMAT, "the header JSON is not an object");
    uint64_t end = BASE_PREAMBLE + header_len;
    b->blob_start = (end + BASE_BLOB_ALIGN - 1) / BASE_BLOB_ALIGN * BASE_BLOB_ALIGN;
    return BASERT_OK;
}

/* ---- config ---------------------------------------------------------------- */

#define RT_MAX_LAYERS 1024

typedef struct {
    BaseRTModelConfig cfg;
    const arch_traits *traits;
    rt_arch arch;
    bool sliding[RT_MAX_LAYERS];
    uint32_t longrope_orig; /* rope_scaling "longrope": its original context; 0 = none */
    int trained_context;
    int tie; /* -1 = unspecified */
    bool has_bos, has_eos;
    uint32_t bos_id, eos_id;
} parsed_config;

static int cfg_uint(const bundle *b, const json_value *cfg, const char *key, bool required, uint32_t dflt,
                    uint32_t lo, uint32_t hi, uint32_t *out) {
    const json_value *v = json_get(cfg, key);
    if (!v || v->type == JSON_NULL) {
        if (required) return bundle_fail(b, BASERT_ERR_INVALID_FORMAT, "config.%s is missing", key);
        *out = dflt;
        return BASERT_OK;
    }
    int64_t x;
    if (!json_int64(v, &x) || x < (int64_t)lo || x > (int64_t)hi)
        return bundle_fail(b, BASERT_ERR_INVALID_FORMAT, "config.%s must be an integer in [%u, %u]", key, lo, hi);
    *out = (uint32_t)x;
    return BASERT_OK;
}

static int cfg_float(const bundle *b, const json_value *cfg, const char *key, double dflt, double lo, double hi,
                     float *out) {
    const json_value *v = json_get(cfg, key);
    double x = dflt;
    /* The value is used as a float: it must stay a positive normal float
     * (1e-300 would round to 0 and turn RoPE or the norm into inf / NaN). */
    if (v && v->type != JSON_NULL &&
        (!json_number(v, &x) || !isfinite(x) || x <= lo || x > hi || !((float)x >= FLT_MIN)))
        return bundle_fail(b, BASERT_ERR_INVALID_FORMAT, "config.%s must be a number in (%g, %g]", key, lo, hi);
    *out = (float)x;
    return BASERT_OK;
}

/* config.rope_scaling (null or {"rope_type": "linear" | "yarn", "factor", and for
 * YaRN "original_max_position_embeddings", "beta_fast", "beta_slow", "attn_factor",
 * "ext_factor"}, llama.cpp's defaults; "llama3"; "longrope" with
 * "original_max_position_embeddings" and "attn_factor") into the full-attention layers' RoPE. */
static int parse_rope_scaling(const bundle *b, const json_value *c, rt_rope_params *r, uint32_t *longrope_orig) {
    const json_value *rs = json_get(c, "rope_scaling");
    if (!rs || rs->type == JSON_NULL) return BASERT_OK;
    if (rs->type != JSON_OBJECT) return bundle_fail(b, BASERT_ERR_INVALID_FORMAT, "config.rope_scaling is not an object");
    const char *type = json_string(json_get(rs, "rope_type"));
    if (!type || strcmp(type, "none") == 0) return BASERT_OK;
    bool yarn = strcmp(type, "yarn") == 0, llama3 = strcmp(type, "llama3") == 0;
    bool longrope = strcmp(type, "longrope") == 0;
    if (!yarn && !llama3 && !longrope && strcmp(type, "linear") != 0)
        return bundle_fail(b, BASERT_ERR_UNSUPPORTED,
                           "config.rope_scaling.rope_type '%s' is not supported (linear, yarn, llama3, longrope)",
                           type);
    float factor = 1.0f, bf = 32.0f, bs = 1.0f, af = 1.0f, ef = 1.0f;
    uint32_t orig = 0;
    int rc;
    if ((rc = cfg_float(b, rs, "factor", 1.0, 0.0, 1e6, &factor)) ||
        (rc = cfg_float(b, rs, "beta_fast", 32.0, 0.0, 1e6, &bf)) ||
        (rc = cfg_float(b, rs, "beta_slow", 1.0, 0.0, 1e6, &bs)) ||
        (rc = cfg_float(b, rs, "attn_factor", 1.0, 0.0, 1e6, &af)) ||
        (rc = cfg_uint(b, rs, "original_max_position_embeddings", yarn || llama3 || longrope, 0, 1, 1u << 24,
                       &orig)))
        return rc;
    if (longrope) { /* llama.cpp's phi3: the long or short factor tensor divides each frequency (which one:
                     * parse_tensors, by the context), and q and k turn scaled by attn_factor */
        r->attn_factor = af;
        *longrope_orig = orig;
        return BASERT_OK;
    }
    if (llama3) { /* HF's defaults; a rope_freqs tensor, where the bundle has one, takes precedence */
        float low = 1.0f, high = 4.0f;
        if ((rc = cfg_float(b, rs, "low_freq_factor", 1.0, 0.0, 1e6, &low)) ||
            (rc = cfg_float(b, rs, "high_freq_factor", 4.0, 0.0, 1e6, &high)))
            return rc;
        if (!(high > low))
            return bundle_fail(b, BASERT_ERR_INVALID_FORMAT,
                               "config.rope_scaling: high_freq_factor must be above low_freq_factor");
        r->llama3_factor = factor;
        r->low_freq_factor = low;
        r->high_freq_factor = high;
        r->orig_ctx = orig;
        return BASERT_OK;
    }
    double ext = yarn ? 1.0 : 0.0;
    const json_value *ev = json_get(rs, "ext_factor");
    if (ev && ev->type != JSON_NULL) {
        if ((rc = cfg_float(b, rs, "ext_factor", 1.0, 0.0, 1e6, &ef))) return rc;
        ext = ef;
    }
    r->freq_scale = 1.0 / (double)factor;
    r->ext_factor = ext;
    r->attn_factor = af;
    r->beta_fast = bf;
    r->beta_slow = bs;
    r->orig_ctx = orig;
    return BASERT_OK;
}

/* The architecture's description: its traits, then the config's numbers. */
static int parse_arch(const bundle *b, const json_value *c, const char *arch_name, parsed_config *pc) {
    const BaseRTModelConfig *cfg = &pc->cfg;
    const arch_traits *t = pc->traits;
    rt_arch *a = &pc->arch;
    snprintf(a->name, sizeof a->name, "%s", arch_name);
    a->rope_pairs = t->rope_pairs;
    a->act = t->act;
    a->qkv_bias = t->qkv_bias;
    a->qk_norm = t->qk_norm;
    a->out_norms = t->out_norms;
    a->embed_scale = t->embed_scaled ? sqrtf((float)cfg->dim) : 1.0f;
    rt_rope_params plain = {.theta = cfg->rope_theta, .freq_scale = 1.0, .attn_factor = 1.0,
                            .beta_fast = 32.0, .beta_slow = 1.0};
    a->rope[0] = plain;
    a->rope[0].freq_factors = true; /* used only when the bundle has rope_freqs */
    int rc = parse_rope_scaling(b, c, &a->rope[0], &pc->longrope_orig);
    if (rc) return rc;
    float scalar = 1.0f;
    if ((rc = cfg_float(b, c, "query_pre_attn_scalar", (double)cfg->head_dim, 0.0, 1e9, &scalar))) return rc;
    a->attn_scale = (float)(1.0 / sqrt((double)scalar));
    const json_value *cap = json_get(c, "final_logit_softcapping");
    double cap0;
    bool no_cap = !cap || cap->type == JSON_NULL || (json_number(cap, &cap0) && cap0 == 0.0); /* null or 0: none */
    if (!no_cap && (rc = cfg_float(b, c, "final_logit_softcapping", 0.0, 0.0, 1e9, &a->final_softcap))) return rc;

    /* Sliding-window layers: which ones (config.layer_types, or every layer but each
     * sliding_window_pattern-th), how wide, and their own RoPE base (unscaled). */
    const json_value *types = json_get(c, "layer_types");
    const json_value *win = json_get(c, "sliding_window");
    bool any = (types && types->type != JSON_NULL) || (win && win->type != JSON_NULL);
    if (!any) return BASERT_OK;
    if (!t->sliding_layers)
        return bundle_fail(b, BASERT_ERR_UNSUPPORTED, "config: sliding-window layers are not part of arch '%s'",
                           arch_name);
    if ((rc = cfg_uint(b, c, "sliding_window", true, 0, 1, 1u << 24, &a->sliding_window))) return rc;
    if (types && types->type != JSON_NULL) {
        if (types->type != JSON_ARRAY || json_count(types) != cfg->n_layers)
            return bundle_fail(b, BASERT_ERR_INVALID_FORMAT, "config.layer_types must list one type per layer");
        for (uint32_t l = 0; l < cfg->n_layers; l++) {
            const char *ty = json_string(json_at(types, l));
            bool sliding = ty && strcmp(ty, "sliding_attention") == 0;
            if (!sliding && !(ty && strcmp(ty, "full_attention") == 0))
                return bundle_fail(b, BASERT_ERR_INVALID_FORMAT,
                                   "config.layer_types[%u] is not 'sliding_attention' or 'full_attention'", l);
            pc->sliding[l] = sliding;
        }
    } else {
        uint32_t pattern = 6;
        if ((rc = cfg_uint(b, c, "sliding_window_pattern", false, 6, 1, 1u << 16, &pattern))) return rc;
        for (uint32_t l = 0; l < cfg->n_layers; l++) pc->sliding[l] = l % pattern < pattern - 1;
    }
    float local = 10000.0f;
    if ((rc = cfg_float(b, c, "rope_local_base_freq", 10000.0, 1.0, 1e12, &local))) return rc;
    a->rope[1] = plain;
    a->rope[1].theta = local;
    return BASERT_OK;
}

static int parse_config(const bundle *b, bool tokenizer_only, parsed_config *pc) {
    memset(pc, 0, sizeof *pc);
    /* The architecture decides what the rest of the header means: check it first.
     * A tokenizer-only load reads any architecture's tokenizer. */
    const char *arch_name = json_string(json_get(b->hdr, "arch"));
    if (!arch_name && !tokenizer_only) return bundle_fail(b, BASERT_ERR_INVALID_FORMAT, "the header has no arch");
    pc->traits = find_arch(arch_name);
    if (!pc->traits) {
        if (!tokenizer_only)
            return bundle_fail(b, BASERT_ERR_UNSUPPORTED,
                               "arch '%s' is not supported (the reference engine runs llama, qwen2, qwen3, gemma3, "
                               "phi3)",
                               arch_name);
        pc->traits = &ARCHS[0]; /* tokenizer-only: no forward reads it */
    }
    bool foreign = strcmp(pc->traits->name, arch_name ? arch_name : "") != 0;
    if (!arch_name) arch_name = pc->traits->name;
    const json_value *c = json_get(b->hdr, "config");
    if (!c || c->type != JSON_OBJECT) return bundle_fail(b, BASERT_ERR_INVALID_FORMAT, "the header has no config object");
    BaseRTModelConfig *cfg = &pc->cfg;
    uint32_t trained = 0;
    int rc;
    if ((rc = cfg_uint(b, c, "hidden_size", true, 0, 1, 1u << 16, &cfg->dim)) ||
        (rc = cfg_uint(b, c, "num_hidden_layers", true, 0, 1, RT_MAX_LAYERS, &cfg->n_layers)) ||
        (rc = cfg_uint(b, c, "num_attention_heads", true, 0, 1, 1024, &cfg->n_heads)) ||
        (rc = cfg_uint(b, c, "num_key_value_heads", false, cfg->n_heads, 1, 1024, &cfg->n_kv_heads)) ||
        (rc = cfg_uint(b, c, "intermediate_size", true, 0, 1, 1u << 20, &cfg->ffn_dim)) ||
        (rc = cfg_uint(b, c, "vocab_size", true, 0, 1, 1u << 24, &cfg->vocab_size)) ||
        (rc = cfg_uint(b, c, "max_position_embeddings", true, 0, 1, 1u << 24, &trained)) ||
        (rc = cfg_float(b, c, "rope_theta", 10000.0, 1.0, 1e12, &cfg->rope_theta)) ||
        (rc = cfg_float(b, c, "rms_norm_eps", 1e-5, 0.0, 1.0, &cfg->norm_eps)))
        return rc;
    uint32_t head_dim_default = cfg->dim % cfg->n_heads == 0 ? cfg->dim / cfg->n_heads : 0;
    if ((rc = cfg_uint(b, c, "head_dim", head_dim_default == 0, head_dim_default, 2, 1024, &cfg->head_dim)))
        return rc;
    if (cfg->head_dim % 2 != 0)
        return bundle_fail(b, BASERT_ERR_INVALID_FORMAT, "config.head_dim %u is odd (RoPE rotates pairs)", cfg->head_dim);
    if (cfg->n_kv_heads > cfg->n_heads || cfg->n_heads % cfg->n_kv_heads != 0)
        return bundle_fail(b, BASERT_ERR_INVALID_FORMAT,
                           "config.num_attention_heads %u is not a multiple of num_key_value_heads %u", cfg->n_heads,
                           cfg->n_kv_heads);
    cfg->q_dim = cfg->n_heads * cfg->head_dim;
    cfg->kv_dim = cfg->n_kv_heads * cfg->head_dim;
    if (cfg->q_dim > (1u << 20))
        return bundle_fail(b, BASERT_ERR_INVALID_FORMAT, "config: num_attention_heads * head_dim is too large");
    snprintf(cfg->architecture, sizeof cfg->architecture, "%s", arch_name);
    pc->trained_context = (int)trained;
    if (!foreign && (rc = parse_arch(b, c, arch_name, pc))) return rc; /* a foreign arch's keys are not ours to read */

    const json_value *tie = json_get(c, "tie_word_embeddings");
    bool tb;
    pc->tie = json_bool(tie, &tb) ? (int)tb : -1;

    /* bos/eos: integers, or (HF style) a list whose first entry is primary. */
    int64_t x;
    const json_value *bos = json_get(c, "bos_token_id");
    if (json_at(bos, 0)) bos = json_at(bos, 0);
    if (json_int64(bos, &x) && x >= 0 && x < (int64_t)cfg->vocab_size) {
        pc->has_bos = true;
        pc->bos_id = (uint32_t)x;
    } else if (bos && bos->type != JSON_NULL) {
        return bundle_fail(b, BASERT_ERR_INVALID_FORMAT, "config.bos_token_id is not a token id below vocab_size");
    }
    const json_value *eos = json_get(c, "eos_token_id");
    if (json_at(eos, 0)) eos = json_at(eos, 0);
    if (json_int64(eos, &x) && x >= 0 && x < (int64_t)cfg->vocab_size) {
        pc->has_eos = true;
        pc->eos_id = (uint32_t)x;
    } else if (eos && eos->type != JSON_NULL) {
        return bundle_fail(b, BASERT_ERR_INVALID_FORMAT, "config.eos_token_id is not a token id below vocab_size");
    }
    return BASERT_OK;
}

/* ---- tensor table ------------------------------------------------------------ */

/* Does [off, off + len) lie inside the blob? Compared by subtraction (no wrap). */
static bool blob_range_ok(const bundle *b, uint64_t off, uint64_t len) {
    uint64_t room = b->size > b->blob_start ? b->size - b->blob_start : 0;
    return off <= room && len <= room - off;
}

/* The group fields of a base_q8 / base_q4 tensor (CANONICAL_QUANT_SPEC.md):
 * 2-D, rows split into groups of 32 / 64 / 128, f16 or bf16 scales, the
 * cpu_avx2 row-major layout (q4: per group, byte j holds value j in its low
 * nibble and value j + G/2 in its high nibble), a scale region and, unless
 * symmetric, a bias region. */
static int parse_quant(const bundle *b, const json_value *t, tensor_entry *out) {
    const char *name = out->name;
    int bits = out->dtype == DT_Q4 ? 4 : out->dtype == DT_Q5 ? 5 : 8;
    int64_t gs = 0, x;
    if (!json_int64(json_get(t, "group_size"), &gs) || (gs != 32 && gs != 64 && gs != 128))
        return bundle_fail(b, BASERT_ERR_UNSUPPORTED, "tensor '%s': group_size must be 32, 64 or 128", name);
    if (out->ndim != 2 || out->shape[1] % gs != 0 || out->shape[1] == 0)
        return bundle_fail(b, BASERT_ERR_INVALID_FORMAT,
                           "tensor '%s': a quantized tensor must be 2-D with rows that split into groups of %lld",
                           name, (long long)gs);
    out->group_size = (uint32_t)gs;
    const char *sd = json_string(json_get(t, "scale_dtype"));
    if (!sd) sd = "bf16"; /* the spec's default */
    if (strcmp(sd, "f16") == 0) out->scale_type = RT_SCALE_F16;
    else if (strcmp(sd, "bf16") == 0) out->scale_type = RT_SCALE_BF16;
    else if (strcmp(sd, "f32") == 0) out->scale_type = RT_SCALE_F32; /* K-quant sub-block scales, exactly */
    else
        return bundle_fail(b, BASERT_ERR_UNSUPPORTED,
                           "tensor '%s': scale_dtype '%s' is not supported (f16, bf16, f32)", name, sd);
    bool sym = false;
    const json_value *symv = json_get(t, "symmetric");
    if (symv && symv->type != JSON_NULL && !json_bool(symv, &sym))
        return bundle_fail(b, BASERT_ERR_INVALID_FORMAT, "tensor '%s': symmetric is not a boolean", name);
    out->symmetric = sym;
    const char *layout = json_string(json_get(t, "layout"));
    /* base_q5 (GGML Q5_0 / Q5_1 / Q5_K blocks): per group, gs / 8 bytes of fifth bits (bit v % 8 of byte
     * v / 8 for value v), then the nibbles as base_q4 stores them */
    const char *want = bits == 4 ? "rowmajor_nibble_halves" : bits == 5 ? "rowmajor_qh_nibble_halves" : "rowmajor";
    if (!layout || strcmp(layout, want) != 0)
        return bundle_fail(b, BASERT_ERR_UNSUPPORTED,
                           "tensor '%s': layout '%s' is not supported (the reference engine reads '%s')", name,
                           layout ? layout : "(none)", want);
    uint64_t packed = out->n_elems / 8 * (uint64_t)bits;
    if (out->length != packed)
        return bundle_fail(b, BASERT_ERR_INVALID_FORMAT, "tensor '%s': length %llu, expected %llu packed bytes",
                           name, (unsigned long long)out->length, (unsigned long long)packed);
    uint64_t region = out->n_elems / (uint64_t)gs * (out->scale_type == RT_SCALE_F32 ? 4 : 2);
    const char *keys[2][2] = {{"scale_offset", "scale_length"}, {"bias_offset", "bias_length"}};
    uint64_t *offs[2] = {&out->scale_offset, &out->bias_offset};
    for (int k = 0; k < (sym ? 1 : 2); k++) {
        int64_t len;
        if (!json_int64(json_get(t, keys[k][0]), &x) || x < 0 || !json_int64(json_get(t, keys[k][1]), &len) ||
            (uint64_t)len != region || !blob_range_ok(b, (uint64_t)x, region))
            return bundle_fail(b, BASERT_ERR_INVALID_FORMAT,
                               "tensor '%s': %s / %s missing, not %llu bytes, or outside the weights", name,
                               keys[k][0], keys[k][1], (unsigned long long)region);
        *offs[k] = (uint64_t)x;
    }
    return BASERT_OK;
}

static int parse_tensor(const bundle *b, const json_value *t, size_t index, tensor_entry *out) {
    memset(out, 0, sizeof *out);
    out->name = json_string(json_get(t, "name"));
    if (!out->name || !out->name[0])
        return bundle_fail(b, BASERT_ERR_INVALID_FORMAT, "tensors[%zu] has no name", index);
    const char *name = out->name;
    const char *dtype = json_string(json_get(t, "dtype"));
    if (!dtype) return bundle_fail(b, BASERT_ERR_INVALID_FORMAT, "tensor '%s' has no dtype", name);
    uint64_t esize;
    if (strcmp(dtype, "f32") == 0) out->dtype = DT_F32, esize = 4;
    else if (strcmp(dtype, "f16") == 0) out->dtype = DT_F16, esize = 2;
    else if (strcmp(dtype, "bf16") == 0) out->dtype = DT_BF16, esize = 2;
    else if (strcmp(dtype, "base_q8") == 0) out->dtype = DT_Q8, esize = 0;
    else if (strcmp(dtype, "base_q4") == 0) out->dtype = DT_Q4, esize = 0;
    else if (strcmp(dtype, "base_q5") == 0) out->dtype = DT_Q5, esize = 0;
    else if (strcmp(dtype, "ggml_q4_k") == 0) out->dtype = DT_GGML_Q4_K, esize = 0;
    else if (strcmp(dtype, "ggml_q5_k") == 0) out->dtype = DT_GGML_Q5_K, esize = 0;
    else if (strcmp(dtype, "ggml_q6_k") == 0) out->dtype = DT_GGML_Q6_K, esize = 0;
    else
        return bundle_fail(b, BASERT_ERR_UNSUPPORTED,
                           "tensor '%s' has dtype '%s'; the reference engine reads f32, f16, bf16, base_q8, "
                           "base_q5, base_q4, ggml_q4_k, ggml_q5_k and ggml_q6_k",
                           name, dtype);
    const json_value *shape = json_get(t, "shape");
    size_t nd = json_count(shape);
    if (!shape || shape->type != JSON_ARRAY || nd < 1 || nd > 4)
        return bundle_fail(b, BASERT_ERR_INVALID_FORMAT, "tensor '%s' has no valid shape (1 to 4 dims)", name);
    out->ndim = (int)nd;
    uint64_t n = 1;
    for (size_t i = 0; i < nd; i++) {
        int64_t d;
        if (!json_int64(json_at(shape, i), &d) || d < 0 || d > ((int64_t)1 << 40))
            return bundle_fail(b, BASERT_ERR_INVALID_FORMAT, "tensor '%s' has an invalid shape entry", name);
        out->shape[i] = d;
        if (d && n > UINT64_MAX / 8 / (uint64_t)d)
            return bundle_fail(b, BASERT_ERR_INVALID_FORMAT, "tensor '%s' shape overflows", name);
        n *= (uint64_t)d;
    }
    out->n_elems = n;
    int64_t off, len;
    if (!json_int64(json_get(t, "offset"), &off) || off < 0)
        return bundle_fail(b, BASERT_ERR_INVALID_FORMAT, "tensor '%s' has no valid offset", name);
    if (!json_int64(json_get(t, "length"), &len) || len < 0)
        return bundle_fail(b, BASERT_ERR_INVALID_FORMAT, "tensor '%s' has no valid length", name);
    out->offset = (uint64_t)off;
    out->length = (uint64_t)len;
    if (out->dtype >= DT_GGML_Q4_K) {
        /* GGML K-quant blocks as a GGUF stores them: rows of whole 256-value super-blocks */
        uint64_t size = out->dtype == DT_GGML_Q4_K ? 144 : out->dtype == DT_GGML_Q5_K ? 176 : 210;
        if (out->ndim != 2 || out->shape[1] % 256 != 0 || out->shape[1] == 0 || out->length != n / 256 * size)
            return bundle_fail(b, BASERT_ERR_INVALID_FORMAT,
                               "tensor '%s': a %s tensor is 2-D, its rows whole blocks of 256 values (%llu bytes "
                               "each), length %llu",
                               name, dtype, (unsigned long long)size, (unsigned long long)(n / 256 * size));
    } else if (esize == 0) {
        int rc = parse_quant(b, t, out);
        if (rc) return rc;
    } else if (n * esize != out->length) {
        return bundle_fail(b, BASERT_ERR_INVALID_FORMAT,
                           "tensor '%s': length %llu does not match its shape (%llu elements of %s)", name,
                           (unsigned long long)out->length, (unsigned long long)n, dtype);
    }
    /* Compared by subtraction: offset and length may each be near 2^63, so
     * their sum with blob_start could wrap a uint64. */
    uint64_t room = b->size > b->blob_start ? b->size - b->blob_start : 0;
    if (out->offset > room || out->length > room - out->offset)
        return bundle_fail(b, BASERT_ERR_INVALID_FORMAT,
                           "truncated or inconsistent: tensor '%s' at blob offset %llu with %llu bytes does not fit the "
                           "%llu bytes of weights in a %zu-byte file",
                           name, (unsigned long long)out->offset, (unsigned long long)out->length,
                           (unsigned long long)room, b->size);
    return BASERT_OK;
}

/* Slot of a tensor name in the llama layout; -1 for a name outside it. */
static long tensor_slot(const char *name, uint32_t n_layers) {
    if (strcmp(name, "embed_tokens.weight") == 0) return SLOT_EMBED;
    if (strcmp(name, "final_norm.weight") == 0) return SLOT_FINAL_NORM;
    if (strcmp(name, "lm_head.weight") == 0) return SLOT_LM_HEAD;
    if (strcmp(name, "rope_freqs.weight") == 0) return SLOT_ROPE_FREQS;
    if (strncmp(name, "layers.", 7) != 0) return -1;
    const char *p = name + 7;
    if (*p < '0' || *p > '9' || (*p == '0' && p[1] != '.')) return -1;
    unsigned long layer = 0;
    while (*p >= '0' && *p <= '9') {
        layer = layer * 10 + (unsigned long)(*p - '0');
        if (layer >= n_layers) return -1;
        p++;
    }
    if (*p != '.') return -1;
    p++;
    for (int k = 0; k < LAYER_SLOTS; k++)
        if (strcmp(p, LAYER_SUFFIX[k]) == 0) return SLOT_LAYER0 + (long)layer * LAYER_SLOTS + k;
    return -1;
}

static bool shape_is(const tensor_entry *t, int ndim, uint32_t d0, uint32_t d1) {
    if (t->ndim != ndim || t->shape[0] != (int64_t)d0) return false;
    return ndim == 1 || t->shape[1] == (int64_t)d1;
}

static int check_shape(const bundle *b, const tensor_entry *t, int ndim, uint32_t d0, uint32_t d1) {
    if (shape_is(t, ndim, d0, d1)) return BASERT_OK;
    if (ndim == 1)
        return bundle_fail(b, BASERT_ERR_INVALID_FORMAT, "tensor '%s' must have shape [%u] for this config", t->name,
                           d0);
    return bundle_fail(b, BASERT_ERR_INVALID_FORMAT, "tensor '%s' must have shape [%u, %u] for this config", t->name,
                       d0, d1);
}

/* Validate the whole table; slots[] receives the architecture's tensors. */
static int parse_tensors(const bundle *b, const parsed_config *pc, tensor_entry **entries_out,
                         tensor_entry ***slots_out) {
    const BaseRTModelConfig *cfg = &pc->cfg;
    const arch_traits *arch = pc->traits;
    int tie = pc->tie;
    *entries_out = NULL;
    *slots_out = NULL;
    const json_value *arr = json_get(b->hdr, "tensors");
    if (!arr || arr->type != JSON_ARRAY) return bundle_fail(b, BASERT_ERR_INVALID_FORMAT, "the header has no tensors array");
    size_t n = json_count(arr);
    if (n > BASE_MAX_TENSORS) return bundle_fail(b, BASERT_ERR_INVALID_FORMAT, "too many tensors (%zu)", n);
    size_t n_slots = SLOT_LAYER0 + (size_t)cfg->n_layers * LAYER_SLOTS;
    tensor_entry *entries = calloc(n ? n : 1, sizeof *entries);
    tensor_entry **slots = calloc(n_slots, sizeof *slots);
    if (!entries || !slots) {
        free(entries);
        free(slots);
        return bundle_fail(b, BASERT_ERR_OUT_OF_MEMORY, "out of memory reading the tensor table");
    }
    *entries_out = entries;
    *slots_out = slots;
    for (size_t i = 0; i < n; i++) {
        const json_value *t = json_at(arr, i);
        if (t->type != JSON_OBJECT)
            return bundle_fail(b, BASERT_ERR_INVALID_FORMAT, "tensors[%zu] is not an object", i);
        int rc = parse_tensor(b, t, i, &entries[i]);
        if (rc) return rc;
        long slot = tensor_slot(entries[i].name, cfg->n_layers);
        /* LongRoPE: llama.cpp divides by rope_factors_long when the context (per sequence) is longer than
         * the original one, else by rope_factors_short (llama_model::get_rope_factors); the other stays unread */
        bool is_long = strcmp(entries[i].name, "rope_factors_long.weight") == 0;
        if (pc->longrope_orig && (is_long || strcmp(entries[i].name, "rope_factors_short.weight") == 0)) {
            if (is_long != (cfg->max_seq_len > pc->longrope_orig)) continue;
            slot = SLOT_ROPE_FREQS;
        }
        if (slot >= SLOT_LAYER0 && !layer_slot_used(arch, (int)((slot - SLOT_LAYER0) % LAYER_SLOTS))) slot = -1;
        if (slot == SLOT_ROPE_FREQS && !arch->rope_freqs) slot = -1;
        if (slot < 0)
            return bundle_fail(b, BASERT_ERR_UNSUPPORTED,
                               "tensor '%s' is not part of the %s layout the reference engine runs",
                               entries[i].name, arch->name);
        if (slots[slot]) return bundle_fail(b, BASERT_ERR_INVALID_FORMAT, "tensor '%s' appears twice", entries[i].name);
        slots[slot] = &entries[i];
    }

    if (pc->longrope_orig && !slots[SLOT_ROPE_FREQS])
        return bundle_fail(b, BASERT_ERR_INVALID_FORMAT, "missing tensor '%s' (config.rope_scaling is longrope)",
                           cfg->max_seq_len > pc->longrope_orig ? "rope_factors_long.weight"
                                                                : "rope_factors_short.weight");
    static const char *const TOP_NAMES[3] = {"embed_tokens.weight", "final_norm.weight", "lm_head.weight"};
    for (int s = 0; s < SLOT_ROPE_FREQS; s++) {
        bool needed = s != SLOT_LM_HEAD || tie == 0;
        if (!slots[s] && needed)
            return bundle_fail(b, BASERT_ERR_INVALID_FORMAT, "missing tensor '%s'%s", TOP_NAMES[s],
                               s == SLOT_LM_HEAD ? " (config.tie_word_embeddings is false)" : "");
    }
    int rc;
    if ((rc = check_shape(b, slots[SLOT_EMBED], 2, cfg->vocab_size, cfg->dim)) ||
        (rc = check_shape(b, slots[SLOT_FINAL_NORM], 1, cfg->dim, 0)) ||
        (slots[SLOT_LM_HEAD] && (rc = check_shape(b, slots[SLOT_LM_HEAD], 2, cfg->vocab_size, cfg->dim))) ||
        (slots[SLOT_ROPE_FREQS] && (rc = check_shape(b, slots[SLOT_ROPE_FREQS], 1, cfg->head_dim / 2, 0))))
        return rc;
    const uint32_t D = cfg->dim, Q = cfg->q_dim, KV = cfg->kv_dim, F = cfg->ffn_dim, H = cfg->head_dim;
    const uint32_t shapes[LAYER_SLOTS][3] = {
        {1, D, 0}, {2, Q, D},  {2, KV, D}, {2, KV, D}, {2, D, Q}, {1, D, 0}, {2, F, D}, {2, F, D},
        {2, D, F}, {1, Q, 0},  {1, KV, 0}, {1, KV, 0}, {1, H, 0}, {1, H, 0}, {1, D, 0}, {1, D, 0},
    };
    for (uint32_t l = 0; l < cfg->n_layers; l++) {
        for (int k = 0; k < LAYER_SLOTS; k++) {
            if (!layer_slot_used(arch, k)) continue;
            const tensor_entry *t = slots[SLOT_LAYER0 + (size_t)l * LAYER_SLOTS + k];
            if (!t) return bundle_fail(b, BASERT_ERR_INVALID_FORMAT, "missing tensor 'layers.%u.%s'", l, LAYER_SUFFIX[k]);
            if ((rc = check_shape(b, t, (int)shapes[k][0], shapes[k][1], shapes[k][2]))) return rc;
        }
    }
    return BASERT_OK;
}

/* ---- weights -------------------------------------------------------------------- */

static float *load_tensor_f32(const bundle *b, const tensor_entry *t) {
    size_t n = (size_t)t->n_elems;
    float *out = malloc((n ? n : 1) * sizeof(float));
    if (!out) {
        bundle_fail(b, BASERT_ERR_OUT_OF_MEMORY, "out of memory converting tensor '%s' (%zu elements)", t->name, n);
        return NULL;
    }
    const unsigned char *src = b->map + b->blob_start + t->offset;
    if (t->dtype == DT_F32) {
        memcpy(out, src, n * sizeof(float));
    } else {
        for (size_t i = 0; i < n; i++) {
            uint16_t h;
            memcpy(&h, src + 2 * i, 2);
            out[i] = t->dtype == DT_F16 ? rt_f16_to_f32(h) : rt_bf16_to_f32(h);
        }
    }
    return out;
}

/* A repacked tensor's file pages are not read again: drop them from this process's resident set (the
 * page cache keeps them), so loading a quantized model peaks near its repacked size, not that plus the
 * file. Whole pages inside [off, off + len) only; a neighbour's pages stay. */
static void release_pages(const bundle *b, uint64_t off, uint64_t len) {
    uintptr_t page = (uintptr_t)sysconf(_SC_PAGESIZE), lo = (uintptr_t)(b->map + b->blob_start + off);
    uintptr_t hi = lo + (uintptr_t)len;
    lo = (lo + page - 1) & ~(page - 1);
    hi &= ~(page - 1);
    if (hi > lo) madvise((void *)lo, hi - lo, MADV_DONTNEED);
}

/* A matrix: f16 stays f16 (the kernels widen it in registers, exactly);
 * f32 and bf16 become f32. BASERT_REF_WIDEN_F16=1 widens f16 at load as
 * the engine used to (benchmarks and the bit-identity test compare both). */
/* A NaN or Inf group scale or bias (f16: exponent 0x7c00, bf16: 0x7f80 all
 * ones) is refused: every value of its group would be non-finite. */
static bool quant_params_finite(const bundle *b, const tensor_entry *t) {
    const unsigned char *blob = b->map + b->blob_start;
    size_t n = (size_t)(t->n_elems / t->group_size);
    size_t width = t->scale_type == RT_SCALE_F32 ? 4 : 2;
    uint16_t exp = t->scale_type == RT_SCALE_BF16 ? 0x7f80u : 0x7c00u;
    for (int k = 0; k < (t->symmetric ? 1 : 2); k++) {
        const unsigned char *p = blob + (k ? t->bias_offset : t->scale_offset);
        for (size_t i = 0; i < n; i++) {
            bool nan, inf;
            if (width == 4) {
                float f;
                memcpy(&f, p + 4 * i, 4);
                nan = isnan(f), inf = isinf(f);
            } else {
                uint16_t h;
                memcpy(&h, p + 2 * i, 2);
                nan = (h & exp) == exp && (h & (exp ^ 0x7fffu));
                inf = (h & exp) == exp && !(h & (exp ^ 0x7fffu));
            }
            if (nan || inf) {
                bundle_fail(b, BASERT_ERR_INVALID_FORMAT, "tensor '%s': group %s %zu is %s", t->name,
                            k ? "bias" : "scale", i, nan ? "NaN" : "Inf");
                return false;
            }
        }
    }
    return true;
}

/* A tensor being repacked: its rows [0, rows_done) are read, so their whole pages go (release_pages' rule)
 * as each chunk is done, in every region of the tensor (values, group scales, group biases); the load thus
 * peaks at the repacked weights plus about one chunk, not plus the whole source tensor. */
typedef struct {
    uint64_t off, row_bytes, released; /* blob-relative; bytes of the region already released */
} row_region;
typedef struct {
    const bundle *b;
    size_t rows;
    int n;
    row_region r[3];
} chunk_release;

static chunk_release chunk_release_of(const bundle *b, const tensor_entry *t) {
    chunk_release c = {b, (size_t)t->shape[0], 1, {{t->offset, 0, 0}}};
    if (!c.rows) return c;
    c.r[0].row_bytes = t->length / c.rows;
    if (t->dtype == DT_Q8 || t->dtype == DT_Q4 || t->dtype == DT_Q5) { /* their scale and bias regions */
        uint64_t row_scales = (uint64_t)t->shape[1] / t->group_size * (t->scale_type == RT_SCALE_F32 ? 4 : 2);
        c.r[c.n++] = (row_region){t->scale_offset, row_scales, 0};
        if (!t->symmetric) c.r[c.n++] = (row_region){t->bias_offset, row_scales, 0};
    }
    return c;
}

static void release_rows(void *ctx, size_t rows_done) {
    chunk_release *c = ctx;
    uintptr_t page = (uintptr_t)sysconf(_SC_PAGESIZE), base = (uintptr_t)(c->b->map + c->b->blob_start);
    for (int i = 0; i < c->n; i++) {
        row_region *r = &c->r[i];
        uint64_t end = (uint64_t)rows_done * r->row_bytes;
        /* an end inside the tensor goes down to a page boundary, so a page split between two chunks is
         * released with the later one, not skipped by both (none yet: nothing to release) */
        if (rows_done < c->rows) {
            uintptr_t at = (base + r->off + end) & ~(page - 1);
            end = at > base + r->off ? at - base - r->off : 0;
        }
        if (end > r->released) {
            release_pages(c->b, r->off + r->released, end - r->released);
            r->released = end;
        }
    }
}

static bool load_matrix(const bundle *b, const tensor_entry *t, bool widen_f16, rt_weight *out, uint64_t *total) {
    if (t->dtype >= DT_GGML_Q4_K) {
        chunk_release c = chunk_release_of(b, t);
        rt_ggml_bad bad = {0, NULL, NULL};
        size_t bytes = rt_weight_from_ggml(out,
                                           t->dtype == DT_GGML_Q4_K   ? RT_GGML_Q4_K
                                           : t->dtype == DT_GGML_Q5_K ? RT_GGML_Q5_K
                                                                      : RT_GGML_Q6_K,
                                           b->map + b->blob_start + t->offset, (size_t)t->shape[0],
                                           (size_t)t->shape[1], release_rows, &c, &bad);
        if (bad.field) {
            bundle_fail(b, BASERT_ERR_INVALID_FORMAT, "tensor '%s': super-block %zu %s is %s", t->name, bad.block,
                        bad.field, bad.what);
            return false;
        }
        if (!bytes) {
            bundle_fail(b, BASERT_ERR_OUT_OF_MEMORY, "out of memory loading tensor '%s'", t->name);
            return false;
        }
        *total += bytes;
        return true;
    }
    if (t->dtype == DT_Q8 || t->dtype == DT_Q4 || t->dtype == DT_Q5) {
        if (!quant_params_finite(b, t)) return false;
        const unsigned char *blob = b->map + b->blob_start;
        int bits = t->dtype == DT_Q4 ? 4 : t->dtype == DT_Q5 ? 5 : 8;
        chunk_release c = chunk_release_of(b, t);
        size_t bytes = rt_weight_from_groups(out, bits, blob + t->offset, blob + t->scale_offset,
                                             t->symmetric ? NULL : blob + t->bias_offset, t->scale_type,
                                             t->symmetric, (size_t)t->shape[0], (size_t)t->shape[1],
                                             (int)t->group_size, release_rows, &c);
        if (!bytes) {
            bundle_fail(b, BASERT_ERR_OUT_OF_MEMORY, "out of memory loading tensor '%s'", t->name);
            return false;
        }
        *total += bytes;
        return true;
    }
    if (t->dtype == DT_F16 && !widen_f16) {
        size_t bytes = (size_t)t->n_elems * 2;
        uint16_t *h = malloc(bytes ? bytes : 1);
        if (!h) {
            bundle_fail(b, BASERT_ERR_OUT_OF_MEMORY, "out of memory loading tensor '%s' (%zu bytes)", t->name, bytes);
            return false;
        }
        /* in chunks of whole rows (about 2 MB), each released once copied */
        chunk_release c = chunk_release_of(b, t);
        size_t row = (size_t)t->shape[1] * 2, step = row ? ((2u << 20) / row + 1) : 1;
        for (size_t r0 = 0; r0 < c.rows; r0 += step) {
            size_t n = c.rows - r0 < step ? c.rows - r0 : step;
            memcpy((uint8_t *)h + r0 * row, b->map + b->blob_start + t->offset + r0 * row, n * row);
            release_rows(&c, r0 + n);
        }
        *out = (rt_weight){h, RT_W_F16, 0};
        *total += bytes;
        return true;
    }
    float *f = load_tensor_f32(b, t);
    if (!f) return false;
    chunk_release c = chunk_release_of(b, t);
    release_rows(&c, c.rows);
    *out = (rt_weight){f, RT_W_F32, 0};
    *total += t->n_elems * sizeof(float);
    return true;
}

static int load_weights(const bundle *b, rt_model *m, tensor_entry **slots) {
    const BaseRTModelConfig *cfg = &m->cfg;
    m->layers = calloc(cfg->n_layers, sizeof *m->layers);
    if (!m->layers) return bundle_fail(b, BASERT_ERR_OUT_OF_MEMORY, "out of memory");
    const char *widen_env = getenv("BASERT_REF_WIDEN_F16");
    bool widen = widen_env && widen_env[0] && strcmp(widen_env, "0") != 0;
    uint64_t total = 0;
#define LOAD(dst, slot)                                                                                                \
    do {                                                                                                               \
        if (!((dst) = load_tensor_f32(b, slots[slot]))) return BASERT_ERR_OUT_OF_MEMORY;                              \
        total += slots[slot]->n_elems * sizeof(float);                                                                 \
    } while (0)
#define LOADW(dst, slot)                                                                                               \
    do {                                                                                                               \
        if (!load_matrix(b, slots[slot], widen, &(dst), &total)) return rt_last_error_code();                         \
    } while (0)
    LOADW(m->tok_embd, SLOT_EMBED);
    LOAD(m->final_norm, SLOT_FINAL_NORM);
    if (slots[SLOT_LM_HEAD]) {
        LOADW(m->lm_head, SLOT_LM_HEAD);
        m->tied_embeddings = false;
    } else {
        m->lm_head = m->tok_embd;
        m->tied_embeddings = true;
    }
    if (slots[SLOT_ROPE_FREQS]) {
        LOAD(m->rope_freqs, SLOT_ROPE_FREQS);
        /* frequency divisors: a zero, negative or non-finite one turns RoPE's angles into NaN / nonsense */
        for (uint64_t i = 0; i < slots[SLOT_ROPE_FREQS]->n_elems; i++)
            if (!(m->rope_freqs[i] > 0.0f) || !isfinite(m->rope_freqs[i]))
                return bundle_fail(b, BASERT_ERR_INVALID_FORMAT,
                                   "tensor '%s': RoPE frequency divisor %llu is %g, not a positive number",
                                   slots[SLOT_ROPE_FREQS]->name, (unsigned long long)i, (double)m->rope_freqs[i]);
    }
    for (uint32_t l = 0; l < cfg->n_layers; l++) {
        rt_layer *L = &m->layers[l];
        size_t s = SLOT_LAYER0 + (size_t)l * LAYER_SLOTS;
        LOAD(L->attn_norm, s + L_ATTN_NORM);
        LOADW(L->wq, s + L_WQ);
        LOADW(L->wk, s + L_WK);
        LOADW(L->wv, s + L_WV);
        LOADW(L->wo, s + L_WO);
        LOAD(L->ffn_norm, s + L_FFN_NORM);
        LOADW(L->w_gate, s + L_GATE);
        LOADW(L->w_up, s + L_UP);
        LOADW(L->w_down, s + L_DOWN);
        if (m->arch.qkv_bias) {
            LOAD(L->bq, s + L_BQ);
            LOAD(L->bk, s + L_BK);
            LOAD(L->bv, s + L_BV);
        }
        if (m->arch.qk_norm) {
            LOAD(L->q_norm, s + L_Q_NORM);
            LOAD(L->k_norm, s + L_K_NORM);
        }
        if (m->arch.out_norms) {
            LOAD(L->attn_out_norm, s + L_ATTN_OUT_NORM);
            LOAD(L->ffn_out_norm, s + L_FFN_OUT_NORM);
        }
    }
#undef LOAD
#undef LOADW
    m->weight_bytes = (size_t)total;
    return BASERT_OK;
}

/* ---- tokenizer metadata ------------------------------------------------------------ */

/* Copy every tensor's name (pointers into the header's parse tree) into one buffer and point the
 * entries at it, so the tree can be freed while they are still used. Returns the buffer, NULL when out
 * of memory (the entries are then unchanged). */
static char *detach_names(const bundle *b, tensor_entry *entries) {
    size_t n = json_count(json_get(b->hdr, "tensors")), total = 1;
    for (size_t i = 0; i < n; i++) total += strlen(entries[i].name) + 1;
    char *buf = malloc(total), *at = buf;
    if (!buf) return NULL;
    for (size_t i = 0; i < n; i++) {
        size_t len = strlen(entries[i].name) + 1;
        memcpy(at, entries[i].name, len);
        entries[i].name = at;
        at += len;
    }
    return buf;
}

static uint64_t fnv1a64(const unsigned char *p, size_t n);

static char *token_string(const bpe_tokenizer *tok, uint32_t id) {
    int n = bpe_token_bytes(tok, id, NULL, 0);
    if (n < 0) n = 0;
    char *s = malloc((size_t)n + 1);
    if (!s) return NULL;
    if (n) bpe_token_bytes(tok, id, s, n);
    s[n] = '\0';
    return s;
}

static bool add_eos_id(rt_model *m, uint32_t id) {
    for (int i = 0; i < m->n_eos_ids; i++)
        if (m->eos_ids[i] == id) return true;
    uint32_t *ids = realloc(m->eos_ids, ((size_t)m->n_eos_ids + 1) * sizeof *ids);
    if (!ids) return false;
    m->eos_ids = ids;
    m->eos_ids[m->n_eos_ids++] = id;
    return true;
}

/* The header's tokenizer object, read field group by field group: the model and pre-tokenizer kind, the
 * per-token lists (text, type, score), the merges and the rstrip ids (shape first, then each entry), then
 * the special ids (bos / eos, the stop set, the control tokens) of the tokenizer they built. */
typedef struct {
    const json_value *tk, *tokens, *types, *merges, *scores, *rstrip_ids; /* parse-tree nodes; NULL: absent */
    const char *model, *pre;
    size_t n_tokens, n_merges;
    bool spm, add_space_prefix;
} tokenizer_fields;

/* What bpe_create_model reads, copied out of the fields (the strings still point into the tree). */
typedef struct {
    const char **text, **merge;
    int32_t *type;
    float *score;
    unsigned char *rstrip;
} tokenizer_arrays;

static int tokenizer_kind(const bundle *b, tokenizer_fields *f) {
    const json_value *model_kind = json_get(f->tk, "tokenizer.ggml.model");
    const char *model = model_kind ? json_string(model_kind) : "gpt2";
    const char *pre = json_string(json_get(f->tk, "tokenizer.ggml.pre"));
    if (!pre) pre = "default";
    if (!model || !bpe_supported(model, "gpt2"))
        return bundle_fail(b, BASERT_ERR_UNSUPPORTED, "tokenizer.ggml.model '%s' is not supported (gpt2, llama)",
                           model ? model : "?");
    if (!bpe_supported(model, pre))
        return bundle_fail(b, BASERT_ERR_UNSUPPORTED,
                           "tokenizer.ggml.pre '%s' is not a pre-tokenizer the engine runs exactly (docs/models.md)", pre);
    f->model = model;
    f->pre = pre;
    f->spm = strcmp(model, "llama") == 0;
    f->add_space_prefix = f->spm; /* llama.cpp's default for SentencePiece */
    json_bool(json_get(f->tk, "tokenizer.ggml.add_space_prefix"), &f->add_space_prefix);
    return BASERT_OK;
}

static bool one_per_token(const json_value *list, size_t n_tokens) {
    return list->type == JSON_ARRAY && json_count(list) == n_tokens;
}

/* The lists' shapes, in the order they are checked: tokens and their types, merges, scores, rstrip ids. */
static int tokenizer_lists(const bundle *b, const rt_model *m, tokenizer_fields *f) {
    f->tokens = json_get(f->tk, "tokenizer.ggml.tokens");
    f->n_tokens = json_count(f->tokens);
    if (!f->tokens || f->tokens->type != JSON_ARRAY || f->n_tokens == 0)
        return bundle_fail(b, BASERT_ERR_INVALID_FORMAT, "tokenizer.ggml.tokens is missing or empty");
    if (f->n_tokens > m->cfg.vocab_size)
        return bundle_fail(b, BASERT_ERR_INVALID_FORMAT, "the tokenizer has %zu tokens, more than config.vocab_size %u",
                           f->n_tokens, m->cfg.vocab_size);
    f->types = json_get(f->tk, "tokenizer.ggml.token_type");
    if (f->types && !one_per_token(f->types, f->n_tokens))
        return bundle_fail(b, BASERT_ERR_INVALID_FORMAT, "tokenizer.ggml.token_type must list one type per token");
    f->merges = json_get(f->tk, "tokenizer.ggml.merges");
    if (f->merges && f->merges->type != JSON_ARRAY)
        return bundle_fail(b, BASERT_ERR_INVALID_FORMAT, "tokenizer.ggml.merges is not an array");
    f->n_merges = json_count(f->merges);
    if (f->n_merges > (size_t)1 << 24) return bundle_fail(b, BASERT_ERR_INVALID_FORMAT, "too many merges");
    f->scores = json_get(f->tk, "tokenizer.ggml.scores");
    if (f->scores && !one_per_token(f->scores, f->n_tokens))
        return bundle_fail(b, BASERT_ERR_INVALID_FORMAT, "tokenizer.ggml.scores must list one score per token");
    /* the added tokens llama.cpp strips the whitespace after (Phi-3's: the converter lists them) */
    f->rstrip_ids = json_get(f->tk, "tokenizer.aiobasert.rstrip_token_ids");
    if (f->rstrip_ids && f->rstrip_ids->type != JSON_ARRAY)
        return bundle_fail(b, BASERT_ERR_INVALID_FORMAT, "tokenizer.aiobasert.rstrip_token_ids is not an array");
    return BASERT_OK;
}

static void tokenizer_arrays_free(tokenizer_arrays *a) {
    free(a->text);
    free(a->type);
    free(a->merge);
    free(a->score);
    free(a->rstrip);
}

/* Each token's text, type and score, entry by entry (the first bad entry of any of them is the one named). */
static int read_token_rows(const bundle *b, const tokenizer_fields *f, tokenizer_arrays *a) {
    for (size_t i = 0; i < f->n_tokens; i++) {
        const json_value *t = json_at(f->tokens, i);
        if (!json_string(t) || strlen(t->u.str.s) != t->u.str.len || t->u.str.len == 0)
            return bundle_fail(b, BASERT_ERR_INVALID_FORMAT, "tokenizer.ggml.tokens[%zu] is not a non-empty string", i);
        a->text[i] = t->u.str.s;
        if (f->types) {
            int64_t ty;
            if (!json_int64(json_at(f->types, i), &ty) || ty < 0 || ty > 6)
                return bundle_fail(b, BASERT_ERR_INVALID_FORMAT, "tokenizer.ggml.token_type[%zu] is not a token type", i);
            a->type[i] = (int32_t)ty;
        }
        double sc;
        if (f->scores && !json_number(json_at(f->scores, i), &sc))
            return bundle_fail(b, BASERT_ERR_INVALID_FORMAT, "tokenizer.ggml.scores[%zu] is not a number", i);
        if (f->scores) a->score[i] = (float)sc;
    }
    return BASERT_OK;
}

static int read_merges(const bundle *b, const tokenizer_fields *f, tokenizer_arrays *a) {
    for (size_t i = 0; i < f->n_merges; i++) {
        const json_value *t = json_at(f->merges, i);
        if (!json_string(t) || strlen(t->u.str.s) != t->u.str.len)
            return bundle_fail(b, BASERT_ERR_INVALID_FORMAT, "tokenizer.ggml.merges[%zu] is not a string", i);
        a->merge[i] = t->u.str.s;
    }
    return BASERT_OK;
}

static int read_rstrip_ids(const bundle *b, const tokenizer_fields *f, tokenizer_arrays *a) {
    for (size_t i = 0; i < json_count(f->rstrip_ids); i++) {
        int64_t id;
        if (!json_int64(json_at(f->rstrip_ids, i), &id) || id < 0 || (uint64_t)id >= f->n_tokens)
            return bundle_fail(b, BASERT_ERR_INVALID_FORMAT,
                               "tokenizer.aiobasert.rstrip_token_ids[%zu] is not a token id below %zu", i, f->n_tokens);
        a->rstrip[id] = 1;
    }
    return BASERT_OK;
}

/* m->tok from the arrays: the one of a handle already open on the same file (and header bytes) when there
 * is one (bpe_shared_get), else built and shared. */
static int create_tokenizer(const bundle *b, rt_model *m, const tokenizer_fields *f, const tokenizer_arrays *a) {
    char err[256] = "";
    bpe_options opt = {.model = f->model, .pre = f->pre, .scores = a->score,
                       .add_space_prefix = f->add_space_prefix, .rstrip = a->rstrip};
    uint64_t key[BPE_SHARE_KEY] = {b->file_id[0], b->file_id[1], b->file_id[2], b->file_id[3],
                                   (uint64_t)b->blob_start, fnv1a64(b->map, (size_t)b->blob_start)};
    m->tok = bpe_shared_get(key);
    if (!m->tok) {
        m->tok = bpe_create_model(a->text, a->type, (int)f->n_tokens, a->merge, (int)f->n_merges, &opt, err,
                                  sizeof err);
        bpe_shared_put(m->tok, key);
    }
    if (!m->tok) return bundle_fail(b, BASERT_ERR_INVALID_FORMAT, "cannot build the tokenizer: %s", err);
    return BASERT_OK;
}

static int build_tokenizer(const bundle *b, rt_model *m, const tokenizer_fields *f) {
    size_t n = f->n_tokens;
    tokenizer_arrays a = {
        .text = malloc(n * sizeof *a.text),
        .type = f->types ? malloc(n * sizeof *a.type) : NULL,
        .merge = malloc((f->n_merges ? f->n_merges : 1) * sizeof *a.merge),
        .score = f->scores ? malloc(n * sizeof *a.score) : NULL,
        .rstrip = f->rstrip_ids ? calloc(n, 1) : NULL,
    };
    int rc;
    if (!a.text || (f->types && !a.type) || !a.merge || (f->scores && !a.score) || (f->rstrip_ids && !a.rstrip))
        rc = bundle_fail(b, BASERT_ERR_OUT_OF_MEMORY, "out of memory reading the tokenizer");
    else if (!(rc = read_token_rows(b, f, &a)) && !(rc = read_merges(b, f, &a)) && !(rc = read_rstrip_ids(b, f, &a)))
        rc = create_tokenizer(b, m, f, &a);
    tokenizer_arrays_free(&a);
    return rc;
}

/* A token id below n, from a header value; false when it is absent or not one. */
static bool token_id_below(const json_value *v, size_t n, uint32_t *id) {
    int64_t x;
    if (!json_int64(v, &x) || x < 0 || (size_t)x >= n) return false;
    *id = (uint32_t)x;
    return true;
}

/* bos / eos: the config first, then the tokenizer's keys. */
static int read_bos_eos(const bundle *b, rt_model *m, const parsed_config *pc, const tokenizer_fields *f) {
    if (pc->has_eos) m->eos_id = pc->eos_id;
    else if (!token_id_below(json_get(f->tk, "tokenizer.ggml.eos_token_id"), f->n_tokens, &m->eos_id))
        return bundle_fail(b, BASERT_ERR_INVALID_FORMAT, "no valid eos_token_id in the config or the tokenizer");
    if (pc->has_bos) m->bos_id = pc->bos_id;
    else if (!token_id_below(json_get(f->tk, "tokenizer.ggml.bos_token_id"), f->n_tokens, &m->bos_id))
        m->bos_id = m->eos_id; /* GPT-2 convention: one <|endoftext|> for both */
    if (m->eos_id >= f->n_tokens || m->bos_id >= f->n_tokens)
        return bundle_fail(b, BASERT_ERR_INVALID_FORMAT, "bos/eos token id is outside the tokenizer's %zu tokens",
                           f->n_tokens);
    bool add_bos = f->spm; /* llama.cpp's default: SentencePiece adds BOS */
    json_bool(json_get(f->tk, "tokenizer.ggml.add_bos_token"), &add_bos);
    m->add_bos = add_bos;
    return BASERT_OK;
}

/* The config's stop ids: eos_token_id when it is a list, and eos_token_ids. */
static int add_config_eos_ids(const bundle *b, rt_model *m, size_t n_tokens) {
    const json_value *cfgj = json_get(b->hdr, "config");
    const json_value *lists[2] = {json_get(cfgj, "eos_token_id"), json_get(cfgj, "eos_token_ids")};
    for (int li = 0; li < 2; li++) {
        const json_value *l = lists[li];
        if (!l || l->type == JSON_NULL || (li == 0 && l->type != JSON_ARRAY)) continue;
        if (l->type != JSON_ARRAY)
            return bundle_fail(b, BASERT_ERR_INVALID_FORMAT, "config.eos_token_ids is not an array");
        for (size_t i = 0; i < json_count(l); i++) {
            uint32_t id;
            if (!token_id_below(json_at(l, i), n_tokens, &id))
                return bundle_fail(b, BASERT_ERR_INVALID_FORMAT, "config.%s[%zu] is not a token id of the tokenizer",
                                   li ? "eos_token_ids" : "eos_token_id", i);
            if (!add_eos_id(m, id)) return bundle_fail(b, BASERT_ERR_OUT_OF_MEMORY, "out of memory");
        }
    }
    return BASERT_OK;
}

/* The GGUF's end-of-turn / end-of-message ids, then every family's end markers by their text, whatever
 * their token type (llama.cpp's end-of-generation set: Gemma's GGUFs store <end_of_turn> as a normal
 * token).
 *
 * Harmony (gpt-oss): <|end|> ends one message inside the turn (the analysis channel, and the final one
 * follows), <|return|> ends the turn and <|call|> ends it with a tool call. A vocabulary with either of
 * those is Harmony's, and its <|end|> is no stop (not even as the GGUF's end-of-turn id: llama.cpp drops it
 * from its set as well); elsewhere (Phi-3) <|end|> ends the turn. */
static bool add_end_of_turn_ids(rt_model *m, const tokenizer_fields *f) {
    bool harmony = bpe_token_id(m->tok, "<|return|>") >= 0 || bpe_token_id(m->tok, "<|call|>") >= 0;
    int32_t message_end = harmony ? bpe_token_id(m->tok, "<|end|>") : -1;
    static const char *const EOG_KEYS[] = {"tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"};
    for (size_t i = 0; i < sizeof EOG_KEYS / sizeof *EOG_KEYS; i++) {
        uint32_t id;
        if (token_id_below(json_get(f->tk, EOG_KEYS[i]), f->n_tokens, &id) && (int64_t)id != message_end &&
            !add_eos_id(m, id))
            return false;
    }
    static const char *const STOP_MARKERS[] = {
        "<|endoftext|>", "<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end_of_text|>", "<end_of_turn>",
        "<|end|>",       "<|return|>", "<|call|>",   "<EOT>",      "_<EOT>",          "<end_of_utterance>",
    };
    for (size_t i = 0; i < sizeof STOP_MARKERS / sizeof *STOP_MARKERS; i++) {
        int32_t id = bpe_token_id(m->tok, STOP_MARKERS[i]);
        if (id >= 0 && id != message_end && !add_eos_id(m, (uint32_t)id)) return false;
    }
    return true;
}

/* Every stop id: the primary eos, the config's extra ids, the known end-of-turn markers. */
static int read_stop_ids(const bundle *b, rt_model *m, const tokenizer_fields *f) {
    if (!add_eos_id(m, m->eos_id)) return bundle_fail(b, BASERT_ERR_OUT_OF_MEMORY, "out of memory");
    int rc = add_config_eos_ids(b, m, f->n_tokens);
    if (rc) return rc;
    if (!add_end_of_turn_ids(m, f)) return bundle_fail(b, BASERT_ERR_OUT_OF_MEMORY, "out of memory");
    return BASERT_OK;
}

static bool is_special(const bpe_tokenizer *tok, uint32_t id) {
    int ty = bpe_token_type(tok, id);
    return ty == BPE_TOKEN_CONTROL || ty == BPE_TOKEN_USER_DEFINED;
}

/* The control / user-defined token ids, the bos and eos texts and the chat template (the tokenizer's, else
 * the metadata's). */
static int read_special_tokens(const bundle *b, rt_model *m, const tokenizer_fields *f) {
    size_t n_special = 0;
    for (uint32_t id = 0; id < f->n_tokens; id++) n_special += is_special(m->tok, id);
    m->special_ids = malloc((n_special ? n_special : 1) * sizeof *m->special_ids);
    m->bos_str = token_string(m->tok, m->bos_id);
    m->eos_str = token_string(m->tok, m->eos_id);
    const char *tmpl = json_string(json_get(f->tk, "tokenizer.chat_template"));
    if (!tmpl) tmpl = json_string(json_get(json_get(b->hdr, "metadata"), "tokenizer.chat_template"));
    m->chat_template = strdup(tmpl ? tmpl : "");
    if (!m->special_ids || !m->bos_str || !m->eos_str || !m->chat_template)
        return bundle_fail(b, BASERT_ERR_OUT_OF_MEMORY, "out of memory");
    for (uint32_t id = 0; id < f->n_tokens; id++)
        if (is_special(m->tok, id)) m->special_ids[m->n_special++] = id;
    return BASERT_OK;
}

static int load_tokenizer(const bundle *b, rt_model *m, const parsed_config *pc) {
    tokenizer_fields f = {.tk = json_get(b->hdr, "tokenizer")};
    if (!f.tk || f.tk->type != JSON_OBJECT)
        return bundle_fail(b, BASERT_ERR_INVALID_FORMAT, "the header has no tokenizer object");
    int rc;
    if ((rc = tokenizer_kind(b, &f)) || (rc = tokenizer_lists(b, m, &f)) || (rc = build_tokenizer(b, m, &f)) ||
        (rc = read_bos_eos(b, m, pc, &f)) || (rc = read_stop_ids(b, m, &f)) || (rc = read_special_tokens(b, m, &f)))
        return rc;
    return BASERT_OK;
}

/* ---- load ---------------------------------------------------------------------------- */

static uint64_t fnv1a64(const unsigned char *p, size_t n) {
    uint64_t h = 0xcbf29ce484222325ull;
    for (size_t i = 0; i < n; i++) {
        h ^= p[i];
        h *= 0x100000001b3ull;
    }
    return h;
}

static int apply_options(const char *fn, rt_model *m, const BaseRTLoadOptions *o) {
    if (o->max_batch_size < 0) {
        rt_set_error(BASERT_ERR_INVALID_ARGUMENT, "%s: max_batch_size must be >= 0, got %d", fn, o->max_batch_size);
        return BASERT_ERR_INVALID_ARGUMENT;
    }
    m->paged_kv = o->paged_kv != 0;
    /* The prefix cache lives on the paged pool: without it the option has no effect. */
    m->prefix_cache = m->paged_kv && o->prefix_cache != 0;
    /* 0 and out-of-range values leave the default, as baseRT_set_prefill_chunk documents. */
    m->prefill_chunk = (o->prefill_chunk >= RT_MIN_PREFILL_CHUNK && o->prefill_chunk <= RT_MAX_PREFILL_CHUNK)
                           ? o->prefill_chunk
                           : RT_DEFAULT_PREFILL_CHUNK;
    int batch = o->max_batch_size ? o->max_batch_size : 1;
    m->max_batch_size = batch < m->prefill_chunk ? batch : m->prefill_chunk; /* capped at prefill_chunk */
    /* KV element width: 0 (auto) keeps the reference engine's exact f32 pool
     * (reported as 32 by baseRT_kv_bits_effective: no encoding of the header
     * names f32, and reporting 16 for it would be false); 16 is an f16 pool,
     * 8 a Q8_0 pool (rt_load falls back to f16 when head_dim % 32 != 0). Q4_0
     * is not implemented: 4 and 84 get Q8_0 (a paged pool is uniform, as the
     * header says for 84), and baseRT_kv_bits_effective says so. */
    switch (o->kv_bits) {
    case 0: m->kv_bits = 32; break;
    case 16: m->kv_bits = 16; break;
    case 4: case 8: case 84: m->kv_bits = 8; break;
    default:
        rt_set_error(BASERT_ERR_INVALID_ARGUMENT, "%s: kv_bits must be 0, 4, 8, 16 or 84, got %d", fn, o->kv_bits);
        return BASERT_ERR_INVALID_ARGUMENT;
    }
    return BASERT_OK;
}

rt_model *rt_load(const char *fn, const char *path, int max_context, const BaseRTLoadOptions *opts,
                  bool tokenizer_only) {
    if (!path) {
        rt_set_error(BASERT_ERR_INVALID_ARGUMENT, "%s: model_path is NULL", fn);
        return NULL;
    }
    if (max_context < 0) {
        rt_set_error(BASERT_ERR_INVALID_ARGUMENT, "%s: max_context must be >= 0, got %d", fn, max_context);
        return NULL;
    }
    rt_model *m = calloc(1, sizeof *m);
    if (!m || !(m->path = strdup(path))) {
        free(m);
        rt_set_error(BASERT_ERR_OUT_OF_MEMORY, "%s: out of memory", fn);
        return NULL;
    }
    m->tokenizer_only = tokenizer_only;
    const BaseRTLoadOptions defaults = {.struct_size = sizeof defaults};
    if (apply_options(fn, m, opts ? opts : &defaults) != BASERT_OK) {
        rt_model_destroy(m);
        return NULL;
    }

    bundle b;
    tensor_entry *entries = NULL, **slots = NULL;
    char *names = NULL;
    parsed_config pc;
    int rc = bundle_open(&b, fn, path);
    if (rc) goto fail;
    if ((rc = parse_config(&b, tokenizer_only, &pc))) goto fail;
    m->cfg = pc.cfg;
    m->arch = pc.arch;
    /* Q8_0 KV blocks must not straddle heads, and a widened page slice must fit attention's buffer. */
    if (m->kv_bits == 8 && (m->cfg.head_dim % 32 != 0 || m->cfg.head_dim > RT_KV_MAX_HEAD_DIM)) m->kv_bits = 16;
    m->trained_context = pc.trained_context;
    if (tokenizer_only) {
        m->cfg.max_seq_len = (uint32_t)pc.trained_context;
    } else {
        int ctx = max_context ? max_context : RT_DEFAULT_CONTEXT;
        m->cfg.max_seq_len = (uint32_t)(ctx < pc.trained_context ? ctx : pc.trained_context);
        pc.cfg.max_seq_len = m->cfg.max_seq_len; /* LongRoPE's factors depend on it */
        if ((rc = parse_tensors(&b, &pc, &entries, &slots))) goto fail;
    }
    if ((rc = load_tokenizer(&b, m, &pc))) goto fail;
    if (!tokenizer_only) {
        /* The header is read: free its parse tree (tens of MB for a 262k vocabulary) before the weights
         * are repacked, so a load peaks at the weights, not the weights plus the tree. The tensor names
         * (for load errors) move to one copy first. */
        if (!(names = detach_names(&b, entries))) {
            rc = bundle_fail(&b, BASERT_ERR_OUT_OF_MEMORY, "out of memory");
            goto fail;
        }
        json_free(b.doc);
        b.doc = NULL;
        b.hdr = NULL;
#ifdef __GLIBC__
        malloc_trim(0);
#endif
        if ((rc = load_weights(&b, m, slots))) goto fail;
        for (uint32_t l = 0; l < m->cfg.n_layers; l++) m->layers[l].sliding = pc.sliding[l];
    }
    m->weights_identity = fnv1a64(b.map, b.size < IDENTITY_BYTES ? b.size : IDENTITY_BYTES);
    free(entries);
    free(slots);
    free(names);
    entries = NULL;
    slots = NULL;
    bundle_close(&b);
#ifdef __GLIBC__
    /* the header's parse tree (tens of MB for a 262k vocabulary) was freed in small chunks the heap keeps
     * resident: hand them back, so a handle costs what it holds */
    malloc_trim(0);
#endif

    return m;

fail:
    free(entries);
    free(slots);
    free(names);
    bundle_close(&b);
    rt_model_destroy(m);
    return NULL;
}

/* About what a tensor costs once loaded: quantized matrices are repacked into panels of about their
 * stored size (values, scales and biases; quant.h), f16 matrices stay f16, everything else becomes f32. */
static uint64_t resident_bytes(const tensor_entry *t) {
    if (t->dtype >= DT_GGML_Q4_K) return t->length;
    if (t->dtype == DT_Q8 || t->dtype == DT_Q4 || t->dtype == DT_Q5) {
        uint64_t region = t->n_elems / t->group_size * (t->scale_type == RT_SCALE_F32 ? 4 : 2);
        return t->length + region * (t->symmetric ? 1 : 2);
    }
    return t->n_elems * (t->dtype == DT_F16 && t->ndim == 2 ? 2 : sizeof(float));
}

int rt_bundle_read_budget(const char *fn, const char *path, rt_bundle_budget *out) {
    memset(out, 0, sizeof *out);
    if (!path) {
        rt_set_error(BASERT_ERR_INVALID_ARGUMENT, "%s: model_path is NULL", fn);
        return BASERT_ERR_INVALID_ARGUMENT;
    }
    bundle b;
    parsed_config pc;
    int rc = bundle_open(&b, fn, path);
    if (!rc) rc = parse_config(&b, true, &pc);
    if (!rc) {
        const json_value *arr = json_get(b.hdr, "tensors");
        if (!arr || arr->type != JSON_ARRAY)
            rc = bundle_fail(&b, BASERT_ERR_INVALID_FORMAT, "the header has no tensors array");
        uint64_t weights = 0;
        for (size_t i = 0; !rc && i < json_count(arr); i++) {
            tensor_entry t;
            rc = parse_tensor(&b, json_at(arr, i), i, &t);
            if (!rc) weights += resident_bytes(&t);
        }
        out->trained_context = pc.trained_context;
        out->weight_bytes = weights;
        out->kv_bytes_per_token = (uint64_t)pc.cfg.n_layers * 2 * pc.cfg.kv_dim * sizeof(float); /* f32 pool */
    }
    bundle_close(&b);
    return rc;
}
