/* hf_config.c — see hf_config.h.
 *
 * Defaults follow transformers' LlamaConfig / Qwen2Config / MistralConfig, so a config.json that
 * leaves a field out means here what it means there.
 */
#include "formats/hf_config.h"

#include "common/fileio.h"
#include "formats/json_check.h"
#include "formats/mxfp4.h"

#include <cjson/cJSON.h>
#include <float.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

void tkd_model_config_defaults(tkd_model_config *cfg)
{
    memset(cfg, 0, sizeof *cfg);
    cfg->arch = TKD_ARCH_LLAMA;
    cfg->vocab_size = 50257; /* GPT-2 byte-level BPE, the demo's tokenizer */
    cfg->hidden_size = 256;
    cfg->intermediate_size = 768;
    cfg->num_hidden_layers = 4;
    cfg->num_attention_heads = 4;
    cfg->num_key_value_heads = 2;
    cfg->head_dim = 64;
    cfg->max_position_embeddings = 1024;
    cfg->rms_norm_eps = 1e-5f;
    cfg->rope_theta = 10000.0;
    cfg->tie_word_embeddings = 1;
    cfg->attention_bias = 0;
    cfg->initializer_range = 0.02f;
    cfg->rope_scaling = TKD_ROPE_SCALING_NONE;
    cfg->bos_token_id = -1;
    cfg->eos_token_id = -1;
}

const char *tkd_arch_name(tkd_arch arch)
{
    switch (arch) {
    case TKD_ARCH_LLAMA: return "llama";
    case TKD_ARCH_QWEN2: return "qwen2";
    case TKD_ARCH_MISTRAL: return "mistral";
    case TKD_ARCH_QWEN3: return "qwen3";
    case TKD_ARCH_QWEN3_MOE: return "qwen3_moe";
    case TKD_ARCH_GPT_OSS: return "gpt_oss";
    }
    return "?";
}

const char *tkd_arch_class(tkd_arch arch)
{
    switch (arch) {
    case TKD_ARCH_LLAMA: return "LlamaForCausalLM";
    case TKD_ARCH_QWEN2: return "Qwen2ForCausalLM";
    case TKD_ARCH_MISTRAL: return "MistralForCausalLM";
    case TKD_ARCH_QWEN3: return "Qwen3ForCausalLM";
    case TKD_ARCH_QWEN3_MOE: return "Qwen3MoeForCausalLM";
    case TKD_ARCH_GPT_OSS: return "GptOssForCausalLM";
    }
    return "?";
}

int tkd_arch_qk_norm(tkd_arch arch) { return arch == TKD_ARCH_QWEN3 || arch == TKD_ARCH_QWEN3_MOE; }

int tkd_arch_sinks(tkd_arch arch) { return arch == TKD_ARCH_GPT_OSS; }

/* Architectures whose MLPs may be mixture-of-experts blocks. */
static int arch_moe(tkd_arch arch) { return arch == TKD_ARCH_QWEN3_MOE || arch == TKD_ARCH_GPT_OSS; }

int tkd_model_config_o_bias(const tkd_model_config *c)
{
    return c->attention_bias && (c->arch == TKD_ARCH_LLAMA || c->arch == TKD_ARCH_GPT_OSS);
}

int tkd_model_config_moe(const tkd_model_config *c, int l)
{
    return arch_moe(c->arch) && l >= 0 && l < TKD_MAX_MOE_LAYERS && c->layer_moe[l];
}

int tkd_model_config_has_moe(const tkd_model_config *c)
{
    for (int l = 0; l < c->num_hidden_layers && l < TKD_MAX_MOE_LAYERS; l++)
        if (tkd_model_config_moe(c, l))
            return 1;
    return 0;
}

/* Architectures whose config.json says "every layer slides or none" (one sliding_window for all:
 * Mistral's, and Qwen3-MoE's, whose model builds one mask for every layer). */
int tkd_arch_windows_uniform(tkd_arch arch) { return arch == TKD_ARCH_MISTRAL || arch == TKD_ARCH_QWEN3_MOE; }

/* The MoE fields where some layer is MoE: sizes the op takes (kernels/moe.h), layers within reach. */
static tkd_status validate_moe(const tkd_model_config *c)
{
    for (int l = 0; l < TKD_MAX_MOE_LAYERS; l++)
        if (c->layer_moe[l] && (!arch_moe(c->arch) || l >= c->num_hidden_layers))
            return tkd_error_set(TKD_ERR_CONFIG, "model config: layer %d is marked mixture-of-experts, which %s "
                                 "with %d layers cannot express", l, tkd_arch_class(c->arch), c->num_hidden_layers);
    if (c->arch == TKD_ARCH_GPT_OSS)
        for (int l = 0; l < c->num_hidden_layers && l < TKD_MAX_MOE_LAYERS; l++)
            if (!c->layer_moe[l]) /* GptOssDecoderLayer's MLP is always GptOssMLP */
                return tkd_error_set(TKD_ERR_CONFIG, "model config: layer %d of GptOssForCausalLM is dense: every "
                                     "gpt_oss layer is mixture-of-experts", l);
    if (!tkd_model_config_has_moe(c))
        return TKD_OK;
    if (c->arch == TKD_ARCH_GPT_OSS && !(c->swiglu_limit > 0))
        return tkd_error_set(TKD_ERR_CONFIG, "model config: swiglu_limit must be > 0 (got %g)", (double)c->swiglu_limit);
    if (c->num_hidden_layers > TKD_MAX_MOE_LAYERS)
        return tkd_error_set(TKD_ERR_UNSUPPORTED, "model config: mixture-of-experts over %d layers: at most %d layers",
                             c->num_hidden_layers, TKD_MAX_MOE_LAYERS);
    if (c->num_experts < 1 || c->num_experts_per_tok < 1 || c->num_experts_per_tok > c->num_experts ||
        c->moe_intermediate_size < 1)
        return tkd_error_set(TKD_ERR_CONFIG, "model config: mixture-of-experts needs num_experts >= 1, 1 <= "
                             "num_experts_per_tok <= num_experts and moe_intermediate_size >= 1 (got %d, %d, %d)",
                             c->num_experts, c->num_experts_per_tok, c->moe_intermediate_size);
    return TKD_OK;
}

int tkd_model_config_window(const tkd_model_config *c, int l)
{
    return c->sliding_window > 0 && l >= 0 && l < TKD_MAX_WINDOW_LAYERS && c->layer_sliding[l] ? c->sliding_window : 0;
}

tkd_status tkd_model_config_validate(const tkd_model_config *c)
{
#define POS(f)                                                                                      \
    if (!(c->f > 0))                                                                                \
        return tkd_error_set(TKD_ERR_CONFIG, "model config: " #f " must be > 0 (got %g)", (double)c->f);
    POS(vocab_size) POS(hidden_size) POS(intermediate_size) POS(num_hidden_layers)
    POS(num_attention_heads) POS(num_key_value_heads) POS(head_dim) POS(max_position_embeddings)
    POS(rms_norm_eps) POS(rope_theta)
#undef POS
    if (c->num_attention_heads % c->num_key_value_heads != 0)
        return tkd_error_set(TKD_ERR_CONFIG,
                             "model config: num_attention_heads (%d) is not a multiple of num_key_value_heads (%d)",
                             c->num_attention_heads, c->num_key_value_heads);
    if (c->head_dim % 2 != 0)
        return tkd_error_set(TKD_ERR_CONFIG, "model config: head_dim (%d) must be even for rotary embeddings",
                             c->head_dim);
    if (!(c->initializer_range >= 0))
        return tkd_error_set(TKD_ERR_CONFIG, "model config: initializer_range must be >= 0");
    if (c->arch == TKD_ARCH_QWEN2 && !c->attention_bias)
        return tkd_error_set(TKD_ERR_CONFIG, "model config: qwen2 always has q/k/v bias; attention_bias must be 1");
    if ((c->arch == TKD_ARCH_MISTRAL || tkd_arch_qk_norm(c->arch)) && c->attention_bias)
        return tkd_error_set(TKD_ERR_CONFIG, "model config: %s is built without attention bias here; attention_bias "
                             "must be 0", tkd_arch_name(c->arch));
    if (c->sliding_window < 0)
        return tkd_error_set(TKD_ERR_CONFIG, "model config: sliding_window must be >= 0 (0: none), got %d",
                             c->sliding_window);
    if (c->sliding_window > 0 && c->num_hidden_layers > TKD_MAX_WINDOW_LAYERS)
        return tkd_error_set(TKD_ERR_UNSUPPORTED, "model config: sliding windows over %d layers: at most %d layers "
                             "can slide", c->num_hidden_layers, TKD_MAX_WINDOW_LAYERS);
    for (int l = 0; c->sliding_window > 0 && l < c->num_hidden_layers; l++) {
        /* what config.json can say: Llama has no window, Mistral's covers every layer */
        int slides = tkd_model_config_window(c, l) > 0;
        if ((c->arch == TKD_ARCH_LLAMA && slides) || (tkd_arch_windows_uniform(c->arch) && !slides))
            return tkd_error_set(TKD_ERR_CONFIG, "model config: layer %d %s a sliding window, which %s cannot express",
                                 l, slides ? "has" : "lacks", tkd_arch_class(c->arch));
    }
    if (c->vocab_size > 0 && (c->bos_token_id >= c->vocab_size || c->eos_token_id >= c->vocab_size))
        return tkd_error_set(TKD_ERR_CONFIG, "model config: bos/eos token id (%d/%d) >= vocab_size %d",
                             c->bos_token_id, c->eos_token_id, c->vocab_size);
    TKD_TRY(validate_moe(c));
    if (c->rope_scaling == TKD_ROPE_SCALING_YARN &&
        (!(c->rope_factor > 0) || !(c->rope_beta_fast > 0) || !(c->rope_beta_slow > 0) || c->rope_original_max_pos <= 0 ||
         !(c->rope_attention_factor >= 0)))
        return tkd_error_set(TKD_ERR_CONFIG, "model config: yarn rope scaling needs factor > 0, beta_fast > 0, "
                             "beta_slow > 0, original_max_position_embeddings > 0 and attention_factor >= 0");
    if (c->rope_scaling == TKD_ROPE_SCALING_LLAMA3) {
        if (!(c->rope_factor >= 1.0) || !(c->rope_low_freq_factor > 0) ||
            !(c->rope_high_freq_factor > c->rope_low_freq_factor) || c->rope_original_max_pos <= 0)
            return tkd_error_set(TKD_ERR_CONFIG,
                                 "model config: llama3 rope scaling needs factor >= 1, 0 < low_freq_factor < "
                                 "high_freq_factor, original_max_position_embeddings > 0");
    }
    return TKD_OK;
}

/* ---- reading -------------------------------------------------------------------------------- */

static const cJSON *field(const cJSON *o, const char *name)
{
    const cJSON *j = cJSON_GetObjectItemCaseSensitive(o, name);
    return cJSON_IsNull(j) ? NULL : j; /* null means "use the default", as in transformers */
}

/* Integer field: *out keeps its value when absent; required fields error when absent. */
static tkd_status get_int(const char *path, const cJSON *o, const char *prefix, const char *name, int required,
                          int *out)
{
    const cJSON *j = field(o, name);
    if (!j) {
        if (required)
            return tkd_error_set(TKD_ERR_FORMAT, "%s: required field \"%s%s\" is missing", path, prefix, name);
        return TKD_OK;
    }
    if (!cJSON_IsNumber(j) || j->valuedouble != floor(j->valuedouble) || fabs(j->valuedouble) > 2147483647.0)
        return tkd_error_set(TKD_ERR_FORMAT, "%s: field \"%s%s\" must be an integer", path, prefix, name);
    *out = (int)j->valuedouble;
    return TKD_OK;
}

static tkd_status get_num(const char *path, const cJSON *o, const char *prefix, const char *name, int required,
                          double *out)
{
    const cJSON *j = field(o, name);
    if (!j) {
        if (required)
            return tkd_error_set(TKD_ERR_FORMAT, "%s: required field \"%s%s\" is missing", path, prefix, name);
        return TKD_OK;
    }
    /* 1e999 parses as inf, which nothing downstream (nor a config.json written back) can hold */
    if (!cJSON_IsNumber(j) || !isfinite(j->valuedouble))
        return tkd_error_set(TKD_ERR_FORMAT, "%s: field \"%s%s\" must be a finite number", path, prefix, name);
    *out = j->valuedouble;
    return TKD_OK;
}

/* get_num for a field stored as float: beyond FLT_MAX it would become inf (found by fuzz_hf_config). */
static tkd_status get_float(const char *path, const cJSON *o, const char *name, float *out)
{
    double v = *out;
    TKD_TRY(get_num(path, o, "", name, 0, &v));
    if (fabs(v) > FLT_MAX)
        return tkd_error_set(TKD_ERR_FORMAT, "%s: field \"%s\" = %g does not fit a float", path, name, v);
    *out = (float)v;
    return TKD_OK;
}

static tkd_status get_bool(const char *path, const cJSON *o, const char *name, int *out)
{
    const cJSON *j = field(o, name);
    if (!j)
        return TKD_OK;
    if (!cJSON_IsBool(j))
        return tkd_error_set(TKD_ERR_FORMAT, "%s: field \"%s\" must be true or false", path, name);
    *out = cJSON_IsTrue(j);
    return TKD_OK;
}

/* bos/eos: an int, a list of ints (the first is taken) or null. */
static tkd_status get_token_id(const char *path, const cJSON *o, const char *name, int *out)
{
    const cJSON *j = field(o, name);
    if (j && cJSON_IsArray(j))
        j = cJSON_GetArrayItem(j, 0);
    if (!j || cJSON_IsNull(j))
        return TKD_OK;
    if (!cJSON_IsNumber(j) || j->valuedouble != floor(j->valuedouble) || j->valuedouble < 0 ||
        j->valuedouble > 2147483647.0)
        return tkd_error_set(TKD_ERR_FORMAT, "%s: field \"%s\" must be a token id or a list of them", path, name);
    *out = (int)j->valuedouble;
    return TKD_OK;
}

static int has_architecture(const cJSON *root, const char *cls)
{
    const cJSON *a = field(root, "architectures"), *it;
    cJSON_ArrayForEach(it, a) if (cJSON_IsString(it) && strcmp(it->valuestring, cls) == 0) return 1;
    return 0;
}

static tkd_status read_arch(const char *path, const cJSON *root, tkd_arch *arch)
{
    const cJSON *mt = field(root, "model_type");
    const char *m = cJSON_IsString(mt) ? mt->valuestring : "";
    static const tkd_arch all[] = {TKD_ARCH_LLAMA, TKD_ARCH_QWEN2, TKD_ARCH_MISTRAL, TKD_ARCH_QWEN3,
                                   TKD_ARCH_QWEN3_MOE, TKD_ARCH_GPT_OSS};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++)
        if (strcmp(m, tkd_arch_name(all[i])) == 0 || (!*m && has_architecture(root, tkd_arch_class(all[i])))) {
            *arch = all[i];
            return TKD_OK;
        }
    /* A llama under another name computes like a llama when transformers builds it as one. */
    if (has_architecture(root, "LlamaForCausalLM")) {
        *arch = TKD_ARCH_LLAMA;
        return TKD_OK;
    }
    return tkd_error_set(TKD_ERR_UNSUPPORTED,
                         "%s: model_type \"%.64s\" is not supported (llama, qwen2, qwen3, qwen3_moe, gpt_oss, mistral, or "
                         "architectures "
                         "[\"LlamaForCausalLM\"])",
                         path, *m ? m : "(missing)");
}

/* YaRN's fields as transformers 5 reads them (standardize_rope_params, then
 * _compute_yarn_parameters): factor (required; null: max_position / original),
 * original_max_position_embeddings (a top-level field of that name wins, as standardize_rope_params
 * gives it priority; absent: max_position_embeddings), beta_fast / beta_slow (null or 0: 32 / 1),
 * truncate (default true), attention_factor (null: 0.1·ln(factor) + 1). mscale / mscale_all_dim
 * (DeepSeek's attention factor) and partial_rotary_factor change the maths: refused by name. */
static tkd_status read_yarn(const char *path, const cJSON *root, const cJSON *rp, const char *prefix,
                            tkd_model_config *c)
{
    static const char *refused[] = {"mscale", "mscale_all_dim", "partial_rotary_factor"};
    for (size_t i = 0; i < sizeof refused / sizeof refused[0]; i++) {
        double v = 0;
        TKD_TRY(get_num(path, rp, prefix, refused[i], 0, &v));
        if (v != 0 && !(strcmp(refused[i], "partial_rotary_factor") == 0 && v == 1.0))
            return tkd_error_set(TKD_ERR_UNSUPPORTED, "%s: %s%s = %g (yarn) is not supported", path, prefix,
                                 refused[i], v);
    }
    c->rope_scaling = TKD_ROPE_SCALING_YARN;
    c->rope_original_max_pos = c->max_position_embeddings;
    TKD_TRY(get_int(path, rp, prefix, "original_max_position_embeddings", 0, &c->rope_original_max_pos));
    TKD_TRY(get_int(path, root, "", "original_max_position_embeddings", 0, &c->rope_original_max_pos));
    if (!cJSON_GetObjectItemCaseSensitive(rp, "factor"))
        return tkd_error_set(TKD_ERR_FORMAT, "%s: required field \"%sfactor\" is missing", path, prefix);
    c->rope_factor = c->rope_original_max_pos > 0 ? (double)c->max_position_embeddings / c->rope_original_max_pos : 0;
    TKD_TRY(get_num(path, rp, prefix, "factor", 0, &c->rope_factor));
    c->rope_beta_fast = c->rope_beta_slow = c->rope_attention_factor = 0;
    TKD_TRY(get_num(path, rp, prefix, "beta_fast", 0, &c->rope_beta_fast));
    TKD_TRY(get_num(path, rp, prefix, "beta_slow", 0, &c->rope_beta_slow));
    TKD_TRY(get_num(path, rp, prefix, "attention_factor", 0, &c->rope_attention_factor));
    if (c->rope_beta_fast == 0) /* transformers: `get("beta_fast") or 32` */
        c->rope_beta_fast = 32.0;
    if (c->rope_beta_slow == 0)
        c->rope_beta_slow = 1.0;
    c->rope_truncate = 1;
    return get_bool(path, rp, "truncate", &c->rope_truncate);
}

void tkd_model_config_gpt_oss_yarn(tkd_model_config *c)
{
    c->rope_scaling = TKD_ROPE_SCALING_YARN;
    c->rope_factor = 32.0;
    c->rope_beta_fast = 32.0;
    c->rope_beta_slow = 1.0;
    c->rope_truncate = 0;
    c->rope_original_max_pos = 4096;
    c->rope_attention_factor = 0;
}

/* rope_scaling (older transformers) or rope_parameters (newer): "default"/null, "llama3" or "yarn". */
static tkd_status read_rope(const char *path, const cJSON *root, tkd_model_config *c)
{
    const char *key = "rope_parameters";
    const cJSON *rp = field(root, key);
    if (!rp) {
        key = "rope_scaling";
        rp = field(root, key);
    }
    TKD_TRY(get_num(path, root, "", "rope_theta", 0, &c->rope_theta));
    if (!rp && c->arch == TKD_ARCH_GPT_OSS)
        tkd_model_config_gpt_oss_yarn(c);
    if (!rp)
        return TKD_OK;
    if (!cJSON_IsObject(rp))
        return tkd_error_set(TKD_ERR_FORMAT, "%s: field \"%s\" must be an object or null", path, key);
    char prefix[32];
    snprintf(prefix, sizeof prefix, "%s.", key);
    TKD_TRY(get_num(path, rp, prefix, "rope_theta", 0, &c->rope_theta));
    const cJSON *ty = field(rp, "rope_type");
    if (!ty)
        ty = field(rp, "type"); /* the older spelling */
    if (ty && !cJSON_IsString(ty))
        return tkd_error_set(TKD_ERR_FORMAT, "%s: field \"%srope_type\" must be a string", path, prefix);
    const char *t = ty ? ty->valuestring : "default";
    if (strcmp(t, "default") == 0) {
        c->rope_scaling = TKD_ROPE_SCALING_NONE;
        return TKD_OK;
    }
    if (strcmp(t, "yarn") == 0)
        return read_yarn(path, root, rp, prefix, c);
    if (strcmp(t, "llama3") != 0)
        return tkd_error_set(TKD_ERR_UNSUPPORTED,
                             "%s: %srope_type \"%.32s\" is not supported (default, llama3 or yarn); it changes the "
                             "positional encoding",
                             path, prefix, t);
    c->rope_scaling = TKD_ROPE_SCALING_LLAMA3;
    TKD_TRY(get_num(path, rp, prefix, "factor", 1, &c->rope_factor));
    TKD_TRY(get_num(path, rp, prefix, "low_freq_factor", 1, &c->rope_low_freq_factor));
    TKD_TRY(get_num(path, rp, prefix, "high_freq_factor", 1, &c->rope_high_freq_factor));
    return get_int(path, rp, prefix, "original_max_position_embeddings", 1, &c->rope_original_max_pos);
}

/* Fields that change the maths and that we do not implement: refuse them by name. */
static tkd_status refuse_unsupported(const char *path, const cJSON *root, const tkd_model_config *c)
{
    const cJSON *act = field(root, "hidden_act");
    if (act && (!cJSON_IsString(act) || strcmp(act->valuestring, "silu") != 0))
        return tkd_error_set(TKD_ERR_UNSUPPORTED, "%s: hidden_act \"%.32s\" is not supported (only silu)", path,
                             cJSON_IsString(act) ? act->valuestring : "?");
    static const char *moe[] = {"num_local_experts", "num_experts", "n_routed_experts"};
    for (size_t i = 0; i < sizeof moe / sizeof moe[0] && !arch_moe(c->arch); i++) {
        int n = 0;
        TKD_TRY(get_int(path, root, "", moe[i], 0, &n));
        if (n > 0)
            return tkd_error_set(TKD_ERR_UNSUPPORTED,
                                 "%s: %s = %d: mixture-of-experts models are not supported as model_type %s (only "
                                 "qwen3_moe and gpt_oss)", path, moe[i], n, tkd_arch_name(c->arch));
    }
    double prf = 1.0; /* transformers moves a top-level partial_rotary_factor into every rope type */
    TKD_TRY(get_num(path, root, "", "partial_rotary_factor", 0, &prf));
    if (prf != 1.0)
        return tkd_error_set(TKD_ERR_UNSUPPORTED, "%s: partial_rotary_factor = %g is not supported (only 1: RoPE on "
                             "the whole head)", path, prf);
    double alpha = 1.702;
    TKD_TRY(get_num(path, root, "", "swiglu_alpha", 0, &alpha));
    if (c->arch == TKD_ARCH_GPT_OSS && alpha != 1.702) /* GptOssExperts' alpha, fixed in kernels/moe.h */
        return tkd_error_set(TKD_ERR_UNSUPPORTED, "%s: swiglu_alpha = %g is not supported (only 1.702)", path, alpha);
    int mlp_bias = 0, tp = 1;
    TKD_TRY(get_bool(path, root, "mlp_bias", &mlp_bias));
    if (mlp_bias)
        return tkd_error_set(TKD_ERR_UNSUPPORTED, "%s: mlp_bias = true is not supported", path);
    TKD_TRY(get_int(path, root, "", "pretraining_tp", 0, &tp));
    if (tp > 1)
        return tkd_error_set(TKD_ERR_UNSUPPORTED, "%s: pretraining_tp = %d is not supported (only 1)", path, tp);
    if (tkd_arch_qk_norm(c->arch) && c->attention_bias)
        return tkd_error_set(TKD_ERR_UNSUPPORTED,
                             "%s: attention_bias = true on %s (biases on q/k/v and o_proj) is not supported", path,
                             tkd_arch_name(c->arch));
    return TKD_OK;
}

/* ---- Qwen3-MoE ----------------------------------------------------------------------------- */

/* mlp_only_layers: a list of layer indices (null or absent: none) into dense[]; an index outside
 * [0, L) names no layer, and transformers ignores it, so do we. */
static tkd_status read_mlp_only(const char *path, const cJSON *root, int L, unsigned char *dense)
{
    const cJSON *a = field(root, "mlp_only_layers"), *it;
    if (!a)
        return TKD_OK;
    if (!cJSON_IsArray(a))
        return tkd_error_set(TKD_ERR_FORMAT, "%s: field \"mlp_only_layers\" must be a list of layer indices", path);
    int i = 0;
    cJSON_ArrayForEach(it, a) {
        if (!cJSON_IsNumber(it) || it->valuedouble != floor(it->valuedouble))
            return tkd_error_set(TKD_ERR_FORMAT, "%s: mlp_only_layers[%d] must be an integer layer index", path, i);
        if (it->valuedouble >= 0 && it->valuedouble < L && it->valuedouble < TKD_MAX_MOE_LAYERS)
            dense[(int)it->valuedouble] = 1;
        i++;
    }
    return TKD_OK;
}

/* The experts' count under its field name or its transformers attribute_map alias (Qwen3-MoE:
 * num_experts / num_local_experts; gpt-oss the other way round): the alias wins when only it is
 * given; both given and different is refused. dflt when neither is. */
static tkd_status read_expert_count(const char *path, const cJSON *root, const char *name, const char *alias,
                                    int dflt, int *out)
{
    int n = dflt, a = -1;
    TKD_TRY(get_int(path, root, "", name, 0, &n));
    TKD_TRY(get_int(path, root, "", alias, 0, &a));
    if (a >= 0 && field(root, name) && a != n)
        return tkd_error_set(TKD_ERR_FORMAT, "%s: %s = %d and %s = %d disagree", path, name, n, alias, a);
    *out = a >= 0 ? a : n;
    return TKD_OK;
}

/* Qwen3MoeConfig's fields, with its defaults, and Qwen3MoeDecoderLayer's rule: layer l is MoE when
 * l is not in mlp_only_layers, num_experts > 0 and (l + 1) % decoder_sparse_step == 0. The
 * experts' count is num_experts (num_local_experts, its attribute_map alias, is read too).
 * output_router_logits and router_aux_loss_coef only shape training's auxiliary loss: ignored. */
static tkd_status read_moe(const char *path, const cJSON *root, tkd_model_config *c)
{
    int step = 1, shared = 0, L = c->num_hidden_layers;
    TKD_TRY(read_expert_count(path, root, "num_experts", "num_local_experts", 128, &c->num_experts));
    c->num_experts_per_tok = 8;
    c->moe_intermediate_size = 768;
    TKD_TRY(get_int(path, root, "", "num_experts_per_tok", 0, &c->num_experts_per_tok));
    TKD_TRY(get_int(path, root, "", "moe_intermediate_size", 0, &c->moe_intermediate_size));
    TKD_TRY(get_bool(path, root, "norm_topk_prob", &c->norm_topk_prob));
    TKD_TRY(get_int(path, root, "", "decoder_sparse_step", 0, &step));
    TKD_TRY(get_int(path, root, "", "shared_expert_intermediate_size", 0, &shared));
    if (shared > 0) /* Qwen2-MoE's always-on expert: Qwen3-MoE has none, and we would drop it */
        return tkd_error_set(TKD_ERR_UNSUPPORTED, "%s: shared_expert_intermediate_size = %d: a shared expert "
                             "(Qwen2-MoE) is not part of qwen3_moe and is not supported", path, shared);
    if (c->num_experts < 0)
        return tkd_error_set(TKD_ERR_FORMAT, "%s: field \"num_experts\" must be >= 0 (got %d)", path, c->num_experts);
    if (step < 1) /* transformers would divide by it */
        return tkd_error_set(TKD_ERR_FORMAT, "%s: field \"decoder_sparse_step\" must be >= 1 (got %d)", path, step);
    unsigned char dense[TKD_MAX_MOE_LAYERS] = {0};
    TKD_TRY(read_mlp_only(path, root, L, dense));
    for (int l = 0; l < L && c->num_experts > 0; l++) {
        if (dense[l < TKD_MAX_MOE_LAYERS ? l : 0] || (l + 1) % step != 0)
            continue;
        if (l >= TKD_MAX_MOE_LAYERS)
            return tkd_error_set(TKD_ERR_UNSUPPORTED, "%s: layer %d is mixture-of-experts: at most %d layers are "
                                 "supported", path, l, TKD_MAX_MOE_LAYERS);
        c->layer_moe[l] = 1;
    }
    return TKD_OK;
}

/* GptOssConfig's MoE fields: every layer is GptOssMLP with num_local_experts experts (num_experts,
 * its attribute_map alias, is read too), num_experts_per_tok (default 4) and experts of
 * intermediate_size. The original release's "experts_per_token" is not a GptOssConfig field and
 * transformers ignores it: so do we. */
static tkd_status read_gpt_oss_moe(const char *path, const cJSON *root, tkd_model_config *c)
{
    TKD_TRY(read_expert_count(path, root, "num_local_experts", "num_experts", 128, &c->num_experts));
    c->num_experts_per_tok = 4;
    TKD_TRY(get_int(path, root, "", "num_experts_per_tok", 0, &c->num_experts_per_tok));
    c->moe_intermediate_size = c->intermediate_size;
    /* transformers 5.17's GptOssExperts clamps at a fixed 7.0 whatever swiglu_limit says (every released
     * gpt-oss config says 7.0): the field is read for its type only, and the layer computes what
     * transformers computes (docs/model.md) */
    float limit = 7.0f;
    TKD_TRY(get_float(path, root, "swiglu_limit", &limit));
    c->swiglu_limit = 7.0f;
    if (c->num_hidden_layers > TKD_MAX_MOE_LAYERS)
        return tkd_error_set(TKD_ERR_UNSUPPORTED, "%s: %d mixture-of-experts layers: at most %d are supported", path,
                             c->num_hidden_layers, TKD_MAX_MOE_LAYERS);
    for (int l = 0; l < c->num_hidden_layers; l++)
        c->layer_moe[l] = 1;
    return TKD_OK;
}

/* quantization_config (formats/mxfp4.h): mxfp4 on gpt-oss, whose experts then may be stored as
 * _blocks/_scales pairs; another quant_method is refused there by name; mxfp4 elsewhere too (only
 * gpt-oss's experts are read in that layout). modules_to_not_convert is not needed: which tensors
 * are MXFP4 is what the checkpoint holds. */
static tkd_status read_quant(const char *path, const cJSON *root, tkd_model_config *c)
{
    tkd_mxfp4_quant q;
    memset(&q, 0, sizeof q);
    TKD_TRY(tkd_mxfp4_quant_parse(field(root, "quantization_config"), path, &q));
    c->quant_mxfp4 = q.mxfp4;
    tkd_mxfp4_quant_free(&q);
    if (c->quant_mxfp4 && c->arch != TKD_ARCH_GPT_OSS)
        return tkd_error_set(TKD_ERR_UNSUPPORTED, "%s: quantization_config.quant_method \"mxfp4\" on %s is not "
                             "supported (only gpt_oss's experts)", path, tkd_arch_name(c->arch));
    return TKD_OK;
}

/* ---- sliding windows ------------------------------------------------------------------------ */

/* layer_types (transformers >= 4.54 spells the per-layer choice out): flags[l] = 1 for
 * "sliding_attention", 0 for "full_attention"; *present = 0 when the field is absent. */
static tkd_status read_layer_types(const char *path, const cJSON *root, const tkd_model_config *c,
                                   unsigned char *flags, int *present)
{
    const cJSON *lt = field(root, "layer_types"), *it;
    *present = lt != NULL;
    if (!lt)
        return TKD_OK;
    if (!cJSON_IsArray(lt))
        return tkd_error_set(TKD_ERR_FORMAT, "%s: field \"layer_types\" must be a list of strings", path);
    int n = cJSON_GetArraySize(lt), i = 0;
    if (n != c->num_hidden_layers)
        return tkd_error_set(TKD_ERR_FORMAT, "%s: layer_types has %d entries for num_hidden_layers %d", path, n,
                             c->num_hidden_layers);
    cJSON_ArrayForEach(it, lt) {
        const char *t = cJSON_IsString(it) ? it->valuestring : "?";
        int slides = strcmp(t, "sliding_attention") == 0;
        if (!slides && strcmp(t, "full_attention") != 0)
            return tkd_error_set(TKD_ERR_UNSUPPORTED,
                                 "%s: layer_types[%d] = \"%.32s\": only full_attention and sliding_attention "
                                 "layers are supported", path, i, t);
        if (i < TKD_MAX_WINDOW_LAYERS)
            flags[i] = (unsigned char)slides;
        else if (slides)
            return tkd_error_set(TKD_ERR_UNSUPPORTED, "%s: layer_types[%d] slides: at most %d layers can slide", path,
                                 i, TKD_MAX_WINDOW_LAYERS);
        i++;
    }
    return TKD_OK;
}

/* sliding_window as transformers reads it: a positive integer, or null (no window). *sw keeps its
 * default when the key is absent (Mistral and Qwen2/3 default to 4096 there). */
static tkd_status read_window_size(const char *path, const cJSON *root, int *sw)
{
    const cJSON *j = cJSON_GetObjectItemCaseSensitive(root, "sliding_window");
    if (cJSON_IsNull(j)) {
        *sw = 0;
        return TKD_OK;
    }
    TKD_TRY(get_int(path, root, "", "sliding_window", 0, sw));
    if (j && *sw <= 0) /* a window of 0 keys would leave every query nothing to attend */
        return tkd_error_set(TKD_ERR_FORMAT, "%s: field \"sliding_window\" must be a positive integer or null (got %d)",
                             path, *sw);
    return TKD_OK;
}

/* Which layers slide, following each configuration class of transformers 5:
 *   mistral — every layer, with sliding_window (4096 when the key is absent; null: none); MistralConfig
 *             does not read layer_types (it only warns), so neither do we;
 *   qwen3_moe — every layer alike, when use_sliding_window (Qwen3MoeConfig keeps sliding_window
 *             only then; the model masks all layers with one mask); layer_types must agree;
 *   qwen2/3 — sliding_window counts only with use_sliding_window; layer_types when present, else the
 *             layers >= max_window_layers (default 28); a sliding layer without a window in effect is
 *             refused (transformers' mask builder raises there);
 *   gpt_oss — GptOssConfig: layer_types (default: even layers sliding_attention, odd full), the window
 *             sliding_window (default 128; null with a sliding layer is refused, as for qwen2/3);
 *   llama   — LlamaForCausalLM has no window: a window that would mask is refused, as before. */
static tkd_status read_windows(const char *path, const cJSON *root, tkd_model_config *c)
{
    int gpt_oss = c->arch == TKD_ARCH_GPT_OSS;
    int sw = c->arch == TKD_ARCH_LLAMA ? 0 : gpt_oss ? 128 : 4096, use_sw = gpt_oss, mwl = 28, has_lt = 0;
    unsigned char lt[TKD_MAX_WINDOW_LAYERS] = {0};
    TKD_TRY(read_window_size(path, root, &sw));
    TKD_TRY(get_bool(path, root, "use_sliding_window", &use_sw));
    TKD_TRY(get_int(path, root, "", "max_window_layers", 0, &mwl));
    TKD_TRY(read_layer_types(path, root, c, lt, &has_lt));
    int L = c->num_hidden_layers, any = 0;
    if (c->arch == TKD_ARCH_LLAMA) {
        for (int l = 0; l < L && l < TKD_MAX_WINDOW_LAYERS; l++)
            any |= lt[l];
        if ((sw > 0 && sw < c->max_position_embeddings) || any)
            return tkd_error_set(TKD_ERR_UNSUPPORTED,
                                 "%s: sliding_window = %d / sliding_attention layers on a llama: LlamaForCausalLM "
                                 "has no sliding window, so this checkpoint is not what it claims",
                                 path, sw);
        return TKD_OK;
    }
    if (tkd_arch_windows_uniform(c->arch)) {
        if (c->arch == TKD_ARCH_QWEN3_MOE && !use_sw)
            sw = 0;
        for (int l = 0; l < L && l < TKD_MAX_WINDOW_LAYERS; l++) {
            /* Qwen3MoeModel builds one mask for all layers: a per-layer list that says otherwise
             * would be read by a person and ignored by transformers */
            if (c->arch == TKD_ARCH_QWEN3_MOE && has_lt && lt[l] != (sw > 0))
                return tkd_error_set(TKD_ERR_UNSUPPORTED,
                                     "%s: layer_types[%d] is %s, but Qwen3MoeForCausalLM masks every layer alike "
                                     "(use_sliding_window and sliding_window): per-layer windows are not supported",
                                     path, l, lt[l] ? "sliding_attention" : "full_attention");
            lt[l] = (unsigned char)(sw > 0);
        }
    } else {
        if (!use_sw)
            sw = 0;
        for (int l = 0; l < L && !has_lt && l < TKD_MAX_WINDOW_LAYERS; l++) /* gpt-oss: even layers slide */
            lt[l] = (unsigned char)(gpt_oss ? l % 2 == 0 : sw > 0 && l >= mwl);
        for (int l = 0; l < L && l < TKD_MAX_WINDOW_LAYERS; l++)
            if (lt[l] && sw == 0)
                return tkd_error_set(TKD_ERR_FORMAT,
                                     "%s: layer_types[%d] is sliding_attention but no sliding window is in effect "
                                     "(use_sliding_window false or sliding_window null)", path, l);
        if (sw > 0 && !has_lt && L > TKD_MAX_WINDOW_LAYERS && (mwl < L || gpt_oss))
            return tkd_error_set(TKD_ERR_UNSUPPORTED, "%s: sliding windows over %d layers: at most %d layers can slide",
                                 path, L, TKD_MAX_WINDOW_LAYERS);
    }
    for (int l = 0; l < L && l < TKD_MAX_WINDOW_LAYERS; l++)
        any |= lt[l];
    if (!any)
        return TKD_OK;
    c->sliding_window = sw;
    memcpy(c->layer_sliding, lt, sizeof lt);
    return TKD_OK;
}

static tkd_status read_fields(const char *path, const cJSON *root, tkd_model_config *c)
{
    memset(c, 0, sizeof *c);
    TKD_TRY(read_arch(path, root, &c->arch));
    TKD_TRY(get_int(path, root, "", "vocab_size", 1, &c->vocab_size));
    TKD_TRY(get_int(path, root, "", "hidden_size", 1, &c->hidden_size));
    TKD_TRY(get_int(path, root, "", "intermediate_size", 1, &c->intermediate_size));
    TKD_TRY(get_int(path, root, "", "num_hidden_layers", 1, &c->num_hidden_layers));
    TKD_TRY(get_int(path, root, "", "num_attention_heads", 1, &c->num_attention_heads));
    c->num_key_value_heads = c->num_attention_heads;
    TKD_TRY(get_int(path, root, "", "num_key_value_heads", 0, &c->num_key_value_heads));
    /* Qwen3Config's head_dim is a field of its own (128), not hidden_size / heads */
    c->head_dim = c->arch == TKD_ARCH_QWEN3 ? 128 : c->arch == TKD_ARCH_GPT_OSS ? 64
                  : c->num_attention_heads > 0 ? c->hidden_size / c->num_attention_heads : 0;
    TKD_TRY(get_int(path, root, "", "head_dim", 0, &c->head_dim));
    c->max_position_embeddings = c->arch == TKD_ARCH_LLAMA                                 ? 2048
                                 : c->arch == TKD_ARCH_QWEN2 || tkd_arch_qk_norm(c->arch) ? 32768
                                                                                         : 131072;
    TKD_TRY(get_int(path, root, "", "max_position_embeddings", 0, &c->max_position_embeddings));
    c->rms_norm_eps = c->arch == TKD_ARCH_GPT_OSS ? 1e-5f : 1e-6f;
    c->initializer_range = 0.02f;
    TKD_TRY(get_float(path, root, "rms_norm_eps", &c->rms_norm_eps));
    TKD_TRY(get_float(path, root, "initializer_range", &c->initializer_range));
    TKD_TRY(get_bool(path, root, "tie_word_embeddings", &c->tie_word_embeddings));
    c->attention_bias = c->arch == TKD_ARCH_GPT_OSS; /* GptOssConfig: true */
    if (c->arch == TKD_ARCH_LLAMA || tkd_arch_qk_norm(c->arch) || c->arch == TKD_ARCH_GPT_OSS)
        TKD_TRY(get_bool(path, root, "attention_bias", &c->attention_bias));
    else
        c->attention_bias = c->arch == TKD_ARCH_QWEN2; /* Qwen2: always; Mistral: never */
    c->rope_theta = c->arch == TKD_ARCH_GPT_OSS ? 150000.0 : 10000.0;
    TKD_TRY(read_rope(path, root, c));
    c->bos_token_id = c->eos_token_id = -1;
    TKD_TRY(get_token_id(path, root, "bos_token_id", &c->bos_token_id));
    TKD_TRY(get_token_id(path, root, "eos_token_id", &c->eos_token_id));
    TKD_TRY(refuse_unsupported(path, root, c));
    TKD_TRY(read_quant(path, root, c));
    if (c->arch == TKD_ARCH_QWEN3_MOE)
        TKD_TRY(read_moe(path, root, c));
    if (c->arch == TKD_ARCH_GPT_OSS)
        TKD_TRY(read_gpt_oss_moe(path, root, c));
    return read_windows(path, root, c);
}

tkd_status tkd_hf_config_parse(const char *text, size_t len, const char *path, tkd_model_config *cfg)
{
    const char *end = NULL;
    cJSON *root = cJSON_ParseWithLengthOpts(text, len, &end, 0);
    if (!root || !cJSON_IsObject(root)) {
        int line = 0, col = 0;
        tkd_json_line_col(text, len, end && root == NULL ? (size_t)(end - text) : 0, &line, &col);
        cJSON_Delete(root);
        return tkd_error_set(TKD_ERR_FORMAT, "%s:%d:%d: not a JSON object (config.json expected)", path, line, col);
    }
    tkd_model_config c;
    tkd_status st = tkd_json_unique_keys(root, text, len, path);
    if (st == TKD_OK)
        st = read_fields(path, root, &c);
    cJSON_Delete(root);
    if (st == TKD_OK && (st = tkd_model_config_validate(&c)) != TKD_OK)
        tkd_error_prefix(st, "%s", path);
    if (st == TKD_OK)
        *cfg = c;
    return st;
}

tkd_status tkd_hf_config_read(const char *path, tkd_model_config *cfg)
{
    char *text = NULL;
    size_t len = 0;
    TKD_TRY(tkd_read_input(path, "model config", (void **)&text, &len));
    tkd_status st = tkd_hf_config_parse(text, len, path, cfg);
    free(text);
    return st;
}

/* ---- writing -------------------------------------------------------------------------------- */
