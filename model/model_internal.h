/* model_internal.h — what the parts of the decoder share (model.c, model_hf.c, model_fwd_bwd.c;
 * nothing outside model/model*.c includes it but tests/test_model.c, which reads the residual
 * stream): the activation buffers' layout, small shape helpers,
 * and the functions one part calls in another. */
#ifndef TKD_MODEL_INTERNAL_H
#define TKD_MODEL_INTERNAL_H

#include <stddef.h>
#include <stdint.h>

#include "model/model.h"

/* One block's saved activations (backend memory); in inference every block aliases one set.
 * f32: the residual stream and rstd; act: everything the GEMMs read or write. */
typedef struct layer_acts {
    float *x;     // (N, D) f32 the block's residual input
    void *n1;     // (N, D) rmsnorm(x)
    float *rstd1; // (N)
    void *q;      // (N, H·Dh) after RoPE
    void *k;      // (N, Hkv·Dh) after RoPE
    float *qr;    // (N, H·Dh) f32 q_proj(n1) before Qwen3's per-head norm (NULL without it)
    float *kr;    // (N, Hkv·Dh) f32 k_proj(n1) before the norm
    float *rstdq; // (N·H) f32 the per-head norms' rstd
    float *rstdk; // (N·Hkv)
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
    size_t lent;                /* kept activations placed in the gradient buffer (lend_grads) */
    void *buf;                  /* the one backend allocation every view below points into */
    int32_t *tokens;            // (cap_b·cap_t) backend copy of the last forward's tokens
    layer_acts *layer;          // (L) host array of views
    float *xl;                  // (N, D) f32 residual after the last block
    void *hidden;               // (N, D) final rmsnorm(xl)
    float *rstdf;               // (N)
    /* backward scratch (training only) */
    float *dx;                  // (N, D) f32
    void *dn, *dq, *dk, *dv, *dy, *dg, *du, *dh;
    float *dqk;                 // (N, H·Dh) f32 the q/k norms' input gradient (Qwen3), q's then k's
    /* packed documents (tkd_model_forward_docs; allocated at the first such forward) */
    int32_t *doc;               // (cap_b·cap_t) backend copy of the last forward's document starts
    float *rope_tok;            // (2, cap_b·cap_t, Dh/2) f32 RoPE cos then sin per token (position i − doc)
    float *rope_host;           // host staging of rope_tok
    int docs;                   /* 1: the last forward ran packed documents (its backward reads doc) */
    int b, t;                   /* shape of the last forward */
    int have_train_fwd;         /* a training forward happened since the last backward */
};

static inline int q_dim(const tkd_model_config *c) { return c->num_attention_heads * c->head_dim; }
static inline int kv_dim(const tkd_model_config *c) { return c->num_key_value_heads * c->head_dim; }
static inline int has_qk_norm(const tkd_model_config *c) { return tkd_arch_qk_norm(c->arch); }

/* 1 when the model holds fp32 master weights (every CPU model; a _for_training one elsewhere). */
static inline int has_master(const tkd_model *m) { return m->params || m->master_lo; }

/* model.c: the weights' views, a model's creation, the activations' release, staging a tensor */
void tkd_model_set_views(const tkd_model *m, float *base, tkd_model_weights *w);
tkd_status tkd_model_create(const tkd_model_config *cfg, tkd_backend *be, int own_be, int trainable,
                            tkd_model **out);
void tkd_model_free_acts(tkd_model *m);
size_t tkd_model_largest_tensor(const tkd_model *m);

/* model_mxfp4.c: gpt-oss's experts kept as MXFP4 (cfg.experts_mxfp4): the storage (no-op otherwise)
 * and one layer's experts from the checkpoint's pairs. */
tkd_status tkd_model_alloc_mxfp4(tkd_model *m);
tkd_status tkd_model_load_mxfp4_layer(tkd_model *m, const char *dir, const tkd_st_dir *st, int l);
tkd_status tkd_model_put_tensor(tkd_model *m, const tkd_param_info *p, const float *x);

#endif
