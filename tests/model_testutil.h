/* model_testutil.h — what the model tests share (tests/test_model.c, tests/test_model_moe.c): small
 * model configs, a parameter looked up by name, and a safetensors file of U8 tensors written by
 * hand. Header-only (static functions): include it once per test program. cmocka.h first. */
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

/* A safetensors file of U8 tensors written by hand (tkd_st_writer writes floats only): the MXFP4
 * pairs of a gpt-oss checkpoint. */
typedef struct st_hand {
    const char *name;
    int ndim;
    int64_t shape[4];
    const void *data;
    size_t nbytes;
} st_hand;

static inline void write_u8_st(const char *path, const st_hand *e, int n)
{
    char hdr[8192];
    size_t len = (size_t)snprintf(hdr, sizeof hdr, "{\"__metadata__\":{\"format\":\"pt\"}"), off = 0;
    for (int i = 0; i < n; i++) {
        len += (size_t)snprintf(hdr + len, sizeof hdr - len, ",\"%s\":{\"dtype\":\"U8\",\"shape\":[", e[i].name);
        for (int k = 0; k < e[i].ndim; k++)
            len += (size_t)snprintf(hdr + len, sizeof hdr - len, "%s%lld", k ? "," : "", (long long)e[i].shape[k]);
        len += (size_t)snprintf(hdr + len, sizeof hdr - len, "],\"data_offsets\":[%zu,%zu]}", off, off + e[i].nbytes);
        off += e[i].nbytes;
    }
    len += (size_t)snprintf(hdr + len, sizeof hdr - len, "}");
    assert_true(len < sizeof hdr);
    FILE *fp = fopen(path, "wb");
    assert_non_null(fp);
    uint64_t n8 = len;
    assert_int_equal(fwrite(&n8, 8, 1, fp), 1);
    assert_int_equal(fwrite(hdr, 1, len, fp), len);
    for (int i = 0; i < n; i++)
        assert_int_equal(fwrite(e[i].data, 1, e[i].nbytes, fp), e[i].nbytes);
    assert_int_equal(fclose(fp), 0);
}

#endif /* TKD_MODEL_TESTUTIL_H */
