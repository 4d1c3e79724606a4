/* hf_config.h — the Llama-family architecture description, read from / written to a Hugging Face
 * config.json (cJSON). Covers model_type llama, qwen2, mistral and look-alikes (e.g. SmolLM is
 * model_type llama). A field that changes the maths and is not supported (sliding window in use,
 * MoE experts, hidden_act other than silu, unknown rope_scaling type) is TKD_ERR_UNSUPPORTED with a
 * message naming the field. See docs/model.md.
 */
#ifndef TKD_HF_CONFIG_H
#define TKD_HF_CONFIG_H

#include <stddef.h>
#include <stdint.h>

#include "common/status.h"

typedef enum tkd_arch {
    TKD_ARCH_LLAMA = 0,   /* LlamaForCausalLM (also SmolLM and other llama look-alikes) */
    TKD_ARCH_QWEN2 = 1,   /* Qwen2ForCausalLM: q/k/v bias always on */
    TKD_ARCH_MISTRAL = 2, /* MistralForCausalLM with sliding_window null or >= max positions */
} tkd_arch;

typedef enum tkd_rope_scaling {
    TKD_ROPE_SCALING_NONE = 0,
    TKD_ROPE_SCALING_LLAMA3 = 1,
} tkd_rope_scaling;

typedef struct tkd_model_config {
    tkd_arch arch;
    int vocab_size;               /* V */
    int hidden_size;              /* D */
    int intermediate_size;        /* F (SwiGLU inner size) */
    int num_hidden_layers;        /* L */
    int num_attention_heads;      /* H */
    int num_key_value_heads;      /* Hkv, divides H */
    int head_dim;                 /* Dh; defaults to D / H when absent */
    int max_position_embeddings;
    float rms_norm_eps;
    double rope_theta;
    int tie_word_embeddings;      /* 1: lm_head.weight absent, the embedding is reused */
    int attention_bias;           /* 1: q/k/v projections carry a bias (Qwen2 always) */
    float initializer_range;      /* std of the normal init for random students */
    /* llama3 rope scaling (rope_scaling.rope_type == "llama3") */
    tkd_rope_scaling rope_scaling;
    double rope_factor;
    double rope_low_freq_factor;
    double rope_high_freq_factor;
    int rope_original_max_pos;
    int bos_token_id;             /* -1 when absent */
    int eos_token_id;             /* -1 when absent */
} tkd_model_config;

/* "llama", "qwen2", "mistral" (the model_type written to config.json). */
const char *tkd_arch_name(tkd_arch arch);

/* Fills cfg with defaults for a small llama (used before overriding fields from YAML). */
void tkd_model_config_defaults(tkd_model_config *cfg);

/* Checks internal consistency (H % Hkv == 0, sizes > 0, ...). */
tkd_status tkd_model_config_validate(const tkd_model_config *cfg);

/* Parses <path> (a config.json). Errors name the path and the field. */
tkd_status tkd_hf_config_read(const char *path, tkd_model_config *cfg);

/* The same for config.json text already in memory (len bytes); path names it in messages. */
tkd_status tkd_hf_config_parse(const char *text, size_t len, const char *path, tkd_model_config *cfg);

/* Writes a config.json that transformers' AutoModelForCausalLM.from_pretrained accepts
 * (architectures, model_type, torch_dtype given by dtype_name "float32" or "bfloat16"). */
tkd_status tkd_hf_config_write(const char *path, const tkd_model_config *cfg, const char *dtype_name);

#endif /* TKD_HF_CONFIG_H */
