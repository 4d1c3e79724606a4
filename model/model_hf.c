/* model_hf.c — a model's weights in and out (model.h): Hugging Face checkpoints (config.json and
 * safetensors) loaded and saved, the fp32 parameters read and written as one host array. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "formats/mxfp4.h"
#include "kernels/cpu/cpu_moe.h"
#include "model/model.h"
#include "model/model_internal.h"

/* ---- checkpoints -------------------------------------------------------------------------- */

/* Tensors a checkpoint may carry that we do not use (old Llama exports store RoPE buffers). */
static int ignorable(const char *name)
{
    return strstr(name, "rotary_emb.inv_freq") != NULL;
}

/* Qwen3-MoE's experts come in two layouts: per expert, model.layers.<l>.mlp.experts.<e>.
 * {gate,up,down}_proj.weight (the released checkpoints, and what transformers 5's save_pretrained
 * writes back through its conversion mapping), or fused as transformers 5 holds them in memory,
 * model.layers.<l>.mlp.experts.gate_up_proj (E, 2I, D) — expert e's [gate; up] rows — and
 * model.layers.<l>.mlp.experts.down_proj (E, D, I). fused_name gives the fused tensor and the
 * offset of the expert tensor p within it; 0 when p is not an expert tensor. */
static int fused_expert(const tkd_model *m, const char *name, char *fused, size_t cap, size_t *first)
{
    static const char *kinds[3] = {"gate_proj", "up_proj", "down_proj"};
    int l, e, n = 0;
    char kind[16];
    if (sscanf(name, "model.layers.%d.mlp.experts.%d.%15[a-z_].weight%n", &l, &e, kind, &n) != 3 ||
        name[n] != '\0')
        return 0;
    size_t ID = (size_t)m->cfg.moe_intermediate_size * m->cfg.hidden_size;
    for (int j = 0; j < 3; j++)
        if (!strcmp(kind, kinds[j])) {
            snprintf(fused, cap, "model.layers.%d.mlp.experts.%s", l, j == 2 ? "down_proj" : "gate_up_proj");
            *first = j == 2 ? (size_t)e * ID : (size_t)(2 * e + j) * ID;
            return 1;
        }
    return 0;
}

/* Where tensor p's values are: its own tensor (shape checked), or a slice of the fused expert
 * tensor that holds it (fused_expert; its 3-D shape checked) at element *first. */
static tkd_status tensor_source(const tkd_model *m, const char *dir, const tkd_st_dir *st, const tkd_param_info *p,
                                const tkd_st_tensor **t, size_t *first)
{
    char fused[TKD_PARAM_NAME_MAX];
    *first = 0;
    if ((*t = tkd_st_find(st, p->name)))
        return tkd_st_check_shape(*t, p->ndim, p->shape);
    if (fused_expert(m, p->name, fused, sizeof fused, first) && (*t = tkd_st_find(st, fused))) {
        int64_t E = m->cfg.num_experts, I = m->cfg.moe_intermediate_size, D = m->cfg.hidden_size;
        int64_t gate_up[3] = {E, 2 * I, D}, down[3] = {E, D, I};
        return tkd_st_check_shape(*t, 3, strstr(fused, "down_proj") ? down : gate_up);
    }
    return tkd_error_set(TKD_ERR_NOT_FOUND,
                         "%s: tensor '%s' is missing (config.json asks for it, shape (%lld%s%lld)); "
                         "check the checkpoint matches its config",
                         dir, p->name, (long long)p->shape[0], p->ndim == 2 ? ", " : "",
                         p->ndim == 2 ? (long long)p->shape[1] : 0LL);
}

/* ---- gpt-oss's experts ---------------------------------------------------------------------- */

/* The layout's gpt-oss expert stacks (model.c: internal names, not checkpoint ones), in the order
 * tkd_moe_from_gpt_oss writes them. */
static const char *const gpt_oss_stacks[5] = {"w_gate", "w_up", "w_down", "b_gate", "b_up"};

/* Which of gpt_oss_stacks p is (0..4), or -1; *l its layer. */
static int gpt_oss_stack(const tkd_model *m, const char *name, int *l)
{
    char kind[16];
    int n = 0;
    if (m->cfg.arch != TKD_ARCH_GPT_OSS ||
        sscanf(name, "model.layers.%d.mlp.experts.%15[a-z_]%n", l, kind, &n) != 2 || name[n] != '\0')
        return -1;
    for (int j = 0; j < 5; j++)
        if (!strcmp(kind, gpt_oss_stacks[j]))
            return j;
    return -1;
}

/* One of a gpt-oss checkpoint's expert tensors, model.layers.<l>.mlp.experts.<kind> of shape
 * (ndim 2 or 3), into dst (fp32): the tensor itself (bf16 / fp32: the dequantised layout), or its
 * MXFP4 _blocks/_scales pair (the released layout, formats/mxfp4.h, decoded exactly). */
static tkd_status read_gpt_oss_src(const char *dir, const tkd_st_dir *st, int l, const char *kind, int ndim,
                                   const int64_t *shape, float *dst)
{
    char name[TKD_PARAM_NAME_MAX];
    snprintf(name, sizeof name, "model.layers.%d.mlp.experts.%s", l, kind);
    size_t n = (size_t)shape[0] * (size_t)shape[1] * (size_t)(ndim == 3 ? shape[2] : 1);
    int found = 0;
    int64_t got[3];
    if (ndim == 3)
        TKD_TRY(tkd_mxfp4_probe(st, name, &found, got));
    if (found)
        return tkd_mxfp4_read(st, name, shape, TKD_DTYPE_F32, dst, n);
    const tkd_st_tensor *t = tkd_st_find(st, name);
    if (!t)
        return tkd_error_set(TKD_ERR_NOT_FOUND,
                             "%s: tensor '%s'%s is missing (config.json asks for gpt-oss experts of shape (%lld, "
                             "%lld%s%lld)); check the checkpoint matches its config", dir, name,
                             ndim == 3 ? " (or its MXFP4 _blocks/_scales pair)" : "", (long long)shape[0],
                             (long long)shape[1], ndim == 3 ? ", " : "", ndim == 3 ? (long long)shape[2] : 0LL);
    TKD_TRY(tkd_st_check_shape(t, ndim, shape));
    return tkd_st_slice_f32(t, 0, n, dst);
}

/* Host scratch for one gpt-oss layer's experts, allocated once per load: the checkpoint's
 * gate_up_proj (E, D, 2I), its bias (E, 2I), down_proj (E, I, D), and (off the host backend) the
 * five converted stacks before they go up. */
typedef struct gpt_oss_stage {
    float *gate_up, *gate_up_bias, *down;
    float *out[5]; /* w_gate, w_up (E, I, D); w_down (E, D, I); b_gate, b_up (E, I) */
    float *buf;
} gpt_oss_stage;

static tkd_status gpt_oss_stage_alloc(const tkd_model *m, int on_host, gpt_oss_stage *s)
{
    size_t E = (size_t)m->cfg.num_experts, D = (size_t)m->cfg.hidden_size, I = (size_t)m->cfg.moe_intermediate_size;
    size_t in = 3 * E * D * I + 2 * E * I, out = on_host ? 0 : 3 * E * D * I + 2 * E * I;
    memset(s, 0, sizeof *s);
    if (!(s->buf = malloc((in + out) * sizeof(float))))
        return tkd_error_set(TKD_ERR_NOMEM, "model: out of host memory converting gpt-oss's experts (%zu floats)",
                             in + out);
    s->gate_up = s->buf;
    s->gate_up_bias = s->gate_up + 2 * E * D * I;
    s->down = s->gate_up_bias + 2 * E * I;
    float *o = s->down + E * D * I;
    size_t sizes[5] = {E * I * D, E * I * D, E * D * I, E * I, E * I};
    for (int j = 0; j < 5 && !on_host; j++) {
        s->out[j] = o;
        o += sizes[j];
    }
    return TKD_OK;
}

/* Block l's gpt-oss experts: read (bf16, fp32 or MXFP4), converted by tkd_moe_from_gpt_oss into the
 * layout's stacks (stacks[j]: the m->info entry of gpt_oss_stacks[j]), then put on the backend. */
static tkd_status load_gpt_oss_experts(tkd_model *m, const char *dir, const tkd_st_dir *st, int l,
                                       const tkd_param_info *const stacks[5], int on_host, gpt_oss_stage *s)
{
    int64_t E = m->cfg.num_experts, D = m->cfg.hidden_size, I = m->cfg.moe_intermediate_size;
    int64_t gu_shape[3] = {E, D, 2 * I}, gub_shape[2] = {E, 2 * I}, down_shape[3] = {E, I, D};
    TKD_TRY(read_gpt_oss_src(dir, st, l, "gate_up_proj", 3, gu_shape, s->gate_up));
    TKD_TRY(read_gpt_oss_src(dir, st, l, "gate_up_proj_bias", 2, gub_shape, s->gate_up_bias));
    TKD_TRY(read_gpt_oss_src(dir, st, l, "down_proj", 3, down_shape, s->down));
    float *out[5];
    for (int j = 0; j < 5; j++)
        out[j] = on_host ? m->params + stacks[j]->offset : s->out[j];
    tkd_moe_from_gpt_oss((int)E, (int)D, (int)I, s->gate_up, s->gate_up_bias, s->down, out[0], out[1], out[3],
                         out[4], out[2]);
    for (int j = 0; j < 5 && !on_host; j++)
        TKD_TRY(tkd_model_put_tensor(m, stacks[j], out[j]));
    return TKD_OK;
}

/* Block l's gpt-oss experts kept as MXFP4 (cfg.experts_mxfp4): the biases (gate_up_proj_bias's
 * interleaved halves into stacks[3] b_gate and stacks[4] b_up), then the weights' pairs as they are
 * stored (model_mxfp4.c). */
static tkd_status load_gpt_oss_packed(tkd_model *m, const char *dir, const tkd_st_dir *st, int l,
                                      const tkd_param_info *const stacks[5])
{
    const int64_t E = m->cfg.num_experts, I = m->cfg.moe_intermediate_size, gub_shape[2] = {E, 2 * I};
    float *gub = malloc(sizeof(float) * 4 * (size_t)(E * I)), *bg = gub + 2 * E * I, *bu = bg + E * I;
    if (!gub)
        return tkd_error_set(TKD_ERR_NOMEM, "%s: out of host memory for layer %d's expert biases", dir, l);
    tkd_status rc = read_gpt_oss_src(dir, st, l, "gate_up_proj_bias", 2, gub_shape, gub);
    for (int64_t i = 0; rc == TKD_OK && i < E * I; i++)
        bg[i] = gub[2 * i], bu[i] = gub[2 * i + 1];
    if (rc == TKD_OK)
        rc = tkd_model_put_tensor(m, stacks[3], bg);
    if (rc == TKD_OK)
        rc = tkd_model_put_tensor(m, stacks[4], bu);
    free(gub);
    return rc == TKD_OK ? tkd_model_load_mxfp4_layer(m, dir, st, l) : rc;
}

/* The five stacks of block l in m->info (they are all in its range). */
static void find_gpt_oss_stacks(const tkd_model *m, int l, const tkd_param_info *stacks[5])
{
    for (int i = m->info_layer[l]; i < m->info_layer[l + 1]; i++) {
        int ll, j = gpt_oss_stack(m, m->info[i].name, &ll);
        if (j >= 0)
            stacks[j] = &m->info[i];
    }
}

/* Reads every tensor the layout lists (converted to fp32, then to the backend's act type through a
 * staging buffer where the backend's memory is not the host's); gpt-oss's expert stacks come from
 * the checkpoint's own tensors, a layer at a time (load_gpt_oss_experts). */
static tkd_status read_tensors(tkd_model *m, const char *dir, const tkd_st_dir *st)
{
    int on_host = tkd_backend_host_f32(m->be); /* straight into the host weights */
    float *stage = on_host ? NULL : malloc(tkd_model_largest_tensor(m) * sizeof(float));
    if (!on_host && !stage)
        return tkd_error_set(TKD_ERR_NOMEM, "%s: out of host memory for the load's staging buffer", dir);
    gpt_oss_stage gs = {0};
    tkd_status rc = TKD_OK;
    for (int i = 0; i < m->n_info && rc == TKD_OK; i++) {
        const tkd_param_info *p = &m->info[i];
        const tkd_st_tensor *t = NULL;
        size_t first = 0;
        /* a layer's experts are read at its first stack: w_gate, or b_gate when the weights stay MXFP4 */
        int l, j = gpt_oss_stack(m, p->name, &l), at = m->cfg.experts_mxfp4 ? 3 : 0;
        if (j > at)
            continue;
        if (j == at) {
            const tkd_param_info *stacks[5] = {NULL};
            find_gpt_oss_stacks(m, l, stacks);
            if (m->cfg.experts_mxfp4) {
                rc = load_gpt_oss_packed(m, dir, st, l, stacks);
                continue;
            }
            rc = gs.buf ? TKD_OK : gpt_oss_stage_alloc(m, on_host, &gs);
            if (rc == TKD_OK)
                rc = load_gpt_oss_experts(m, dir, st, l, stacks, on_host, &gs);
            continue;
        }
        rc = tensor_source(m, dir, st, p, &t, &first);
        if (rc != TKD_OK)
            break;
        float *x = on_host ? m->params + p->offset : stage;
        rc = tkd_st_slice_f32(t, first, p->numel, x);
        if (rc == TKD_OK && !on_host)
            rc = tkd_model_put_tensor(m, p, x);
    }
    free(gs.buf);
    free(stage);
    return rc;
}

static int cmp_name(const void *a, const void *b)
{
    return strcmp(*(const char *const *)a, *(const char *const *)b);
}

/* 1 when checkpoint tensor name is one the model reads: a layout name (looked up in names, the
 * layout's names sorted: Qwen3-30B-A3B lists 18,000), or an MoE layer's fused expert tensor. */
static int known_tensor(const tkd_model *m, const char **names, const char *name)
{
    static const char *gpt_oss_src[] = {"gate_up_proj", "gate_up_proj_bias", "gate_up_proj_blocks",
                                        "gate_up_proj_scales", "down_proj", "down_proj_blocks", "down_proj_scales"};
    int gl, gn = 0;
    char gkind[24];
    if (m->cfg.arch == TKD_ARCH_GPT_OSS &&
        sscanf(name, "model.layers.%d.mlp.experts.%23[a-z_]%n", &gl, gkind, &gn) == 2 && name[gn] == '\0' &&
        tkd_model_config_moe(&m->cfg, gl))
        for (size_t j = 0; j < sizeof gpt_oss_src / sizeof gpt_oss_src[0]; j++)
            if (!strcmp(gkind, gpt_oss_src[j]))
                return 1;
    if (ignorable(name) || (m->cfg.tie_word_embeddings && !strcmp(name, "lm_head.weight")) ||
        bsearch(&name, names, (size_t)m->n_info, sizeof *names, cmp_name))
        return 1;
    int l, n = 0;
    char kind[16];
    return sscanf(name, "model.layers.%d.mlp.experts.%15[a-z_]%n", &l, kind, &n) == 2 && name[n] == '\0' &&
           tkd_model_config_moe(&m->cfg, l) && (!strcmp(kind, "gate_up_proj") || !strcmp(kind, "down_proj"));
}

static tkd_status load_tensors(tkd_model *m, const char *dir, const tkd_st_dir *st)
{
    TKD_TRY(read_tensors(m, dir, st));
    const char **names = malloc((size_t)m->n_info * sizeof *names);
    if (!names)
        return tkd_error_set(TKD_ERR_NOMEM, "%s: out of memory", dir);
    for (int j = 0; j < m->n_info; j++)
        names[j] = m->info[j].name;
    qsort(names, (size_t)m->n_info, sizeof *names, cmp_name);
    /* A tensor we would silently ignore means the config and the weights disagree (e.g. q/k/v
     * biases present but attention_bias false): refuse rather than compute something else. */
    for (int i = 0; i < tkd_st_count(st); i++) {
        const tkd_st_tensor *t = tkd_st_at(st, i);
        if (!known_tensor(m, names, t->name)) {
            free(names);
            return tkd_error_set(TKD_ERR_FORMAT,
                                 "%s: tensor '%s' is not part of the architecture config.json describes "
                                 "(check num_hidden_layers, attention_bias, tie_word_embeddings, "
                                 "mlp_only_layers)", t->file, t->name);
        }
    }
    free(names);
    return TKD_OK;
}

static tkd_status load_hf(const char *dir, tkd_backend *be, int own_be, int trainable, tkd_model **out)
{
    *out = NULL;
    char path[4096];
    snprintf(path, sizeof path, "%s/config.json", dir);
    tkd_model_config cfg;
    tkd_st_dir *st = NULL;
    tkd_status rc = tkd_hf_config_read(path, &cfg);
    if (rc == TKD_OK)
        rc = tkd_st_open(dir, &st);
    if (rc != TKD_OK) {
        if (own_be)
            tkd_backend_close(be);
        return rc;
    }
    tkd_model *m = NULL;
    rc = tkd_model_create(&cfg, be, own_be, trainable, &m);
    if (rc == TKD_OK)
        rc = load_tensors(m, dir, st);
    tkd_st_close(st);
    if (rc != TKD_OK) {
        tkd_model_free(m);
        return rc;
    }
    *out = m;
    return TKD_OK;
}

tkd_status tkd_model_load_hf(const char *dir, tkd_model **out)
{
    *out = NULL;
    tkd_backend *be = NULL;
    TKD_TRY(tkd_backend_cpu_open(&be));
    return load_hf(dir, be, 1, 0, out);
}

tkd_status tkd_model_load_hf_on(const char *dir, tkd_backend *be, tkd_model **out)
{
    return load_hf(dir, be, 0, 0, out);
}

tkd_status tkd_model_load_hf_for_training(const char *dir, tkd_backend *be, tkd_model **out)
{
    return load_hf(dir, be, 0, 1, out);
}

tkd_status tkd_model_get_params(const tkd_model *m, float *host)
{
    if (!has_master(m))
        return tkd_error_set(TKD_ERR_UNSUPPORTED, "model: no fp32 weights to read (an inference model on %s)",
                             m->be->name);
    if (m->params) {
        memcpy(host, m->params, m->n_params * sizeof(float));
        return TKD_OK;
    }
    return m->be->op->master_download(m->be, host, m->dparams, m->master_lo, m->n_params);
}

tkd_status tkd_model_set_params(tkd_model *m, const float *host)
{
    if (!has_master(m))
        return tkd_error_set(TKD_ERR_UNSUPPORTED, "model: no fp32 weights to set (an inference model on %s)",
                             m->be->name);
    if (m->params) {
        memcpy(m->params, host, m->n_params * sizeof(float));
        return TKD_OK;
    }
    return m->be->op->master_upload(m->be, m->dparams, m->master_lo, host, m->n_params);
}

/* The writer of tkd_model_save_hf over host fp32 weights params (the model's layout). */
static tkd_status save_hf(const tkd_model *m, const float *params, const char *dir, tkd_dtype dtype)
{
    if (dtype != TKD_DTYPE_F32 && dtype != TKD_DTYPE_BF16)
        return tkd_error_set(TKD_ERR_INVALID_ARG, "%s: checkpoints are written in F32 or BF16", dir);
    if (mkdir(dir, 0755) != 0 && errno != EEXIST)
        return tkd_error_set(errno == ENOSPC ? TKD_ERR_NOSPACE : TKD_ERR_IO, "%s: cannot create directory: %s",
                             dir, strerror(errno));
    char path[4096];
    snprintf(path, sizeof path, "%s/config.json", dir);
    TKD_TRY(tkd_hf_config_write(path, &m->cfg, dtype == TKD_DTYPE_F32 ? "float32" : "bfloat16"));
    tkd_st_writer *w = NULL;
    TKD_TRY(tkd_st_writer_init(&w, dtype));
    tkd_status rc = TKD_OK;
    for (int i = 0; i < m->n_info && rc == TKD_OK; i++)
        rc = tkd_st_writer_add(w, m->info[i].name, m->info[i].ndim, m->info[i].shape,
                               params + m->info[i].offset);
    snprintf(path, sizeof path, "%s/model.safetensors", dir);
    if (rc == TKD_OK)
        rc = tkd_st_writer_finish(w, path);
    tkd_st_writer_free(w);
    return rc;
}

tkd_status tkd_model_save_hf(const tkd_model *m, const char *dir, tkd_dtype dtype)
{
    if (m->cfg.arch == TKD_ARCH_GPT_OSS) /* its experts live in the op's layout, not transformers' */
        return tkd_error_set(TKD_ERR_UNSUPPORTED, "%s: saving a GptOssForCausalLM checkpoint is not supported (a "
                             "teacher only)", dir);
    if (m->params)
        return save_hf(m, m->params, dir, dtype);
    if (!has_master(m))
        return tkd_error_set(TKD_ERR_UNSUPPORTED, "%s: this model has no fp32 weights to save (an inference "
                             "model on %s)", dir, m->be->name);
    float *host = malloc(m->n_params * sizeof(float));
    if (!host)
        return tkd_error_set(TKD_ERR_NOMEM, "%s: out of host memory for the %zu weights to save", dir, m->n_params);
    tkd_status rc = tkd_model_get_params(m, host);
    if (rc == TKD_OK)
        rc = save_hf(m, host, dir, dtype);
    free(host);
    return rc;
}
