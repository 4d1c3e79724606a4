/* mxfp4.c — see mxfp4.h. */
#include "formats/mxfp4.h"

#include "common/half.h"

#include <cjson/cJSON.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- a checkpoint's pair ------------------------------------------------------------------------ */

/* "<name>_blocks" and "<name>_scales" */
typedef struct pair_names {
    char blocks[512], scales[512];
} pair_names;

static tkd_status pair_names_make(const char *name, pair_names *p)
{
    if ((size_t)snprintf(p->blocks, sizeof p->blocks, "%s_blocks", name) >= sizeof p->blocks ||
        (size_t)snprintf(p->scales, sizeof p->scales, "%s_scales", name) >= sizeof p->scales)
        return tkd_error_set(TKD_ERR_INVALID_ARG, "mxfp4: tensor name '%.64s...' is too long", name);
    return TKD_OK;
}

static tkd_status check_u8(const tkd_st_tensor *t, const char *role)
{
    if (t->dtype != TKD_DTYPE_U8)
        return tkd_error_set(TKD_ERR_FORMAT, "%s: tensor '%s' is %s, but MXFP4 %s are U8", t->file, t->name,
                             tkd_dtype_name(t->dtype), role);
    return TKD_OK;
}

/* The pair's checks (mxfp4.h, tkd_mxfp4_probe): blocks (E, R, G, 16) and scales (E, R, G), U8. */
static tkd_status pair_check(const pair_names *p, const tkd_st_tensor *b, const tkd_st_tensor *s)
{
    if (!b || !s) {
        const tkd_st_tensor *have = b ? b : s;
        return tkd_error_set(TKD_ERR_FORMAT,
                             "%s: tensor '%s' has no partner '%s' in the checkpoint: an MXFP4 weight is a "
                             "_blocks/_scales pair",
                             have->file, have->name, b ? p->scales : p->blocks);
    }
    TKD_TRY(check_u8(b, "blocks"));
    TKD_TRY(check_u8(s, "scales"));
    char sb[160], ss[160], sw[160];
    if (b->ndim != 4)
        return tkd_error_set(TKD_ERR_FORMAT,
                             "%s: tensor '%s' has shape %s: MXFP4 expert blocks are 4-D (experts, rows, "
                             "groups, 16)",
                             b->file, b->name, tkd_st_shape_str(sb, sizeof sb, b->ndim, b->shape));
    if (b->shape[3] != TKD_MXFP4_BLOCK_BYTES)
        return tkd_error_set(TKD_ERR_FORMAT,
                             "%s: tensor '%s' has shape %s: its last dimension must be 16 (16 bytes hold one "
                             "block's 32 FP4 values)",
                             b->file, b->name, tkd_st_shape_str(sb, sizeof sb, b->ndim, b->shape));
    int same = s->ndim == 3;
    for (int i = 0; same && i < 3; i++)
        same = s->shape[i] == b->shape[i];
    if (!same)
        return tkd_error_set(TKD_ERR_FORMAT,
                             "%s: tensor '%s' has shape %s, but '%s' of shape %s needs scales %s (one E8M0 "
                             "byte per block)",
                             s->file, s->name, tkd_st_shape_str(ss, sizeof ss, s->ndim, s->shape), b->name,
                             tkd_st_shape_str(sb, sizeof sb, 4, b->shape), tkd_st_shape_str(sw, sizeof sw, 3, b->shape));
    return TKD_OK;
}

/* Finds and checks the pair; *b = *s = NULL when neither exists. */
static tkd_status pair_find(const tkd_st_dir *d, const char *name, pair_names *p, const tkd_st_tensor **b,
                            const tkd_st_tensor **s)
{
    TKD_TRY(pair_names_make(name, p));
    *b = tkd_st_find(d, p->blocks);
    *s = tkd_st_find(d, p->scales);
    if (!*b && !*s)
        return TKD_OK;
    return pair_check(p, *b, *s);
}

/* The dequantised parameter's shape (E, G·32, R) of blocks (E, R, G, 16). */
static void param_shape(const tkd_st_tensor *b, int64_t out[3])
{
    out[0] = b->shape[0];
    out[1] = b->shape[2] * TKD_MXFP4_BLOCK;
    out[2] = b->shape[1];
}

tkd_status tkd_mxfp4_probe(const tkd_st_dir *d, const char *name, int *found, int64_t out_shape[3])
{
    pair_names p;
    const tkd_st_tensor *b, *s;
    *found = 0;
    TKD_TRY(pair_find(d, name, &p, &b, &s));
    if (b) {
        *found = 1;
        param_shape(b, out_shape);
    }
    return TKD_OK;
}

/* Rows per tile of the transposing read: each tile is decoded row-major into scratch (TILE, K), then
 * written out as K runs of TILE contiguous values of dst (E, K, R). */
#define TILE_ROWS 32

/* Expert e of the pair into out (K, R), one tile of rows at a time through scratch (TILE_ROWS, K). */
static tkd_status read_expert(const tkd_mxfp4_lut *t, const tkd_st_tensor *b, const tkd_st_tensor *s, int64_t e,
                              float *scratch, float *out32, uint16_t *out16, const char *what)
{
    int64_t R = b->shape[1], G = b->shape[2], K = G * TKD_MXFP4_BLOCK;
    const uint8_t *blocks = (const uint8_t *)b->data + e * R * G * TKD_MXFP4_BLOCK_BYTES;
    const uint8_t *scales = (const uint8_t *)s->data + e * R * G;
    for (int64_t r0 = 0; r0 < R; r0 += TILE_ROWS) {
        int64_t nr = R - r0 < TILE_ROWS ? R - r0 : TILE_ROWS;
        TKD_TRY(tkd_mxfp4_decode_rows(t, blocks + r0 * G * TKD_MXFP4_BLOCK_BYTES, scales + r0 * G, nr, G, scratch, NULL,
                            what, e, r0));
        for (int64_t k = 0; k < K; k++)
            for (int64_t r = 0; r < nr; r++) {
                float v = scratch[r * K + k];
                if (out32)
                    out32[k * R + r0 + r] = v;
                else
                    out16[k * R + r0 + r] = (uint16_t)(tkd_f32_bits(v) >> 16); /* exact: mxfp4.h */
            }
    }
    return TKD_OK;
}

/* Checks the found pair against the caller's expectation (shape, element count). */
static tkd_status read_check(const pair_names *p, const tkd_st_tensor *b, const int64_t expect[3], size_t n)
{
    int64_t got[3];
    param_shape(b, got);
    if (got[0] != expect[0] || got[1] != expect[1] || got[2] != expect[2]) {
        char a[160], c[160];
        return tkd_error_set(TKD_ERR_MISMATCH,
                             "%s: tensors '%s'/'%s' dequantise to %s, expected %s: the checkpoint does not "
                             "match its config.json",
                             b->file, p->blocks, p->scales, tkd_st_shape_str(a, sizeof a, 3, got),
                             tkd_st_shape_str(c, sizeof c, 3, expect));
    }
    if ((uint64_t)got[0] * (uint64_t)got[1] * (uint64_t)got[2] != (uint64_t)n)
        return tkd_error_set(TKD_ERR_INVALID_ARG, "%s: tensors '%s'/'%s' dequantise to %lld elements, destination "
                             "holds %zu", b->file, p->blocks, p->scales,
                             (long long)(got[0] * got[1] * got[2]), n);
    return TKD_OK;
}

tkd_status tkd_mxfp4_read(const tkd_st_dir *d, const char *name, const int64_t expect_shape[3], tkd_dtype dtype,
                          void *dst, size_t n)
{
    if (dtype != TKD_DTYPE_F32 && dtype != TKD_DTYPE_BF16)
        return tkd_error_set(TKD_ERR_INVALID_ARG, "mxfp4: '%s' can be read as F32 or BF16, not %s", name,
                             tkd_dtype_name(dtype));
    pair_names p;
    const tkd_st_tensor *b, *s;
    TKD_TRY(pair_find(d, name, &p, &b, &s));
    if (!b)
        return tkd_error_set(TKD_ERR_NOT_FOUND, "checkpoint: neither '%s' nor '%s' is there", p.blocks, p.scales);
    TKD_TRY(read_check(&p, b, expect_shape, n));
    int64_t E = b->shape[0], R = b->shape[1], K = b->shape[2] * TKD_MXFP4_BLOCK;
    if (E == 0 || R == 0 || K == 0)
        return TKD_OK;
    float *scratch = malloc(sizeof(float) * TILE_ROWS * (size_t)K);
    tkd_mxfp4_lut *t = malloc(sizeof *t);
    if (!scratch || !t) {
        free(scratch);
        free(t);
        return tkd_error_set(TKD_ERR_NOMEM, "mxfp4: out of memory reading '%s'", p.blocks);
    }
    tkd_mxfp4_lut_init(t);
    char what[1280]; /* file + both names (512 each) */
    snprintf(what, sizeof what, "%s: tensors '%s'/'%s'", b->file, p.blocks, p.scales);
    tkd_status st = TKD_OK;
    for (int64_t e = 0; e < E && st == TKD_OK; e++)
        st = dtype == TKD_DTYPE_F32
                 ? read_expert(t, b, s, e, scratch, (float *)dst + e * K * R, NULL, what)
                 : read_expert(t, b, s, e, scratch, NULL, (uint16_t *)dst + e * K * R, what);
    free(scratch);
    free(t);
    return st;
}

/* ---- quantization_config ------------------------------------------------------------------------ */

/* modules_to_not_convert: null, or an array of strings, copied into q. */
static tkd_status parse_not_convert(const cJSON *j, const char *path, tkd_mxfp4_quant *q)
{
    if (!j || cJSON_IsNull(j))
        return TKD_OK;
    if (!cJSON_IsArray(j))
        return tkd_error_set(TKD_ERR_FORMAT,
                             "%s: \"quantization_config.modules_to_not_convert\" must be a list of module names",
                             path);
    int n = cJSON_GetArraySize(j);
    if (n == 0)
        return TKD_OK;
    if (!(q->not_convert = calloc((size_t)n, sizeof *q->not_convert)))
        return tkd_error_set(TKD_ERR_NOMEM, "%s: out of memory", path);
    const cJSON *it;
    cJSON_ArrayForEach(it, j) {
        if (!cJSON_IsString(it))
            return tkd_error_set(TKD_ERR_FORMAT,
                                 "%s: \"quantization_config.modules_to_not_convert\"[%d] is not a string", path,
                                 q->n_not_convert);
        if (!(q->not_convert[q->n_not_convert] = strdup(it->valuestring)))
            return tkd_error_set(TKD_ERR_NOMEM, "%s: out of memory", path);
        q->n_not_convert++;
    }
    return TKD_OK;
}

static tkd_status quant_parse(const cJSON *qc, const char *path, tkd_mxfp4_quant *out)
{
    if (!qc || cJSON_IsNull(qc))
        return TKD_OK;
    if (!cJSON_IsObject(qc))
        return tkd_error_set(TKD_ERR_FORMAT, "%s: \"quantization_config\" must be an object", path);
    const cJSON *m = cJSON_GetObjectItemCaseSensitive(qc, "quant_method");
    if (!cJSON_IsString(m))
        return tkd_error_set(TKD_ERR_FORMAT, "%s: \"quantization_config.quant_method\" must be a string", path);
    if (strcmp(m->valuestring, "mxfp4") != 0)
        return tkd_error_set(TKD_ERR_UNSUPPORTED,
                             "%s: quantization_config.quant_method \"%.64s\" is not supported: topkd reads "
                             "unquantised checkpoints and gpt-oss's \"mxfp4\"",
                             path, m->valuestring);
    out->mxfp4 = 1;
    const cJSON *dq = cJSON_GetObjectItemCaseSensitive(qc, "dequantize");
    if (dq && !cJSON_IsNull(dq)) {
        if (!cJSON_IsBool(dq))
            return tkd_error_set(TKD_ERR_FORMAT, "%s: \"quantization_config.dequantize\" must be true or false",
                                 path);
        out->dequantize = cJSON_IsTrue(dq);
    }
    return parse_not_convert(cJSON_GetObjectItemCaseSensitive(qc, "modules_to_not_convert"), path, out);
}

tkd_status tkd_mxfp4_quant_parse(const struct cJSON *qc, const char *path, tkd_mxfp4_quant *out)
{
    memset(out, 0, sizeof *out);
    tkd_status st = quant_parse(qc, path, out);
    if (st != TKD_OK)
        tkd_mxfp4_quant_free(out); /* nothing half-filled handed out */
    return st;
}

void tkd_mxfp4_quant_free(tkd_mxfp4_quant *q)
{
    if (!q)
        return;
    for (int i = 0; i < q->n_not_convert; i++)
        free(q->not_convert[i]);
    free(q->not_convert);
    memset(q, 0, sizeof *q);
}
