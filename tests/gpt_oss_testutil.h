/* gpt_oss_testutil.h — a gpt-oss checkpoint written from a model in memory, for the tests that load
 * one (test_model, test_teacher_dump). tkd_model_save_hf refuses gpt-oss (a teacher only: nothing
 * trains one), so the tests write config.json and the tensors themselves, in transformers'
 * GptOssExperts layout: gate_up_proj (E, D, 2I) with the gate and up columns interleaved,
 * gate_up_proj_bias (E, 2I), down_proj (E, I, D), down_proj_bias (E, D). Header-only: static
 * functions a test file includes. */
#ifndef TKD_GPT_OSS_TESTUTIL_H
#define TKD_GPT_OSS_TESTUTIL_H

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "formats/safetensors.h"
#include "model/model.h"
#include "model/model_internal.h"

/* <dir>/config.json for c (gpt_oss), every field spelled out; with mxfp4 the release's
 * quantization_config. */
static void gpt_oss_write_config(const char *dir, const tkd_model_config *c, int mxfp4)
{
    char path[4400];
    snprintf(path, sizeof path, "%s/config.json", dir);
    FILE *f = fopen(path, "w");
    if (!f)
        fail_msg("cannot write %s", path);
    fprintf(f, "{\"architectures\": [\"GptOssForCausalLM\"], \"model_type\": \"gpt_oss\", \"vocab_size\": %d, "
               "\"hidden_size\": %d, \"intermediate_size\": %d, \"num_hidden_layers\": %d, "
               "\"num_attention_heads\": %d, \"num_key_value_heads\": %d, \"head_dim\": %d, "
               "\"max_position_embeddings\": %d, \"rms_norm_eps\": %.9g, \"rope_theta\": %.17g, "
               "\"num_local_experts\": %d, \"num_experts_per_tok\": %d, \"swiglu_limit\": %.9g, "
               "\"attention_bias\": true, \"tie_word_embeddings\": false, \"sliding_window\": %d, ",
            c->vocab_size, c->hidden_size, c->intermediate_size, c->num_hidden_layers, c->num_attention_heads,
            c->num_key_value_heads, c->head_dim, c->max_position_embeddings, (double)c->rms_norm_eps, c->rope_theta,
            c->num_experts, c->num_experts_per_tok, (double)c->swiglu_limit, c->sliding_window > 0 ? c->sliding_window : 128);
    fprintf(f, "\"rope_scaling\": {\"rope_type\": \"yarn\", \"factor\": %.17g, \"beta_fast\": %.17g, "
               "\"beta_slow\": %.17g, \"truncate\": %s, \"original_max_position_embeddings\": %d}, \"layer_types\": [",
            c->rope_factor, c->rope_beta_fast, c->rope_beta_slow, c->rope_truncate ? "true" : "false",
            c->rope_original_max_pos);
    for (int l = 0; l < c->num_hidden_layers; l++)
        fprintf(f, "%s\"%s\"", l ? ", " : "", tkd_model_config_window(c, l) ? "sliding_attention" : "full_attention");
    fprintf(f, "]%s}\n", mxfp4 ? ", \"quantization_config\": {\"quant_method\": \"mxfp4\", \"modules_to_not_convert\": "
                                 "[\"model.layers.*.self_attn\", \"model.layers.*.mlp.router\", "
                                 "\"model.embed_tokens\", \"lm_head\"]}"
                               : "");
    fclose(f);
}

/* Block l's experts of m (the op's stacks) back in transformers' layout: gate_up (E, D, 2I),
 * gate_up_bias (E, 2I), down (E, I, D); caller-sized buffers. */
static void gpt_oss_experts_to_hf(const tkd_model *m, int l, float *gate_up, float *gate_up_bias, float *down)
{
    const tkd_layer_weights *W = &m->w.layers[l];
    int E = m->cfg.num_experts, D = m->cfg.hidden_size, I = m->cfg.moe_intermediate_size;
    for (int e = 0; e < E; e++)
        for (int i = 0; i < I; i++) {
            for (int d = 0; d < D; d++) {
                gate_up[((size_t)e * D + d) * 2 * I + 2 * i] = W->eg[((size_t)e * I + i) * D + d];
                gate_up[((size_t)e * D + d) * 2 * I + 2 * i + 1] = W->eu[((size_t)e * I + i) * D + d];
                down[((size_t)e * I + i) * D + d] = W->ed[((size_t)e * D + d) * I + i];
            }
            gate_up_bias[(size_t)e * 2 * I + 2 * i] = W->ebg[(size_t)e * I + i];
            gate_up_bias[(size_t)e * 2 * I + 2 * i + 1] = W->ebu[(size_t)e * I + i];
        }
}

/* 1 for the layout's internal expert stacks (model.c), which a checkpoint stores as gate_up_proj /
 * down_proj instead. */
static int gpt_oss_internal_name(const char *name)
{
    static const char *s[] = {".mlp.experts.w_gate", ".mlp.experts.w_up", ".mlp.experts.w_down", ".mlp.experts.b_gate",
                              ".mlp.experts.b_up"};
    size_t n = strlen(name);
    for (size_t i = 0; i < sizeof s / sizeof s[0]; i++)
        if (n >= strlen(s[i]) && !strcmp(name + n - strlen(s[i]), s[i]))
            return 1;
    return 0;
}

/* <dir>/model.safetensors in dtype: every tensor of m but the experts' stacks, then each layer's
 * gate_up_proj_bias and, unless skip_weights (the caller adds MXFP4 pairs itself), gate_up_proj and
 * down_proj. The writer is finished here. */
static void gpt_oss_write_tensors(const tkd_model *m, const char *dir, tkd_dtype dtype, int skip_weights,
                                  tkd_st_writer *w)
{
    int E = m->cfg.num_experts, D = m->cfg.hidden_size, I = m->cfg.moe_intermediate_size, L = m->cfg.num_hidden_layers;
    size_t n = (size_t)E * D * I, per = 3 * n + 2 * (size_t)E * I;
    float *buf = malloc(sizeof(float) * per * L); /* the writer keeps the pointers until finish */
    if (!buf)
        fail_msg("out of memory");
    (void)dtype;
    for (int i = 0; i < m->n_info; i++)
        if (!gpt_oss_internal_name(m->info[i].name))
            assert_int_equal(tkd_st_writer_add(w, m->info[i].name, m->info[i].ndim, m->info[i].shape,
                                               m->params + m->info[i].offset), TKD_OK);
    for (int l = 0; l < m->cfg.num_hidden_layers; l++) {
        char nm[TKD_PARAM_NAME_MAX];
        int64_t gu_shape[3] = {E, D, 2 * I}, gub_shape[2] = {E, 2 * I}, dn_shape[3] = {E, I, D};
        float *gu = buf + per * l, *dn = gu + 2 * n, *gub = dn + n;
        gpt_oss_experts_to_hf(m, l, gu, gub, dn);
        snprintf(nm, sizeof nm, "model.layers.%d.mlp.experts.gate_up_proj_bias", l);
        assert_int_equal(tkd_st_writer_add(w, nm, 2, gub_shape, gub), TKD_OK);
        if (skip_weights)
            continue;
        snprintf(nm, sizeof nm, "model.layers.%d.mlp.experts.gate_up_proj", l);
        assert_int_equal(tkd_st_writer_add(w, nm, 3, gu_shape, gu), TKD_OK);
        snprintf(nm, sizeof nm, "model.layers.%d.mlp.experts.down_proj", l);
        assert_int_equal(tkd_st_writer_add(w, nm, 3, dn_shape, dn), TKD_OK);
    }
    char path[4400];
    snprintf(path, sizeof path, "%s/model.safetensors", dir);
    assert_int_equal(tkd_st_writer_finish(w, path), TKD_OK);
    free(buf);
}

/* A bf16-layout (dequantised) gpt-oss checkpoint of m in dir (made here), tensors in dtype. */
static void gpt_oss_save(const tkd_model *m, const char *dir, tkd_dtype dtype)
{
    char cmd[4300];
    snprintf(cmd, sizeof cmd, "mkdir -p '%s'", dir);
    assert_int_equal(system(cmd), 0);
    gpt_oss_write_config(dir, &m->cfg, 0);
    tkd_st_writer *w = NULL;
    assert_int_equal(tkd_st_writer_init(&w, dtype), TKD_OK);
    gpt_oss_write_tensors(m, dir, dtype, 0, w);
    tkd_st_writer_free(w);
}

#endif /* TKD_GPT_OSS_TESTUTIL_H */
