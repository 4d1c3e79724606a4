/* model.c — see model.h. Every op goes through the backend's table (kernels/backend.h); the RoPE
 * tables are built on the host by the backend-neutral kernels/rope_table.h. */
#include "model/model.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "kernels/rope_table.h"

/* One block's saved activations (backend memory); in inference every block aliases one set.
 * f32: the residual stream and rstd; act: everything the GEMMs read or write. */
typedef struct layer_acts {
    float *x;     // (N, D) f32 the block's residual input
    void *n1;     // (N, D) rmsnorm(x)
    float *rstd1; // (N)
    void *q;      // (N, H·Dh) after RoPE
    void *k;      // (N, Hkv·Dh) after RoPE
    void *v;      // (N, Hkv·Dh)
    void *att;    // the attention's saved state (backend->attn_saved_bytes)
    void *y;      // (N, H·Dh) attention output before o_proj
    void *ao;     // (N, D) o_proj(y)
    float *x2;    // (N, D) f32 x + ao
    void *n2;     // (N, D) rmsnorm(x2)
    float *rstd2; // (N)
    void *gt;     // (N, F) gate_proj(n2)
    void *up;     // (N, F) up_proj(n2)
    void *hm;     // (N, F) silu(gt)·up
    void *mo;     // (N, D) down_proj(hm)
} layer_acts;

struct tkd_model_acts {
    int cap_b, cap_t, training; /* what the buffers are sized for */
    size_t bytes;               /* of buf */
    void *buf;                  /* the one backend allocation every view below points into */
    int32_t *tokens;            // (cap_b·cap_t) backend copy of the last forward's tokens
    layer_acts *layer;          // (L) host array of views
    float *xl;                  // (N, D) f32 residual after the last block
    void *hidden;               // (N, D) final rmsnorm(xl)
    float *rstdf;               // (N)
    /* backward scratch (training only) */
    float *dx;                  // (N, D) f32
    void *dn, *dq, *dk, *dv, *dy, *dg, *du, *dh;
    int b, t;                   /* shape of the last forward */
    int have_train_fwd;         /* a training forward happened since the last backward */
};

/* ---- parameter layout --------------------------------------------------------------------- */

static int q_dim(const tkd_model_config *c) { return c->num_attention_heads * c->head_dim; }
static int kv_dim(const tkd_model_config *c) { return c->num_key_value_heads * c->head_dim; }

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

/* Fills m->info in storage order (the order HF models list their parameters). */
static void build_layout(tkd_model *m)
{
    const tkd_model_config *c = &m->cfg;
    int64_t D = c->hidden_size, F = c->intermediate_size, V = c->vocab_size;
    size_t off = 0;
    char nm[TKD_PARAM_NAME_MAX];
    add_param(m, &off, "model.embed_tokens.weight", 2, V, D, 1);
    for (int l = 0; l < c->num_hidden_layers; l++) {
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
        P("post_attention_layernorm.weight", 1, D, 0, 0);
        P("mlp.gate_proj.weight", 2, F, D, 1);
        P("mlp.up_proj.weight", 2, F, D, 1);
        P("mlp.down_proj.weight", 2, D, F, 1);
#undef P
    }
    m->info_per_layer = c->num_hidden_layers > 0 ? (m->n_info - 1) / c->num_hidden_layers : 0;
    add_param(m, &off, "model.norm.weight", 1, D, 0, 0);
    if (!c->tie_word_embeddings)
        add_param(m, &off, "lm_head.weight", 2, V, D, 1);
    m->n_params = off;
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
            ptr_t *f_[12];                                                                 \
            layer_fields_##ptr_t(&(w)->layers[l_], f_);                                    \
            for (int j_ = 0; j_ < 12; j_++) {                                              \
                int bias_ = j_ == 2 || j_ == 4 || j_ == 6;                                 \
                *f_[j_] = bias_ && !c_->attention_bias ? NULL                              \
                                                       : (ptr_t)(b_ + (m)->info[i_++].offset * (esz)); \
            }                                                                              \
        }                                                                                  \
        (w)->final_norm = (ptr_t)(b_ + (m)->info[i_++].offset * (esz));                   \
        (w)->lm_head = c_->tie_word_embeddings ? (w)->embed                                \
                                               : (ptr_t)(b_ + (m)->info[i_++].offset * (esz)); \
    } while (0)

typedef float *fptr;
typedef const void *cvptr;

/* A block's 12 tensor slots in storage order (q/k/v biases at 2, 4, 6). */
static void layer_fields_fptr(tkd_layer_weights *L, fptr *f[12])
{
    fptr *a[12] = {&L->attn_norm, &L->wq, &L->bq, &L->wk, &L->bk, &L->wv, &L->bv,
                   &L->wo, &L->mlp_norm, &L->wg, &L->wu, &L->wd};
    memcpy(f, a, sizeof a);
}

static void layer_fields_cvptr(tkd_layer_dweights *L, cvptr *f[12])
{
    cvptr *a[12] = {&L->attn_norm, &L->wq, &L->bq, &L->wk, &L->bk, &L->wv, &L->bv,
                    &L->wo, &L->mlp_norm, &L->wg, &L->wu, &L->wd};
    memcpy(f, a, sizeof a);
}

static void set_views(const tkd_model *m, float *base, tkd_model_weights *w)
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
static tkd_status model_create(const tkd_model_config *cfg, tkd_backend *be, int own_be, int trainable,
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
    m->be = be;
    m->be_owned = own_be;
    int L = cfg->num_hidden_layers, half = cfg->head_dim / 2, P = cfg->max_position_embeddings;
    m->info = calloc((size_t)(3 + 15 * L), sizeof *m->info);
    m->w.layers = calloc((size_t)L, sizeof *m->w.layers);
    m->g.layers = calloc((size_t)L, sizeof *m->g.layers);
    m->d.layers = calloc((size_t)L, sizeof *m->d.layers);
    m->rope_cos = malloc(sizeof(float) * (size_t)P * half);
    m->rope_sin = malloc(sizeof(float) * (size_t)P * half);
    if (!m->info || !m->w.layers || !m->g.layers || !m->d.layers || !m->rope_cos || !m->rope_sin) {
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
    tkd_rope_inv_freq(cfg->rope_theta, cfg->head_dim, cfg->rope_scaling == TKD_ROPE_SCALING_LLAMA3,
                      cfg->rope_factor, cfg->rope_low_freq_factor, cfg->rope_high_freq_factor,
                      cfg->rope_original_max_pos, inv);
    tkd_rope_table(inv, cfg->head_dim, P, m->rope_cos, m->rope_sin);
    if (tkd_backend_host_f32(m->be)) {
        m->params = calloc(m->n_params, sizeof(float));
        if (!m->params)
            return tkd_error_set(TKD_ERR_NOMEM, "model: out of memory for %zu parameters", m->n_params);
        set_views(m, m->params, &m->w);
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
    return TKD_OK;
}

static void free_acts(tkd_model *m)
{
    tkd_model_acts *a = m->acts;
    if (!a)
        return;
    m->be->op->free(m->be, a->buf);
    m->be->op->free(m->be, a->tokens);
    free(a->layer);
    free(a);
    m->acts = NULL;
}

void tkd_model_free(tkd_model *m)
{
    if (!m)
        return;
    if (m->be) {
        free_acts(m);
        m->be->op->free(m->be, m->grads);
        m->be->op->free(m->be, m->master_lo);
        if (m->dparams != m->params)
            m->be->op->free(m->be, m->dparams);
        if (m->d_rope_cos != m->rope_cos)
            m->be->op->free(m->be, m->d_rope_cos);
        if (m->be_owned)
            tkd_backend_close(m->be);
    }
    free(m->params);
    free(m->info);
    free(m->w.layers);
    free(m->g.layers);
    free(m->d.layers);
    free(m->rope_cos);
    free(m->rope_sin);
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
static size_t largest_tensor(const tkd_model *m)
{
    size_t n = 0;
    for (int i = 0; i < m->n_info; i++)
        n = m->info[i].numel > n ? m->info[i].numel : n;
    return n;
}

/* 1 when the model holds fp32 master weights (every CPU model; a _for_training one elsewhere). */
static int has_master(const tkd_model *m) { return m->params || m->master_lo; }

/* One fp32 tensor x (host) into the backend: exactly into the master weights when the model has
 * them (their high half is the compute copy), else rounded into the compute weights. */
static tkd_status put_tensor(tkd_model *m, const tkd_param_info *p, const float *x)
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
    float *stage = on_host ? NULL : malloc(largest_tensor(m) * sizeof(float));
    if (!on_host && !stage)
        return tkd_error_set(TKD_ERR_NOMEM, "model: out of host memory for the init's staging buffer");
    uint64_t drawn = 0;
    tkd_status st = TKD_OK;
    for (int i = 0; i < m->n_info && st == TKD_OK; i++) {
        const tkd_param_info *p = &m->info[i];
        float *x = on_host ? m->params + p->offset : stage;
        init_tensor(p, seed, &drawn, m->cfg.initializer_range, x);
        if (!on_host)
            st = put_tensor(m, p, x);
    }
    free(stage);
    return st;
}

static tkd_status init_random_on(const tkd_model_config *cfg, uint64_t seed, tkd_backend *be, int trainable,
                                 tkd_model **out)
{
    TKD_TRY(model_create(cfg, be, 0, trainable, out));
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
    TKD_TRY(model_create(cfg, be, 1, 0, out));
    return init_weights(*out, seed); /* cannot fail on the CPU */
}

/* ---- checkpoints -------------------------------------------------------------------------- */

/* Tensors a checkpoint may carry that we do not use (old Llama exports store RoPE buffers). */
static int ignorable(const char *name)
{
    return strstr(name, "rotary_emb.inv_freq") != NULL;
}

/* Reads every tensor the layout lists (converted to fp32, then to the backend's act type through a
 * staging buffer where the backend's memory is not the host's). */
static tkd_status read_tensors(tkd_model *m, const char *dir, const tkd_st_dir *st)
{
    int on_host = tkd_backend_host_f32(m->be); /* straight into the host weights */
    float *stage = on_host ? NULL : malloc(largest_tensor(m) * sizeof(float));
    if (!on_host && !stage)
        return tkd_error_set(TKD_ERR_NOMEM, "%s: out of host memory for the load's staging buffer", dir);
    tkd_status rc = TKD_OK;
    for (int i = 0; i < m->n_info && rc == TKD_OK; i++) {
        const tkd_param_info *p = &m->info[i];
        if (!tkd_st_find(st, p->name)) {
            rc = tkd_error_set(TKD_ERR_NOT_FOUND,
                               "%s: tensor '%s' is missing (config.json asks for it, shape (%lld%s%lld)); "
                               "check the checkpoint matches its config",
                               dir, p->name, (long long)p->shape[0], p->ndim == 2 ? ", " : "",
                               p->ndim == 2 ? (long long)p->shape[1] : 0LL);
            break;
        }
        float *x = on_host ? m->params + p->offset : stage;
        rc = tkd_st_read_f32(st, p->name, p->ndim, p->shape, x, p->numel);
        if (rc == TKD_OK && !on_host)
            rc = put_tensor(m, p, x);
    }
    free(stage);
    return rc;
}

static tkd_status load_tensors(tkd_model *m, const char *dir, const tkd_st_dir *st)
{
    TKD_TRY(read_tensors(m, dir, st));
    /* A tensor we would silently ignore means the config and the weights disagree (e.g. q/k/v
     * biases present but attention_bias false): refuse rather than compute something else. */
    for (int i = 0; i < tkd_st_count(st); i++) {
        const tkd_st_tensor *t = tkd_st_at(st, i);
        int known = ignorable(t->name) || (m->cfg.tie_word_embeddings && !strcmp(t->name, "lm_head.weight"));
        for (int j = 0; j < m->n_info && !known; j++)
            known = !strcmp(t->name, m->info[j].name);
        if (!known)
            return tkd_error_set(TKD_ERR_FORMAT,
                                 "%s: tensor '%s' is not part of the architecture config.json describes "
                                 "(check num_hidden_layers, attention_bias, tie_word_embeddings)",
                                 t->file, t->name);
    }
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
    rc = model_create(&cfg, be, own_be, trainable, &m);
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

/* ---- activations -------------------------------------------------------------------------- */

/* Hands out n elements of esz bytes from buf at *off (64-byte aligned); with buf NULL only counts. */
static void *take(char *buf, size_t *off, size_t n, size_t esz)
{
    void *p = buf ? buf + *off : NULL;
    *off += (n * esz + 63) / 64 * 64;
    return p;
}

/* Points a's views into buf (NULL: sizing pass) and returns the bytes needed. a->layer must exist. */
static size_t carve(const tkd_model *m, tkd_model_acts *a, char *buf, int B, int T, int training)
{
    const tkd_model_config *c = &m->cfg;
    size_t N = (size_t)B * T, D = c->hidden_size, F = c->intermediate_size;
    size_t Q = q_dim(c), KV = kv_dim(c), A = m->be->act_size, S = sizeof(float);
    size_t att = m->be->op->attn_saved_bytes(m->be, B, T, c->num_attention_heads);
    size_t off = 0;
    for (int l = 0; l < c->num_hidden_layers; l++) {
        layer_acts *t = &a->layer[l];
        if (!training && l > 0) {
            *t = a->layer[0]; /* inference: every block reuses one set */
            continue;
        }
        /* recompute: each block's input is kept (attention: and its MLP's activations); the rest
         * is one set (block 0's), remade per block in backward. ao and mo are read only by the
         * forward's residual adds, so sharing them needs no recompute. */
        int shared = m->recompute != TKD_RECOMPUTE_NONE && l > 0;
        if (shared)
            *t = a->layer[0];
        t->x = take(buf, &off, N * D, S);
        if (shared && m->recompute == TKD_RECOMPUTE_FULL)
            continue;
        if (!shared) {
            t->n1 = take(buf, &off, N * D, A);
            t->rstd1 = take(buf, &off, N, S);
            t->q = take(buf, &off, N * Q, A);
            t->k = take(buf, &off, N * KV, A);
            t->v = take(buf, &off, N * KV, A);
            t->att = take(buf, &off, att, 1);
            t->y = take(buf, &off, N * Q, A);
            t->ao = take(buf, &off, N * D, A);
        }
        /* inference: the residual stream is updated in place */
        t->x2 = training ? take(buf, &off, N * D, S) : t->x;
        t->n2 = training ? take(buf, &off, N * D, A) : t->n1;
        t->rstd2 = take(buf, &off, N, S);
        t->gt = take(buf, &off, N * F, A);
        t->up = take(buf, &off, N * F, A);
        t->hm = take(buf, &off, N * F, A);
        if (!shared)
            t->mo = training ? take(buf, &off, N * D, A) : t->ao;
    }
    a->xl = training ? take(buf, &off, N * D, S) : a->layer[0].x;
    a->hidden = take(buf, &off, N * D, A);
    a->rstdf = take(buf, &off, N, S);
    if (training) {
        a->dx = take(buf, &off, N * D, S);
        a->dn = take(buf, &off, N * D, A);
        a->dq = take(buf, &off, N * Q, A);
        a->dy = take(buf, &off, N * Q, A);
        a->dk = take(buf, &off, N * KV, A);
        a->dv = take(buf, &off, N * KV, A);
        a->dg = take(buf, &off, N * F, A);
        a->du = take(buf, &off, N * F, A);
        a->dh = take(buf, &off, N * F, A);
    }
    return off;
}

/* The gradients: one backend allocation (host memory on the CPU), zeroed, laid out as params. */
static tkd_status alloc_grads(tkd_model *m)
{
    if (m->grads)
        return TKD_OK;
    if (!m->be->op->linear_bwd)
        return tkd_error_set(TKD_ERR_UNSUPPORTED, "model: training on the %s backend is not built — use device: cpu",
                             m->be->name);
    if (!has_master(m))
        return tkd_error_set(TKD_ERR_UNSUPPORTED, "model: this model was made for inference on %s (no fp32 master "
                             "weights); make it with tkd_model_*_for_training to train it", m->be->name);
    TKD_TRY(m->be->op->alloc(m->be, m->n_params * sizeof(float), "model: gradients", (void **)&m->grads));
    set_views(m, m->grads, &m->g);
    return TKD_OK;
}

size_t tkd_model_activation_bytes(const tkd_model *m)
{
    return m->acts ? m->acts->bytes : 0;
}

void tkd_model_set_recompute(tkd_model *m, tkd_recompute mode)
{
    if (m->recompute == mode)
        return;
    m->recompute = mode;
    free_acts(m); /* the next reserve carves for the new layout */
}

tkd_status tkd_model_reserve(tkd_model *m, int B, int T, int training)
{
    if (B <= 0 || T <= 0)
        return tkd_error_set(TKD_ERR_INVALID_ARG, "model: batch shape (%d, %d) must be positive", B, T);
    if (T > m->cfg.max_position_embeddings)
        return tkd_error_set(TKD_ERR_INVALID_ARG,
                             "model: sequence length %d exceeds max_position_embeddings %d; use a shorter seq_len",
                             T, m->cfg.max_position_embeddings);
    if (training)
        TKD_TRY(alloc_grads(m));
    tkd_model_acts *a = m->acts;
    if (a && a->cap_b >= B && a->cap_t >= T && a->training >= training)
        return TKD_OK;
    int nb = a && a->cap_b > B ? a->cap_b : B, nt = a && a->cap_t > T ? a->cap_t : T;
    int tr = training || (a && a->training);
    free_acts(m);
    a = calloc(1, sizeof *a);
    if (!a || !(a->layer = calloc((size_t)m->cfg.num_hidden_layers, sizeof *a->layer))) {
        free(a);
        return tkd_error_set(TKD_ERR_NOMEM, "model: out of memory");
    }
    m->acts = a;
    size_t n = carve(m, a, NULL, nb, nt, tr);
    char what[128];
    snprintf(what, sizeof what, "model: activations of batch (%d, %d)", nb, nt);
    tkd_status st = m->be->op->alloc(m->be, n, what, &a->buf);
    if (st == TKD_OK)
        st = m->be->op->alloc(m->be, sizeof(int32_t) * (size_t)nb * nt, "model: tokens", (void **)&a->tokens);
    if (st != TKD_OK) {
        free_acts(m);
        /* device allocations already say what to lower (cuda_mem); host ones do not */
        return st == TKD_ERR_NOMEM ? tkd_error_hint(st, "lower the batch size or the sequence length") : st;
    }
    a->cap_b = nb;
    a->cap_t = nt;
    a->bytes = n;
    a->training = tr;
    carve(m, a, a->buf, nb, nt, tr);
    return TKD_OK;
}

/* ---- forward / backward ------------------------------------------------------------------- */

/* A block's attention from A->n1 = rmsnorm(A->x): q, k (after RoPE), v, the attention output A->y
 * and its saved state (what the attention side's backward reads). */
static tkd_status block_attn_fwd(const tkd_model *m, const tkd_layer_dweights *W, layer_acts *A, int B, int T)
{
    const tkd_model_config *c = &m->cfg;
    const tkd_backend_ops *op = m->be->op;
    tkd_backend *be = m->be;
    int N = B * T, D = c->hidden_size, H = c->num_attention_heads;
    int Hkv = c->num_key_value_heads, Dh = c->head_dim, Q = q_dim(c), KV = kv_dim(c);
    TKD_TRY(op->linear_fwd(be, A->n1, W->wq, W->bq, N, D, Q, A->q));
    TKD_TRY(op->linear_fwd(be, A->n1, W->wk, W->bk, N, D, KV, A->k));
    TKD_TRY(op->linear_fwd(be, A->n1, W->wv, W->bv, N, D, KV, A->v));
    TKD_TRY(op->rope_fwd(be, A->q, A->k, N, T, H, Hkv, Dh, m->d_rope_cos, m->d_rope_sin));
    return op->attn_fwd(be, A->q, A->k, A->v, B, T, H, Hkv, Dh, A->y, A->att);
}

/* A block from A->n1 = rmsnorm(A->x) up to its MLP output A->mo (everything but the residual add
 * that makes the next block's input). */
static tkd_status block_fwd_body(const tkd_model *m, const tkd_layer_dweights *W, layer_acts *A, int B, int T)
{
    const tkd_model_config *c = &m->cfg;
    const tkd_backend_ops *op = m->be->op;
    tkd_backend *be = m->be;
    int N = B * T, D = c->hidden_size, F = c->intermediate_size, Q = q_dim(c);
    float eps = (float)c->rms_norm_eps;
    TKD_TRY(block_attn_fwd(m, W, A, B, T));
    TKD_TRY(op->linear_fwd(be, A->y, W->wo, NULL, N, Q, D, A->ao));
    TKD_TRY(op->add_rmsnorm_fwd(be, A->x, A->ao, A->x2, W->mlp_norm, N, D, eps, A->n2, A->rstd2));
    TKD_TRY(op->linear_fwd(be, A->n2, W->wg, NULL, N, D, F, A->gt));
    TKD_TRY(op->linear_fwd(be, A->n2, W->wu, NULL, N, D, F, A->up));
    TKD_TRY(op->swiglu_fwd(be, A->gt, A->up, (int64_t)N * F, A->hm));
    return op->linear_fwd(be, A->hm, W->wd, NULL, N, F, D, A->mo);
}

static tkd_status block_fwd(const tkd_model *m, const tkd_layer_dweights *W, layer_acts *A, float *xnext,
                            const void *next_norm, void *n_next, float *rstd_next, int B, int T)
{
    TKD_TRY(block_fwd_body(m, W, A, B, T));
    int N = B * T, D = m->cfg.hidden_size;
    return m->be->op->add_rmsnorm_fwd(m->be, A->x2, A->mo, xnext, next_norm, N, D, (float)m->cfg.rms_norm_eps, n_next,
                                      rstd_next);
}

/* Recompute: what block l did not keep, again from its kept input (same ops, same order: the same
 * values), into the one shared set, just before its backward: the attention side (attention mode)
 * or the whole block (full). */
static tkd_status block_recompute(const tkd_model *m, int l, layer_acts *A, int B, int T)
{
    int N = B * T, D = m->cfg.hidden_size;
    const tkd_layer_dweights *W = &m->d.layers[l];
    TKD_TRY(m->be->op->rmsnorm_fwd(m->be, A->x, W->attn_norm, N, D, (float)m->cfg.rms_norm_eps, A->n1, A->rstd1));
    if (m->recompute == TKD_RECOMPUTE_ATTENTION)
        return block_attn_fwd(m, W, A, B, T);
    return block_fwd_body(m, W, A, B, T);
}

static tkd_status check_tokens(const tkd_model *m, const int32_t *tokens, int64_t N, int T)
{
    for (int64_t n = 0; n < N; n++)
        if (tokens[n] < 0 || tokens[n] >= m->cfg.vocab_size)
            return tkd_error_set(TKD_ERR_INVALID_ARG,
                                 "model: token %d at batch row %lld, position %lld is outside the vocabulary [0, %d)",
                                 tokens[n], (long long)(n / T), (long long)(n % T), m->cfg.vocab_size);
    return TKD_OK;
}

tkd_status tkd_model_forward(tkd_model *m, const int32_t *tokens, int B, int T, int training,
                             const void **hidden)
{
    const tkd_model_config *c = &m->cfg;
    const tkd_backend_ops *op = m->be->op;
    int64_t N = (int64_t)B * T;
    TKD_TRY(check_tokens(m, tokens, N, T));
    TKD_TRY(tkd_model_reserve(m, B, T, training));
    tkd_model_acts *a = m->acts;
    int L = c->num_hidden_layers, D = c->hidden_size;
    float eps = (float)c->rms_norm_eps;
    TKD_TRY(op->upload(m->be, a->tokens, tokens, sizeof(int32_t) * (size_t)N));
    TKD_TRY(op->embedding_fwd(m->be, a->tokens, (int)N, m->d.embed, D, a->layer[0].x));
    TKD_TRY(op->rmsnorm_fwd(m->be, a->layer[0].x, m->d.layers[0].attn_norm, (int)N, D, eps, a->layer[0].n1,
                            a->layer[0].rstd1));
    for (int l = 0; l < L; l++) {
        /* block l makes block l+1's input and its normed copy (training: l+1's own buffers;
         * inference: the one set, in place), the last block the final hidden states */
        layer_acts *A = &a->layer[training ? l : 0];
        int last = l + 1 == L;
        layer_acts *nx = last ? NULL : &a->layer[training ? l + 1 : 0];
        TKD_TRY(block_fwd(m, &m->d.layers[l], A, last ? a->xl : nx->x,
                          last ? m->d.final_norm : m->d.layers[l + 1].attn_norm, last ? a->hidden : nx->n1,
                          last ? a->rstdf : nx->rstd1, B, T));
    }
    a->b = B;
    a->t = T;
    a->have_train_fwd = training;
    if (hidden)
        *hidden = a->hidden;
    return TKD_OK;
}

/* The residual stream's gradient dx (f32) as the act-typed dy a linear backward reads: dx itself
 * where act is fp32 (the CPU), else a->dn, where the rmsnorm backward that last updated dx wrote it
 * rounded (residual_grad_act_out: no separate conversion pass over N·D). */
static const void *residual_grad_act(const tkd_model *m, tkd_model_acts *a)
{
    return m->be->act_size == sizeof(float) ? (const void *)a->dx : (const void *)a->dn;
}

/* Where an rmsnorm backward writes the new dx as act for the linear backward after it: a->dn (its
 * own dy, read by then, and free until that linear backward) unless act is fp32. */
static void *residual_grad_act_out(const tkd_model *m, tkd_model_acts *a)
{
    return m->be->act_size == sizeof(float) ? NULL : a->dn;
}

/* On entry a->dx = ∂loss/∂(block output), and residual_grad_act holds it as act; on return
 * ∂loss/∂(block input), also as act when act_out (the block below reads it). */
static tkd_status block_bwd(const tkd_model *m, const tkd_layer_dweights *W, tkd_layer_weights *G,
                            const layer_acts *A, tkd_model_acts *a, int B, int T, int act_out)
{
    const tkd_model_config *c = &m->cfg;
    const tkd_backend_ops *op = m->be->op;
    tkd_backend *be = m->be;
    int N = B * T, D = c->hidden_size, F = c->intermediate_size, H = c->num_attention_heads;
    int Hkv = c->num_key_value_heads, Dh = c->head_dim, Q = q_dim(c), KV = kv_dim(c);
    size_t NF = (size_t)N * F;
    const void *dres = residual_grad_act(m, a);
    /* The first contribution to each activation gradient overwrites it (dx_acc / acc 0, attn_bwd
     * always): no zeroing pass over dh, dg, du, dn, dy, dq, dk, dv. */
    /* MLP branch: out = x2 + down(silu(gate(n2)) · up(n2)) */
    TKD_TRY(op->linear_bwd(be, dres, A->hm, W->wd, N, F, D, a->dh, G->wd, NULL, 0));
    TKD_TRY(op->swiglu_bwd(be, a->dh, A->gt, A->up, (int64_t)NF, a->dg, a->du, 0));
    TKD_TRY(op->linear_bwd(be, a->dg, A->n2, W->wg, N, D, F, a->dn, G->wg, NULL, 0));
    TKD_TRY(op->linear_bwd(be, a->du, A->n2, W->wu, N, D, F, a->dn, G->wu, NULL, 1));
    TKD_TRY(op->rmsnorm_bwd(be, a->dn, A->x2, W->mlp_norm, A->rstd2, N, D, a->dx, G->mlp_norm,
                            residual_grad_act_out(m, a)));
    /* attention branch: x2 = x + o_proj(attn(...)) */
    TKD_TRY(op->linear_bwd(be, dres, A->y, W->wo, N, Q, D, a->dy, G->wo, NULL, 0));
    TKD_TRY(op->attn_bwd(be, a->dy, A->q, A->k, A->v, A->y, A->att, B, T, H, Hkv, Dh, a->dq, a->dk, a->dv));
    TKD_TRY(op->rope_bwd(be, a->dq, a->dk, N, T, H, Hkv, Dh, m->d_rope_cos, m->d_rope_sin));
    TKD_TRY(op->linear_bwd(be, a->dq, A->n1, W->wq, N, D, Q, a->dn, G->wq, G->bq, 0));
    TKD_TRY(op->linear_bwd(be, a->dk, A->n1, W->wk, N, D, KV, a->dn, G->wk, G->bk, 1));
    TKD_TRY(op->linear_bwd(be, a->dv, A->n1, W->wv, N, D, KV, a->dn, G->wv, G->bv, 1));
    return op->rmsnorm_bwd(be, a->dn, A->x, W->attn_norm, A->rstd1, N, D, a->dx, G->attn_norm,
                           act_out ? residual_grad_act_out(m, a) : NULL);
}

tkd_status tkd_model_backward(tkd_model *m, const float *dhidden)
{
    tkd_model_acts *a = m->acts;
    if (!a || !a->have_train_fwd || !m->grads)
        return tkd_error_set(TKD_ERR_INVALID_ARG, "model: backward needs a training forward (training = 1) first");
    const tkd_model_config *c = &m->cfg;
    const tkd_backend_ops *op = m->be->op;
    int B = a->b, T = a->t, N = B * T, D = c->hidden_size;
    const void *dy = dhidden;
    if (m->be->act_size != sizeof(float)) { /* the loss's fp32 gradient as the act the ops take */
        TKD_TRY(op->f32_to_act(m->be, dhidden, a->dn, (size_t)N * D));
        dy = a->dn; /* read by the final norm's backward, which then writes dx over it as act */
    }
    TKD_TRY(op->memset0(m->be, a->dx, sizeof(float) * (size_t)N * D));
    TKD_TRY(op->rmsnorm_bwd(m->be, dy, a->xl, m->d.final_norm, a->rstdf, N, D, a->dx, m->g.final_norm,
                            residual_grad_act_out(m, a)));
    for (int l = c->num_hidden_layers - 1; l >= 0; l--) {
        /* the last block's activations are still in the shared set: the forward ended with it */
        if (m->recompute != TKD_RECOMPUTE_NONE && l + 1 < c->num_hidden_layers)
            TKD_TRY(block_recompute(m, l, &a->layer[l], B, T));
        TKD_TRY(block_bwd(m, &m->d.layers[l], &m->g.layers[l], &a->layer[l], a, B, T, l > 0));
        if (m->grad_hook)
            TKD_TRY(m->grad_hook(m->grad_hook_ctx, m, l));
    }
    TKD_TRY(op->embedding_bwd(m->be, a->tokens, N, a->dx, D, m->g.embed));
    a->have_train_fwd = 0; /* activations are consumed: a second backward would double-count */
    return m->grad_hook ? m->grad_hook(m->grad_hook_ctx, m, -1) : TKD_OK;
}

void tkd_model_set_grad_hook(tkd_model *m, tkd_status (*fn)(void *ctx, tkd_model *m, int layer), void *ctx)
{
    m->grad_hook = fn;
    m->grad_hook_ctx = ctx;
}

void tkd_model_layer_range(const tkd_model *m, int l, size_t *begin, size_t *end)
{
    const int per = m->info_per_layer; /* the embedding is first, then block by block */
    *begin = m->info[1 + l * per].offset;
    *end = m->info[1 + (l + 1) * per].offset; /* the next block's first tensor, or the final norm */
}

const float *tkd_model_lm_head(const tkd_model *m) { return m->w.lm_head; }

const void *tkd_model_lm_head_dev(const tkd_model *m) { return m->d.lm_head; }

float *tkd_model_lm_head_grad(tkd_model *m) { return m->grads ? m->g.lm_head : NULL; }

tkd_status tkd_model_zero_grad(tkd_model *m)
{
    if (!m->grads)
        return TKD_OK;
    return m->be->op->memset0(m->be, m->grads, sizeof(float) * m->n_params);
}

tkd_status tkd_model_logits(const tkd_model *m, const void *hidden, int64_t N, void *logits)
{
    return m->be->op->linear_fwd(m->be, hidden, m->d.lm_head, NULL, (int)N, m->cfg.hidden_size, m->cfg.vocab_size,
                                 logits);
}
