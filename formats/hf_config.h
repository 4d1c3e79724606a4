/* hf_config.h — the Llama-family architecture description, read from / written to a Hugging Face
 * config.json (cJSON). Covers model_type llama, qwen2, qwen3, qwen3_moe, mistral and look-alikes
 * (e.g. SmolLM is model_type llama), with the sliding windows Mistral and Qwen2/3 configs ask for,
 * per layer, and Qwen3-MoE's sparse layers (which layers are MoE: decoder_sparse_step and
 * mlp_only_layers, as Qwen3MoeDecoderLayer decides). A field that changes the maths and is not
 * supported (experts on another architecture, a shared expert, hidden_act other than silu,
 * unknown rope_scaling type, a layer type other than full or sliding attention) is
 * TKD_ERR_UNSUPPORTED with a message naming the field. See docs/model.md.
 */
#ifndef TKD_HF_CONFIG_H
#define TKD_HF_CONFIG_H

#include <stddef.h>
#include <stdint.h>

#include "common/status.h"

typedef enum tkd_arch {
    TKD_ARCH_LLAMA = 0,   /* LlamaForCausalLM (also SmolLM and other llama look-alikes) */
    TKD_ARCH_QWEN2 = 1,   /* Qwen2ForCausalLM: q/k/v bias always on */
    TKD_ARCH_MISTRAL = 2, /* MistralForCausalLM: sliding_window (default 4096) on every layer */
    TKD_ARCH_QWEN3 = 3,   /* Qwen3ForCausalLM: RMSNorm of each q and k head before RoPE, no bias */
    TKD_ARCH_QWEN3_MOE = 4, /* Qwen3MoeForCausalLM: Qwen3's attention; MoE MLPs where layer_moe (forward only) */
    TKD_ARCH_GPT_OSS = 5, /* GptOssForCausalLM: q/k/v/o biases, attention sinks, per-layer windows, YaRN, MoE
                             with a biased router and clamped-SwiGLU experts with biases (forward only) */
} tkd_arch;

/* Layers whose sliding window a config can describe (tkd_model_config.layer_sliding). Deeper
 * models are fine as long as no layer slides. */
#define TKD_MAX_WINDOW_LAYERS 512

/* Layers whose MLP kind a config can describe (tkd_model_config.layer_moe); Qwen3-235B-A22B has 94. */
#define TKD_MAX_MOE_LAYERS 512

typedef enum tkd_rope_scaling {
    TKD_ROPE_SCALING_NONE = 0,
    TKD_ROPE_SCALING_LLAMA3 = 1,
    TKD_ROPE_SCALING_YARN = 2,   /* kernels/rope_table.h's tkd_rope_inv_freq_yarn, cos/sin scaled */
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
    /* YaRN (rope_type "yarn"; rope_factor and rope_original_max_pos above are shared) */
    double rope_beta_fast;        /* default 32 */
    double rope_beta_slow;        /* default 1 */
    int rope_truncate;            /* default 1 (transformers' default; gpt-oss writes false) */
    double rope_attention_factor; /* 0: derived from the factor, 0.1·ln(factor) + 1 */
    int bos_token_id;             /* -1 when absent */
    int eos_token_id;             /* -1 when absent */
    /* Sliding-window attention: query i of a sliding layer attends keys j with
     * i - sliding_window < j <= i (the window counts the query itself; transformers'
     * sliding_window_overlay). 0: no layer slides. */
    int sliding_window;
    unsigned char layer_sliding[TKD_MAX_WINDOW_LAYERS]; /* 1: layer l slides (only where sliding_window > 0) */
    /* Qwen3-MoE (kernels/moe.h's SOFTMAX_TOPK router, SwiGLU experts without biases): layer l's MLP
     * is the sparse block where layer_moe[l], else the dense SwiGLU of intermediate_size. */
    int num_experts;              /* E (0: no layer is MoE) */
    int num_experts_per_tok;      /* k, 1..E */
    int moe_intermediate_size;    /* I: one expert's SwiGLU width */
    int norm_topk_prob;           /* 1: the k routing weights are divided by their sum */
    unsigned char layer_moe[TKD_MAX_MOE_LAYERS]; /* 1: layer l is MoE (qwen3_moe; every layer on gpt_oss) */
    /* gpt-oss: the experts' clamped SwiGLU (kernels/moe.h's SWIGLU_CLAMP, α 1.702) */
    float swiglu_limit;
    /* 1: quantization_config says mxfp4 (gpt-oss's experts may be stored as _blocks/_scales pairs) */
    int quant_mxfp4;
    /* Set by the model, never by config.json: 1 when it keeps gpt-oss's experts as MXFP4 (quant_mxfp4,
     * an inference model on a backend whose MoE op takes them: model/model_mxfp4.c) */
    int experts_mxfp4;
} tkd_model_config;

/* "llama", "qwen2", "qwen3", "mistral", "qwen3_moe" (the model_type written to config.json). */
const char *tkd_arch_name(tkd_arch arch);

/* "LlamaForCausalLM", ... (the architectures entry written to config.json). */
const char *tkd_arch_class(tkd_arch arch);

/* 1 when the architecture masks every layer with one window (Mistral, Qwen3-MoE): config.json
 * has one sliding_window and no per-layer list. */
int tkd_arch_windows_uniform(tkd_arch arch);

/* 1 when the architecture normalises each q and k head (RMSNorm over head_dim) before RoPE: Qwen3,
 * Qwen3-MoE. */
int tkd_arch_qk_norm(tkd_arch arch);

/* 1 when each attention head has a learned sink logit in its softmax denominator: gpt-oss. */
int tkd_arch_sinks(tkd_arch arch);

/* 1 when o_proj carries a bias: attention_bias on llama and gpt-oss (their o_proj is
 * nn.Linear(..., bias=config.attention_bias)); Qwen2's bias is on q/k/v only. */
int tkd_model_config_o_bias(const tkd_model_config *cfg);

/* 1 when layer l's MLP is the mixture-of-experts block; tkd_model_config_has_moe: any layer's. */
int tkd_model_config_moe(const tkd_model_config *cfg, int l);
int tkd_model_config_has_moe(const tkd_model_config *cfg);

/* Layer l's attention window: sliding_window where layer l slides, else 0 (full causal). */
int tkd_model_config_window(const tkd_model_config *cfg, int l);

/* gpt-oss's YaRN as GptOssConfig defaults it (factor 32 over 4096, β 32/1, not truncated): what a
 * gpt-oss config.json without rope_scaling / rope_parameters means (benchmarks use it too). */
void tkd_model_config_gpt_oss_yarn(tkd_model_config *cfg);

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
