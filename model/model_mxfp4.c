/* model_mxfp4.c — gpt-oss's experts kept as MXFP4 (cfg.experts_mxfp4: a checkpoint whose
 * quantization_config says mxfp4, on a backend whose MoE op takes MXFP4 stacks, be->moe_mxfp4): the
 * layout then holds no expert weight stacks, and each MoE layer's W_gate, W_up, W_down live here as
 * blocks and scales (kernels/moe.h's tkd_moe_mxfp4), about 0.53 bytes a weight instead of 4 (gpt-oss-20b
 * on the CPU: ~16 GB instead of ~84).
 *
 * From the checkpoint's pairs (formats/mxfp4.h) without decoding: gate_up_proj_blocks (E, 2I, D/32, 16)
 * holds, row by row, the 2I interleaved outputs of gate_up_proj (gate the even ones, up the odd), so
 * W_gate's row i is its row 2i and W_up's row i its row 2i + 1; down_proj_blocks (E, D, I/32, 16) is
 * W_down's rows as they are. Every block is decoded once at load to refuse a corrupt one (scale 0xFF,
 * a value ≥ 2^128) by name, as the dequantising reader does. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/mxfp4_codec.h"
#include "formats/mxfp4.h"
#include "model/model.h"
#include "model/model_internal.h"

/* Bytes of one kind's blocks and scales (j: 0 gate, 1 up, 2 down) for one layer. */
static void kind_bytes(const tkd_model_config *c, int j, size_t *blocks, size_t *scales)
{
    size_t E = (size_t)c->num_experts, D = (size_t)c->hidden_size, I = (size_t)c->moe_intermediate_size;
    size_t rows = j == 2 ? D : I, groups = (j == 2 ? I : D) / TKD_MXFP4_BLOCK;
    *scales = E * rows * groups;
    *blocks = *scales * TKD_MXFP4_BLOCK_BYTES;
}

/* Each kind's scales padded to 16 bytes in the allocation, so every stack's codes and scales start
 * 16-byte aligned, as the CUDA op requires (kernels/cuda/moe_cuda.h). */
static size_t pad16(size_t n) { return (n + 15) / 16 * 16; }

tkd_status tkd_model_alloc_mxfp4(tkd_model *m)
{
    const tkd_model_config *c = &m->cfg;
    if (!c->experts_mxfp4)
        return TKD_OK;
    size_t layer = 0, b, s;
    for (int j = 0; j < 3; j++) {
        kind_bytes(c, j, &b, &s);
        layer += b + pad16(s);
    }
    m->qlayer = calloc((size_t)c->num_hidden_layers, sizeof *m->qlayer);
    if (!m->qlayer)
        return tkd_error_set(TKD_ERR_NOMEM, "model: out of memory");
    TKD_TRY(m->be->op->alloc(m->be, layer * (size_t)c->num_hidden_layers, "model: MXFP4 experts", &m->qexp));
    uint8_t *p = m->qexp;
    for (int l = 0; l < c->num_hidden_layers; l++)
        for (int j = 0; j < 3; j++) {
            kind_bytes(c, j, &b, &s);
            m->qlayer[l].blocks[j] = p;
            m->qlayer[l].scales[j] = p + b;
            p += b + pad16(s);
        }
    return TKD_OK;
}

/* The pair <name>_blocks / _scales of layer l, checked to be what config.json implies (the
 * dequantised shape (E, D, 2I) or (E, I, D)); its tensors in *b, *s. */
static tkd_status find_pair(const char *dir, const tkd_st_dir *st, int l, const char *kind, const int64_t want[3],
                            const tkd_st_tensor **b, const tkd_st_tensor **s)
{
    char name[TKD_PARAM_NAME_MAX], nb[TKD_PARAM_NAME_MAX + 8], ns[TKD_PARAM_NAME_MAX + 8];
    snprintf(name, sizeof name, "model.layers.%d.mlp.experts.%s", l, kind);
    int found = 0;
    int64_t got[3];
    TKD_TRY(tkd_mxfp4_probe(st, name, &found, got));
    if (!found)
        return tkd_error_hint(tkd_error_set(TKD_ERR_FORMAT, "%s: config.json's quantization_config says mxfp4, but "
                                            "'%s_blocks' is not in the checkpoint (its experts are stored "
                                            "dequantised?)", dir, name),
                              "drop quantization_config from config.json to read the experts as they are stored");
    if (got[0] != want[0] || got[1] != want[1] || got[2] != want[2])
        return tkd_error_set(TKD_ERR_MISMATCH, "%s: '%s_blocks' decodes to (%lld, %lld, %lld); config.json implies "
                             "(%lld, %lld, %lld)", dir, name, (long long)got[0], (long long)got[1],
                             (long long)got[2], (long long)want[0], (long long)want[1], (long long)want[2]);
    snprintf(nb, sizeof nb, "%s_blocks", name);
    snprintf(ns, sizeof ns, "%s_scales", name);
    *b = tkd_st_find(st, nb);
    *s = tkd_st_find(st, ns);
    return TKD_OK;
}

/* Rows row0, row0 + step, ... (n of them) of every expert of pair (b, s) — rows of `groups` blocks —
 * into the staging dst (E, n, groups, 16) / dst_s (E, n, groups), each row decoded once (refused by
 * name when corrupt) into scratch (groups·32 floats). */
static tkd_status gather_rows(const tkd_st_tensor *b, const tkd_st_tensor *s, int64_t row0, int64_t step, int64_t n,
                              const tkd_mxfp4_lut *lut, float *scratch, uint8_t *dst, uint8_t *dst_s)
{
    const int64_t E = b->shape[0], R = b->shape[1], G = b->shape[2];
    char what[1100];
    snprintf(what, sizeof what, "%s: tensors '%s'/'%s'", b->file, b->name, s->name);
    for (int64_t e = 0; e < E; e++)
        for (int64_t i = 0; i < n; i++) {
            const int64_t r = e * R + row0 + i * step;
            const uint8_t *src = (const uint8_t *)b->data + r * G * TKD_MXFP4_BLOCK_BYTES;
            const uint8_t *src_s = (const uint8_t *)s->data + r * G;
            TKD_TRY(tkd_mxfp4_decode_rows(lut, src, src_s, 1, G, scratch, NULL, what, e, row0 + i * step));
            memcpy(dst + (e * n + i) * G * TKD_MXFP4_BLOCK_BYTES, src, (size_t)G * TKD_MXFP4_BLOCK_BYTES);
            memcpy(dst_s + (e * n + i) * G, src_s, (size_t)G);
        }
    return TKD_OK;
}

tkd_status tkd_model_load_mxfp4_layer(tkd_model *m, const char *dir, const tkd_st_dir *st, int l)
{
    const tkd_model_config *c = &m->cfg;
    const int64_t E = c->num_experts, D = c->hidden_size, I = c->moe_intermediate_size;
    const int64_t gu_want[3] = {E, D, 2 * I}, dn_want[3] = {E, I, D};
    const tkd_st_tensor *gb, *gs, *db, *ds;
    TKD_TRY(find_pair(dir, st, l, "gate_up_proj", gu_want, &gb, &gs));
    TKD_TRY(find_pair(dir, st, l, "down_proj", dn_want, &db, &ds));
    size_t cap = 0, b, s;
    for (int j = 0; j < 3; j++) {
        kind_bytes(c, j, &b, &s);
        cap = b + s > cap ? b + s : cap;
    }
    const int64_t widest = (D > I ? D : I);
    uint8_t *stage = malloc(cap);
    float *scratch = malloc(sizeof(float) * (size_t)widest);
    tkd_mxfp4_lut *lut = malloc(sizeof *lut);
    tkd_status st_ = stage && scratch && lut ? TKD_OK
                                             : tkd_error_set(TKD_ERR_NOMEM, "%s: out of host memory staging layer "
                                                             "%d's MXFP4 experts", dir, l);
    if (lut)
        tkd_mxfp4_lut_init(lut);
    for (int j = 0; j < 3 && st_ == TKD_OK; j++) { /* gate: rows 0, 2, ...; up: 1, 3, ...; down: all */
        kind_bytes(c, j, &b, &s);
        st_ = j < 2 ? gather_rows(gb, gs, j, 2, I, lut, scratch, stage, stage + b)
                    : gather_rows(db, ds, 0, 1, D, lut, scratch, stage, stage + b);
        if (st_ == TKD_OK)
            st_ = m->be->op->upload(m->be, (void *)m->qlayer[l].blocks[j], stage, b);
        if (st_ == TKD_OK)
            st_ = m->be->op->upload(m->be, (void *)m->qlayer[l].scales[j], stage + b, s);
    }
    free(stage);
    free(scratch);
    free(lut);
    return st_;
}
