/* test_model_moe.c — the mixture-of-experts teachers in the model (split from test_model.c):
 * Qwen3-MoE (the layout of its dense and sparse layers, the forward against a hand-composed
 * reference whole and in chunks, training and backends without the op refused, per-expert and
 * fused checkpoints) and gpt-oss (sinks, windows, YaRN, biases, the clamped experts; bf16 and MXFP4
 * checkpoints loading to the same weights). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/status.h"
#include "kernels/cpu/cpu_moe.h"
#include "kernels/cpu/cpu_ops_ref.h"
#include "kernels/rope_table.h"
#include "model/model.h"
#include "model/model_internal.h" /* the residual stream after the last block (acts->xl) */
#include "formats/mxfp4.h"
#include "model/optim.h"
#include "tests/gpt_oss_testutil.h"
#include "tests/optim_testutil.h"
#include "tests/model_testutil.h"
#include "common/mxfp4_codec.h"
#include "tests/testutil.h"

#include <sys/stat.h>

static tkd_model_config qwen3_moe_cfg(void)
{
    tkd_model_config c = qwen3_cfg();
    c.arch = TKD_ARCH_QWEN3_MOE;
    c.num_experts = 5, c.num_experts_per_tok = 2, c.moe_intermediate_size = 12, c.norm_topk_prob = 1;
    c.layer_moe[1] = 1;
    return c;
}


/* y = rmsnorm(x) · w over one row of D, in double. */
static void ref_rmsnorm_row(const double *x, const float *w, int D, double eps, double *y)
{
    double ss = 0;
    for (int d = 0; d < D; d++)
        ss += x[d] * x[d];
    double r = 1.0 / sqrt(ss / D + eps);
    for (int d = 0; d < D; d++)
        y[d] = x[d] * r * w[d];
}

/* The layout: layer 0 keeps the dense MLP, layer 1 has the router and per-expert tensors whose
 * stacks are the op's views; then the forward against a reference composed by hand: a dense
 * Qwen3 model with the same tensors and layer 1's MLP zeroed gives the residual stream x2 before
 * layer 1's MLP (its acts->xl), and hidden = rmsnorm(x2 + MoE(rmsnorm(x2) · mlp_norm)) · final_norm
 * with MoE from tkd_ref_moe_fwd (double). Also through the chunked op calls (moe_rows 3 of 10). */
static void test_qwen3_moe_forward(void **s)
{
    (void)s;
    enum { B = 2, T = 5, N = B * T, D = 20, E = 5, K = 2, I = 12 };
    tkd_model_config c = qwen3_moe_cfg(), cq = qwen3_cfg();
    tkd_model *m = NULL, *q = NULL;
    assert_int_equal(tkd_model_init_random(&c, 7, &m), TKD_OK);
    assert_int_equal(tkd_model_init_random(&cq, 7, &q), TKD_OK);
    const tkd_layer_weights *L0 = &m->w.layers[0], *L1 = &m->w.layers[1];
    assert_non_null(L0->wg);
    assert_null(L0->router);
    assert_null(L1->wg);
    assert_null(L1->wd);
    assert_ptr_equal(L1->router, m->params + find_param(m, "model.layers.1.mlp.gate.weight")->offset);
    assert_ptr_equal(L1->eg, m->params + find_param(m, "model.layers.1.mlp.experts.0.gate_proj.weight")->offset);
    assert_ptr_equal(L1->eg + (size_t)4 * I * D,
                     m->params + find_param(m, "model.layers.1.mlp.experts.4.gate_proj.weight")->offset);
    assert_ptr_equal(L1->eu, L1->eg + (size_t)E * I * D);
    assert_ptr_equal(L1->ed, L1->eu + (size_t)E * I * D);
    assert_ptr_equal(L1->ed + (size_t)3 * D * I,
                     m->params + find_param(m, "model.layers.1.mlp.experts.3.down_proj.weight")->offset);
    assert_int_equal(find_param(m, "model.layers.1.mlp.experts.3.down_proj.weight")->shape[0], D);
    assert_null(find_param(m, "model.layers.1.mlp.gate_proj.weight"));
    assert_int_equal(m->info_per_layer, 0); /* blocks differ */
    /* the router's rows spread wider than the init's 0.2, so the top-2 differ from row to row */
    tkd_test_randn(L1->router, (size_t)E * D, 21, 1.0f);
    tkd_test_randn(m->w.layers[1].mlp_norm, D, 22, 1.0f);
    for (int i = 0; i < q->n_info; i++) {
        const tkd_param_info *p = &q->info[i], *pm = find_param(m, p->name);
        if (pm)
            memcpy(q->params + p->offset, m->params + pm->offset, p->numel * sizeof(float));
        else /* layer 1's dense MLP: zero, so the block adds nothing after its attention */
            memset(q->params + p->offset, 0, p->numel * sizeof(float));
    }
    int32_t tok[N] = {3, 9, 1, 36, 22, 5, 5, 17, 0, 30};
    const void *hq = NULL, *hm = NULL;
    assert_int_equal(tkd_model_forward(q, tok, B, T, 0, &hq), TKD_OK);
    const float *x2 = q->acts->xl; // (N, D)
    static double x2d[N * D], n2d[N * D], y[N * D], ref[N * D];
    static float n2[N * D];
    for (int r = 0; r < N; r++) {
        for (int d = 0; d < D; d++)
            x2d[r * D + d] = x2[r * D + d];
        ref_rmsnorm_row(x2d + r * D, L1->mlp_norm, D, c.rms_norm_eps, n2d + r * D);
        for (int d = 0; d < D; d++)
            n2[r * D + d] = (float)n2d[r * D + d];
    }
    tkd_moe_params p = tkd_moe_params_qwen3(D, I, E, K, 1);
    tkd_moe_weights w = {.router_w = L1->router, .w_gate = L1->eg, .w_up = L1->eu, .w_down = L1->ed};
    int32_t ex[N * K];
    tkd_ref_moe_fwd(&p, &w, n2, N, y, ex, NULL);
    int used[E] = {0}, distinct = 0;
    for (int i = 0; i < N * K; i++)
        distinct += !used[ex[i]]++;
    assert_true(distinct >= 4); /* the routing is not degenerate */
    for (int r = 0; r < N; r++) {
        double h[D];
        for (int d = 0; d < D; d++)
            h[d] = x2d[r * D + d] + y[r * D + d];
        ref_rmsnorm_row(h, m->w.final_norm, D, c.rms_norm_eps, ref + r * D);
    }
    /* fp32 sgemms and norms against double over D = 20 and I = 12 sums of O(1) terms: a few ulps
     * of the O(1) outputs */
    for (int chunked = 0; chunked <= 1; chunked++) {
        if (chunked)
            m->moe_rows = 3; /* the workspace holds more; each call takes 3 rows, the last 1 */
        assert_int_equal(tkd_model_forward(m, tok, B, T, 0, &hm), TKD_OK);
        const float *h = hm;
        for (int i = 0; i < N * D; i++)
            if (fabs(h[i] - ref[i]) > 2e-5 + 2e-5 * fabs(ref[i]))
                fail_msg("chunked %d: hidden[%d] = %.7g, reference %.7g", chunked, i, h[i], ref[i]);
    }
    tkd_model_free(q);
    tkd_model_free(m);
}

/* A model with MoE layers is a teacher: training is refused naming the architecture, and a backend
 * without the MoE op is refused naming the backend, before any work. */
static void test_qwen3_moe_refusals(void **s)
{
    (void)s;
    tkd_model_config c = qwen3_moe_cfg();
    tkd_model *m = NULL;
    assert_int_equal(tkd_model_init_random(&c, 3, &m), TKD_OK);
    int32_t tok[4] = {1, 2, 3, 4};
    const char *train[] = {"Qwen3MoeForCausalLM (qwen3_moe) has mixture-of-experts layers",
                           "training it is not supported", "students are dense", NULL};
    tkd_test_expect_error(tkd_model_reserve(m, 1, 4, 1), TKD_ERR_UNSUPPORTED, train);
    tkd_test_expect_error(tkd_model_forward(m, tok, 1, 4, 1, NULL), TKD_ERR_UNSUPPORTED, train);
    assert_null(m->grads);
    assert_int_equal(tkd_model_forward(m, tok, 1, 4, 0, NULL), TKD_OK);
    tkd_model_free(m);

    tkd_backend *be = NULL;
    assert_int_equal(tkd_backend_cpu_open(&be), TKD_OK);
    tkd_backend_ops ops = *be->op; /* the CUDA backend's table until its op lands */
    const tkd_backend_ops *saved = be->op;
    ops.moe_fwd = NULL;
    be->op = &ops;
    assert_int_equal(tkd_model_init_random_on(&c, 3, be, &m), TKD_OK);
    const char *noop[] = {"the cpu backend has no mixture-of-experts op yet", "Qwen3MoeForCausalLM",
                          "use device: cpu", NULL};
    tkd_test_expect_error(tkd_model_forward(m, tok, 1, 4, 0, NULL), TKD_ERR_UNSUPPORTED, noop);
    tkd_model_free(m);
    be->op = saved;
    tkd_backend_close(be);
}

/* Checkpoints: a save writes the experts per expert (the released checkpoints' names, which
 * transformers 5 loads through its conversion mapping) and loads back bit for bit; the fused layout
 * transformers 5 holds in memory (gate_up_proj (E, 2I, D), down_proj (E, D, I)) loads to the same
 * weights; a fused tensor of the wrong shape is refused naming it. */
static void test_qwen3_moe_checkpoints(void **s)
{
    (void)s;
    enum { D = 20, E = 5, I = 12 };
    tkd_model_config c = qwen3_moe_cfg();
    tkd_model *m = NULL, *r = NULL;
    assert_int_equal(tkd_model_init_random(&c, 5, &m), TKD_OK);
    char *dir = tkd_test_mkdtemp("model-qwen3moe");
    assert_int_equal(tkd_model_save_hf(m, dir, TKD_DTYPE_F32), TKD_OK);
    if (tkd_model_load_hf(dir, &r) != TKD_OK)
        fail_msg("%s", tkd_error_msg());
    assert_int_equal(r->cfg.arch, TKD_ARCH_QWEN3_MOE);
    assert_true(!tkd_model_config_moe(&r->cfg, 0) && tkd_model_config_moe(&r->cfg, 1));
    assert_memory_equal(r->params, m->params, sizeof(float) * m->n_params);
    tkd_model_free(r);

    for (int bad = 0; bad <= 1; bad++) {
        /* the same weights with layer 1's experts fused */
        const tkd_layer_weights *L1 = &m->w.layers[1];
        static float gate_up[E * 2 * I * D];
        for (int e = 0; e < E; e++) {
            memcpy(gate_up + (size_t)e * 2 * I * D, L1->eg + (size_t)e * I * D, sizeof(float) * I * D);
            memcpy(gate_up + (size_t)(2 * e + 1) * I * D, L1->eu + (size_t)e * I * D, sizeof(float) * I * D);
        }
        tkd_st_writer *wr = NULL;
        assert_int_equal(tkd_st_writer_init(&wr, TKD_DTYPE_F32), TKD_OK);
        for (int i = 0; i < m->n_info; i++)
            if (!strstr(m->info[i].name, ".mlp.experts."))
                assert_int_equal(tkd_st_writer_add(wr, m->info[i].name, m->info[i].ndim, m->info[i].shape,
                                                   m->params + m->info[i].offset), TKD_OK);
        int64_t gu_shape[3] = {E, 2 * I, D}, down_shape[3] = {E, D, I + bad};
        assert_int_equal(tkd_st_writer_add(wr, "model.layers.1.mlp.experts.gate_up_proj", 3, gu_shape, gate_up),
                         TKD_OK);
        static float down[E * D * (I + 1)];
        memcpy(down, L1->ed, sizeof(float) * E * D * I);
        assert_int_equal(tkd_st_writer_add(wr, "model.layers.1.mlp.experts.down_proj", 3, down_shape, down), TKD_OK);
        char path[4096];
        snprintf(path, sizeof path, "%s/model.safetensors", dir);
        assert_int_equal(tkd_st_writer_finish(wr, path), TKD_OK);
        tkd_st_writer_free(wr);
        tkd_status st = tkd_model_load_hf(dir, &r);
        if (bad) {
            const char *frags[] = {"model.layers.1.mlp.experts.down_proj", "has shape", "expected", NULL};
            tkd_test_expect_error(st, TKD_ERR_MISMATCH, frags);
            assert_null(r);
            continue;
        }
        if (st != TKD_OK)
            fail_msg("%s", tkd_error_msg());
        assert_memory_equal(r->params, m->params, sizeof(float) * m->n_params);
        tkd_model_free(r);
    }
    tkd_test_rmtree(dir);
    free(dir);
    tkd_model_free(m);
}

/* ---- gpt-oss ----------------------------------------------------------------------------------- */

/* A tiny gpt-oss: D 20, H 4, Hkv 2, head_dim 8 != D/H, layer 0 sliding (window 3 < T), layer 1
 * full, YaRN (factor 4 over an original 4 positions, so it matters within 16), every layer MoE
 * (E 5, top-2, I 12) with a swiglu_limit (0.6) the activations reach. */
static tkd_model_config gpt_oss_cfg(void)
{
    tkd_model_config c = small_cfg(0, 1);
    c.arch = TKD_ARCH_GPT_OSS, c.head_dim = 8, c.intermediate_size = 12, c.moe_intermediate_size = 12;
    c.num_experts = 5, c.num_experts_per_tok = 2, c.swiglu_limit = 0.6f;
    c.sliding_window = 3, c.layer_sliding[0] = 1, c.layer_moe[0] = c.layer_moe[1] = 1;
    c.rope_scaling = TKD_ROPE_SCALING_YARN, c.rope_factor = 4, c.rope_beta_fast = 32, c.rope_beta_slow = 1;
    c.rope_original_max_pos = 4, c.rope_truncate = 0;
    return c;
}

/* Every weight drawn again, the biases and sinks away from zero (the init leaves biases 0), the
 * routers wide so tokens pick different experts. */
static void gpt_oss_randomise(tkd_model *m, uint64_t seed)
{
    tkd_test_randn(m->params, m->n_params, seed, 0.3f);
    for (int l = 0; l < m->cfg.num_hidden_layers; l++) {
        tkd_layer_weights *W = &m->w.layers[l];
        tkd_test_randn(W->router, (size_t)m->cfg.num_experts * m->cfg.hidden_size, seed + 10 + l, 1.0f);
        tkd_test_randn(W->sinks, (size_t)m->cfg.num_attention_heads, seed + 20 + l, 1.5f);
    }
}

static double *to_double(const float *x, size_t n)
{
    double *d = malloc(sizeof(double) * n);
    assert_non_null(d);
    for (size_t i = 0; i < n; i++)
        d[i] = x[i];
    return d;
}

/* hidden of the gpt-oss model m, composed from the double reference ops: per block rmsnorm, q/k/v
 * with biases, RoPE from the model's (YaRN) tables, attention with the layer's window and sinks
 * (tkd_ref_attn_sinks_fwd), o_proj with bias, residual, rmsnorm, MoE (tkd_ref_moe_fwd with
 * gpt-oss's params and biases), residual; the final norm. ref (N, D); routed: distinct experts. */
static void gpt_oss_reference(const tkd_model *m, const int32_t *tok, int B, int T, double *ref, int *routed)
{
    const tkd_model_config *c = &m->cfg;
    int N = B * T, D = c->hidden_size, H = c->num_attention_heads, Hkv = c->num_key_value_heads, dh = c->head_dim;
    int Q = H * dh, KV = Hkv * dh, E = c->num_experts, K = c->num_experts_per_tok, I = c->moe_intermediate_size;
    double *emb = to_double(m->w.embed, (size_t)c->vocab_size * D), *x = calloc((size_t)N * D, sizeof(double));
    double *n1 = calloc((size_t)N * D, 8), *q = calloc((size_t)N * Q, 8), *k = calloc((size_t)N * KV, 8);
    double *v = calloc((size_t)N * KV, 8), *att = calloc((size_t)B * H * T * T, 8), *y = calloc((size_t)N * Q, 8);
    double *rstd = calloc((size_t)N, 8), *mo = calloc((size_t)N * D, 8);
    float *n2 = calloc((size_t)N * D, 4);
    int32_t *ex = calloc((size_t)N * K, 4);
    int used[64] = {0};
    *routed = 0;
    tkd_ref_embedding_fwd(tok, N, emb, D, x);
    for (int l = 0; l < c->num_hidden_layers; l++) {
        const tkd_layer_weights *W = &m->w.layers[l];
        double *an = to_double(W->attn_norm, D), *wq = to_double(W->wq, (size_t)Q * D), *bq = to_double(W->bq, Q);
        double *wk = to_double(W->wk, (size_t)KV * D), *bk = to_double(W->bk, KV);
        double *wv = to_double(W->wv, (size_t)KV * D), *bv = to_double(W->bv, KV);
        double *wo = to_double(W->wo, (size_t)D * Q), *bo = to_double(W->bo, D), *sk = to_double(W->sinks, H);
        double *mn = to_double(W->mlp_norm, D);
        tkd_ref_rmsnorm_fwd(x, an, N, D, c->rms_norm_eps, n1, rstd);
        tkd_ref_linear_fwd(n1, wq, bq, N, D, Q, 0, q);
        tkd_ref_linear_fwd(n1, wk, bk, N, D, KV, 0, k);
        tkd_ref_linear_fwd(n1, wv, bv, N, D, KV, 0, v);
        tkd_ref_rope_fwd(q, N, T, H, dh, m->rope_cos, m->rope_sin);
        tkd_ref_rope_fwd(k, N, T, Hkv, dh, m->rope_cos, m->rope_sin);
        tkd_ref_attn_sinks_fwd(q, k, v, B, T, H, Hkv, dh, tkd_model_config_window(c, l), NULL, sk, att, y);
        tkd_ref_linear_fwd(y, wo, bo, N, Q, D, 1, x); /* x += o_proj(y) */
        tkd_ref_rmsnorm_fwd(x, mn, N, D, c->rms_norm_eps, n1, rstd);
        for (int i = 0; i < N * D; i++)
            n2[i] = (float)n1[i]; /* the op reads fp32 rows, as the model's n2 */
        tkd_moe_params p = tkd_moe_params_gpt_oss(D, I, E, K, c->swiglu_limit);
        tkd_moe_weights w = {W->router, W->router_b, W->eg, W->eu, W->ed, W->ebg, W->ebu, W->ebd, {{NULL}, {NULL}}};
        tkd_ref_moe_fwd(&p, &w, n2, N, mo, ex, NULL);
        for (int i = 0; i < N * D; i++)
            x[i] += mo[i];
        for (int i = 0; i < N * K; i++)
            *routed += !used[l * E + ex[i]]++;
        free(an), free(wq), free(bq), free(wk), free(bk), free(wv), free(bv), free(wo), free(bo), free(sk), free(mn);
    }
    double *fn = to_double(m->w.final_norm, D);
    tkd_ref_rmsnorm_fwd(x, fn, N, D, c->rms_norm_eps, ref, rstd);
    free(fn), free(emb), free(x), free(n1), free(q), free(k), free(v), free(att), free(y), free(rstd), free(mo);
    free(n2), free(ex);
}

/* The gpt-oss block: its layout (o_proj and q/k/v biases, sinks (H), the router with its bias, the
 * experts' stacks in the op's layout with their biases; no q/k norm, no dense MLP), the YaRN tables
 * scaled by the attention factor, and the forward against gpt_oss_reference (window 3 < T 7 on
 * layer 0, sinks, biases, clamped experts). Training is refused naming the sinks. */
static void test_gpt_oss_forward(void **s)
{
    (void)s;
    enum { B = 2, T = 7, N = B * T, D = 20 };
    tkd_model_config c = gpt_oss_cfg();
    tkd_model *m = NULL;
    if (tkd_model_init_random(&c, 9, &m) != TKD_OK)
        fail_msg("%s", tkd_error_msg());
    const tkd_layer_weights *L1 = &m->w.layers[1];
    assert_ptr_equal(L1->sinks, m->params + find_param(m, "model.layers.1.self_attn.sinks")->offset);
    assert_int_equal(find_param(m, "model.layers.1.self_attn.sinks")->shape[0], 4);
    assert_ptr_equal(L1->bo, m->params + find_param(m, "model.layers.1.self_attn.o_proj.bias")->offset);
    assert_ptr_equal(L1->router, m->params + find_param(m, "model.layers.1.mlp.router.weight")->offset);
    assert_ptr_equal(L1->router_b, m->params + find_param(m, "model.layers.1.mlp.router.bias")->offset);
    assert_ptr_equal(L1->ebd, m->params + find_param(m, "model.layers.1.mlp.experts.down_proj_bias")->offset);
    assert_non_null(L1->bq);
    assert_non_null(L1->ebg);
    assert_non_null(L1->ebu);
    assert_null(L1->q_norm);
    assert_null(L1->wg);
    /* YaRN: position 0's cos is the attention factor 0.1·ln(4) + 1 */
    assert_true(fabsf(m->rope_cos[0] - (float)(0.1 * log(4.0) + 1.0)) < 1e-6f);
    float inv[4], af, cos_t[16 * 4], sin_t[16 * 4]; /* and the YaRN frequencies, table for table */
    tkd_rope_inv_freq_yarn(1e4, 8, 4.0, 32.0, 1.0, 4, 0, 0.0, inv, &af);
    tkd_rope_table_scaled(inv, 8, 16, af, cos_t, sin_t);
    assert_memory_equal(m->rope_cos, cos_t, sizeof cos_t);
    assert_memory_equal(m->rope_sin, sin_t, sizeof sin_t);
    gpt_oss_randomise(m, 40);
    int32_t tok[N] = {3, 9, 1, 36, 22, 5, 5, 17, 0, 30, 11, 2, 8, 8};
    static double ref[N * D];
    int routed = 0;
    gpt_oss_reference(m, tok, B, T, ref, &routed);
    assert_true(routed >= 8); /* of 10 experts over the two layers: the routing is not degenerate */
    const void *hm = NULL;
    assert_int_equal(tkd_model_forward(m, tok, B, T, 0, &hm), TKD_OK);
    const float *h = hm;
    /* fp32 against double over two blocks of O(1) values: sums of at most 20 terms, a few ulps */
    for (int i = 0; i < N * D; i++)
        if (fabs(h[i] - ref[i]) > 5e-5 + 5e-5 * fabs(ref[i]))
            fail_msg("hidden[%d] = %.7g, reference %.7g", i, h[i], ref[i]);
    const char *train[] = {"GptOssForCausalLM (gpt_oss) has attention sinks", "training it is not supported", NULL};
    tkd_test_expect_error(tkd_model_reserve(m, 1, 4, 1), TKD_ERR_UNSUPPORTED, train);
    const char *save[] = {"saving a GptOssForCausalLM checkpoint is not supported", NULL};
    tkd_test_expect_error(tkd_model_save_hf(m, "/nonexistent/gptoss", TKD_DTYPE_F32), TKD_ERR_UNSUPPORTED, save);
    tkd_model_free(m);
}

/* The experts of a gpt-oss checkpoint in both layouts load to the same weights: the dequantised one
 * (gate_up_proj (E, D, 2I) interleaved, down_proj (E, I, D): what the model was made from) and the
 * released MXFP4 one (_blocks/_scales pairs whose values are exactly those weights, in a second
 * shard). D = I = 32: one MXFP4 block per row. */
static void test_gpt_oss_checkpoints(void **s)
{
    (void)s;
    enum { D = 32, I = 32, E = 3, G = 1 };
    tkd_model_config c = gpt_oss_cfg();
    c.hidden_size = D, c.intermediate_size = I, c.moe_intermediate_size = I, c.num_experts = E;
    tkd_model *m = NULL, *r = NULL;
    assert_int_equal(tkd_model_init_random(&c, 12, &m), TKD_OK);
    gpt_oss_randomise(m, 50);
    /* MXFP4 pairs per layer (random codes, scales 2^-3..2^0), decoded into the model's experts */
    static uint8_t gu_blk[2][E * 2 * I * G * 16], gu_sc[2][E * 2 * I * G], dn_blk[2][E * D * G * 16], dn_sc[2][E * D * G];
    static float gu_rows[E * 2 * I * D], gu[E * D * 2 * I], gub[E * 2 * I], dn_rows[E * D * I], dn[E * I * D];
    uint64_t st = 77;
    for (int l = 0; l < 2; l++) {
        for (size_t i = 0; i < sizeof gu_blk[l]; i++)
            gu_blk[l][i] = (uint8_t)((st = st * 6364136223846793005ull + 1442695040888963407ull) >> 56);
        for (size_t i = 0; i < sizeof dn_blk[l]; i++)
            dn_blk[l][i] = (uint8_t)((st = st * 6364136223846793005ull + 1442695040888963407ull) >> 56);
        for (size_t i = 0; i < sizeof gu_sc[l]; i++)
            gu_sc[l][i] = (uint8_t)(124 + i % 4);
        for (size_t i = 0; i < sizeof dn_sc[l]; i++)
            dn_sc[l][i] = (uint8_t)(124 + i % 4);
        assert_int_equal(tkd_mxfp4_decode_f32(gu_blk[l], gu_sc[l], E * 2 * I, G, gu_rows, "gu"), TKD_OK);
        assert_int_equal(tkd_mxfp4_decode_f32(dn_blk[l], dn_sc[l], E * D, G, dn_rows, "dn"), TKD_OK);
        /* transformers: the dequantised (E, R, G·32) transposed in its last two dims */
        for (int e = 0; e < E; e++) {
            for (int rr = 0; rr < 2 * I; rr++)
                for (int d = 0; d < D; d++)
                    gu[((size_t)e * D + d) * 2 * I + rr] = gu_rows[((size_t)e * 2 * I + rr) * D + d];
            for (int rr = 0; rr < D; rr++)
                for (int i = 0; i < I; i++)
                    dn[((size_t)e * I + i) * D + rr] = dn_rows[((size_t)e * D + rr) * I + i];
        }
        tkd_layer_weights *W = &m->w.layers[l];
        for (int e = 0; e < E; e++)
            for (int i = 0; i < I; i++) {
                gub[e * 2 * I + 2 * i] = W->ebg[e * I + i];
                gub[e * 2 * I + 2 * i + 1] = W->ebu[e * I + i];
            }
        tkd_moe_from_gpt_oss(E, D, I, gu, gub, dn, W->eg, W->eu, W->ebg, W->ebu, W->ed);
    }
    char *dir = tkd_test_mkdtemp("model-gptoss");
    char bdir[4200], qdir[4200];
    snprintf(bdir, sizeof bdir, "%s/bf16", dir);
    snprintf(qdir, sizeof qdir, "%s/mxfp4", dir);
    gpt_oss_save(m, bdir, TKD_DTYPE_BF16); /* the MXFP4 values and the rest: are they all bf16? */
    if (tkd_model_load_hf(bdir, &r) != TKD_OK)
        fail_msg("%s", tkd_error_msg());
    assert_int_equal(r->cfg.arch, TKD_ARCH_GPT_OSS);
    for (int l = 0; l < 2; l++) /* the experts are exact in bf16 (MXFP4 values) */
        assert_memory_equal(r->w.layers[l].eg, m->w.layers[l].eg, sizeof(float) * (size_t)E * I * D * 3);
    tkd_model_free(r);

    /* MXFP4: shard 1 every other tensor (F32), shard 2 the U8 pairs; the index maps both */
    assert_int_equal(mkdir(qdir, 0755), 0);
    gpt_oss_write_config(qdir, &m->cfg, 1);
    tkd_st_writer *w = NULL;
    assert_int_equal(tkd_st_writer_init(&w, TKD_DTYPE_F32), TKD_OK);
    char p1[4300], p2[4300], idx[4300];
    snprintf(p1, sizeof p1, "%s/model-00001-of-00002.safetensors", qdir);
    snprintf(p2, sizeof p2, "%s/model-00002-of-00002.safetensors", qdir);
    snprintf(idx, sizeof idx, "%s/model.safetensors.index.json", qdir);
    gpt_oss_write_tensors(m, qdir, TKD_DTYPE_F32, 1, w);
    tkd_st_writer_free(w);
    char from[4300];
    snprintf(from, sizeof from, "%s/model.safetensors", qdir);
    assert_int_equal(rename(from, p1), 0);
    FILE *f = fopen(idx, "w");
    assert_non_null(f);
    fprintf(f, "{\"weight_map\": {");
    for (int i = 0; i < m->n_info; i++)
        if (!gpt_oss_internal_name(m->info[i].name))
            fprintf(f, "\"%s\": \"model-00001-of-00002.safetensors\", ", m->info[i].name);
    static char names[2][4][96];
    tkd_test_st_entry e[8];
    for (int l = 0; l < 2; l++) {
        fprintf(f, "\"model.layers.%d.mlp.experts.gate_up_proj_bias\": \"model-00001-of-00002.safetensors\", ", l);
        const char *kinds[4] = {"gate_up_proj_blocks", "gate_up_proj_scales", "down_proj_blocks", "down_proj_scales"};
        for (int j = 0; j < 4; j++) {
            snprintf(names[l][j], sizeof names[l][j], "model.layers.%d.mlp.experts.%s", l, kinds[j]);
            fprintf(f, "\"%s\": \"model-00002-of-00002.safetensors\"%s", names[l][j], l == 1 && j == 3 ? "" : ", ");
        }
        e[4 * l + 0] = (tkd_test_st_entry){names[l][0], "U8", 4, {E, 2 * I, G, 16}, gu_blk[l], sizeof gu_blk[l]};
        e[4 * l + 1] = (tkd_test_st_entry){names[l][1], "U8", 3, {E, 2 * I, G}, gu_sc[l], sizeof gu_sc[l]};
        e[4 * l + 2] = (tkd_test_st_entry){names[l][2], "U8", 4, {E, D, G, 16}, dn_blk[l], sizeof dn_blk[l]};
        e[4 * l + 3] = (tkd_test_st_entry){names[l][3], "U8", 3, {E, D, G}, dn_sc[l], sizeof dn_sc[l]};
    }
    fprintf(f, "}}\n");
    fclose(f);
    tkd_test_write_st(p2, e, 8);
    if (tkd_model_load_hf(qdir, &r) != TKD_OK)
        fail_msg("%s", tkd_error_msg());
    assert_int_equal(r->cfg.quant_mxfp4, 1);
    /* the CPU keeps the experts as MXFP4 (model_mxfp4.c): no fp32 stacks, and the same forward bit
     * for bit (the op decodes exactly, then runs the same GEMMs) */
    assert_int_equal(r->cfg.experts_mxfp4, 1);
    assert_null(r->w.layers[0].eg);
    assert_true(r->n_params + 2 * 3 * (size_t)E * I * D == m->n_params);
    {
        int32_t tok[2 * 7];
        for (int i = 0; i < 14; i++)
            tok[i] = (i * 5 + 1) % m->cfg.vocab_size;
        for (int l = 0; l < 2; l++) { /* each kept stack decodes to the model's own */
            float *dq = malloc(sizeof(float) * (size_t)E * I * D);
            assert_non_null(dq);
            for (int j = 0; j < 3; j++) {
                const float *ref = j == 0 ? m->w.layers[l].eg : j == 1 ? m->w.layers[l].eu : m->w.layers[l].ed;
                assert_int_equal(tkd_mxfp4_decode_f32(r->qlayer[l].blocks[j], r->qlayer[l].scales[j],
                                                      j == 2 ? E * D : E * I, G, dq, "test"), TKD_OK);
                assert_memory_equal(dq, ref, sizeof(float) * (size_t)E * I * D);
            }
            free(dq);
        }
        m->cfg.swiglu_limit = 7.0f; /* what the checkpoint's reader computes with (docs/model.md) */
        const void *hm = NULL, *hr = NULL;
        assert_int_equal(tkd_model_forward(m, tok, 2, 7, 0, &hm), TKD_OK);
        assert_int_equal(tkd_model_forward(r, tok, 2, 7, 0, &hr), TKD_OK);
        assert_memory_equal(hm, hr, sizeof(float) * 14 * (size_t)D);
    }
    tkd_model_free(r);
    /* a missing expert tensor is named, with its MXFP4 alternative */
    remove(p2);
    f = fopen(idx, "w");
    fprintf(f, "{\"weight_map\": {");
    for (int i = 0; i < m->n_info; i++)
        if (!gpt_oss_internal_name(m->info[i].name))
            fprintf(f, "\"%s\": \"model-00001-of-00002.safetensors\", ", m->info[i].name);
    fprintf(f, "\"model.layers.0.mlp.experts.gate_up_proj_bias\": \"model-00001-of-00002.safetensors\", "
               "\"model.layers.1.mlp.experts.gate_up_proj_bias\": \"model-00001-of-00002.safetensors\"}}\n");
    fclose(f);
    const char *missing[] = {"config.json's quantization_config says mxfp4, but",
                             "'model.layers.0.mlp.experts.gate_up_proj_blocks' is not in the checkpoint", NULL};
    tkd_test_expect_error(tkd_model_load_hf(qdir, &r), TKD_ERR_FORMAT, missing);
    tkd_test_rmtree(dir);
    free(dir);
    tkd_model_free(m);
}


TKD_TEST_MAIN(test_qwen3_moe_forward, test_qwen3_moe_refusals, test_qwen3_moe_checkpoints, test_gpt_oss_forward,
              test_gpt_oss_checkpoints)
