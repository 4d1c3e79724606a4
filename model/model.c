/* model.c — see model.h. The layer maths is composed from kernels/cpu_ops.h. */
#include "model/model.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "kernels/cpu_ops.h"

/* One block's saved activations; in inference every block aliases the same set. */
typedef struct layer_acts {
    float *x;     // (N, D) the block's residual input
    float *n1;    // (N, D) rmsnorm(x)
    float *rstd1; // (N)
    float *q;     // (N, H·Dh) after RoPE
    float *k;     // (N, Hkv·Dh) after RoPE
    float *v;     // (N, Hkv·Dh)
    float *att;   // (B, H, T, T) softmax probabilities
    float *y;     // (N, H·Dh) attention output before o_proj
    float *x2;    // (N, D) x + o_proj(y)
    float *n2;    // (N, D) rmsnorm(x2)
    float *rstd2; // (N)
    float *gt;    // (N, F) gate_proj(n2)
    float *up;    // (N, F) up_proj(n2)
    float *hm;    // (N, F) silu(gt)·up
} layer_acts;

struct tkd_model_acts {
    int cap_b, cap_t, training; /* what the buffers are sized for */
    float *buf;                 /* the one allocation every float view below points into */
    int32_t *tokens;            // (cap_b·cap_t) copy of the last forward's tokens (embedding bwd)
    layer_acts *layer;          // (L)
    float *xl;                  // (N, D) residual after the last block
    float *hidden;              // (N, D) final rmsnorm(xl)
    float *rstdf;               // (N)
    /* backward scratch (training only) */
    float *dx, *dn, *dq, *dk, *dv, *dy, *dg, *du, *dh;
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
    add_param(m, &off, "model.norm.weight", 1, D, 0, 0);
    if (!c->tie_word_embeddings)
        add_param(m, &off, "lm_head.weight", 2, V, D, 1);
    m->n_params = off;
}

/* Points the views of w at base, following m->info's order. */
static void set_views(const tkd_model *m, float *base, tkd_model_weights *w)
{
    const tkd_model_config *c = &m->cfg;
    int i = 0;
#define NEXT() (base + m->info[i++].offset)
    w->embed = NEXT();
    for (int l = 0; l < c->num_hidden_layers; l++) {
        tkd_layer_weights *L = &w->layers[l];
        L->attn_norm = NEXT();
        L->wq = NEXT();
        L->bq = c->attention_bias ? NEXT() : NULL;
        L->wk = NEXT();
        L->bk = c->attention_bias ? NEXT() : NULL;
        L->wv = NEXT();
        L->bv = c->attention_bias ? NEXT() : NULL;
        L->wo = NEXT();
        L->mlp_norm = NEXT();
        L->wg = NEXT();
        L->wu = NEXT();
        L->wd = NEXT();
    }
    w->final_norm = NEXT();
    w->lm_head = c->tie_word_embeddings ? w->embed : NEXT();
#undef NEXT
}

/* Allocates a model for cfg with zeroed parameters, no gradients, no activations. */
static tkd_status model_create(const tkd_model_config *cfg, tkd_model **out)
{
    *out = NULL;
    TKD_TRY(tkd_model_config_validate(cfg));
    if (cfg->head_dim % 2 != 0)
        return tkd_error_set(TKD_ERR_UNSUPPORTED, "head_dim %d: RoPE needs an even head_dim", cfg->head_dim);
    tkd_model *m = calloc(1, sizeof *m);
    if (!m)
        return tkd_error_set(TKD_ERR_NOMEM, "model: out of memory");
    m->cfg = *cfg;
    int L = cfg->num_hidden_layers, half = cfg->head_dim / 2, P = cfg->max_position_embeddings;
    m->info = calloc((size_t)(3 + 15 * L), sizeof *m->info);
    m->w.layers = calloc((size_t)L, sizeof *m->w.layers);
    m->g.layers = calloc((size_t)L, sizeof *m->g.layers);
    m->rope_cos = malloc(sizeof(float) * (size_t)P * half);
    m->rope_sin = malloc(sizeof(float) * (size_t)P * half);
    float *inv = malloc(sizeof(float) * (size_t)half);
    if (m->info && m->w.layers && m->g.layers && m->rope_cos && m->rope_sin && inv) {
        build_layout(m);
        m->params = calloc(m->n_params, sizeof(float));
    }
    if (!m->params) {
        free(inv);
        tkd_model_free(m);
        return tkd_error_set(TKD_ERR_NOMEM, "model: out of memory for %zu parameters", m->n_params);
    }
    set_views(m, m->params, &m->w);
    tkd_cpu_rope_inv_freq(cfg->rope_theta, cfg->head_dim, cfg->rope_scaling == TKD_ROPE_SCALING_LLAMA3,
                          cfg->rope_factor, cfg->rope_low_freq_factor, cfg->rope_high_freq_factor,
                          cfg->rope_original_max_pos, inv);
    tkd_cpu_rope_table(inv, cfg->head_dim, P, m->rope_cos, m->rope_sin);
    free(inv);
    *out = m;
    return TKD_OK;
}

static void free_acts(tkd_model_acts *a)
{
    if (!a)
        return;
    free(a->buf);
    free(a->tokens);
    free(a->layer);
    free(a);
}

void tkd_model_free(tkd_model *m)
{
    if (!m)
        return;
    free(m->params);
    free(m->grads);
    free(m->info);
    free(m->w.layers);
    free(m->g.layers);
    free(m->rope_cos);
    free(m->rope_sin);
    free_acts(m->acts);
    free(m);
}

const tkd_param_info *tkd_model_params(const tkd_model *m, int *n)
{
    *n = m->n_info;
    return m->info;
}

/* ---- random init -------------------------------------------------------------------------- */

static uint64_t splitmix64(uint64_t *s)
{
    uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

/* Box-Muller on two 53-bit uniforms in (0, 1): platform-independent up to libm's log/cos. */
static double randn(uint64_t *s)
{
    double u1 = ((splitmix64(s) >> 11) + 0.5) * 0x1p-53;
    double u2 = ((splitmix64(s) >> 11) + 0.5) * 0x1p-53;
    return sqrt(-2.0 * log(u1)) * cos(2.0 * M_PI * u2);
}

tkd_status tkd_model_init_random(const tkd_model_config *cfg, uint64_t seed, tkd_model **out)
{
    TKD_TRY(model_create(cfg, out));
    tkd_model *m = *out;
    uint64_t s = seed;
    for (int i = 0; i < m->n_info; i++) {
        const tkd_param_info *p = &m->info[i];
        float *x = m->params + p->offset;
        int is_norm = strstr(p->name, "norm.weight") != NULL, is_bias = strstr(p->name, ".bias") != NULL;
        for (size_t j = 0; j < p->numel; j++)
            x[j] = is_norm ? 1.0f : is_bias ? 0.0f : (float)(randn(&s) * cfg->initializer_range);
    }
    return TKD_OK;
}

/* ---- checkpoints -------------------------------------------------------------------------- */

/* Tensors a checkpoint may carry that we do not use (old Llama exports store RoPE buffers). */
static int ignorable(const char *name)
{
    return strstr(name, "rotary_emb.inv_freq") != NULL;
}

static tkd_status load_tensors(tkd_model *m, const char *dir, const tkd_st_dir *st)
{
    for (int i = 0; i < m->n_info; i++) {
        const tkd_param_info *p = &m->info[i];
        if (!tkd_st_find(st, p->name))
            return tkd_error_set(TKD_ERR_NOT_FOUND,
                                 "%s: tensor '%s' is missing (config.json asks for it, shape (%lld%s%lld)); "
                                 "check the checkpoint matches its config",
                                 dir, p->name, (long long)p->shape[0], p->ndim == 2 ? ", " : "",
                                 p->ndim == 2 ? (long long)p->shape[1] : 0LL);
        TKD_TRY(tkd_st_read_f32(st, p->name, p->ndim, p->shape, m->params + p->offset, p->numel));
    }
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

tkd_status tkd_model_load_hf(const char *dir, tkd_model **out)
{
    *out = NULL;
    char path[4096];
    snprintf(path, sizeof path, "%s/config.json", dir);
    tkd_model_config cfg;
    TKD_TRY(tkd_hf_config_read(path, &cfg));
    tkd_st_dir *st = NULL;
    TKD_TRY(tkd_st_open(dir, &st));
    tkd_model *m = NULL;
    tkd_status rc = model_create(&cfg, &m);
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

tkd_status tkd_model_save_hf(const tkd_model *m, const char *dir, tkd_dtype dtype)
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
                               m->params + m->info[i].offset);
    snprintf(path, sizeof path, "%s/model.safetensors", dir);
    if (rc == TKD_OK)
        rc = tkd_st_writer_finish(w, path);
    tkd_st_writer_free(w);
    return rc;
}

/* ---- activations -------------------------------------------------------------------------- */

/* Hands out n floats from buf at *off; with buf NULL only counts (sizing pass). */
static float *take(float *buf, size_t *off, size_t n)
{
    float *p = buf ? buf + *off : NULL;
    *off += n;
    return p;
}

/* Points a's views into buf (NULL: sizing pass) and returns the floats needed. a->layer must exist. */
static size_t carve(const tkd_model_config *c, tkd_model_acts *a, float *buf, int B, int T, int training)
{
    size_t N = (size_t)B * T, D = c->hidden_size, F = c->intermediate_size;
    size_t Q = q_dim(c), KV = kv_dim(c), ATT = (size_t)B * c->num_attention_heads * T * T;
    size_t off = 0;
    for (int l = 0; l < c->num_hidden_layers; l++) {
        layer_acts *t = &a->layer[l];
        if (!training && l > 0) {
            *t = a->layer[0]; /* inference: every block reuses one set */
            continue;
        }
        t->x = take(buf, &off, N * D);
        t->n1 = take(buf, &off, N * D);
        t->rstd1 = take(buf, &off, N);
        t->q = take(buf, &off, N * Q);
        t->k = take(buf, &off, N * KV);
        t->v = take(buf, &off, N * KV);
        t->att = take(buf, &off, ATT);
        t->y = take(buf, &off, N * Q);
        t->x2 = take(buf, &off, N * D);
        t->n2 = take(buf, &off, N * D);
        t->rstd2 = take(buf, &off, N);
        t->gt = take(buf, &off, N * F);
        t->up = take(buf, &off, N * F);
        t->hm = take(buf, &off, N * F);
    }
    /* inference: one residual stream updated in place */
    a->xl = training ? take(buf, &off, N * D) : a->layer[0].x;
    a->hidden = take(buf, &off, N * D);
    a->rstdf = take(buf, &off, N);
    if (training) {
        a->dx = take(buf, &off, N * D);
        a->dn = take(buf, &off, N * D);
        a->dq = take(buf, &off, N * Q);
        a->dy = take(buf, &off, N * Q);
        a->dk = take(buf, &off, N * KV);
        a->dv = take(buf, &off, N * KV);
        a->dg = take(buf, &off, N * F);
        a->du = take(buf, &off, N * F);
        a->dh = take(buf, &off, N * F);
    }
    return off;
}

static tkd_status alloc_grads(tkd_model *m)
{
    if (m->grads)
        return TKD_OK;
    m->grads = calloc(m->n_params, sizeof(float));
    if (!m->grads)
        return tkd_error_set(TKD_ERR_NOMEM, "model: out of memory for %zu gradients", m->n_params);
    set_views(m, m->grads, &m->g);
    return TKD_OK;
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
    free_acts(a);
    m->acts = NULL;
    a = calloc(1, sizeof *a);
    size_t n = 0;
    if (a && (a->layer = calloc((size_t)m->cfg.num_hidden_layers, sizeof *a->layer))) {
        n = carve(&m->cfg, a, NULL, nb, nt, tr);
        a->tokens = malloc(sizeof(int32_t) * (size_t)nb * nt);
        a->buf = malloc(sizeof(float) * n);
    }
    if (!a || !a->layer || !a->tokens || !a->buf) {
        free_acts(a);
        return tkd_error_set(TKD_ERR_NOMEM, "model: out of memory for activations of batch (%d, %d) (%zu MB)",
                             nb, nt, n * sizeof(float) >> 20);
    }
    a->cap_b = nb;
    a->cap_t = nt;
    a->training = tr;
    carve(&m->cfg, a, a->buf, nb, nt, tr);
    m->acts = a;
    return TKD_OK;
}

/* ---- forward / backward ------------------------------------------------------------------- */

static void block_fwd(const tkd_model *m, const tkd_layer_weights *W, layer_acts *A, float *xnext, int B,
                      int T)
{
    const tkd_model_config *c = &m->cfg;
    int N = B * T, D = c->hidden_size, F = c->intermediate_size, H = c->num_attention_heads;
    int Hkv = c->num_key_value_heads, Dh = c->head_dim, Q = q_dim(c), KV = kv_dim(c);
    tkd_cpu_rmsnorm_fwd(A->x, W->attn_norm, N, D, c->rms_norm_eps, A->n1, A->rstd1);
    tkd_cpu_linear_fwd(A->n1, W->wq, W->bq, N, D, Q, 0, A->q);
    tkd_cpu_linear_fwd(A->n1, W->wk, W->bk, N, D, KV, 0, A->k);
    tkd_cpu_linear_fwd(A->n1, W->wv, W->bv, N, D, KV, 0, A->v);
    tkd_cpu_rope_fwd(A->q, N, T, H, Dh, m->rope_cos, m->rope_sin);
    tkd_cpu_rope_fwd(A->k, N, T, Hkv, Dh, m->rope_cos, m->rope_sin);
    tkd_cpu_attn_fwd(A->q, A->k, A->v, B, T, H, Hkv, Dh, A->att, A->y);
    memcpy(A->x2, A->x, sizeof(float) * (size_t)N * D);
    tkd_cpu_linear_fwd(A->y, W->wo, NULL, N, Q, D, 1, A->x2);
    tkd_cpu_rmsnorm_fwd(A->x2, W->mlp_norm, N, D, c->rms_norm_eps, A->n2, A->rstd2);
    tkd_cpu_linear_fwd(A->n2, W->wg, NULL, N, D, F, 0, A->gt);
    tkd_cpu_linear_fwd(A->n2, W->wu, NULL, N, D, F, 0, A->up);
    tkd_cpu_swiglu_fwd(A->gt, A->up, (int64_t)N * F, A->hm);
    if (xnext != A->x2)
        memcpy(xnext, A->x2, sizeof(float) * (size_t)N * D);
    tkd_cpu_linear_fwd(A->hm, W->wd, NULL, N, F, D, 1, xnext);
}

tkd_status tkd_model_forward(tkd_model *m, const int32_t *tokens, int B, int T, int training,
                             const float **hidden)
{
    const tkd_model_config *c = &m->cfg;
    int64_t N = (int64_t)B * T;
    for (int64_t n = 0; n < N; n++)
        if (tokens[n] < 0 || tokens[n] >= c->vocab_size)
            return tkd_error_set(TKD_ERR_INVALID_ARG,
                                 "model: token %d at batch row %lld, position %lld is outside the vocabulary [0, %d)",
                                 tokens[n], (long long)(n / T), (long long)(n % T), c->vocab_size);
    TKD_TRY(tkd_model_reserve(m, B, T, training));
    tkd_model_acts *a = m->acts;
    int L = c->num_hidden_layers, D = c->hidden_size;
    memcpy(a->tokens, tokens, sizeof(int32_t) * (size_t)N);
    tkd_cpu_embedding_fwd(tokens, (int)N, m->w.embed, D, a->layer[0].x);
    for (int l = 0; l < L; l++) {
        /* training: block l writes block l+1's input (or xl); inference: the one stream in place */
        float *xnext = !training ? a->layer[0].x : l + 1 < L ? a->layer[l + 1].x : a->xl;
        block_fwd(m, &m->w.layers[l], &a->layer[training ? l : 0], xnext, B, T);
    }
    float *xl = training ? a->xl : a->layer[0].x;
    tkd_cpu_rmsnorm_fwd(xl, m->w.final_norm, (int)N, D, c->rms_norm_eps, a->hidden, a->rstdf);
    a->b = B;
    a->t = T;
    a->have_train_fwd = training;
    if (hidden)
        *hidden = a->hidden;
    return TKD_OK;
}

static void zero(float *p, size_t n) { memset(p, 0, sizeof(float) * n); }

/* On entry a->dx = ∂loss/∂(block output); on return ∂loss/∂(block input). */
static void block_bwd(const tkd_model *m, const tkd_layer_weights *W, tkd_layer_weights *G,
                      const layer_acts *A, tkd_model_acts *a, int B, int T)
{
    const tkd_model_config *c = &m->cfg;
    int N = B * T, D = c->hidden_size, F = c->intermediate_size, H = c->num_attention_heads;
    int Hkv = c->num_key_value_heads, Dh = c->head_dim, Q = q_dim(c), KV = kv_dim(c);
    size_t NF = (size_t)N * F;
    /* MLP branch: out = x2 + down(silu(gate(n2)) · up(n2)) */
    zero(a->dh, NF);
    tkd_cpu_linear_bwd(a->dx, A->hm, W->wd, N, F, D, a->dh, G->wd, NULL);
    zero(a->dg, NF);
    zero(a->du, NF);
    tkd_cpu_swiglu_bwd(a->dh, A->gt, A->up, (int64_t)NF, a->dg, a->du);
    zero(a->dn, (size_t)N * D);
    tkd_cpu_linear_bwd(a->dg, A->n2, W->wg, N, D, F, a->dn, G->wg, NULL);
    tkd_cpu_linear_bwd(a->du, A->n2, W->wu, N, D, F, a->dn, G->wu, NULL);
    tkd_cpu_rmsnorm_bwd(a->dn, A->x2, W->mlp_norm, A->rstd2, N, D, a->dx, G->mlp_norm);
    /* attention branch: x2 = x + o_proj(attn(...)) */
    zero(a->dy, (size_t)N * Q);
    tkd_cpu_linear_bwd(a->dx, A->y, W->wo, N, Q, D, a->dy, G->wo, NULL);
    zero(a->dq, (size_t)N * Q);
    zero(a->dk, (size_t)N * KV);
    zero(a->dv, (size_t)N * KV);
    tkd_cpu_attn_bwd(a->dy, A->q, A->k, A->v, A->att, B, T, H, Hkv, Dh, a->dq, a->dk, a->dv);
    tkd_cpu_rope_bwd(a->dq, N, T, H, Dh, m->rope_cos, m->rope_sin);
    tkd_cpu_rope_bwd(a->dk, N, T, Hkv, Dh, m->rope_cos, m->rope_sin);
    zero(a->dn, (size_t)N * D);
    tkd_cpu_linear_bwd(a->dq, A->n1, W->wq, N, D, Q, a->dn, G->wq, G->bq);
    tkd_cpu_linear_bwd(a->dk, A->n1, W->wk, N, D, KV, a->dn, G->wk, G->bk);
    tkd_cpu_linear_bwd(a->dv, A->n1, W->wv, N, D, KV, a->dn, G->wv, G->bv);
    tkd_cpu_rmsnorm_bwd(a->dn, A->x, W->attn_norm, A->rstd1, N, D, a->dx, G->attn_norm);
}

tkd_status tkd_model_backward(tkd_model *m, const float *dhidden)
{
    tkd_model_acts *a = m->acts;
    if (!a || !a->have_train_fwd || !m->grads)
        return tkd_error_set(TKD_ERR_INVALID_ARG, "model: backward needs a training forward (training = 1) first");
    const tkd_model_config *c = &m->cfg;
    int B = a->b, T = a->t, N = B * T, D = c->hidden_size;
    zero(a->dx, (size_t)N * D);
    tkd_cpu_rmsnorm_bwd(dhidden, a->xl, m->w.final_norm, a->rstdf, N, D, a->dx, m->g.final_norm);
    for (int l = c->num_hidden_layers - 1; l >= 0; l--)
        block_bwd(m, &m->w.layers[l], &m->g.layers[l], &a->layer[l], a, B, T);
    tkd_cpu_embedding_bwd(a->tokens, N, a->dx, D, m->g.embed);
    a->have_train_fwd = 0; /* activations are consumed: a second backward would double-count */
    return TKD_OK;
}

const float *tkd_model_lm_head(const tkd_model *m) { return m->w.lm_head; }

float *tkd_model_lm_head_grad(tkd_model *m) { return m->grads ? m->g.lm_head : NULL; }

void tkd_model_zero_grad(tkd_model *m)
{
    if (m->grads)
        zero(m->grads, m->n_params);
}

void tkd_model_logits(const tkd_model *m, const float *hidden, int64_t N, float *logits)
{
    tkd_cpu_linear_fwd(hidden, m->w.lm_head, NULL, (int)N, m->cfg.hidden_size, m->cfg.vocab_size, 0, logits);
}
