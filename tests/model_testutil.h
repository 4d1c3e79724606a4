/* model_testutil.h — what the model tests share (tests/test_model.c, tests/test_model_moe.c): small
 * model configs and a parameter looked up by name. Header-only (static functions): include it once per test program. cmocka.h first. */
#ifndef TKD_MODEL_TESTUTIL_H
#define TKD_MODEL_TESTUTIL_H

#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "model/model.h"

static inline tkd_model_config small_cfg(int tied, int bias)
{
    tkd_model_config c;
    tkd_model_config_defaults(&c);
    c.vocab_size = 37, c.hidden_size = 20, c.intermediate_size = 28, c.num_hidden_layers = 2;
    c.num_attention_heads = 4, c.num_key_value_heads = 2, c.head_dim = 6, c.max_position_embeddings = 16;
    c.tie_word_embeddings = tied, c.attention_bias = bias, c.initializer_range = 0.2f;
    c.rope_scaling = TKD_ROPE_SCALING_NONE, c.rope_theta = 1e4;
    return c;
}

/* small_cfg as Qwen3: no bias, head_dim 8 != D/H = 5 (q is wider than the hidden state). */
static inline tkd_model_config qwen3_cfg(void)
{
    tkd_model_config c = small_cfg(0, 0);
    c.arch = TKD_ARCH_QWEN3, c.head_dim = 8;
    return c;
}

static inline const tkd_param_info *find_param(const tkd_model *m, const char *name)
{
    for (int i = 0; i < m->n_info; i++)
        if (!strcmp(m->info[i].name, name))
            return &m->info[i];
    return NULL;
}

#endif /* TKD_MODEL_TESTUTIL_H */
