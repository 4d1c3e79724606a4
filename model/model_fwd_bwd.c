/* model_fwd_bwd.c — the decoder's passes (model.h): the activation buffers sized for a batch, the
 * forward (with activation recompute), the backward into the gradients, and the LM head. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "model/model.h"
#include "model/model_internal.h"

/* ---- activations -------------------------------------------------------------------------- */

/* Hands out n elements of esz bytes from buf at *off (64-byte aligned); with buf NULL only counts. */
static void *take(char *buf, size_t *off, size_t n, size_t esz)
{
    void *p = buf ? buf + *off : NULL;
    *off += (n * esz + 63) / 64 * 64;
    return p;
}

/* The dense MLP's width the buffers need: intermediate_size, or 0 when every block is MoE (the
 * MoE op keeps its own workspace). */
static size_t dense_width(const tkd_model_config *c)
{
    for (int l = 0; l < c->num_hidden_layers; l++)
        if (!tkd_model_config_moe(c, l))
            return (size_t)c->intermediate_size;
    return 0;
}

/* Where carve hands out memory: the activations' own buffer, and (lend_grads) the part of the
 * gradient buffer a block may borrow until its backward. A tensor goes to the loan while it fits
 * (first fit), else to own. base NULL: a sizing pass (only offsets move). */
typedef struct region {
    char *base;
    size_t off, cap; /* own: cap unused */
} region;

static void *take_in(region *own, region *loan, size_t n, size_t esz)
{
    size_t bytes = (n * esz + 63) / 64 * 64;
    if (loan && loan->off + bytes <= loan->cap) {
        void *p = loan->base + loan->off;
        loan->off += bytes;
        return p;
    }
    return take(own->base, &own->off, n, esz);
}

/* The loan block l's activations take (lend_grads): the gradients of the tensors whose backward
 * runs after block l's — block l − 1's, and for block 0 the embedding's when it is not the LM
 * head's (the loss writes that one during the forward). Cap 0: no loan. The start is rounded up
 * to 64 bytes from the real address, the same in the sizing pass. */
static region grad_loan(const tkd_model *m, int l)
{
    region r = {NULL, 0, 0};
    if (!m->lend_grads || !m->grads || (l == 0 && m->cfg.tie_word_embeddings))
        return r;
    size_t b, e;
    if (l == 0)
        b = m->info[0].offset, e = b + m->info[0].numel; /* the embedding is the first tensor */
    else
        tkd_model_layer_range(m, l - 1, &b, &e);
    uintptr_t lo = ((uintptr_t)(m->grads + b) + 63) / 64 * 64, hi = (uintptr_t)(m->grads + e);
    if (hi > lo)
        r.base = (char *)lo, r.cap = hi - lo;
    return r;
}

/* What a training block keeps for its backward, by recompute mode: groups of layer_acts' views.
 * The input x is always kept; everything else is one shared set, remade before the backward reads
 * it (block_remake): the norms' outputs n1, n2 and their rstd, and the SwiGLU product hm, always
 * (a norm and an elementwise pass from kept inputs); ao and mo are read only by the forward's
 * residual adds. */
enum { KEEP_QKV = 1, KEEP_ATT = 2, KEEP_MLP = 4 };

static int kept_groups(tkd_recompute r)
{
    switch (r) {
    case TKD_RECOMPUTE_NONE: return KEEP_QKV | KEEP_ATT | KEEP_MLP;
    case TKD_RECOMPUTE_ATTENTION: return KEEP_MLP;
    case TKD_RECOMPUTE_FULL_KEEP_ATTENTION: return KEEP_ATT;
    default: return 0;
    }
}

/* The tensors of the groups a set may hold, in layer_acts' order (the att group: the attention's
 * saved state and output; Qwen3's qk group: q and k's f32 inputs to the per-head norms and rstd). */
enum { W_X, W_Q, W_K, W_QR, W_KR, W_RSTDQ, W_RSTDK, W_V, W_ATT, W_Y, W_X2, W_GT, W_UP, W_COUNT };

/* Points tensor w of t at p (a switch: the views have their own pointer types). */
static void set_field(layer_acts *t, int w, void *p)
{
    switch (w) {
    case W_X: t->x = p; break;
    case W_Q: t->q = p; break;
    case W_K: t->k = p; break;
    case W_QR: t->qr = p; break;
    case W_KR: t->kr = p; break;
    case W_RSTDQ: t->rstdq = p; break;
    case W_RSTDK: t->rstdk = p; break;
    case W_V: t->v = p; break;
    case W_ATT: t->att = p; break;
    case W_Y: t->y = p; break;
    case W_X2: t->x2 = p; break;
    case W_GT: t->gt = p; break;
    default: t->up = p; break;
    }
}

/* Bytes of each tensor of the groups in mask (0: not wanted), and x's when with_x. */
static void want_sizes(const tkd_model *m, int mask, int with_x, size_t N, size_t att, size_t *sz)
{
    const tkd_model_config *c = &m->cfg;
    size_t D = c->hidden_size, F = dense_width(c), Q = q_dim(c), KV = kv_dim(c), A = m->be->act_size;
    size_t S = sizeof(float);
    int qk = has_qk_norm(c) && (mask & KEEP_QKV);
    memset(sz, 0, sizeof(size_t) * W_COUNT);
    sz[W_X] = with_x ? N * D * S : 0;
    if (mask & KEEP_QKV)
        sz[W_Q] = N * Q * A, sz[W_K] = N * KV * A, sz[W_V] = N * KV * A;
    if (qk) {
        sz[W_QR] = N * Q * S, sz[W_KR] = N * KV * S;
        sz[W_RSTDQ] = N * c->num_attention_heads * S, sz[W_RSTDK] = N * c->num_key_value_heads * S;
    }
    if (mask & KEEP_ATT)
        sz[W_ATT] = att, sz[W_Y] = N * Q * A;
    if (mask & KEEP_MLP)
        sz[W_X2] = N * D * S, sz[W_GT] = N * F * A, sz[W_UP] = N * F * A;
}

/* Points t's wanted tensors into memory: with a loan, largest first (first fit then packs the
 * loan fuller: at the ~3B shape gate, up, x, k and v fill a layer's 403 MB where layer order left
 * 67 MB of it unused), else in layer_acts' order. */
static void carve_wanted(layer_acts *t, const size_t *sz, region *own, region *loan)
{
    int order[W_COUNT];
    for (int w = 0; w < W_COUNT; w++) {
        int j = w; /* insertion sort, stable: sizes descending with a loan */
        while (loan && j > 0 && sz[order[j - 1]] < sz[w]) {
            order[j] = order[j - 1];
            j--;
        }
        order[j] = w;
    }
    for (int i = 0; i < W_COUNT; i++)
        if (sz[order[i]])
            set_field(t, order[i], take_in(own, loan, sz[order[i]], 1));
}

/* The one set every block uses in inference (the residual stream updated in place), or the
 * shared set of training: what no block keeps, and the remade n1, n2, rstd1, rstd2, hm, ao, mo. */
static void carve_shared(const tkd_model *m, int kept, layer_acts *t, region *own, size_t N, size_t att,
                         int training)
{
    size_t D = m->cfg.hidden_size, F = dense_width(&m->cfg), A = m->be->act_size, S = sizeof(float);
    kept = training ? kept : 0;
    if (!training)
        t->x = take(own->base, &own->off, N * D, S);
    t->n1 = take(own->base, &own->off, N * D, A);
    t->rstd1 = take(own->base, &own->off, N, S);
    size_t sz[W_COUNT];
    want_sizes(m, (KEEP_QKV | KEEP_ATT | KEEP_MLP) & ~kept & ~(training ? 0 : KEEP_MLP), 0, N, att, sz);
    carve_wanted(t, sz, own, NULL);
    t->ao = take(own->base, &own->off, N * D, A);
    t->n2 = training ? take(own->base, &own->off, N * D, A) : t->n1;
    t->rstd2 = take(own->base, &own->off, N, S);
    if (!training) { /* inference: x2 is x (in place), and the MLP's buffers are the one set's */
        t->x2 = t->x;
        t->gt = take(own->base, &own->off, N * F, A);
        t->up = take(own->base, &own->off, N * F, A);
    }
    t->hm = take(own->base, &own->off, N * F, A);
    t->mo = training ? take(own->base, &own->off, N * D, A) : t->ao;
}

/* Block l's mode: r, or none for the last `whole` blocks (tkd_model_set_recompute_whole). */
static tkd_recompute layer_mode(const tkd_model *m, tkd_recompute r, int whole, int l)
{
    return l >= m->cfg.num_hidden_layers - whole ? TKD_RECOMPUTE_NONE : r;
}

/* Points a's views into buf (NULL: sizing pass) and returns the bytes needed for recompute mode r
 * with the last `whole` blocks keeping everything. a->layer must exist. Training: the shared set
 * first (what r does not keep), then each block's kept groups (in its gradient loan while they fit,
 * lend_grads); inference: one set for every block. */
static size_t carve(const tkd_model *m, tkd_recompute r, int whole, tkd_model_acts *a, char *buf, int B, int T,
                    int training)
{
    const tkd_model_config *c = &m->cfg;
    size_t N = (size_t)B * T, D = c->hidden_size, F = dense_width(c);
    size_t Q = q_dim(c), KV = kv_dim(c), A = m->be->act_size, S = sizeof(float);
    size_t att = m->be->op->attn_saved_bytes(m->be, B, T, c->num_attention_heads);
    region own = {buf, 0, 0};
    layer_acts shared = {0};
    int kept = kept_groups(r);
    carve_shared(m, kept, &shared, &own, N, att, training);
    a->lent = 0;
    for (int l = 0; l < c->num_hidden_layers; l++) {
        layer_acts *t = &a->layer[l];
        *t = shared;
        if (!training)
            continue;
        region loan = grad_loan(m, l);
        size_t sz[W_COUNT];
        want_sizes(m, kept_groups(layer_mode(m, r, whole, l)), 1, N, att, sz);
        carve_wanted(t, sz, &own, &loan);
        a->lent += loan.off;
    }
    a->xl = training ? take(buf, &own.off, N * D, S) : a->layer[0].x;
    a->hidden = take(buf, &own.off, N * D, A);
    a->rstdf = take(buf, &own.off, N, S);
    if (training) {
        a->dx = take(buf, &own.off, N * D, S);
        a->dn = take(buf, &own.off, N * D, A);
        a->dq = take(buf, &own.off, N * Q, A);
        a->dy = take(buf, &own.off, N * Q, A);
        a->dk = take(buf, &own.off, N * KV, A);
        a->dv = take(buf, &own.off, N * KV, A);
        a->dg = take(buf, &own.off, N * F, A);
        a->du = take(buf, &own.off, N * F, A);
        a->dh = take(buf, &own.off, N * F, A);
        if (has_qk_norm(c))
            a->dqk = take(buf, &own.off, N * Q, S);
    }
    return own.off;
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
    tkd_model_set_views(m, m->grads, &m->g);
    return TKD_OK;
}

/* A layer whose window is shorter than T needs a backend whose attention masks it (forward, and
 * backward when training): refused here, naming the layer, rather than silently run as full
 * attention. */
static tkd_status check_windows(const tkd_model *m, int T, int training)
{
    if (m->be->attn_window && (!training || m->be->attn_window_bwd))
        return TKD_OK;
    for (int l = 0; l < m->cfg.num_hidden_layers; l++) {
        int w = tkd_model_config_window(&m->cfg, l);
        if (w > 0 && w < T)
            return tkd_error_set(TKD_ERR_UNSUPPORTED,
                                 "model: layer %d has sliding_window %d < sequence length %d, and the %s backend's "
                                 "attention%s does not mask a window yet; use device: cpu or sequences of at most %d",
                                 l, w, T, m->be->name, m->be->attn_window ? " backward (training)" : "", w);
    }
    return TKD_OK;
}

/* Bytes the MoE op's workspace may take; beyond them the forward calls it in chunks of rows (its
 * workspace is about rows·k·(D + 2I) floats: 115 KB a row at Qwen3-30B-A3B's shape, so 2 GiB holds
 * 18,000 rows: a T 8192 batch in one call, one host sync and full expert GEMMs per layer on CUDA). */
#define TKD_MODEL_MOE_WS_BYTES ((size_t)2 << 30)

/* A model with MoE layers is a teacher here: no backward for the op, so training is refused, and
 * a backend without the op is refused by name before any work. */
static tkd_status check_moe(const tkd_model *m, int training)
{
    const tkd_model_config *c = &m->cfg;
    if (training && tkd_arch_sinks(c->arch)) /* attn_bwd takes no sinks */
        return tkd_error_set(TKD_ERR_UNSUPPORTED,
                             "model: %s (%s) has attention sinks, which run forward only here (a teacher): "
                             "training it is not supported", tkd_arch_class(c->arch), tkd_arch_name(c->arch));
    if (!tkd_model_config_has_moe(c))
        return TKD_OK;
    if (training)
        return tkd_error_set(TKD_ERR_UNSUPPORTED,
                             "model: %s (%s) has mixture-of-experts layers, which run forward only here (a "
                             "teacher): training it is not supported; students are dense (model.arch llama, qwen2 "
                             "or qwen3)", tkd_arch_class(c->arch), tkd_arch_name(c->arch));
    if (!m->be->op->moe_create || !m->be->op->moe_fwd)
        return tkd_error_set(TKD_ERR_UNSUPPORTED,
                             "model: the %s backend has no mixture-of-experts op yet, which %s's MoE layers need; "
                             "use device: cpu", m->be->name, tkd_arch_class(c->arch));
    return TKD_OK;
}

/* The MoE workspace for up to N rows a forward (one for every MoE layer: they share a shape),
 * capped at TKD_MODEL_MOE_WS_BYTES' worth of rows; kept while it is large enough. */
static tkd_status reserve_moe(tkd_model *m, int N)
{
    const tkd_model_config *c = &m->cfg;
    if (!tkd_model_config_has_moe(c))
        return TKD_OK;
    size_t per_row = sizeof(float) * (size_t)c->num_experts_per_tok *
                     ((size_t)c->hidden_size + 2 * (size_t)c->moe_intermediate_size);
    size_t cap = TKD_MODEL_MOE_WS_BYTES / per_row;
    int rows = cap < 1 ? 1 : cap < (size_t)N ? (int)cap : N;
    if (m->moe && m->moe_rows >= rows)
        return TKD_OK;
    if (m->moe)
        m->be->op->moe_free(m->be, m->moe);
    m->moe = NULL;
    m->moe_rows = 0;
    tkd_moe_params p = c->arch == TKD_ARCH_GPT_OSS
                           ? tkd_moe_params_gpt_oss(c->hidden_size, c->moe_intermediate_size, c->num_experts,
                                                    c->num_experts_per_tok, c->swiglu_limit)
                           : tkd_moe_params_qwen3(c->hidden_size, c->moe_intermediate_size, c->num_experts,
                                                  c->num_experts_per_tok, c->norm_topk_prob);
    p.mxfp4 = c->experts_mxfp4;
    TKD_TRY(m->be->op->moe_create(m->be, &p, rows, &m->moe));
    m->moe_rows = rows;
    return TKD_OK;
}

size_t tkd_model_activation_bytes(const tkd_model *m)
{
    return m->acts ? m->acts->bytes : 0;
}

size_t tkd_model_activation_lent_bytes(const tkd_model *m)
{
    return m->acts ? m->acts->lent : 0;
}

void tkd_model_set_recompute(tkd_model *m, tkd_recompute mode)
{
    if (m->recompute == mode)
        return;
    m->recompute = mode;
    tkd_model_free_acts(m); /* the next reserve carves for the new layout */
}

void tkd_model_set_recompute_whole(tkd_model *m, int whole)
{
    int L = m->cfg.num_hidden_layers;
    whole = whole < 0 ? 0 : whole > L ? L : whole;
    if (m->recompute_whole == whole)
        return;
    m->recompute_whole = whole;
    tkd_model_free_acts(m);
}

/* The FLOPs per token one block runs again in backward under mode r: an estimate that ranks the
 * modes, not a timing. The q/k/v projections, the other GEMMs (o_proj and the MLP's three), and
 * the causal attention forward (QKᵀ and PV over T/2 keys on average; a sliding window makes it
 * smaller than this says). */
static double recompute_flops(const tkd_model *m, tkd_recompute r, int T)
{
    const tkd_model_config *c = &m->cfg;
    double D = c->hidden_size, F = dense_width(c), Q = q_dim(c), KV = kv_dim(c);
    double qkv = 2 * D * (Q + 2 * KV), rest = 2 * (Q * D + 3 * D * F), att = 2 * Q * (double)T;
    switch (r) {
    case TKD_RECOMPUTE_NONE: return 0;
    case TKD_RECOMPUTE_ATTENTION: return qkv + att;
    case TKD_RECOMPUTE_FULL_KEEP_ATTENTION: return qkv + rest;
    default: return qkv + rest + att;
    }
}

/* The checks and the gradient buffer a sizing pass needs, and a layer array for it in a (a->layer,
 * freed by the caller). */
static tkd_status plan_begin(tkd_model *m, int B, int T, tkd_model_acts *a)
{
    *a = (tkd_model_acts){0};
    if (B <= 0 || T <= 0)
        return tkd_error_set(TKD_ERR_INVALID_ARG, "model: batch shape (%d, %d) must be positive", B, T);
    if (m->lend_grads)
        TKD_TRY(alloc_grads(m)); /* the loans are ranges of the gradient buffer */
    if (!(a->layer = calloc((size_t)m->cfg.num_hidden_layers, sizeof *a->layer)))
        return tkd_error_set(TKD_ERR_NOMEM, "model: out of memory");
    return TKD_OK;
}

tkd_status tkd_model_recompute_bytes(tkd_model *m, tkd_recompute mode, int whole, int B, int T, size_t *bytes)
{
    tkd_model_acts a;
    *bytes = 0;
    TKD_TRY(plan_begin(m, B, T, &a));
    *bytes = carve(m, mode, whole, &a, NULL, B, T, 1);
    free(a.layer);
    return TKD_OK;
}

/* For each mode, the most blocks kept whole that fit in budget (the FLOPs fall as they grow) into
 * *out when it recomputes less than what *out holds; the last block is never recomputed, so a plan
 * recomputes L − max(whole, 1) blocks, and whole = 1 (which only moves the last block's activations
 * out of the shared set) is never taken. Returns whether any plan fits. a: a sizing pass's layers. */
static int pick_partial(const tkd_model *m, tkd_model_acts *a, int B, int T, size_t budget, tkd_recompute_fit *out)
{
    static const tkd_recompute modes[] = {TKD_RECOMPUTE_ATTENTION, TKD_RECOMPUTE_FULL_KEEP_ATTENTION,
                                          TKD_RECOMPUTE_FULL};
    int L = m->cfg.num_hidden_layers;
    double best = -1;
    for (int i = 0; i < 3; i++)
        for (int w = L - 1; w >= 0; w--) {
            if (w == 1)
                continue;
            size_t n = carve(m, modes[i], w, a, NULL, B, T, 1);
            if (n > budget)
                continue;
            double f = (double)(L - (w > 1 ? w : 1)) * recompute_flops(m, modes[i], T);
            if (best < 0 || f < best)
                best = f, out->mode = modes[i], out->whole = w, out->need = n;
            break; /* fewer blocks whole recompute more */
        }
    return best >= 0;
}

tkd_status tkd_model_pick_recompute(tkd_model *m, int B, int T, size_t budget, tkd_recompute_fit *out)
{
    tkd_model_acts a;
    *out = (tkd_recompute_fit){.mode = TKD_RECOMPUTE_NONE, .budget = budget};
    TKD_TRY(plan_begin(m, B, T, &a));
    out->need = carve(m, TKD_RECOMPUTE_NONE, 0, &a, NULL, B, T, 1);
    if (out->need > budget && !pick_partial(m, &a, B, T, budget, out)) /* the least memory, over the budget */
        out->mode = TKD_RECOMPUTE_FULL, out->whole = 0, out->need = carve(m, TKD_RECOMPUTE_FULL, 0, &a, NULL, B, T, 1);
    free(a.layer);
    return TKD_OK;
}

/* What the first training step allocates on demand beside the activations: the attention
 * backward's fp32 dQ accumulators (CUDA), library workspaces, allocator rounding. A margin: 512 MiB
 * and 1/32 of the device's memory, plus the accumulators. */
static size_t fit_margin(const tkd_model *m, int B, int T, size_t total)
{
    size_t dq = sizeof(float) * (size_t)B * (size_t)T * (size_t)q_dim(&m->cfg);
    return ((size_t)512 << 20) + total / 32 + dq;
}

tkd_status tkd_model_fit_recompute(tkd_model *m, int B, int T, size_t budget_override, tkd_recompute_fit *out)
{
    size_t free_b = 0, total = 0;
    if (!m->be->op->mem_info)
        return tkd_error_set(TKD_ERR_UNSUPPORTED, "model: the %s backend cannot say its free memory", m->be->name);
    TKD_TRY(m->be->op->mem_info(m->be, &free_b, &total));
    size_t held = tkd_model_activation_bytes(m), margin = fit_margin(m, B, T, total);
    size_t budget = budget_override ? budget_override : free_b + held > margin ? free_b + held - margin : 0;
    TKD_TRY(tkd_model_pick_recompute(m, B, T, budget, out));
    tkd_model_set_recompute(m, out->mode); /* each drops the activations held unless it stays */
    tkd_model_set_recompute_whole(m, out->whole);
    return tkd_model_reserve(m, B, T, 1);
}

void tkd_model_set_lend_grads(tkd_model *m, int on)
{
    if (m->lend_grads == !!on)
        return;
    m->lend_grads = !!on;
    tkd_model_free_acts(m);
}

tkd_status tkd_model_reserve(tkd_model *m, int B, int T, int training)
{
    if (B <= 0 || T <= 0)
        return tkd_error_set(TKD_ERR_INVALID_ARG, "model: batch shape (%d, %d) must be positive", B, T);
    if (T > m->cfg.max_position_embeddings)
        return tkd_error_set(TKD_ERR_INVALID_ARG,
                             "model: sequence length %d exceeds max_position_embeddings %d; use a shorter seq_len",
                             T, m->cfg.max_position_embeddings);
    TKD_TRY(check_windows(m, T, training));
    TKD_TRY(check_moe(m, training));
    if (training)
        TKD_TRY(alloc_grads(m));
    tkd_model_acts *a = m->acts;
    if (a && a->cap_b >= B && a->cap_t >= T && a->training >= training)
        return reserve_moe(m, a->cap_b * a->cap_t);
    int nb = a && a->cap_b > B ? a->cap_b : B, nt = a && a->cap_t > T ? a->cap_t : T;
    int tr = training || (a && a->training);
    tkd_model_free_acts(m);
    a = calloc(1, sizeof *a);
    if (!a || !(a->layer = calloc((size_t)m->cfg.num_hidden_layers, sizeof *a->layer))) {
        free(a);
        return tkd_error_set(TKD_ERR_NOMEM, "model: out of memory");
    }
    m->acts = a;
    size_t n = carve(m, m->recompute, m->recompute_whole, a, NULL, nb, nt, tr);
    char what[128];
    snprintf(what, sizeof what, "model: activations of batch (%d, %d)", nb, nt);
    tkd_status st = m->be->op->alloc(m->be, n, what, &a->buf);
    if (st == TKD_OK)
        st = m->be->op->alloc(m->be, sizeof(int32_t) * (size_t)nb * nt, "model: tokens", (void **)&a->tokens);
    if (st != TKD_OK) {
        tkd_model_free_acts(m);
        /* device allocations already say what to lower (cuda_mem); host ones do not */
        return st == TKD_ERR_NOMEM ? tkd_error_hint(st, "lower the batch size or the sequence length") : st;
    }
    a->cap_b = nb;
    a->cap_t = nt;
    a->bytes = n;
    a->training = tr;
    carve(m, m->recompute, m->recompute_whole, a, a->buf, nb, nt, tr);
    return reserve_moe(m, nb * nt);
}

/* ---- forward / backward ------------------------------------------------------------------- */

/* One projection of n1 into q or k, then (Qwen3) each head's RMSNorm: the row RMSNorm over
 * (N·heads, Dh) rows, from its f32 copy raw (saved for backward) into out; without a backward to
 * come (no training activations) straight from the act projection in place, the same bits without
 * the copy. Without the norm the projection writes out itself. */
static tkd_status qk_proj(const tkd_model *m, const void *n1, const void *w, const void *b, const void *norm,
                          int N, int heads, float *raw, float *rstd, void *out) // raw (N, heads·Dh) f32
{
    const tkd_model_config *c = &m->cfg;
    const tkd_backend_ops *op = m->be->op;
    tkd_backend *be = m->be;
    int D = c->hidden_size, Dh = c->head_dim, M = heads * Dh;
    if (!norm)
        return op->linear_fwd(be, n1, w, b, N, D, M, out);
    /* fp32 act (the CPU): the projection is already the f32 input the norm reads */
    int f32_act = be->act_size == sizeof(float);
    TKD_TRY(op->linear_fwd(be, n1, w, b, N, D, M, f32_act ? (void *)raw : out));
    if (!f32_act && !m->acts->training)
        return op->rmsnorm_act_fwd(be, out, norm, N * heads, Dh, (float)c->rms_norm_eps, out, rstd);
    if (!f32_act)
        TKD_TRY(op->act_to_f32(be, out, raw, (size_t)N * M));
    return op->rmsnorm_fwd(be, raw, norm, N * heads, Dh, (float)c->rms_norm_eps, out, rstd);
}

/* The RoPE tables the last forward rotates by, (rows, Dh/2) f32 each in backend memory; the op
 * rotates row n by table row n mod rows. Plain sequences: the model's tables by position, rows = T.
 * Packed documents: one row per token at its position within its document, rows = B·T. */
static void rope_rows(const tkd_model *m, int T, const float **cs, const float **sn, int *rows)
{
    const tkd_model_acts *a = m->acts;
    if (a->docs) {
        *rows = a->b * a->t;
        *cs = a->rope_tok;
        *sn = a->rope_tok + (size_t)*rows * (m->cfg.head_dim / 2);
        return;
    }
    *rows = T;
    *cs = m->d_rope_cos;
    *sn = m->d_rope_sin;
}

/* Block l's attention from A->n1 = rmsnorm(A->x): q, k (normed per head for Qwen3, then RoPE), v,
 * the attention output A->y over the layer's window, and its saved state (what the attention
 * side's backward reads). */
/* Block l's attention side from A->n1: q, k, v (with their norms and RoPE), then the attention
 * itself into A->y and A->att unless core is 0 (a recompute that kept them). */
static tkd_status block_attn_fwd(const tkd_model *m, int l, const tkd_layer_dweights *W, layer_acts *A, int B,
                                 int T, int core)
{
    const tkd_model_config *c = &m->cfg;
    const tkd_backend_ops *op = m->be->op;
    tkd_backend *be = m->be;
    int N = B * T, D = c->hidden_size, H = c->num_attention_heads;
    int Hkv = c->num_key_value_heads, Dh = c->head_dim, KV = kv_dim(c);
    TKD_TRY(qk_proj(m, A->n1, W->wq, W->bq, W->q_norm, N, H, A->qr, A->rstdq, A->q));
    TKD_TRY(qk_proj(m, A->n1, W->wk, W->bk, W->k_norm, N, Hkv, A->kr, A->rstdk, A->k));
    TKD_TRY(op->linear_fwd(be, A->n1, W->wv, W->bv, N, D, KV, A->v));
    const tkd_model_acts *a = m->acts;
    const float *cs, *sn;
    int rows;
    rope_rows(m, T, &cs, &sn, &rows);
    TKD_TRY(op->rope_fwd(be, A->q, A->k, N, rows, H, Hkv, Dh, cs, sn));
    if (!core)
        return TKD_OK;
    return op->attn_fwd(be, A->q, A->k, A->v, B, T, H, Hkv, Dh, tkd_model_config_window(c, l),
                        a->docs ? a->doc : NULL, W->sinks, A->y, A->att);
}

/* Block l's MoE MLP, mo = MoE(n2) over N rows (N, D) act, through the backend's op in chunks of
 * m->moe_rows rows (the rows are independent tokens). */
static tkd_status block_moe_fwd(const tkd_model *m, int l, const void *n2, int N, void *mo)
{
    const tkd_layer_dweights *W = &m->d.layers[l];
    tkd_moe_act_weights w = {.q = m->qlayer ? m->qlayer[l] : (tkd_moe_mxfp4){{NULL}, {NULL}},
                             .router_w = W->router, .router_b = W->router_b, .w_gate = W->eg, .w_up = W->eu,
                             .w_down = W->ed, .b_gate = W->ebg, .b_up = W->ebu, .b_down = W->ebd};
    size_t row = (size_t)m->cfg.hidden_size * m->be->act_size;
    for (int r = 0; r < N; r += m->moe_rows) {
        int n = N - r < m->moe_rows ? N - r : m->moe_rows;
        TKD_TRY(m->be->op->moe_fwd(m->be, m->moe, &w, (const char *)n2 + r * row, n, (char *)mo + r * row));
    }
    return TKD_OK;
}

/* A block from A->n1 = rmsnorm(A->x) up to its MLP output A->mo (everything but the residual add
 * that makes the next block's input); core 0: the attention's output A->y is already there. */
static tkd_status block_fwd_body(const tkd_model *m, int l, const tkd_layer_dweights *W, layer_acts *A, int B,
                                 int T, int core)
{
    const tkd_model_config *c = &m->cfg;
    const tkd_backend_ops *op = m->be->op;
    tkd_backend *be = m->be;
    int N = B * T, D = c->hidden_size, F = c->intermediate_size, Q = q_dim(c);
    float eps = (float)c->rms_norm_eps;
    TKD_TRY(block_attn_fwd(m, l, W, A, B, T, core));
    TKD_TRY(op->linear_fwd(be, A->y, W->wo, W->bo, N, Q, D, A->ao));
    TKD_TRY(op->add_rmsnorm_fwd(be, A->x, A->ao, A->x2, W->mlp_norm, N, D, eps, A->n2, A->rstd2));
    if (tkd_model_config_moe(c, l))
        return block_moe_fwd(m, l, A->n2, N, A->mo);
    TKD_TRY(op->linear_fwd(be, A->n2, W->wg, NULL, N, D, F, A->gt));
    TKD_TRY(op->linear_fwd(be, A->n2, W->wu, NULL, N, D, F, A->up));
    TKD_TRY(op->swiglu_fwd(be, A->gt, A->up, (int64_t)N * F, A->hm));
    return op->linear_fwd(be, A->hm, W->wd, NULL, N, F, D, A->mo);
}

static tkd_status block_fwd(const tkd_model *m, int l, layer_acts *A, float *xnext, const void *next_norm,
                            void *n_next, float *rstd_next, int B, int T)
{
    TKD_TRY(block_fwd_body(m, l, &m->d.layers[l], A, B, T, 1));
    int N = B * T, D = m->cfg.hidden_size;
    return m->be->op->add_rmsnorm_fwd(m->be, A->x2, A->mo, xnext, next_norm, N, D, (float)m->cfg.rms_norm_eps, n_next,
                                      rstd_next);
}

/* Recompute: what block l did not keep, again from its kept inputs (same ops, same order: the same
 * values; rmsnorm_fwd is add_rmsnorm_fwd's kernel without the add), into the one shared set, just
 * before its backward: the norms' outputs and the SwiGLU product (none), the attention side too
 * (attention), the whole block (full) or the whole block but the attention itself
 * (full_keep_attention). */
static tkd_status block_recompute(const tkd_model *m, int l, layer_acts *A, int B, int T)
{
    const tkd_backend_ops *op = m->be->op;
    int N = B * T, D = m->cfg.hidden_size;
    float eps = (float)m->cfg.rms_norm_eps;
    const tkd_layer_dweights *W = &m->d.layers[l];
    tkd_recompute r = layer_mode(m, m->recompute, m->recompute_whole, l);
    r = r == TKD_RECOMPUTE_AUTO ? TKD_RECOMPUTE_FULL : r; /* what kept_groups keeps of it */
    TKD_TRY(op->rmsnorm_fwd(m->be, A->x, W->attn_norm, N, D, eps, A->n1, A->rstd1));
    if (r == TKD_RECOMPUTE_FULL || r == TKD_RECOMPUTE_FULL_KEEP_ATTENTION)
        return block_fwd_body(m, l, W, A, B, T, r == TKD_RECOMPUTE_FULL);
    if (r == TKD_RECOMPUTE_ATTENTION)
        TKD_TRY(block_attn_fwd(m, l, W, A, B, T, 1));
    TKD_TRY(op->rmsnorm_fwd(m->be, A->x2, W->mlp_norm, N, D, eps, A->n2, A->rstd2));
    return op->swiglu_fwd(m->be, A->gt, A->up, (int64_t)N * m->cfg.intermediate_size, A->hm);
}

/* lend_grads: zeroes the gradient range [b, e) (floats) before a backward writes it, when it held
 * a block's activations (grad_loan). */
static tkd_status zero_lent(const tkd_model *m, size_t b, size_t e)
{
    if (!m->lend_grads)
        return TKD_OK;
    return m->be->op->memset0(m->be, m->grads + b, sizeof(float) * (e - b));
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

/* doc (host (B, T)) as tkd_model_forward_docs asks: 0 ≤ doc[i] ≤ i within a sequence, equal to i or
 * to the previous position's. */
static tkd_status check_docs(const int32_t *doc, int B, int T)
{
    for (int b = 0; b < B; b++)
        for (int i = 0; i < T; i++) {
            int32_t d = doc[(int64_t)b * T + i];
            if (d != i && (i == 0 || d != doc[(int64_t)b * T + i - 1]))
                return tkd_error_set(TKD_ERR_INVALID_ARG,
                                     "model: document start %d at batch row %d, position %d: it must be the position "
                                     "itself (a new document) or the previous position's start", d, b, i);
        }
    return TKD_OK;
}

/* The packed documents' buffers of a (the first forward with documents), then doc and the per-token
 * RoPE tables (each position's row at its offset in its document) in backend memory. */
static tkd_status stage_docs(tkd_model *m, const int32_t *doc, int B, int T)
{
    tkd_model_acts *a = m->acts;
    const tkd_backend_ops *op = m->be->op;
    const size_t cap = (size_t)a->cap_b * a->cap_t, half = (size_t)m->cfg.head_dim / 2, N = (size_t)B * T;
    if (!a->doc) {
        TKD_TRY(op->alloc(m->be, sizeof(int32_t) * cap, "model: document starts", (void **)&a->doc));
        TKD_TRY(op->alloc(m->be, 2 * sizeof(float) * cap * half, "model: RoPE tables per token",
                          (void **)&a->rope_tok));
        a->rope_host = malloc(2 * sizeof(float) * cap * half);
        if (!a->rope_host)
            return tkd_error_set(TKD_ERR_NOMEM, "model: out of host memory for the RoPE tables per token");
    }
    for (size_t n = 0; n < N; n++) { /* cos rows, then sin rows */
        const size_t pos = n % (size_t)T - (size_t)doc[n];
        memcpy(a->rope_host + n * half, m->rope_cos + pos * half, sizeof(float) * half);
        memcpy(a->rope_host + (N + n) * half, m->rope_sin + pos * half, sizeof(float) * half);
    }
    TKD_TRY(op->upload(m->be, a->doc, doc, sizeof(int32_t) * N));
    return op->upload(m->be, a->rope_tok, a->rope_host, 2 * sizeof(float) * N * half);
}

/* A backend that cannot confine attention to documents is refused by name (training: its
 * backward too), rather than run across them. */
static tkd_status check_docs_backend(const tkd_model *m, int training)
{
    if (m->be->attn_docs && (!training || m->be->attn_docs_bwd))
        return TKD_OK;
    return tkd_error_set(TKD_ERR_UNSUPPORTED, "model: the %s backend's attention%s does not confine queries to "
                         "packed documents yet (data.packing: documents); use device: cpu", m->be->name,
                         m->be->attn_docs ? " backward (training)" : "");
}

tkd_status tkd_model_forward(tkd_model *m, const int32_t *tokens, int B, int T, int training,
                             const void **hidden)
{
    return tkd_model_forward_docs(m, tokens, NULL, B, T, training, hidden);
}

tkd_status tkd_model_forward_docs(tkd_model *m, const int32_t *tokens, const int32_t *doc, int B, int T,
                                  int training, const void **hidden)
{
    const tkd_model_config *c = &m->cfg;
    const tkd_backend_ops *op = m->be->op;
    int64_t N = (int64_t)B * T;
    TKD_TRY(check_tokens(m, tokens, N, T));
    if (doc) {
        TKD_TRY(check_docs(doc, B, T));
        TKD_TRY(check_docs_backend(m, training));
    }
    TKD_TRY(tkd_model_reserve(m, B, T, training));
    tkd_model_acts *a = m->acts;
    a->docs = 0;
    a->b = B; /* rope_rows reads the shape */
    a->t = T;
    if (doc) {
        TKD_TRY(stage_docs(m, doc, B, T));
        a->docs = 1;
    }
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
        TKD_TRY(block_fwd(m, l, A, last ? a->xl : nx->x,
                          last ? m->d.final_norm : m->d.layers[l + 1].attn_norm, last ? a->hidden : nx->n1,
                          last ? a->rstdf : nx->rstd1, B, T));
    }
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

/* Backward of qk_proj's norm (Qwen3; nothing without it): d (N, heads·Dh) act holds ∂loss/∂out on
 * entry and ∂loss/∂raw on return, through a->dqk (f32, zeroed first: the row backward adds); the
 * norm weight's gradient adds into dw. */
static tkd_status qk_norm_bwd(const tkd_model *m, tkd_model_acts *a, void *d, const float *raw, const void *norm,
                              const float *rstd, int N, int heads, float *dw)
{
    if (!norm)
        return TKD_OK;
    tkd_backend *be = m->be;
    int Dh = m->cfg.head_dim;
    TKD_TRY(be->op->memset0(be, a->dqk, sizeof(float) * (size_t)N * heads * Dh));
    return be->op->rmsnorm_bwd(be, d, raw, norm, rstd, N * heads, Dh, a->dqk, dw, d);
}

/* On entry a->dx = ∂loss/∂(block output), and residual_grad_act holds it as act; on return
 * ∂loss/∂(block input), also as act when act_out (the block below reads it). */
static tkd_status block_bwd(const tkd_model *m, int l, tkd_layer_weights *G, const layer_acts *A, tkd_model_acts *a,
                            int B, int T, int act_out)
{
    const tkd_layer_dweights *W = &m->d.layers[l];
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
    TKD_TRY(op->linear_bwd(be, dres, A->y, W->wo, N, Q, D, a->dy, G->wo, G->bo, 0));
    TKD_TRY(op->attn_bwd(be, a->dy, A->q, A->k, A->v, A->y, A->att, B, T, H, Hkv, Dh,
                         tkd_model_config_window(c, l), a->docs ? a->doc : NULL, a->dq, a->dk, a->dv));
    const float *cs, *sn;
    int rows;
    rope_rows(m, T, &cs, &sn, &rows);
    TKD_TRY(op->rope_bwd(be, a->dq, a->dk, N, rows, H, Hkv, Dh, cs, sn));
    TKD_TRY(qk_norm_bwd(m, a, a->dq, A->qr, W->q_norm, A->rstdq, N, H, G->q_norm));
    TKD_TRY(qk_norm_bwd(m, a, a->dk, A->kr, W->k_norm, A->rstdk, N, Hkv, G->k_norm));
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
        if (l + 1 < c->num_hidden_layers) {
            TKD_TRY(block_recompute(m, l, &a->layer[l], B, T));
            size_t gb, ge; /* block l + 1's activations, consumed (the last block's range lent nothing) */
            tkd_model_layer_range(m, l, &gb, &ge);
            TKD_TRY(zero_lent(m, gb, ge));
        }
        TKD_TRY(block_bwd(m, l, &m->g.layers[l], &a->layer[l], a, B, T, l > 0));
        if (m->grad_hook)
            TKD_TRY(m->grad_hook(m->grad_hook_ctx, m, l));
    }
    if (!c->tie_word_embeddings) /* block 0's activations (grad_loan) */
        TKD_TRY(zero_lent(m, m->info[0].offset, m->info[0].offset + m->info[0].numel));
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
    *begin = m->info[m->info_layer[l]].offset; /* the embedding is first, then block by block */
    *end = m->info[m->info_layer[l + 1]].offset; /* the next block's first tensor, or the final norm */
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
