/* test_hf_config.c — config.json parsing for llama / qwen2 / qwen3 / qwen3_moe / mistral, their
 * sliding windows per layer, Qwen3-MoE's sparse layers, gpt-oss (YaRN, sinks, MXFP4 quantization_config), each refusal by name, and the write -> read
 * round trip. Sample configs live in tests/data/hf/. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/status.h"
#include "formats/hf_config.h"
#include "tests/testutil.h"

/* A file in the group's temp dir (generated configs). */
static const char *tmp_path(const char *name)
{
    return tkd_test_path(tkd_test_group_dir, name);
}

/* Writes a small config: the given model_type, the base fields that extra does not set, then extra. */
static const char *small_config(const char *model_type, const char *extra)
{
    static const char *base[][2] = {
        {"hidden_size", "64"},         {"intermediate_size", "96"}, {"num_hidden_layers", "3"},
        {"num_attention_heads", "4"},  {"num_key_value_heads", "2"}, {"vocab_size", "100"},
        {"max_position_embeddings", "512"},
    };
    const char *path = tmp_path("config.json");
    FILE *f = fopen(path, "w");
    assert_non_null(f);
    fprintf(f, "{\"model_type\": \"%s\"", model_type);
    for (size_t i = 0; i < sizeof base / sizeof base[0]; i++) {
        char key[64];
        snprintf(key, sizeof key, "\"%s\"", base[i][0]);
        if (!strstr(extra, key))
            fprintf(f, ",\n \"%s\": %s", base[i][0], base[i][1]);
    }
    fprintf(f, "%s%s}\n", *extra ? ",\n " : "", extra);
    fclose(f);
    return path;
}

static void test_llama32(void **state)
{
    (void)state;
    tkd_model_config c;
    assert_int_equal(tkd_hf_config_read(tkd_test_src("data/hf/llama32_1b.json"), &c), TKD_OK);
    assert_int_equal(c.arch, TKD_ARCH_LLAMA);
    assert_int_equal(c.vocab_size, 128256);
    assert_int_equal(c.hidden_size, 2048);
    assert_int_equal(c.intermediate_size, 8192);
    assert_int_equal(c.num_hidden_layers, 16);
    assert_int_equal(c.num_attention_heads, 32);
    assert_int_equal(c.num_key_value_heads, 8);
    assert_int_equal(c.head_dim, 64);
    assert_int_equal(c.max_position_embeddings, 131072);
    assert_true(c.rms_norm_eps == 1e-5f);
    assert_true(c.rope_theta == 500000.0);
    assert_int_equal(c.tie_word_embeddings, 1);
    assert_int_equal(c.attention_bias, 0);
    assert_int_equal(c.rope_scaling, TKD_ROPE_SCALING_LLAMA3);
    assert_true(c.rope_factor == 32.0 && c.rope_low_freq_factor == 1.0 && c.rope_high_freq_factor == 4.0);
    assert_int_equal(c.rope_original_max_pos, 8192);
    assert_int_equal(c.bos_token_id, 128000);
    assert_int_equal(c.eos_token_id, 128001);
    assert_true(c.initializer_range == 0.02f);
}

static void test_qwen2_mistral_smollm(void **state)
{
    (void)state;
    tkd_model_config c;
    assert_int_equal(tkd_hf_config_read(tkd_test_src("data/hf/qwen25_05b.json"), &c), TKD_OK);
    assert_int_equal(c.arch, TKD_ARCH_QWEN2);
    assert_int_equal(c.attention_bias, 1); /* Qwen2 always has q/k/v bias */
    assert_int_equal(c.head_dim, 64);      /* 896 / 14 */
    assert_int_equal(c.num_key_value_heads, 2);
    assert_true(c.rope_theta == 1e6);
    assert_true(c.rms_norm_eps == 1e-6f);
    assert_int_equal(c.tie_word_embeddings, 1);
    assert_int_equal(c.rope_scaling, TKD_ROPE_SCALING_NONE);

    assert_int_equal(tkd_hf_config_read(tkd_test_src("data/hf/mistral_7b_v03.json"), &c), TKD_OK);
    assert_int_equal(c.arch, TKD_ARCH_MISTRAL);
    assert_int_equal(c.attention_bias, 0);
    assert_int_equal(c.tie_word_embeddings, 0);
    assert_int_equal(c.head_dim, 128);
    assert_int_equal(c.vocab_size, 32768);

    assert_int_equal(tkd_hf_config_read(tkd_test_src("data/hf/smollm_135m.json"), &c), TKD_OK);
    assert_int_equal(c.arch, TKD_ARCH_LLAMA);
    assert_int_equal(c.head_dim, 64); /* 576 / 9 */
    assert_int_equal(c.bos_token_id, 0);
    assert_int_equal(c.eos_token_id, 0); /* a list: the first */
    assert_int_equal(c.num_key_value_heads, 3);
}

static void test_rope_parameters_and_defaults(void **state)
{
    (void)state;
    tkd_model_config c;
    assert_int_equal(tkd_hf_config_read(tkd_test_src("data/hf/llama_rope_parameters.json"), &c), TKD_OK);
    assert_true(c.rope_theta == 250000.0);        /* from rope_parameters */
    assert_int_equal(c.num_key_value_heads, 4);   /* default: heads */
    assert_int_equal(c.head_dim, 16);             /* null: hidden / heads */
    assert_int_equal(c.max_position_embeddings, 2048); /* LlamaConfig's default */
    assert_true(c.rms_norm_eps == 1e-6f);
    assert_int_equal(c.tie_word_embeddings, 0);
    assert_int_equal(c.bos_token_id, -1);
    assert_true(c.initializer_range == 0.02f);

    /* the transformers-written fixture: llama3 scaling inside rope_parameters */
    assert_int_equal(tkd_hf_config_read(tkd_test_src("fixtures/hf/llama_gqa_f32/config.json"), &c), TKD_OK);
    assert_int_equal(c.rope_scaling, TKD_ROPE_SCALING_LLAMA3);
    assert_true(c.rope_factor == 8.0 && c.rope_theta == 10000.0);
    assert_int_equal(c.rope_original_max_pos, 32);
    assert_int_equal(tkd_hf_config_read(tkd_test_src("fixtures/hf/qwen2_tied_f32/config.json"), &c), TKD_OK);
    assert_int_equal(c.arch, TKD_ARCH_QWEN2);
    assert_true(c.rope_theta == 1e6);

    /* the older "type" spelling and a look-alike model_type that transformers builds as a llama */
    assert_int_equal(tkd_hf_config_read(small_config("my_llama", "\"architectures\": [\"LlamaForCausalLM\"], "
                                                                 "\"rope_scaling\": {\"type\": \"default\"}"),
                                        &c),
                     TKD_OK);
    assert_int_equal(c.arch, TKD_ARCH_LLAMA);
    /* model_type absent: the architectures entry decides */
    assert_int_equal(tkd_hf_config_read(small_config("", "\"architectures\": [\"MistralForCausalLM\"]"), &c),
                     TKD_OK);
    assert_int_equal(c.arch, TKD_ARCH_MISTRAL);
    /* attention_bias on a llama */
    assert_int_equal(tkd_hf_config_read(small_config("llama", "\"attention_bias\": true"), &c), TKD_OK);
    assert_int_equal(c.attention_bias, 1);
    /* a window that never bites is accepted */
    assert_int_equal(tkd_hf_config_read(small_config("mistral", "\"sliding_window\": 4096"), &c), TKD_OK);
    assert_int_equal(tkd_hf_config_read(small_config("qwen2", "\"use_sliding_window\": true, \"sliding_window\": "
                                                              "16, \"max_window_layers\": 3"),
                                        &c),
                     TKD_OK);
    assert_int_equal(tkd_hf_config_read(small_config("llama", "\"attention_dropout\": 0.1"), &c), TKD_OK);
}

typedef struct refusal {
    const char *model_type, *extra;
    tkd_status st;
    const char *msg;
} refusal;

/* Each case's config.json read: the status it wants, its message fragment, and the file's name in
 * the message (every refusal names the file). */
static void expect_refusals(const refusal *cases, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        tkd_model_config c;
        const char *path = small_config(cases[i].model_type, cases[i].extra);
        tkd_status st = tkd_hf_config_read(path, &c);
        if (st != cases[i].st)
            fail_msg("case %zu (%s): got %s: %s", i, cases[i].extra, tkd_status_name(st), tkd_error_msg());
        tkd_test_assert_msg_has(cases[i].msg);
        tkd_test_assert_msg_has(path);
    }
}

static void test_refusals(void **state)
{
    (void)state;
    static const refusal cases[] = {
        {"llama", "\"hidden_act\": \"gelu\"", TKD_ERR_UNSUPPORTED, "hidden_act \"gelu\" is not supported"},
        {"llama", "\"num_local_experts\": 8", TKD_ERR_UNSUPPORTED, "num_local_experts = 8: mixture-of-experts"},
        {"qwen2", "\"num_experts\": 4", TKD_ERR_UNSUPPORTED, "num_experts = 4"},
        {"llama", "\"sliding_window\": 128", TKD_ERR_UNSUPPORTED, "sliding_window = 128 / sliding_attention layers on a llama"},
        {"qwen2", "\"layer_types\": [\"full_attention\", \"sliding_attention\", \"full_attention\"]",
         TKD_ERR_FORMAT, "layer_types[1] is sliding_attention but no sliding window is in effect"},
        {"qwen3", "\"layer_types\": [\"full_attention\", \"chunked_attention\", \"full_attention\"]",
         TKD_ERR_UNSUPPORTED, "layer_types[1] = \"chunked_attention\": only full_attention and sliding_attention"},
        {"qwen3", "\"layer_types\": [\"full_attention\"]", TKD_ERR_FORMAT,
         "layer_types has 1 entries for num_hidden_layers 3"},
        {"qwen3", "\"layer_types\": \"full_attention\"", TKD_ERR_FORMAT, "\"layer_types\" must be a list of strings"},
        {"mistral", "\"sliding_window\": 0", TKD_ERR_FORMAT, "\"sliding_window\" must be a positive integer or null"},
        {"qwen3", "\"attention_bias\": true", TKD_ERR_UNSUPPORTED, "attention_bias = true on qwen3"},
        {"llama", "\"rope_scaling\": {\"rope_type\": \"longrope\", \"factor\": 4.0}", TKD_ERR_UNSUPPORTED,
         "rope_scaling.rope_type \"longrope\" is not supported (default, llama3 or yarn)"},
        {"qwen3", "\"rope_scaling\": {\"rope_type\": \"yarn\", \"original_max_position_embeddings\": 64}",
         TKD_ERR_FORMAT, "required field \"rope_scaling.factor\" is missing"},
        {"qwen2", "\"partial_rotary_factor\": 0.5", TKD_ERR_UNSUPPORTED, "partial_rotary_factor = 0.5 is not supported"},
        {"qwen3", "\"rope_scaling\": {\"rope_type\": \"yarn\", \"factor\": 4.0, \"mscale\": 0.7, "
                  "\"original_max_position_embeddings\": 64}",
         TKD_ERR_UNSUPPORTED, "rope_scaling.mscale = 0.7 (yarn) is not supported"},
        {"llama", "\"quantization_config\": {\"quant_method\": \"mxfp4\"}", TKD_ERR_UNSUPPORTED,
         "quant_method \"mxfp4\" on llama is not supported"},
        {"qwen2", "\"quantization_config\": {\"quant_method\": \"gptq\"}", TKD_ERR_UNSUPPORTED, "gptq"},
        {"llama", "\"rope_parameters\": {\"type\": \"linear\", \"factor\": 2.0}", TKD_ERR_UNSUPPORTED,
         "rope_parameters.rope_type \"linear\""},
        {"llama", "\"mlp_bias\": true", TKD_ERR_UNSUPPORTED, "mlp_bias = true"},
        {"llama", "\"pretraining_tp\": 2", TKD_ERR_UNSUPPORTED, "pretraining_tp = 2"},
        {"gemma", "", TKD_ERR_UNSUPPORTED, "model_type \"gemma\" is not supported"},
        {"llama", "\"rope_scaling\": {\"rope_type\": \"llama3\", \"factor\": 8.0, \"low_freq_factor\": 1.0, "
                  "\"high_freq_factor\": 4.0}",
         TKD_ERR_FORMAT, "required field \"rope_scaling.original_max_position_embeddings\" is missing"},
        {"llama", "\"hidden_size\": \"big\"", TKD_ERR_FORMAT, "field \"hidden_size\" must be an integer"},
        {"llama", "\"num_key_value_heads\": 3", TKD_ERR_CONFIG, "not a multiple of num_key_value_heads (3)"},
        {"llama", "\"tie_word_embeddings\": 1", TKD_ERR_FORMAT, "\"tie_word_embeddings\" must be true or false"},
        {"llama", "\"head_dim\": 15", TKD_ERR_CONFIG, "head_dim (15) must be even"},
        {"llama", "\"eos_token_id\": 100", TKD_ERR_CONFIG, ">= vocab_size 100"},
    };
    expect_refusals(cases, sizeof cases / sizeof cases[0]);
}

/* Which layers slide (tkd_model_config_window), per architecture, as transformers 5's config classes
 * decide it (docs/model.md). */
static void test_sliding_windows(void **state)
{
    (void)state;
    tkd_model_config c;
    struct {
        const char *model_type, *extra;
        int want[3]; /* window of layers 0, 1, 2 */
    } cases[] = {
        {"mistral", "\"sliding_window\": 128", {128, 128, 128}},
        {"mistral", "\"sliding_window\": null", {0, 0, 0}},
        {"mistral", "\"rope_theta\": 10000.0", {4096, 4096, 4096}}, /* absent: MistralConfig's 4096 */
        /* Qwen2/3: only with use_sliding_window, on the layers >= max_window_layers */
        {"qwen2", "\"use_sliding_window\": true, \"sliding_window\": 16, \"max_window_layers\": 1", {0, 16, 16}},
        {"qwen2", "\"use_sliding_window\": false, \"sliding_window\": 16, \"max_window_layers\": 1", {0, 0, 0}},
        {"qwen3", "\"use_sliding_window\": true, \"max_window_layers\": 2", {0, 0, 4096}}, /* default size */
        {"qwen3", "\"use_sliding_window\": true, \"sliding_window\": null", {0, 0, 0}},
        {"qwen3", "\"use_sliding_window\": true, \"sliding_window\": 8", {0, 0, 0}}, /* default mwl 28 */
        /* layer_types, when present, wins over max_window_layers */
        {"qwen3", "\"use_sliding_window\": true, \"sliding_window\": 8, \"max_window_layers\": 0, "
                  "\"layer_types\": [\"sliding_attention\", \"full_attention\", \"sliding_attention\"]", {8, 0, 8}},
        {"qwen2", "\"layer_types\": [\"full_attention\", \"full_attention\", \"full_attention\"]", {0, 0, 0}},
        {"llama", "\"sliding_window\": 4096", {0, 0, 0}}, /* never masks (>= max positions): accepted */
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        if (tkd_hf_config_read(small_config(cases[i].model_type, cases[i].extra), &c) != TKD_OK)
            fail_msg("case %zu (%s): %s", i, cases[i].extra, tkd_error_msg());
        for (int l = 0; l < 3; l++)
            if (tkd_model_config_window(&c, l) != cases[i].want[l])
                fail_msg("case %zu (%s): layer %d window %d, want %d", i, cases[i].extra, l,
                         tkd_model_config_window(&c, l), cases[i].want[l]);
    }
    /* a Mistral config whose layers disagree cannot be written: MistralConfig has one window */
    assert_int_equal(tkd_hf_config_read(small_config("mistral", "\"sliding_window\": 8"), &c), TKD_OK);
    c.layer_sliding[1] = 0;
    assert_int_equal(tkd_model_config_validate(&c), TKD_ERR_CONFIG);
    tkd_test_assert_msg_has("layer 1 lacks a sliding window, which MistralForCausalLM cannot express");
}

/* Qwen3: its own defaults (head_dim 128, no bias, untied, 32768 positions) and a published config. */
static void test_qwen3(void **state)
{
    (void)state;
    tkd_model_config c;
    assert_int_equal(tkd_hf_config_read(small_config("qwen3", "\"rope_theta\": 1000000.0"), &c), TKD_OK);
    assert_int_equal(c.arch, TKD_ARCH_QWEN3);
    assert_int_equal(c.head_dim, 128); /* Qwen3Config's default, not hidden / heads = 16 */
    assert_int_equal(c.attention_bias, 0);
    assert_int_equal(c.tie_word_embeddings, 0);
    assert_true(tkd_arch_qk_norm(c.arch) && !tkd_arch_qk_norm(TKD_ARCH_QWEN2));
    assert_int_equal(tkd_hf_config_read(small_config("qwen3", "\"max_position_embeddings\": null"), &c), TKD_OK);
    assert_int_equal(c.max_position_embeddings, 32768);
    /* model_type absent: the architectures entry decides */
    assert_int_equal(tkd_hf_config_read(small_config("", "\"architectures\": [\"Qwen3ForCausalLM\"]"), &c), TKD_OK);
    assert_int_equal(c.arch, TKD_ARCH_QWEN3);

    assert_int_equal(tkd_hf_config_read(tkd_test_src("data/hf/qwen3_8b.json"), &c), TKD_OK);
    assert_int_equal(c.arch, TKD_ARCH_QWEN3);
    assert_int_equal(c.head_dim, 128);
    assert_int_equal(c.hidden_size / c.num_attention_heads, 128);
    assert_int_equal(c.num_key_value_heads, 8);
    assert_int_equal(c.max_position_embeddings, 40960);
    assert_true(c.rope_theta == 1e6);
    assert_int_equal(c.eos_token_id, 151645);
    assert_int_equal(c.sliding_window, 0);
    assert_string_equal(tkd_arch_class(c.arch), "Qwen3ForCausalLM");
}

/* Qwen3-MoE: Qwen3MoeConfig's fields and defaults, and Qwen3MoeDecoderLayer's rule for which layers
 * are MoE (not in mlp_only_layers, (l + 1) % decoder_sparse_step == 0, num_experts > 0). */
static void test_qwen3_moe(void **state)
{
    (void)state;
    tkd_model_config c;
    assert_int_equal(tkd_hf_config_read(tkd_test_src("data/hf/qwen3_30b_a3b.json"), &c), TKD_OK);
    assert_int_equal(c.arch, TKD_ARCH_QWEN3_MOE);
    assert_string_equal(tkd_arch_class(c.arch), "Qwen3MoeForCausalLM");
    assert_true(tkd_arch_qk_norm(c.arch));
    assert_int_equal(c.num_experts, 128);
    assert_int_equal(c.num_experts_per_tok, 8);
    assert_int_equal(c.moe_intermediate_size, 768);
    assert_int_equal(c.norm_topk_prob, 1);
    assert_int_equal(c.head_dim, 128);
    assert_int_equal(c.num_key_value_heads, 4);
    assert_int_equal(c.sliding_window, 0);
    for (int l = 0; l < 48; l++)
        assert_true(tkd_model_config_moe(&c, l));
    assert_false(tkd_model_config_moe(&c, 48));

    /* defaults: 128 experts, top-8, I 768, no renormalisation; head_dim hidden / heads (the config
     * class has no head_dim of its own, unlike Qwen3's 128); every layer MoE */
    assert_int_equal(tkd_hf_config_read(small_config("qwen3_moe", "\"tie_word_embeddings\": true"), &c), TKD_OK);
    assert_int_equal(c.num_experts, 128);
    assert_int_equal(c.num_experts_per_tok, 8);
    assert_int_equal(c.moe_intermediate_size, 768);
    assert_int_equal(c.norm_topk_prob, 0);
    assert_int_equal(c.head_dim, 16);
    assert_int_equal(c.tie_word_embeddings, 1);
    assert_true(tkd_model_config_moe(&c, 0) && tkd_model_config_moe(&c, 1) && tkd_model_config_moe(&c, 2));

    /* decoder_sparse_step 2: layers 1, 3 (of 4); mlp_only_layers takes layer 3 back; an index
     * past the layers is ignored, as transformers does; num_local_experts is the alias */
    const char *sparse = "\"num_hidden_layers\": 4, \"num_local_experts\": 6, \"num_experts_per_tok\": 2, "
                         "\"decoder_sparse_step\": 2, \"mlp_only_layers\": [3, 9]";
    assert_int_equal(tkd_hf_config_read(small_config("qwen3_moe", sparse), &c), TKD_OK);
    assert_int_equal(c.num_experts, 6);
    assert_int_equal(c.num_experts_per_tok, 2);
    int want[4] = {0, 1, 0, 0};
    for (int l = 0; l < 4; l++)
        assert_int_equal(tkd_model_config_moe(&c, l), want[l]);
    assert_true(tkd_model_config_has_moe(&c));
    /* num_experts 0: every layer dense */
    assert_int_equal(tkd_hf_config_read(small_config("qwen3_moe", "\"num_experts\": 0"), &c), TKD_OK);
    assert_false(tkd_model_config_has_moe(&c));
    /* windows: one for every layer, only with use_sliding_window */
    assert_int_equal(tkd_hf_config_read(small_config("qwen3_moe", "\"sliding_window\": 8"), &c), TKD_OK);
    assert_int_equal(c.sliding_window, 0);
    const char *window = "\"use_sliding_window\": true, \"sliding_window\": 8";
    assert_int_equal(tkd_hf_config_read(small_config("qwen3_moe", window), &c), TKD_OK);
    for (int l = 0; l < 3; l++)
        assert_int_equal(tkd_model_config_window(&c, l), 8);
    /* only Qwen3-MoE has experts; a dense-layer flag elsewhere is a config no file can say */
    tkd_model_config d;
    tkd_model_config_defaults(&d);
    d.layer_moe[1] = 1;
    assert_int_equal(tkd_model_config_validate(&d), TKD_ERR_CONFIG);
    tkd_test_assert_msg_has("layer 1 is marked mixture-of-experts");
}

/* The released gpt-oss-20b config.json (huggingface.co/openai/gpt-oss-20b), and GptOssConfig's
 * defaults (transformers 5.17 configuration_gpt_oss.py). */
static void test_gpt_oss(void **state)
{
    (void)state;
    tkd_model_config c;
    assert_int_equal(tkd_hf_config_read(tkd_test_src("data/hf/gpt_oss_20b.json"), &c), TKD_OK);
    assert_int_equal(c.arch, TKD_ARCH_GPT_OSS);
    assert_string_equal(tkd_arch_class(c.arch), "GptOssForCausalLM");
    assert_true(tkd_arch_sinks(c.arch));
    assert_false(tkd_arch_qk_norm(c.arch));
    assert_int_equal(c.attention_bias, 1);
    assert_true(tkd_model_config_o_bias(&c));
    assert_int_equal(c.head_dim, 64); /* != 2880 / 64 */
    assert_int_equal(c.num_key_value_heads, 8);
    assert_int_equal(c.vocab_size, 201088);
    assert_int_equal(c.tie_word_embeddings, 0);
    assert_true(c.rms_norm_eps == 1e-5f);
    assert_true(c.rope_theta == 150000.0);
    assert_int_equal(c.rope_scaling, TKD_ROPE_SCALING_YARN);
    assert_true(c.rope_factor == 32.0 && c.rope_beta_fast == 32.0 && c.rope_beta_slow == 1.0);
    assert_int_equal(c.rope_original_max_pos, 4096);
    assert_int_equal(c.rope_truncate, 0);
    assert_true(c.rope_attention_factor == 0.0);
    assert_int_equal(c.num_experts, 32);
    assert_int_equal(c.num_experts_per_tok, 4);
    assert_int_equal(c.moe_intermediate_size, 2880);
    assert_true(c.swiglu_limit == 7.0f);
    assert_int_equal(c.quant_mxfp4, 1);
    for (int l = 0; l < 24; l++) {
        assert_true(tkd_model_config_moe(&c, l));
        assert_int_equal(tkd_model_config_window(&c, l), l % 2 == 0 ? 128 : 0);
    }

    /* defaults: even layers slide (128), yarn factor 32 / original 4096 / truncate false, top-4 of
     * 128, limit 7, theta 150000, attention bias on, head_dim 64, not quantised */
    assert_int_equal(tkd_hf_config_read(small_config("gpt_oss", "\"num_hidden_layers\": 4"), &c), TKD_OK);
    assert_int_equal(c.num_experts, 128);
    assert_int_equal(c.num_experts_per_tok, 4);
    assert_int_equal(c.moe_intermediate_size, 96);
    assert_int_equal(c.head_dim, 64);
    assert_int_equal(c.attention_bias, 1);
    assert_int_equal(c.quant_mxfp4, 0);
    assert_true(c.rope_theta == 150000.0 && c.rms_norm_eps == 1e-5f && c.swiglu_limit == 7.0f);
    assert_int_equal(c.rope_scaling, TKD_ROPE_SCALING_YARN);
    assert_true(c.rope_factor == 32.0 && c.rope_original_max_pos == 4096 && c.rope_truncate == 0);
    int want[4] = {128, 0, 128, 0};
    for (int l = 0; l < 4; l++)
        assert_int_equal(tkd_model_config_window(&c, l), want[l]);
    /* layer_types, sliding_window, num_experts (the alias), rope_parameters spelled out */
    const char *custom = "\"num_hidden_layers\": 3, \"sliding_window\": 4, \"num_experts\": 6, "
                         "\"num_experts_per_tok\": 2, \"swiglu_limit\": 5.5, \"layer_types\": [\"full_attention\", "
                         "\"sliding_attention\", \"sliding_attention\"], \"rope_parameters\": {\"rope_type\": \"yarn\", "
                         "\"rope_theta\": 1000.0, \"factor\": 4.0, \"original_max_position_embeddings\": 8, "
                         "\"attention_factor\": 1.5}";
    assert_int_equal(tkd_hf_config_read(small_config("gpt_oss", custom), &c), TKD_OK);
    assert_int_equal(c.num_experts, 6);
    assert_int_equal(c.num_experts_per_tok, 2);
    /* swiglu_limit 5.5 is read but, as in transformers 5.17's GptOssExperts, the clamp stays at 7 */
    assert_true(c.swiglu_limit == 7.0f && c.rope_theta == 1000.0 && c.rope_factor == 4.0);
    assert_true(c.rope_attention_factor == 1.5 && c.rope_truncate == 1 && c.rope_beta_fast == 32.0);
    assert_int_equal(tkd_model_config_window(&c, 0), 0);
    assert_int_equal(tkd_model_config_window(&c, 1), 4);
    assert_int_equal(tkd_model_config_window(&c, 2), 4);
    /* YaRN on Qwen3 (long context) reads the same fields */
    const char *qyarn = "\"rope_scaling\": {\"rope_type\": \"yarn\", \"factor\": 4.0, "
                        "\"original_max_position_embeddings\": 128}";
    assert_int_equal(tkd_hf_config_read(small_config("qwen3", qyarn), &c), TKD_OK);
    assert_int_equal(c.rope_scaling, TKD_ROPE_SCALING_YARN);
    assert_true(c.rope_factor == 4.0 && c.rope_original_max_pos == 128 && c.rope_truncate == 1);
    /* standardize_rope_params: original absent -> max_position_embeddings; a top-level one wins;
     * factor null -> max_position / original */
    const char *q2 = "\"rope_scaling\": {\"rope_type\": \"yarn\", \"factor\": 4.0}";
    assert_int_equal(tkd_hf_config_read(small_config("qwen3", q2), &c), TKD_OK);
    assert_int_equal(c.rope_original_max_pos, 512);
    const char *q3 = "\"original_max_position_embeddings\": 64, \"rope_scaling\": {\"rope_type\": \"yarn\", "
                     "\"factor\": null, \"original_max_position_embeddings\": 128}";
    assert_int_equal(tkd_hf_config_read(small_config("qwen3", q3), &c), TKD_OK);
    assert_int_equal(c.rope_original_max_pos, 64);
    assert_true(c.rope_factor == 8.0);
    /* a Llama with attention_bias: o_proj has a bias too (LlamaAttention); Qwen2's is q/k/v only */
    assert_int_equal(tkd_hf_config_read(small_config("llama", "\"attention_bias\": true"), &c), TKD_OK);
    assert_true(tkd_model_config_o_bias(&c));
    assert_int_equal(tkd_hf_config_read(small_config("qwen2", ""), &c), TKD_OK);
    assert_false(tkd_model_config_o_bias(&c));
    /* written back, each reads to the same values: the release, the custom layers above, no
     * window at all, and plain RoPE (which must not become GptOssConfig's default YaRN) */
    char text[3][2048];
    snprintf(text[0], sizeof text[0], "%s", custom);
    snprintf(text[1], sizeof text[1], "\"layer_types\": [\"full_attention\", \"full_attention\", \"full_attention\"]");
    snprintf(text[2], sizeof text[2], "\"rope_parameters\": {\"rope_type\": \"default\"}");
    for (int i = 0; i < 4; i++) {
        tkd_model_config a, b;
        assert_int_equal(tkd_hf_config_read(i ? small_config("gpt_oss", text[i - 1])
                                              : tkd_test_src("data/hf/gpt_oss_20b.json"), &a), TKD_OK);
        assert_int_equal(tkd_hf_config_write(tmp_path("g.json"), &a, "bfloat16"), TKD_OK);
        if (tkd_hf_config_read(tmp_path("g.json"), &b) != TKD_OK)
            fail_msg("case %d: %s", i, tkd_error_msg());
        assert_memory_equal(&a, &b, sizeof a);
    }
}

static void test_gpt_oss_refusals(void **state)
{
    (void)state;
    static const refusal cases[] = {
        {"gpt_oss", "\"swiglu_alpha\": 1.5", TKD_ERR_UNSUPPORTED, "swiglu_alpha = 1.5 is not supported (only 1.702)"},
        {"gpt_oss", "\"swiglu_limit\": 1e300", TKD_ERR_FORMAT, "field \"swiglu_limit\" = 1e+300 does not fit a float"},
        {"gpt_oss", "\"quantization_config\": {\"quant_method\": \"fp8\"}", TKD_ERR_UNSUPPORTED, "fp8"},
        {"gpt_oss", "\"num_local_experts\": 8, \"num_experts\": 4", TKD_ERR_FORMAT,
         "num_local_experts = 8 and num_experts = 4 disagree"},
        {"gpt_oss", "\"num_local_experts\": 4, \"num_experts_per_tok\": 5", TKD_ERR_CONFIG,
         "1 <= num_experts_per_tok <= num_experts"},
        {"gpt_oss", "\"sliding_window\": null", TKD_ERR_FORMAT,
         "layer_types[0] is sliding_attention but no sliding window is in effect"},
        {"gpt_oss", "\"layer_types\": [\"full_attention\", \"chunked_attention\", \"full_attention\"]",
         TKD_ERR_UNSUPPORTED, "layer_types[1] = \"chunked_attention\""},
        {"gpt_oss", "\"hidden_act\": \"gelu\"", TKD_ERR_UNSUPPORTED, "hidden_act \"gelu\" is not supported"},
        {"gpt_oss", "\"rope_scaling\": {\"rope_type\": \"yarn\", \"factor\": 32.0, \"partial_rotary_factor\": 0.5, "
                    "\"original_max_position_embeddings\": 64}",
         TKD_ERR_UNSUPPORTED, "rope_scaling.partial_rotary_factor = 0.5 (yarn) is not supported"},
    };
    expect_refusals(cases, sizeof cases / sizeof cases[0]);
}

/* Qwen3-MoE's refusals, each naming its field. */
static void test_qwen3_moe_refusals(void **state)
{
    (void)state;
    static const refusal cases[] = {
        {"qwen3_moe", "\"shared_expert_intermediate_size\": 512", TKD_ERR_UNSUPPORTED,
         "shared_expert_intermediate_size = 512: a shared expert (Qwen2-MoE)"},
        {"qwen3_moe", "\"decoder_sparse_step\": 0", TKD_ERR_FORMAT, "\"decoder_sparse_step\" must be >= 1 (got 0)"},
        {"qwen3_moe", "\"num_experts\": 4, \"num_experts_per_tok\": 5", TKD_ERR_CONFIG,
         "1 <= num_experts_per_tok <= num_experts"},
        {"qwen3_moe", "\"moe_intermediate_size\": 0", TKD_ERR_CONFIG, "moe_intermediate_size >= 1"},
        {"qwen3_moe", "\"num_experts\": -2", TKD_ERR_FORMAT, "\"num_experts\" must be >= 0"},
        {"qwen3_moe", "\"num_experts\": 8, \"num_local_experts\": 4", TKD_ERR_FORMAT,
         "num_experts = 8 and num_local_experts = 4 disagree"},
        {"qwen3_moe", "\"mlp_only_layers\": 1", TKD_ERR_FORMAT, "\"mlp_only_layers\" must be a list"},
        {"qwen3_moe", "\"mlp_only_layers\": [0, \"a\"]", TKD_ERR_FORMAT, "mlp_only_layers[1] must be an integer"},
        {"qwen3_moe", "\"norm_topk_prob\": 1", TKD_ERR_FORMAT, "\"norm_topk_prob\" must be true or false"},
        {"qwen3_moe", "\"attention_bias\": true", TKD_ERR_UNSUPPORTED, "attention_bias = true on qwen3_moe"},
        {"qwen3_moe", "\"use_sliding_window\": true, \"sliding_window\": 8, \"layer_types\": [\"sliding_attention\", "
                      "\"full_attention\", \"sliding_attention\"]",
         TKD_ERR_UNSUPPORTED, "layer_types[1] is full_attention, but Qwen3MoeForCausalLM masks every layer alike"},
        {"qwen3", "\"num_experts\": 8", TKD_ERR_UNSUPPORTED, "num_experts = 8: mixture-of-experts models are not "
                                                          "supported as model_type qwen3 (only qwen3_moe"},
    };
    expect_refusals(cases, sizeof cases / sizeof cases[0]);
}

static void test_missing_and_malformed(void **state)
{
    (void)state;
    tkd_model_config c;
    const char *path = tmp_path("missing.json");
    FILE *f = fopen(path, "w");
    fputs("{\"model_type\": \"llama\", \"hidden_size\": 64, \"intermediate_size\": 96,\n"
          " \"num_attention_heads\": 4, \"vocab_size\": 100}\n", f);
    fclose(f);
    assert_int_equal(tkd_hf_config_read(path, &c), TKD_ERR_FORMAT);
    tkd_test_assert_msg_has("missing.json: required field \"num_hidden_layers\" is missing");

    path = tmp_path("bad.json");
    f = fopen(path, "w");
    fputs("{\n  \"model_type\": \"llama\",\n  \"hidden_size\": 64,,\n}\n", f);
    fclose(f);
    assert_int_equal(tkd_hf_config_read(path, &c), TKD_ERR_FORMAT);
    tkd_test_assert_msg_has("bad.json:3:");

    assert_int_equal(tkd_hf_config_read(tmp_path("absent.json"), &c), TKD_ERR_NOT_FOUND);
    tkd_test_assert_msg_has("absent.json: cannot open model config: No such file");
}

static tkd_status open_broken(const char *path)
{
    tkd_model_config c;
    return tkd_hf_config_read(path, &c);
}

/* The hf_* files of tests/data/broken/: duplicate keys, at the top level and nested, refused with
 * the line of each occurrence (cJSON keeps both and its lookup took the first). */
static void test_broken_files(void **state)
{
    (void)state;
    assert_true(tkd_test_broken_files("hf_", open_broken) >= 2);
}

static void roundtrip(const char *src, const char *dtype)
{
    tkd_model_config a, b;
    assert_int_equal(tkd_hf_config_read(src, &a), TKD_OK);
    const char *out = tmp_path("written.json");
    assert_int_equal(tkd_hf_config_write(out, &a, dtype), TKD_OK);
    assert_int_equal(tkd_hf_config_read(out, &b), TKD_OK);
    assert_int_equal(a.arch, b.arch);
    assert_memory_equal(&a, &b, sizeof a); /* every field, bit for bit (read zeroes padding) */
}

static void test_write_read_roundtrip(void **state)
{
    (void)state;
    roundtrip(tkd_test_src("data/hf/llama32_1b.json"), "bfloat16");
    /* the written text is what transformers expects to see */
    FILE *f = fopen(tmp_path("written.json"), "r");
    char text[8192];
    size_t n = fread(text, 1, sizeof text - 1, f);
    fclose(f);
    text[n] = '\0';
    assert_non_null(strstr(text, "\"LlamaForCausalLM\""));
    assert_non_null(strstr(text, "\"rope_theta\":\t500000.0"));
    assert_non_null(strstr(text, "\"rms_norm_eps\":\t1e-05"));
    assert_non_null(strstr(text, "\"torch_dtype\":\t\"bfloat16\""));
    assert_non_null(strstr(text, "\"rope_type\":\t\"llama3\""));
    assert_non_null(strstr(text, "\"transformers_version\""));

    roundtrip(tkd_test_src("data/hf/qwen25_05b.json"), "float32");
    roundtrip(tkd_test_src("data/hf/mistral_7b_v03.json"), "float32");
    roundtrip(tkd_test_src("data/hf/smollm_135m.json"), "float32");
    roundtrip(tkd_test_src("fixtures/hf/llama_gqa_f32/config.json"), "float32");
    roundtrip(tkd_test_src("data/hf/qwen3_8b.json"), "bfloat16");
    /* windows: Mistral's one, and a Qwen3 pattern that max_window_layers alone cannot say */
    roundtrip(small_config("mistral", "\"sliding_window\": 8"), "float32");
    roundtrip(small_config("qwen3", "\"head_dim\": 32, \"use_sliding_window\": true, \"sliding_window\": 8, "
                                    "\"layer_types\": [\"sliding_attention\", \"full_attention\", "
                                    "\"sliding_attention\"]"),
              "float32");
    f = fopen(tmp_path("written.json"), "r");
    n = fread(text, 1, sizeof text - 1, f);
    fclose(f);
    text[n] = '\0';
    assert_non_null(strstr(text, "\"Qwen3ForCausalLM\""));
    assert_non_null(strstr(text, "\"use_sliding_window\":\ttrue"));
    assert_non_null(strstr(text, "\"max_window_layers\":\t0"));
    assert_non_null(strstr(text, "\"sliding_attention\", \"full_attention\", \"sliding_attention\""));
    /* Qwen3-MoE: the dense layers spelled out as mlp_only_layers, one window for all */
    roundtrip(tkd_test_src("data/hf/qwen3_30b_a3b.json"), "bfloat16");
    roundtrip(small_config("qwen3_moe", "\"num_hidden_layers\": 5, \"num_experts\": 6, \"num_experts_per_tok\": 2, "
                                        "\"decoder_sparse_step\": 2, \"mlp_only_layers\": [1], "
                                        "\"use_sliding_window\": true, \"sliding_window\": 8"),
              "float32");
    f = fopen(tmp_path("written.json"), "r");
    n = fread(text, 1, sizeof text - 1, f);
    fclose(f);
    text[n] = '\0';
    assert_non_null(strstr(text, "\"Qwen3MoeForCausalLM\""));
    assert_non_null(strstr(text, "\"mlp_only_layers\":\t[0, 1, 2, 4]"));
    assert_non_null(strstr(text, "\"decoder_sparse_step\":\t1"));
    assert_non_null(strstr(text, "\"num_experts\":\t6"));
    assert_non_null(strstr(text, "\"use_sliding_window\":\ttrue"));
    assert_null(strstr(text, "layer_types"));

    /* defaults are valid and round-trip too */
    tkd_model_config d, e;
    tkd_model_config_defaults(&d);
    assert_int_equal(tkd_model_config_validate(&d), TKD_OK);
    assert_int_equal(tkd_hf_config_write(tmp_path("d.json"), &d, "float32"), TKD_OK);
    assert_int_equal(tkd_hf_config_read(tmp_path("d.json"), &e), TKD_OK);
    assert_memory_equal(&d, &e, sizeof d);

    assert_int_equal(tkd_hf_config_write(tmp_path("x.json"), &d, "float16"), TKD_ERR_INVALID_ARG);
    d.arch = TKD_ARCH_QWEN2; /* qwen2 without bias cannot be written faithfully */
    assert_int_equal(tkd_hf_config_write(tmp_path("x.json"), &d, "float32"), TKD_ERR_CONFIG);
    tkd_test_assert_msg_has("attention_bias");
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_llama32),
        cmocka_unit_test(test_qwen2_mistral_smollm),
        cmocka_unit_test(test_rope_parameters_and_defaults),
        cmocka_unit_test(test_refusals),
        cmocka_unit_test(test_sliding_windows),
        cmocka_unit_test(test_qwen3),
        cmocka_unit_test(test_qwen3_moe),
        cmocka_unit_test(test_qwen3_moe_refusals),
        cmocka_unit_test(test_gpt_oss),
        cmocka_unit_test(test_gpt_oss_refusals),
        cmocka_unit_test(test_missing_and_malformed),
        cmocka_unit_test(test_broken_files),
        cmocka_unit_test(test_write_read_roundtrip),
    };
    return cmocka_run_group_tests(tests, tkd_test_group_dir_setup, tkd_test_group_dir_teardown);
}
