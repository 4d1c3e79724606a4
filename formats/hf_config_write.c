/* hf_config_write.c — see hf_config.h: tkd_hf_config_write, a model config as the config.json
 * transformers reads back (the reading side is hf_config.c). */
#include "formats/hf_config.h"

#include "common/fileio.h"

#include <cjson/cJSON.h>
#include <float.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* The shortest decimal that reads back as the same float ("1e-05", not "9.99999974737875e-06"),
 * so Python sees the value the user wrote. */
static void add_float(cJSON *o, const char *name, float v)
{
    char buf[48];
    for (int p = 1; p <= 9; p++) {
        snprintf(buf, sizeof buf, "%.*g", p, (double)v);
        if (strtof(buf, NULL) == v)
            break;
    }
    cJSON_AddRawToObject(o, name, buf);
}

static void add_double(cJSON *o, const char *name, double v)
{
    char buf[48];
    if (v == floor(v) && fabs(v) < 1e15) { /* 500000.0, not 5e+05 */
        snprintf(buf, sizeof buf, "%.1f", v);
        cJSON_AddRawToObject(o, name, buf);
        return;
    }
    for (int p = 1; p <= 17; p++) {
        snprintf(buf, sizeof buf, "%.*g", p, v);
        if (strtod(buf, NULL) == v)
            break;
    }
    /* keep it a float in Python (rope_theta: 10000.0, not 10000) */
    if (!strpbrk(buf, ".eEn"))
        strcat(buf, ".0");
    cJSON_AddRawToObject(o, name, buf);
}

static void add_token(cJSON *o, const char *name, int id)
{
    if (id >= 0)
        cJSON_AddNumberToObject(o, name, id);
    else
        cJSON_AddNullToObject(o, name);
}

/* The window fields as the architecture's configuration class reads them back (read_windows):
 * Mistral's one sliding_window (Qwen3-MoE's with use_sliding_window), or Qwen2/3's
 * use_sliding_window + sliding_window + max_window_layers (the first sliding layer) with
 * layer_types spelled out, which transformers 5 reads in preference (any pattern of sliding
 * layers, not only a suffix). */
static void add_windows(cJSON *o, const tkd_model_config *c)
{
    int L = c->num_hidden_layers, first = L;
    for (int l = L - 1; l >= 0; l--)
        if (tkd_model_config_window(c, l))
            first = l;
    if (first == L)
        cJSON_AddNullToObject(o, "sliding_window");
    else
        cJSON_AddNumberToObject(o, "sliding_window", c->sliding_window);
    if (c->arch == TKD_ARCH_QWEN3_MOE)
        cJSON_AddBoolToObject(o, "use_sliding_window", first < L);
    if (tkd_arch_windows_uniform(c->arch))
        return; /* every layer slides or none (tkd_model_config_validate) */
    if (c->arch != TKD_ARCH_GPT_OSS) { /* gpt-oss: layer_types always (absent, even layers slide) */
        cJSON_AddBoolToObject(o, "use_sliding_window", first < L);
        cJSON_AddNumberToObject(o, "max_window_layers", first);
        if (first == L)
            return;
    }
    cJSON *lt = cJSON_AddArrayToObject(o, "layer_types");
    for (int l = 0; lt && l < L; l++)
        cJSON_AddItemToArray(lt, cJSON_CreateString(tkd_model_config_window(c, l) ? "sliding_attention"
                                                                                  : "full_attention"));
}

/* Qwen3-MoE's fields: which layers are dense is spelled out as mlp_only_layers with
 * decoder_sparse_step 1, which says any pattern read_moe can read. */
static void add_moe(cJSON *o, const tkd_model_config *c)
{
    cJSON_AddNumberToObject(o, "num_experts", c->num_experts);
    cJSON_AddNumberToObject(o, "num_experts_per_tok", c->num_experts_per_tok);
    cJSON_AddNumberToObject(o, "moe_intermediate_size", c->moe_intermediate_size);
    cJSON_AddBoolToObject(o, "norm_topk_prob", c->norm_topk_prob != 0);
    cJSON_AddNumberToObject(o, "decoder_sparse_step", 1);
    cJSON *dense = cJSON_AddArrayToObject(o, "mlp_only_layers");
    for (int l = 0; dense && l < c->num_hidden_layers; l++)
        if (!tkd_model_config_moe(c, l))
            cJSON_AddItemToArray(dense, cJSON_CreateNumber(l));
    cJSON_AddFalseToObject(o, "output_router_logits");
}

/* gpt-oss's MoE fields (every layer MoE), and its quantization_config when read with one. */
static void add_gpt_oss(cJSON *o, const tkd_model_config *c)
{
    cJSON_AddNumberToObject(o, "num_local_experts", c->num_experts);
    cJSON_AddNumberToObject(o, "num_experts_per_tok", c->num_experts_per_tok);
    add_float(o, "swiglu_limit", c->swiglu_limit);
    cJSON_AddFalseToObject(o, "output_router_logits");
    if (!c->quant_mxfp4)
        return;
    cJSON *q = cJSON_AddObjectToObject(o, "quantization_config");
    if (q)
        cJSON_AddStringToObject(q, "quant_method", "mxfp4");
}

static cJSON *config_json(const tkd_model_config *c, const char *dtype_name)
{
    cJSON *o = cJSON_CreateObject();
    if (!o)
        return NULL;
    const char *cls = tkd_arch_class(c->arch);
    cJSON_AddItemToObject(o, "architectures", cJSON_CreateStringArray(&cls, 1));
    cJSON_AddStringToObject(o, "model_type", tkd_arch_name(c->arch));
    cJSON_AddNumberToObject(o, "vocab_size", c->vocab_size);
    cJSON_AddNumberToObject(o, "hidden_size", c->hidden_size);
    cJSON_AddNumberToObject(o, "intermediate_size", c->intermediate_size);
    cJSON_AddNumberToObject(o, "num_hidden_layers", c->num_hidden_layers);
    cJSON_AddNumberToObject(o, "num_attention_heads", c->num_attention_heads);
    cJSON_AddNumberToObject(o, "num_key_value_heads", c->num_key_value_heads);
    cJSON_AddNumberToObject(o, "head_dim", c->head_dim);
    cJSON_AddStringToObject(o, "hidden_act", "silu");
    cJSON_AddNumberToObject(o, "max_position_embeddings", c->max_position_embeddings);
    add_float(o, "rms_norm_eps", c->rms_norm_eps);
    add_float(o, "initializer_range", c->initializer_range);
    add_double(o, "rope_theta", c->rope_theta);
    if (c->rope_scaling == TKD_ROPE_SCALING_LLAMA3) {
        cJSON *rs = cJSON_AddObjectToObject(o, "rope_scaling");
        if (rs) {
            cJSON_AddStringToObject(rs, "rope_type", "llama3");
            add_double(rs, "factor", c->rope_factor);
            add_double(rs, "low_freq_factor", c->rope_low_freq_factor);
            add_double(rs, "high_freq_factor", c->rope_high_freq_factor);
            cJSON_AddNumberToObject(rs, "original_max_position_embeddings", c->rope_original_max_pos);
        }
    } else if (c->rope_scaling == TKD_ROPE_SCALING_YARN) {
        cJSON *rs = cJSON_AddObjectToObject(o, "rope_scaling");
        if (rs) {
            cJSON_AddStringToObject(rs, "rope_type", "yarn");
            add_double(rs, "factor", c->rope_factor);
            add_double(rs, "beta_fast", c->rope_beta_fast);
            add_double(rs, "beta_slow", c->rope_beta_slow);
            cJSON_AddBoolToObject(rs, "truncate", c->rope_truncate != 0);
            if (c->rope_attention_factor > 0)
                add_double(rs, "attention_factor", c->rope_attention_factor);
            cJSON_AddNumberToObject(rs, "original_max_position_embeddings", c->rope_original_max_pos);
        }
    } else if (c->arch == TKD_ARCH_GPT_OSS) { /* null would mean GptOssConfig's default YaRN */
        cJSON *rs = cJSON_AddObjectToObject(o, "rope_scaling");
        if (rs)
            cJSON_AddStringToObject(rs, "rope_type", "default");
    } else {
        cJSON_AddNullToObject(o, "rope_scaling");
    }
    cJSON_AddBoolToObject(o, "tie_word_embeddings", c->tie_word_embeddings != 0);
    if (c->arch == TKD_ARCH_LLAMA || tkd_arch_qk_norm(c->arch) || c->arch == TKD_ARCH_GPT_OSS)
        cJSON_AddBoolToObject(o, "attention_bias", c->attention_bias != 0);
    if (c->arch == TKD_ARCH_QWEN3_MOE)
        add_moe(o, c);
    if (c->arch == TKD_ARCH_GPT_OSS)
        add_gpt_oss(o, c);
    if (c->arch == TKD_ARCH_LLAMA) {
        cJSON_AddFalseToObject(o, "mlp_bias");
        cJSON_AddNumberToObject(o, "pretraining_tp", 1);
    } else {
        add_windows(o, c);
    }
    cJSON_AddRawToObject(o, "attention_dropout", "0.0");
    add_token(o, "bos_token_id", c->bos_token_id);
    add_token(o, "eos_token_id", c->eos_token_id);
    cJSON_AddStringToObject(o, "torch_dtype", dtype_name);
    cJSON_AddStringToObject(o, "transformers_version", "4.46.0");
    cJSON_AddTrueToObject(o, "use_cache");
    return o;
}

tkd_status tkd_hf_config_write(const char *path, const tkd_model_config *cfg, const char *dtype_name)
{
    if (!dtype_name || (strcmp(dtype_name, "float32") != 0 && strcmp(dtype_name, "bfloat16") != 0))
        return tkd_error_set(TKD_ERR_INVALID_ARG, "%s: torch_dtype must be \"float32\" or \"bfloat16\"", path);
    tkd_status st = tkd_model_config_validate(cfg);
    if (st != TKD_OK)
        return tkd_error_prefix(st, "%s", path);
    cJSON *o = config_json(cfg, dtype_name);
    char *text = o ? cJSON_Print(o) : NULL;
    cJSON_Delete(o);
    if (!text)
        return tkd_error_set(TKD_ERR_NOMEM, "%s: out of memory", path);
    size_t n = strlen(text);
    char *withnl = malloc(n + 2);
    if (!withnl) {
        free(text);
        return tkd_error_set(TKD_ERR_NOMEM, "%s: out of memory", path);
    }
    memcpy(withnl, text, n);
    memcpy(withnl + n, "\n", 2);
    free(text);
    st = tkd_file_write_atomic(path, withnl, n + 1);
    free(withnl);
    return st;
}
