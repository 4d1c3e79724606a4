/* model.c — see model.h. Every op goes through the backend's table (kernels/backend.h); the RoPE
 * tables are built on the host by the backend-neutral kernels/rope_table.h. This file: the parameter
 * layout, creating and freeing a model, random initialisation; HF checkpoints are model_hf.c, the
 * activations, forward and backward model_fwd_bwd.c (shared state in model_internal.h). */
#include "model/model.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/rope_table.h"
#include "model/model_internal.h"

/* ---- parameter layout --------------------------------------------------------------------- */

enum { LAYER_SLOTS = 24 }; /* a block's tensor slots: see slot_count */

static void add_param(tkd_model *m, size_t *off, const char *name, int ndim, int64_t d0, int64_t d1,
                      int decay)
{
    tkd_param_info *p = &m->info[m->n_info++];
    snprintf(p->name, sizeof p->name, "%s", name);
    p->ndim = ndim;
    p->shape[0] = d0;
    p->shape[1] = ndim == 2 ? d1 : 0;
    p->numel = (size_t)d0 * (size_t)(ndim == 2 ? d1 : 1);
    p->offset = *off;
    p->decay = decay;
    *off += p->numel;
}

/* Block l's MoE MLP: the router, then every expert's gate, every expert's up, every expert's down
 * (the checkpoints' per-expert names), so that each kind stacks into the op's (E, I, D) / (E, D, I). */
static void add_moe_layout(tkd_model *m, size_t *off, int l)
{
    const tkd_model_config *c = &m->cfg;
    int64_t D = c->hidden_size, I = c->moe_intermediate_size;
    static const char *kind[3] = {"gate_proj", "up_proj", "down_proj"};
    char nm[TKD_PARAM_NAME_MAX];
    snprintf(nm, sizeof nm, "model.layers.%d.mlp.gate.weight", l);
    add_param(m, off, nm, 2, c->num_experts, D, 1);
    for (int j = 0; j < 3; j++)
        for (int e = 0; e < c->num_experts; e++) {
            snprintf(nm, sizeof nm, "model.layers.%d.mlp.experts.%d.%s.weight", l, e, kind[j]);
            add_param(m, off, nm, 2, j == 2 ? D : I, j == 2 ? I : D, 1);
        }
}

/* gpt-oss's MoE MLP: the router (mlp.router.weight, a checkpoint name), then the experts' stacks
 * in the op's layout under internal names (the checkpoint's interleaved gate_up_proj (E, D, 2I) and
 * down_proj (E, I, D) are converted at load: model_hf.c). Their biases follow in add_layer_tail. */
static void add_gpt_oss_moe_layout(tkd_model *m, size_t *off, int l)
{
    const tkd_model_config *c = &m->cfg;
    int64_t D = c->hidden_size, I = c->moe_intermediate_size, E = c->num_experts;
    char nm[TKD_PARAM_NAME_MAX];
    snprintf(nm, sizeof nm, "model.layers.%d.mlp.router.weight", l);
    add_param(m, off, nm, 2, E, D, 1);
    if (c->experts_mxfp4) /* kept as MXFP4 outside the layout (model_mxfp4.c) */
        return;
    snprintf(nm, sizeof nm, "model.layers.%d.mlp.experts.w_gate", l);
    add_param(m, off, nm, 2, E * I, D, 1);
    snprintf(nm, sizeof nm, "model.layers.%d.mlp.experts.w_up", l);
    add_param(m, off, nm, 2, E * I, D, 1);
    snprintf(nm, sizeof nm, "model.layers.%d.mlp.experts.w_down", l);
    add_param(m, off, nm, 2, E * D, I, 1);
}

/* The optional tensors stored after the rest of block l (slots 18-23, see slot_count): o_proj's
 * bias, the attention sinks, and gpt-oss's router and expert biases. */
static void add_layer_tail(tkd_model *m, size_t *off, int l)
{
    const tkd_model_config *c = &m->cfg;
    int64_t D = c->hidden_size, I = c->moe_intermediate_size, E = c->num_experts;
    char nm[TKD_PARAM_NAME_MAX];
    if (tkd_model_config_o_bias(c)) {
        snprintf(nm, sizeof nm, "model.layers.%d.self_attn.o_proj.bias", l);
        add_param(m, off, nm, 1, D, 0, 0);
    }
    if (tkd_arch_sinks(c->arch)) {
        snprintf(nm, sizeof nm, "model.layers.%d.self_attn.sinks", l);
        add_param(m, off, nm, 1, c->num_attention_heads, 0, 0);
    }
    if (c->arch != TKD_ARCH_GPT_OSS || !tkd_model_config_moe(c, l))
        return;
    snprintf(nm, sizeof nm, "model.layers.%d.mlp.router.bias", l);
    add_param(m, off, nm, 1, E, 0, 0);
    snprintf(nm, sizeof nm, "model.layers.%d.mlp.experts.b_gate", l);
    add_param(m, off, nm, 2, E, I, 0);
    snprintf(nm, sizeof nm, "model.layers.%d.mlp.experts.b_up", l);
    add_param(m, off, nm, 2, E, I, 0);
    snprintf(nm, sizeof nm, "model.layers.%d.mlp.experts.down_proj_bias", l);
    add_param(m, off, nm, 2, E, D, 0);
}

/* Entries of m->info for cfg: embedding, final norm, head, and per block at most LAYER_SLOTS
 * plus, for an MoE block, the router and 3·E expert tensors. */
static size_t info_capacity(const tkd_model_config *c)
{
    size_t n = 3 + (size_t)LAYER_SLOTS * c->num_hidden_layers;
    for (int l = 0; l < c->num_hidden_layers; l++)
        n += tkd_model_config_moe(c, l) ? 1 + 3 * (size_t)c->num_experts : 0;
    return n;
}

/* Fills m->info in storage order (the order HF models list their parameters). */
static void build_layout(tkd_model *m)
{
    const tkd_model_config *c = &m->cfg;
    int64_t D = c->hidden_size, F = c->intermediate_size, V = c->vocab_size;
    size_t off = 0;
    char nm[TKD_PARAM_NAME_MAX];
    add_param(m, &off, "model.embed_tokens.weight", 2, V, D, 1);
    for (int l = 0; l < c->num_hidden_layers; l++) {
        m->info_layer[l] = m->n_info;
#define P(suffix, nd, a, b, decay)                                              \
    do {                                                                        \
        snprintf(nm, sizeof nm, "model.layers.%d.%s", l, suffix);               \
        add_param(m, &off, nm, nd, a, b, decay);                                \
    } while (0)
        P("input_layernorm.weight", 1, D, 0, 0);
        P("self_attn.q_proj.weight", 2, q_dim(c), D, 1);
        if (c->attention_bias)
            P("self_attn.q_proj.bias", 1, q_dim(c), 0, 0);
        P("self_attn.k_proj.weight", 2, kv_dim(c), D, 1);
        if (c->attention_bias)
            P("self_attn.k_proj.bias", 1, kv_dim(c), 0, 0);
        P("self_attn.v_proj.weight", 2, kv_dim(c), D, 1);
        if (c->attention_bias)
            P("self_attn.v_proj.bias", 1, kv_dim(c), 0, 0);
        P("self_attn.o_proj.weight", 2, D, q_dim(c), 1);
        if (tkd_arch_qk_norm(c->arch)) {
            P("self_attn.q_norm.weight", 1, c->head_dim, 0, 0);
            P("self_attn.k_norm.weight", 1, c->head_dim, 0, 0);
        }
        P("post_attention_layernorm.weight", 1, D, 0, 0);
        if (tkd_model_config_moe(c, l) && c->arch == TKD_ARCH_GPT_OSS) {
            add_gpt_oss_moe_layout(m, &off, l);
        } else if (tkd_model_config_moe(c, l)) {
            add_moe_layout(m, &off, l);
        } else {
            P("mlp.gate_proj.weight", 2, F, D, 1);
            P("mlp.up_proj.weight", 2, F, D, 1);
            P("mlp.down_proj.weight", 2, D, F, 1);
        }
#undef P
        add_layer_tail(m, &off, l);
    }
    m->info_layer[c->num_hidden_layers] = m->n_info;
    m->info_per_layer = c->num_hidden_layers > 0 && !tkd_model_config_has_moe(c)
                            ? (m->n_info - 1) / c->num_hidden_layers : 0;
    add_param(m, &off, "model.norm.weight", 1, D, 0, 0);
    if (!c->tie_word_embeddings)
        add_param(m, &off, "lm_head.weight", 2, V, D, 1);
    m->n_params = off;
}

/* How many entries of m->info slot j of block l takes (0: absent, its view NULL). The slots in
 * storage order; the optional ones are the q/k/v biases (with attention_bias), Qwen3's q/k norms,
 * the MLP: dense (gate, up, down at 11-13) or MoE (router at 14, the expert stacks at 15-17, each
 * E entries of m->info, or one for gpt-oss), then the tail (add_layer_tail): o_proj's bias at 18,
 * the sinks at 19, gpt-oss's router and expert biases at 20-23. */
static int slot_count(const tkd_model_config *c, int l, int j)
{
    int moe = tkd_model_config_moe(c, l), gpt_oss_moe = moe && c->arch == TKD_ARCH_GPT_OSS;
    if (j == 18)
        return tkd_model_config_o_bias(c);
    if (j == 19)
        return tkd_arch_sinks(c->arch);
    if (j >= 20)
        return gpt_oss_moe;
    if (j == 2 || j == 4 || j == 6)
        return c->attention_bias;
    if (j == 8 || j == 9)
        return tkd_arch_qk_norm(c->arch);
    if (j >= 11 && j <= 13)
        return !moe;
    if (j == 14)
        return moe;
    if (j >= 15)
        return gpt_oss_moe ? !c->experts_mxfp4 : moe ? c->num_experts : 0;
    return 1;
}

/* Points a weights struct's views at base (elements of esz bytes), following m->info's order.
 * One body for the host fp32 views (params, grads) and the backend views (dparams). */
#define SET_VIEWS(m, base, esz, w, ptr_t)                                                  \
    do {                                                                                   \
        const tkd_model_config *c_ = &(m)->cfg;                                            \
        int i_ = 0;                                                                        \
        char *b_ = (char *)(base);                                                         \
        (w)->embed = (ptr_t)(b_ + (m)->info[i_++].offset * (esz));                        \
        for (int l_ = 0; l_ < c_->num_hidden_layers; l_++) {                               \
            ptr_t *f_[LAYER_SLOTS];                                                        \
            layer_fields_##ptr_t(&(w)->layers[l_], f_);                                    \
            for (int j_ = 0; j_ < LAYER_SLOTS; j_++) {                                     \
                int n_ = slot_count(c_, l_, j_);                                           \
                *f_[j_] = n_ ? (ptr_t)(b_ + (m)->info[i_].offset * (esz)) : NULL;          \
                i_ += n_;                                                                  \
            }                                                                              \
        }                                                                                  \
        (w)->final_norm = (ptr_t)(b_ + (m)->info[i_++].offset * (esz));                   \
        (w)->lm_head = c_->tie_word_embeddings ? (w)->embed                                \
                                               : (ptr_t)(b_ + (m)->info[i_++].offset * (esz)); \
    } while (0)

typedef float *fptr;
typedef const void *cvptr;

/* A block's slots in storage order (q/k/v biases at 2, 4, 6; q/k norms at 8, 9; see slot_count). */
static void layer_fields_fptr(tkd_layer_weights *L, fptr *f[LAYER_SLOTS])
{
    fptr *a[LAYER_SLOTS] = {&L->attn_norm, &L->wq, &L->bq, &L->wk, &L->bk, &L->wv, &L->bv,
                            &L->wo, &L->q_norm, &L->k_norm, &L->mlp_norm, &L->wg, &L->wu, &L->wd,
                            &L->router, &L->eg, &L->eu, &L->ed, &L->bo, &L->sinks, &L->router_b,
                            &L->ebg, &L->ebu, &L->ebd};
    memcpy(f, a, sizeof a);
}

static void layer_fields_cvptr(tkd_layer_dweights *L, cvptr *f[LAYER_SLOTS])
{
    cvptr *a[LAYER_SLOTS] = {&L->attn_norm, &L->wq, &L->bq, &L->wk, &L->bk, &L->wv, &L->bv,
                             &L->wo, &L->q_norm, &L->k_norm, &L->mlp_norm, &L->wg, &L->wu, &L->wd,
                             &L->router, &L->eg, &L->eu, &L->ed, &L->bo, &L->sinks, &L->router_b,
                             &L->ebg, &L->ebu, &L->ebd};
    memcpy(f, a, sizeof a);
}

void tkd_model_set_views(const tkd_model *m, float *base, tkd_model_weights *w)
{
    SET_VIEWS(m, base, sizeof(float), w, fptr);
}

static void set_dviews(tkd_model *m)
{
    SET_VIEWS(m, m->dparams, m->be->act_size, &m->d, cvptr);
}

static tkd_status model_alloc_weights(tkd_model *m, int trainable);

/* Allocates a model for cfg on be (owned when own_be) with zeroed compute weights: on the CPU the
 * fp32 params themselves, elsewhere backend memory and no host params (and, when trainable, the
 * master weights' residuals in backend memory). No gradients/activations. */
tkd_status tkd_model_create(const tkd_model_config *cfg, tkd_backend *be, int own_be, int trainable,
                            tkd_model **out)
{
    *out = NULL;
    tkd_status st = tkd_model_config_validate(cfg);
    if (st == TKD_OK && cfg->head_dim % 2 != 0)
        st = tkd_error_set(TKD_ERR_UNSUPPORTED, "head_dim %d: RoPE needs an even head_dim", cfg->head_dim);
    tkd_model *m = st == TKD_OK ? calloc(1, sizeof *m) : NULL;
    if (!m) {
        if (own_be)
            tkd_backend_close(be);
        return st != TKD_OK ? st : tkd_error_set(TKD_ERR_NOMEM, "model: out of memory");
    }
    m->cfg = *cfg;
    /* gpt-oss's MXFP4 experts stay MXFP4 where the MoE op takes them (an inference model) */
    m->cfg.experts_mxfp4 = cfg->arch == TKD_ARCH_GPT_OSS && cfg->quant_mxfp4 && be->moe_mxfp4 && !trainable;
    m->be = be;
    m->be_owned = own_be;
    int L = cfg->num_hidden_layers, half = cfg->head_dim / 2, P = cfg->max_position_embeddings;
    m->info = calloc(info_capacity(cfg), sizeof *m->info);
    m->info_layer = calloc((size_t)L + 1, sizeof *m->info_layer);
    m->w.layers = calloc((size_t)L, sizeof *m->w.layers);
    m->g.layers = calloc((size_t)L, sizeof *m->g.layers);
    m->d.layers = calloc((size_t)L, sizeof *m->d.layers);
    m->rope_cos = malloc(sizeof(float) * (size_t)P * half);
    m->rope_sin = malloc(sizeof(float) * (size_t)P * half);
    if (!m->info || !m->info_layer || !m->w.layers || !m->g.layers || !m->d.layers || !m->rope_cos || !m->rope_sin) {
        tkd_model_free(m);
        return tkd_error_set(TKD_ERR_NOMEM, "model: out of memory");
    }
    build_layout(m);
    st = model_alloc_weights(m, trainable);
    if (st != TKD_OK) {
        tkd_model_free(m);
        return st;
    }
    *out = m;
    return TKD_OK;
}

/* The compute weights and RoPE tables: host params on the CPU (aliased by the backend views; they
 * are the master weights too), one backend allocation elsewhere, plus one for the residuals that
 * make the compute copy exact fp32 master weights in a trainable model (be->master_lo_size). */
static tkd_status model_alloc_weights(tkd_model *m, int trainable)
{
    const tkd_model_config *cfg = &m->cfg;
    int half = cfg->head_dim / 2, P = cfg->max_position_embeddings;
    size_t rope_n = (size_t)P * half;
    float inv[1024];
    if (half > (int)(sizeof inv / sizeof inv[0]))
        return tkd_error_set(TKD_ERR_UNSUPPORTED, "head_dim %d: at most 2048 is supported", cfg->head_dim);
    float scale = 1.0f; /* YaRN's attention factor, applied to cos and sin as transformers does */
    if (cfg->rope_scaling == TKD_ROPE_SCALING_YARN)
        tkd_rope_inv_freq_yarn(cfg->rope_theta, cfg->head_dim, cfg->rope_factor, cfg->rope_beta_fast,
                               cfg->rope_beta_slow, cfg->rope_original_max_pos, cfg->rope_truncate,
                               cfg->rope_attention_factor, inv, &scale);
    else
        tkd_rope_inv_freq(cfg->rope_theta, cfg->head_dim, cfg->rope_scaling == TKD_ROPE_SCALING_LLAMA3,
                          cfg->rope_factor, cfg->rope_low_freq_factor, cfg->rope_high_freq_factor,
                          cfg->rope_original_max_pos, inv);
    tkd_rope_table_scaled(inv, cfg->head_dim, P, scale, m->rope_cos, m->rope_sin);
    if (tkd_backend_host_f32(m->be)) {
        m->params = calloc(m->n_params, sizeof(float));
        if (!m->params)
            return tkd_error_set(TKD_ERR_NOMEM, "model: out of memory for %zu parameters", m->n_params);
        tkd_model_set_views(m, m->params, &m->w);
        m->dparams = m->params;
        m->d_rope_cos = m->rope_cos;
        m->d_rope_sin = m->rope_sin;
    } else {
        const tkd_backend_ops *op = m->be->op;
        TKD_TRY(op->alloc(m->be, m->n_params * m->be->act_size, "model weights", &m->dparams));
        if (trainable) /* the master weights' low halves (the compute copy is their high half) */
            TKD_TRY(op->alloc(m->be, m->n_params * m->be->master_lo_size, "model: master weights' residuals",
                              &m->master_lo));
        TKD_TRY(op->alloc(m->be, 2 * rope_n * sizeof(float), "RoPE tables", (void **)&m->d_rope_cos));
        m->d_rope_sin = m->d_rope_cos + rope_n;
        TKD_TRY(op->upload(m->be, m->d_rope_cos, m->rope_cos, rope_n * sizeof(float)));
        TKD_TRY(op->upload(m->be, m->d_rope_sin, m->rope_sin, rope_n * sizeof(float)));
    }
    set_dviews(m);
    return tkd_model_alloc_mxfp4(m);
}

void tkd_model_free_acts(tkd_model *m)
{
    tkd_model_acts *a = m->acts;
    if (!a)
        return;
    m->be->op->free(m->be, a->buf);
    m->be->op->free(m->be, a->tokens);
    m->be->op->free(m->be, a->doc);
    m->be->op->free(m->be, a->rope_tok);
    free(a->rope_host);
    if (m->moe)
        m->be->op->moe_free(m->be, m->moe);
    m->moe = NULL;
    m->moe_rows = 0;
    free(a->layer);
    free(a);
    m->acts = NULL;
}

void tkd_model_free(tkd_model *m)
{
    if (!m)
        return;
    if (m->be) {
        tkd_model_free_acts(m);
        m->be->op->free(m->be, m->grads);
        m->be->op->free(m->be, m->master_lo);
        if (m->dparams != m->params)
            m->be->op->free(m->be, m->dparams);
        if (m->d_rope_cos != m->rope_cos)
            m->be->op->free(m->be, m->d_rope_cos);
        m->be->op->free(m->be, m->qexp);
        if (m->be_owned)
            tkd_backend_close(m->be);
    }
    free(m->params);
    free(m->info);
    free(m->info_layer);
    free(m->w.layers);
    free(m->g.layers);
    free(m->d.layers);
    free(m->rope_cos);
    free(m->rope_sin);
    free(m->qlayer);
    free(m);
}

const tkd_param_info *tkd_model_params(const tkd_model *m, int *n)
{
    *n = m->n_info;
    return m->info;
}

/* ---- random init -------------------------------------------------------------------------- */

/* splitmix64's output for state s (the state before the call is s - golden). */
static uint64_t splitmix64_at(uint64_t s)
{
    uint64_t z = s;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

/* The i-th normal of the stream that starts at seed: Box-Muller on the 2i+1-th and 2i+2-th
 * splitmix64 outputs (53-bit uniforms in (0, 1)). The stream is counter-based, so any element can
 * be drawn on its own: the same numbers in any order or thread split, on every machine up to
 * libm's log/cos. */
static double randn_at(uint64_t seed, uint64_t i)
{
    const uint64_t golden = 0x9e3779b97f4a7c15ull;
    double u1 = ((splitmix64_at(seed + (2 * i + 1) * golden) >> 11) + 0.5) * 0x1p-53;
    double u2 = ((splitmix64_at(seed + (2 * i + 2) * golden) >> 11) + 0.5) * 0x1p-53;
    return sqrt(-2.0 * log(u1)) * cos(2.0 * M_PI * u2);
}

/* Fills tensor p into x (host fp32): norms 1, biases 0, the rest normal(0, std) drawn from the
 * stream at *drawn (which advances only for drawn tensors). */
static void init_tensor(const tkd_param_info *p, uint64_t seed, uint64_t *drawn, double std, float *x)
{
    int is_norm = strstr(p->name, "norm.weight") != NULL, is_bias = strstr(p->name, ".bias") != NULL;
    if (is_norm || is_bias) {
        for (size_t j = 0; j < p->numel; j++)
            x[j] = is_norm ? 1.0f : 0.0f;
        return;
    }
    uint64_t base = *drawn;
#pragma omp parallel for schedule(static) if (p->numel >= 65536)
    for (size_t j = 0; j < p->numel; j++)
        x[j] = (float)(randn_at(seed, base + j) * std);
    *drawn += p->numel;
}

/* Largest tensor, in elements: the staging buffer for backends whose memory is not the host's. */
size_t tkd_model_largest_tensor(const tkd_model *m)
{
    size_t n = 0;
    for (int i = 0; i < m->n_info; i++)
        n = m->info[i].numel > n ? m->info[i].numel : n;
    return n;
}


/* One fp32 tensor x (host) into the backend: exactly into the master weights when the model has
 * them (their high half is the compute copy), else rounded into the compute weights. */
tkd_status tkd_model_put_tensor(tkd_model *m, const tkd_param_info *p, const float *x)
{
    const tkd_backend_ops *op = m->be->op;
    void *w = (char *)m->dparams + p->offset * m->be->act_size;
    if (m->master_lo)
        return op->master_upload(m->be, w, (char *)m->master_lo + p->offset * m->be->master_lo_size, x, p->numel);
    return op->upload_f32(m->be, w, x, p->numel);
}

static tkd_status init_weights(tkd_model *m, uint64_t seed)
{
    int on_host = tkd_backend_host_f32(m->be); /* straight into the host weights */
    float *stage = on_host ? NULL : malloc(tkd_model_largest_tensor(m) * sizeof(float));
    if (!on_host && !stage)
        return tkd_error_set(TKD_ERR_NOMEM, "model: out of host memory for the init's staging buffer");
    uint64_t drawn = 0;
    tkd_status st = TKD_OK;
    for (int i = 0; i < m->n_info && st == TKD_OK; i++) {
        const tkd_param_info *p = &m->info[i];
        float *x = on_host ? m->params + p->offset : stage;
        init_tensor(p, seed, &drawn, m->cfg.initializer_range, x);
        if (!on_host)
            st = tkd_model_put_tensor(m, p, x);
    }
    free(stage);
    return st;
}

static tkd_status init_random_on(const tkd_model_config *cfg, uint64_t seed, tkd_backend *be, int trainable,
                                 tkd_model **out)
{
    TKD_TRY(tkd_model_create(cfg, be, 0, trainable, out));
    tkd_status st = init_weights(*out, seed);
    if (st != TKD_OK) {
        tkd_model_free(*out);
        *out = NULL;
    }
    return st;
}

tkd_status tkd_model_init_random_on(const tkd_model_config *cfg, uint64_t seed, tkd_backend *be, tkd_model **out)
{
    return init_random_on(cfg, seed, be, 0, out);
}

tkd_status tkd_model_create_unset(const tkd_model_config *cfg, tkd_backend *be, tkd_model **out)
{
    return tkd_model_create(cfg, be, 0, 0, out);
}

tkd_status tkd_model_init_random_for_training(const tkd_model_config *cfg, uint64_t seed, tkd_backend *be,
                                              tkd_model **out)
{
    return init_random_on(cfg, seed, be, 1, out);
}

tkd_status tkd_model_init_random(const tkd_model_config *cfg, uint64_t seed, tkd_model **out)
{
    *out = NULL;
    tkd_backend *be = NULL;
    TKD_TRY(tkd_backend_cpu_open(&be));
    TKD_TRY(tkd_model_create(cfg, be, 1, 0, out));
    return init_weights(*out, seed); /* cannot fail on the CPU */
}
