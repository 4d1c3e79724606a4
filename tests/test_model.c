/* test_model.c — the model's contracts other than numerical parity (test_hf_parity.c) and gradients
 * (test_gradcheck.c): seeded init, the parameter list, causality and batch independence, buffer reuse
 * across shapes, gradient accumulation, tied LM-head gradients, errors; Qwen3-MoE's and gpt-oss's
 * forwards against hand-composed references, their layouts (gpt-oss: bf16 and MXFP4 experts) and
 * refusals; and the optimizer's schedule,
 * clipping and AdamW update against hand-computed values.
 */
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
#include "tests/optim_testutil.h"
#include "tests/model_testutil.h"
#include "tests/testutil.h"

#include <sys/stat.h>


static tkd_model *make(int tied, int bias, uint64_t seed)
{
    tkd_model_config c = small_cfg(tied, bias);
    tkd_model *m = NULL;
    if (tkd_model_init_random(&c, seed, &m) != TKD_OK)
        fail_msg("%s", tkd_error_msg());
    return m;
}

/* tkd_model_layer_range (ZeRO's per-block buckets): block l's range holds exactly the tensors
 * named model.layers.<l>.*, the ranges tile the parameters from the embedding's end to the final
 * norm, with and without q/k/v biases and a separate head. */
static void test_layer_ranges(void **s)
{
    (void)s;
    for (int v = 0; v < 4; v++) {
        tkd_model *m = make(v & 1, v >> 1, 3);
        int n = 0;
        const tkd_param_info *info = tkd_model_params(m, &n);
        size_t prev_end = info[0].numel; /* the embedding comes first */
        for (int l = 0; l < m->cfg.num_hidden_layers; l++) {
            size_t b, e;
            tkd_model_layer_range(m, l, &b, &e);
            assert_int_equal(b, prev_end);
            char prefix[64];
            snprintf(prefix, sizeof prefix, "model.layers.%d.", l);
            size_t covered = 0;
            for (int i = 0; i < n; i++) {
                const int inside = info[i].offset >= b && info[i].offset < e;
                assert_int_equal(inside, strncmp(info[i].name, prefix, strlen(prefix)) == 0);
                if (inside)
                    covered += info[i].numel;
            }
            assert_int_equal(covered, e - b);
            prev_end = e;
        }
        for (int i = 0; i < n; i++)
            if (strcmp(info[i].name, "model.norm.weight") == 0)
                assert_int_equal(info[i].offset, prev_end);
        tkd_model_free(m);
    }
}

static void test_init_is_seeded(void **s)
{
    (void)s;
    tkd_model *a = make(0, 1, 5), *b = make(0, 1, 5), *c = make(0, 1, 6);
    assert_int_equal(a->n_params, b->n_params);
    assert_memory_equal(a->params, b->params, sizeof(float) * a->n_params);
    assert_memory_not_equal(a->params, c->params, sizeof(float) * a->n_params);
    int n;
    const tkd_param_info *info = tkd_model_params(a, &n);
    for (int i = 0; i < n; i++) {
        const float *x = a->params + info[i].offset;
        double sum = 0, sq = 0;
        for (size_t j = 0; j < info[i].numel; j++)
            sum += x[j], sq += (double)x[j] * x[j];
        if (strstr(info[i].name, "norm.weight"))
            assert_true(sum == (double)info[i].numel && sq == (double)info[i].numel); /* all ones */
        else if (strstr(info[i].name, ".bias"))
            assert_true(sq == 0);
        else if (info[i].numel >= 500) { /* normal(0, 0.2): std within 10% on >= 500 draws */
            double mean = sum / info[i].numel, sd = sqrt(sq / info[i].numel - mean * mean);
            assert_true(fabs(mean) < 0.05 && fabs(sd - 0.2) < 0.02);
        }
    }
    tkd_model_free(a), tkd_model_free(b), tkd_model_free(c);
}

static void test_param_list(void **s)
{
    (void)s;
    for (int tied = 0; tied <= 1; tied++) {
        tkd_model *m = make(tied, !tied, 1);
        int n;
        const tkd_param_info *info = tkd_model_params(m, &n);
        size_t off = 0;
        int nodecay = 0;
        for (int i = 0; i < n; i++) {
            assert_int_equal(info[i].offset, off); /* contiguous, in order: one allocation */
            off += info[i].numel;
            int want = !(strstr(info[i].name, "norm") || strstr(info[i].name, ".bias"));
            assert_int_equal(info[i].decay, want);
            nodecay += !want;
        }
        assert_int_equal(off, m->n_params);
        /* untied has attention_bias: q/k/v and o_proj biases (LlamaAttention's o_proj is
         * nn.Linear(..., bias=attention_bias)): 2 norms + 4 biases per layer + final norm */
        assert_int_equal(nodecay, tied ? 2 * 2 + 1 : 2 * 6 + 1);
        assert_string_equal(info[0].name, "model.embed_tokens.weight");
        assert_string_equal(info[n - 1].name, tied ? "model.norm.weight" : "lm_head.weight");
        assert_int_equal(n, 2 + !tied + 2 * (tied ? 9 : 13));
        if (!tied)
            assert_ptr_equal(m->w.layers[1].bo,
                             m->params + find_param(m, "model.layers.1.self_attn.o_proj.bias")->offset);
        assert_true((tkd_model_lm_head(m) == m->w.embed) == tied);
        assert_null(tkd_model_lm_head_grad(m)); /* no gradients before a training forward */
        tkd_model_free(m);
    }
}

/* A Llama with attention_bias has an o_proj bias too (transformers' LlamaAttention): the checkpoint
 * it writes holds it, and such a checkpoint loads back bit for bit (before, its o_proj.bias was a
 * tensor "not part of the architecture" and the load failed); the bias is applied. */
static void test_llama_o_proj_bias(void **s)
{
    (void)s;
    tkd_model *m = make(0, 1, 4), *r = NULL;
    tkd_test_randn(m->w.layers[0].bo, 20, 5, 0.5f);
    char *dir = tkd_test_mkdtemp("model-obias");
    assert_int_equal(tkd_model_save_hf(m, dir, TKD_DTYPE_F32), TKD_OK);
    tkd_st_dir *st = NULL;
    assert_int_equal(tkd_st_open(dir, &st), TKD_OK);
    assert_non_null(tkd_st_find(st, "model.layers.0.self_attn.o_proj.bias"));
    tkd_st_close(st);
    if (tkd_model_load_hf(dir, &r) != TKD_OK)
        fail_msg("%s", tkd_error_msg());
    assert_memory_equal(r->params, m->params, sizeof(float) * m->n_params);
    int32_t tok[3] = {1, 2, 3};
    const void *h1 = NULL;
    assert_int_equal(tkd_model_forward(r, tok, 1, 3, 0, &h1), TKD_OK);
    float before[60];
    memcpy(before, h1, sizeof before);
    memset(r->w.layers[0].bo, 0, sizeof(float) * 20);
    assert_int_equal(tkd_model_forward(r, tok, 1, 3, 0, &h1), TKD_OK);
    assert_true(memcmp(before, h1, sizeof before) != 0);
    tkd_model_free(r);
    tkd_model_free(m);
    tkd_test_rmtree(dir);
    free(dir);
}

/* Row b's hidden states depend only on row b, and position t only on positions <= t: a short run on a
 * prefix of one row reproduces the long batched run, after the buffers were sized bigger. */
static void test_causal_and_batch_independent(void **s)
{
    (void)s;
    tkd_model *m = make(0, 1, 2);
    enum { B = 3, T = 9, D = 20 };
    int32_t tok[B * T];
    for (int i = 0; i < B * T; i++)
        tok[i] = (i * 13 + 5) % 37;
    const void *h = NULL;
    assert_int_equal(tkd_model_forward(m, tok, B, T, 0, &h), TKD_OK);
    float *big = malloc(sizeof(float) * B * T * D);
    memcpy(big, h, sizeof(float) * B * T * D);
    for (int b = 0; b < B; b++) {
        assert_int_equal(tkd_model_forward(m, tok + b * T, 1, 4, 1, &h), TKD_OK); /* training path too */
        for (int i = 0; i < 4 * D; i++)
            assert_true(fabsf(((const float *)h)[i] - big[b * T * D + i]) <= 1e-5f * (1 + fabsf(big[b * T * D + i])));
    }
    /* changing a later token leaves earlier positions alone */
    tok[5] = (tok[5] + 1) % 37;
    assert_int_equal(tkd_model_forward(m, tok, B, T, 0, &h), TKD_OK);
    assert_memory_equal(h, big, sizeof(float) * 5 * D);
    assert_memory_not_equal((const float *)h + 5 * D, big + 5 * D, sizeof(float) * D);
    free(big);
    tkd_model_free(m);
}

/* Inference (no activations kept) and training forwards give the same hidden states. */
static void test_inference_equals_training(void **s)
{
    (void)s;
    tkd_model *m = make(1, 0, 3);
    int32_t tok[2 * 7] = {1, 2, 3, 4, 5, 6, 7, 36, 0, 0, 9, 9, 9, 1};
    const void *h = NULL;
    float a[2 * 7 * 20];
    assert_int_equal(tkd_model_forward(m, tok, 2, 7, 0, &h), TKD_OK);
    memcpy(a, h, sizeof a);
    assert_int_equal(tkd_model_forward(m, tok, 2, 7, 1, &h), TKD_OK);
    assert_memory_equal(a, h, sizeof a);
    tkd_model_free(m);
}

/* Two forward/backward pairs without zeroing give twice one; the tied head's gradient is
 * the embedding's buffer, so what the loss adds there lands in the embedding gradient. */
static void test_grad_accumulation_and_tied_head(void **s)
{
    (void)s;
    tkd_model *m = make(1, 1, 4);
    enum { N = 2 * 6, D = 20 };
    int32_t tok[N] = {3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8};
    float dh[N * D];
    tkd_test_randn(dh, N * D, 9, 1);
    assert_int_equal(tkd_model_forward(m, tok, 2, 6, 1, NULL), TKD_OK);
    assert_int_equal(tkd_model_backward(m, dh), TKD_OK);
    assert_int_equal(tkd_model_backward(m, dh), TKD_ERR_INVALID_ARG); /* activations consumed */
    float *once = malloc(sizeof(float) * m->n_params);
    memcpy(once, m->grads, sizeof(float) * m->n_params);
    assert_int_equal(tkd_model_forward(m, tok, 2, 6, 1, NULL), TKD_OK);
    assert_int_equal(tkd_model_backward(m, dh), TKD_OK);
    /* not bit-exact: a repeated token's embedding row sums its rows in a different order */
    for (size_t i = 0; i < m->n_params; i++)
        assert_true(fabsf(m->grads[i] - 2 * once[i]) <= 1e-6f * (1 + fabsf(once[i])));
    float *gh = tkd_model_lm_head_grad(m);
    assert_ptr_equal(gh, m->g.embed);
    size_t row_unused = 36 * D; /* token 36 is not in the batch: only the head path reaches it */
    assert_true(gh[row_unused] == 0);
    gh[row_unused] += 0.5f;
    assert_true(m->grads[m->info[0].offset + row_unused] == 0.5f);
    tkd_model_zero_grad(m);
    for (size_t i = 0; i < m->n_params; i++)
        assert_true(m->grads[i] == 0);
    free(once);
    tkd_model_free(m);
}

/* The recompute and lend tests' model: cfg with three layers (the first and a middle one
 * recomputed, the last kept), a (3, 9) token batch into tok and a loss gradient dh (N3, D3). */
enum { N3 = 3 * 9, D3 = 20 };

static tkd_model *three_layers(tkd_model_config cfg, int32_t *tok, float *dh)
{
    cfg.num_hidden_layers = 3;
    tkd_model *m = NULL;
    assert_int_equal(tkd_model_init_random(&cfg, 7, &m), TKD_OK);
    assert_int_equal(m->cfg.hidden_size, D3);
    for (int i = 0; i < N3; i++)
        tok[i] = (i * 11 + 3) % 37;
    tkd_test_randn(dh, N3 * D3, 5, 1);
    return m;
}

/* train.recompute: full, attention and full_keep_attention: the same hidden states and bit-identical gradients as
 * keeping every activation (the same ops in the same order), over three layers (the first and a
 * middle one recomputed, the last kept), and smaller activation buffers, full the smallest; the
 * same with the middle block kept whole (tkd_model_set_recompute_whole); switching back gives the
 * first layout again. */
static void recompute_same_gradients(tkd_model_config cfg)
{
    int32_t tok[N3];
    float dh[N3 * D3];
    tkd_model *m = three_layers(cfg, tok, dh);
    const void *h = NULL;
    float *h0 = malloc(sizeof dh), *g0 = malloc(sizeof(float) * m->n_params);
    assert_int_equal(tkd_model_forward(m, tok, 3, 9, 1, &h), TKD_OK);
    memcpy(h0, h, sizeof dh);
    assert_int_equal(tkd_model_backward(m, dh), TKD_OK);
    memcpy(g0, m->grads, sizeof(float) * m->n_params);
    size_t all = tkd_model_activation_bytes(m), kept[4] = {all, 0, 0, 0};
    const tkd_recompute modes[3] = {TKD_RECOMPUTE_FULL, TKD_RECOMPUTE_ATTENTION, TKD_RECOMPUTE_FULL_KEEP_ATTENTION};
    for (int i = 0; i < 6; i++) { /* each mode, then with the middle block whole (auto's partial plans) */
        tkd_recompute r = modes[i % 3];
        int whole = i < 3 ? 0 : 2;
        assert_int_equal(tkd_model_zero_grad(m), TKD_OK);
        tkd_model_set_recompute(m, r);
        tkd_model_set_recompute_whole(m, whole);
        assert_int_equal(tkd_model_forward(m, tok, 3, 9, 1, &h), TKD_OK);
        if (!whole)
            kept[r] = tkd_model_activation_bytes(m);
        else /* between the mode's and keeping everything */
            assert_true(tkd_model_activation_bytes(m) > kept[r] && tkd_model_activation_bytes(m) <= all);
        assert_memory_equal(h, h0, sizeof dh);
        assert_int_equal(tkd_model_backward(m, dh), TKD_OK);
        for (size_t j = 0; j < m->n_params; j++)
            if (memcmp(&m->grads[j], &g0[j], sizeof(float)) != 0)
                fail_msg("recompute %d, %d blocks whole: gradient %zu is %.9g, %.9g keeping everything", (int)r, whole,
                         j, m->grads[j], g0[j]);
    }
    tkd_model_set_recompute_whole(m, 0);
    printf("activations: %zu bytes kept without recompute, %zu with attention, %zu with full_keep_attention, %zu "
           "with full\n", all, kept[TKD_RECOMPUTE_ATTENTION], kept[TKD_RECOMPUTE_FULL_KEEP_ATTENTION],
           kept[TKD_RECOMPUTE_FULL]);
    assert_true(kept[TKD_RECOMPUTE_FULL] < kept[TKD_RECOMPUTE_ATTENTION] && kept[TKD_RECOMPUTE_ATTENTION] < all);
    assert_true(kept[TKD_RECOMPUTE_FULL] < kept[TKD_RECOMPUTE_FULL_KEEP_ATTENTION] &&
                kept[TKD_RECOMPUTE_FULL_KEEP_ATTENTION] < all);
    tkd_model_set_recompute(m, TKD_RECOMPUTE_NONE);
    assert_int_equal(tkd_model_forward(m, tok, 3, 9, 1, NULL), TKD_OK);
    assert_int_equal(tkd_model_activation_bytes(m), all);
    free(h0);
    free(g0);
    tkd_model_free(m);
}

static void test_recompute_same_gradients(void **s)
{
    (void)s;
    recompute_same_gradients(small_cfg(0, 1));
}

/* Qwen3 with a window on the middle layer: the per-head norms' saved inputs and the window are
 * remade in the shared set too. */
static void test_recompute_qwen3_window(void **s)
{
    (void)s;
    tkd_model_config c = qwen3_cfg();
    c.sliding_window = 3, c.layer_sliding[1] = 1;
    recompute_same_gradients(c);
}

/* train.recompute: auto's choice (tkd_model_pick_recompute) over every plan of the three-layer
 * model: none, or attention / full_keep_attention / full with the last w ∈ {0, 1, 2} blocks whole.
 * Each plan's planned bytes are what a training reserve then allocates (with and without the
 * gradient loans). For every budget at a plan's bytes (and one byte under): the pick fits when any
 * plan does and no plan that fits recomputes fewer FLOPs, by model.h's measure written out here:
 * (3 − max(w, 1)) blocks × the mode's FLOPs a token, attention 1920 + 48·T (q/k/v and the causal
 * attention forward), full_keep_attention 6240 (every GEMM), full both. So attention wins at T 9
 * and full_keep_attention at T 128. Nothing fits: full, its bytes over the budget. */
enum { PLANS = 10 }; /* none, then 3 modes × w 0..2 */

static double plan_cost(tkd_recompute r, int w, int T)
{
    double att = 1920 + 48.0 * T, fka = 6240;
    double f = r == TKD_RECOMPUTE_NONE ? 0 : r == TKD_RECOMPUTE_ATTENTION ? att
                                         : r == TKD_RECOMPUTE_FULL_KEEP_ATTENTION ? fka : fka + 48.0 * T;
    return (3 - (w > 1 ? w : 1)) * f;
}

static void pick_checks(tkd_model *m, int T, int lend)
{
    const tkd_recompute modes[3] = {TKD_RECOMPUTE_ATTENTION, TKD_RECOMPUTE_FULL_KEEP_ATTENTION, TKD_RECOMPUTE_FULL};
    tkd_recompute pm[PLANS] = {TKD_RECOMPUTE_NONE};
    int pw[PLANS] = {0};
    size_t b[PLANS];
    for (int i = 1; i < PLANS; i++)
        pm[i] = modes[(i - 1) / 3], pw[i] = (i - 1) % 3;
    for (int i = 0; i < PLANS; i++) {
        assert_int_equal(tkd_model_recompute_bytes(m, pm[i], pw[i], 3, T, &b[i]), TKD_OK);
        tkd_model_set_recompute(m, pm[i]);
        tkd_model_set_recompute_whole(m, pw[i]);
        assert_int_equal(tkd_model_reserve(m, 3, T, 1), TKD_OK);
        assert_int_equal(tkd_model_activation_bytes(m), b[i]);
    }
    printf("T %d, lend %d: none %zu bytes; attention %zu %zu %zu, full_keep_attention %zu %zu %zu, full %zu %zu %zu "
           "(0, 1, 2 blocks whole)\n", T, lend, b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7], b[8], b[9]);
    for (int j = 0; j <= 2 * PLANS; j++) {
        size_t budget = j == 2 * PLANS ? SIZE_MAX : b[j / 2] - (size_t)(j % 2);
        tkd_recompute_fit f;
        assert_int_equal(tkd_model_pick_recompute(m, 3, T, budget, &f), TKD_OK);
        assert_true(f.budget == budget);
        size_t planned;
        assert_int_equal(tkd_model_recompute_bytes(m, f.mode, f.whole, 3, T, &planned), TKD_OK);
        assert_int_equal(f.need, planned);
        assert_int_not_equal(f.whole, 1); /* the last block alone is never recomputed: no gain */
        int fits = 0;
        for (int i = 0; i < PLANS; i++)
            if (b[i] <= budget) {
                fits = 1;
                if (plan_cost(f.mode, f.whole, T) > plan_cost(pm[i], pw[i], T))
                    fail_msg("T %d budget %zu: picked mode %d with %d whole, but mode %d with %d whole fits and "
                             "recomputes less", T, budget, (int)f.mode, f.whole, (int)pm[i], pw[i]);
            }
        if (fits)
            assert_true(f.need <= budget);
        else
            assert_true(f.mode == TKD_RECOMPUTE_FULL && f.whole == 0 && f.need > budget);
    }
    /* attention and full_keep_attention both fit, no block whole: the cheaper by T (the CPU keeps
     * the attention's probabilities, so at T 128 full_keep_attention's bytes are the larger) */
    size_t both = b[1] > b[4] ? b[1] : b[4];
    if (both < b[2] && both < b[5]) { /* and neither fits with a block whole */
        tkd_recompute_fit f;
        assert_int_equal(tkd_model_pick_recompute(m, 3, T, both, &f), TKD_OK);
        assert_int_equal(f.mode, T < 90 ? TKD_RECOMPUTE_ATTENTION : TKD_RECOMPUTE_FULL_KEEP_ATTENTION);
    }
    size_t need;
    assert_int_equal(tkd_model_recompute_bytes(m, TKD_RECOMPUTE_NONE, 0, 0, T, &need), TKD_ERR_INVALID_ARG);
    tkd_model_set_recompute_whole(m, 0);
}

static void test_pick_recompute(void **s)
{
    (void)s;
    tkd_model_config c = small_cfg(0, 1);
    c.max_position_embeddings = 128;
    int32_t tok[N3];
    float dh[N3 * D3];
    tkd_model *m = three_layers(c, tok, dh);
    for (int lend = 0; lend < 2; lend++) {
        tkd_model_set_lend_grads(m, lend);
        pick_checks(m, 9, lend);
        pick_checks(m, 128, lend);
    }
    tkd_model_free(m);
}

/* tkd_model_set_lend_grads: each block's kept activations in the gradient buffer give the same
 * hidden states and bit-identical gradients in every recompute mode, over two steps (the second
 * overwrites what the first left lent), in a smaller own buffer; tied heads lend nothing to block
 * 0 (the loss writes the embedding's gradient during the forward). */
static void lend_same_gradients(tkd_model_config cfg)
{
    int32_t tok[N3];
    float dh[N3 * D3];
    tkd_model *m = three_layers(cfg, tok, dh);
    float *h0 = malloc(sizeof dh), *g0 = malloc(sizeof(float) * m->n_params);
    const tkd_recompute modes[4] = {TKD_RECOMPUTE_NONE, TKD_RECOMPUTE_ATTENTION, TKD_RECOMPUTE_FULL,
                                    TKD_RECOMPUTE_FULL_KEEP_ATTENTION};
    for (int i = 0; i < 7; i++) { /* every mode, then the three that recompute with the middle block whole */
        const void *h = NULL;
        tkd_recompute r = modes[i < 4 ? i : i - 3];
        tkd_model_set_recompute(m, r);
        tkd_model_set_recompute_whole(m, i < 4 ? 0 : 2);
        tkd_model_set_lend_grads(m, 0);
        assert_int_equal(tkd_model_zero_grad(m), TKD_OK);
        assert_int_equal(tkd_model_forward(m, tok, 3, 9, 1, &h), TKD_OK);
        assert_int_equal(tkd_model_activation_lent_bytes(m), 0);
        memcpy(h0, h, sizeof dh);
        assert_int_equal(tkd_model_backward(m, dh), TKD_OK);
        memcpy(g0, m->grads, sizeof(float) * m->n_params);
        size_t own = tkd_model_activation_bytes(m);
        tkd_model_set_lend_grads(m, 1);
        for (int step = 0; step < 2; step++) {
            assert_int_equal(tkd_model_zero_grad(m), TKD_OK);
            assert_int_equal(tkd_model_forward(m, tok, 3, 9, 1, &h), TKD_OK);
            assert_memory_equal(h, h0, sizeof dh);
            assert_int_equal(tkd_model_backward(m, dh), TKD_OK);
            for (size_t j = 0; j < m->n_params; j++)
                if (memcmp(&m->grads[j], &g0[j], sizeof(float)) != 0)
                    fail_msg("recompute %d (%d whole), step %d: lent gradient %zu is %.9g, %.9g in own memory",
                             (int)r, m->recompute_whole, step, j, m->grads[j], g0[j]);
        }
        size_t left = tkd_model_activation_bytes(m), lent = tkd_model_activation_lent_bytes(m);
        printf("recompute %d (%d whole): %zu activation bytes of their own, %zu lending the gradients (%zu lent; tied "
               "%d)\n", (int)r, m->recompute_whole, own, left, lent, cfg.tie_word_embeddings);
        assert_true(left < own && lent > 0);
        assert_int_equal(left + lent, own); /* every tensor is somewhere, the same size */
    }
    free(h0);
    free(g0);
    tkd_model_free(m);
}

static void test_lend_grads(void **s)
{
    (void)s;
    lend_same_gradients(small_cfg(0, 1));
    lend_same_gradients(small_cfg(1, 0));
    tkd_model_config c = qwen3_cfg();
    c.sliding_window = 3, c.layer_sliding[1] = 1;
    lend_same_gradients(c);
}

/* Qwen3's q_norm / k_norm: (head_dim) each, after o_proj as transformers lists them, no decay,
 * initialised to 1; its config and tensors survive a save and load (the logits too). */
static void test_qwen3_params_and_save(void **s)
{
    (void)s;
    tkd_model_config c = qwen3_cfg();
    tkd_model *m = NULL, *r = NULL, *llama = make(0, 0, 4);
    assert_int_equal(tkd_model_init_random(&c, 4, &m), TKD_OK);
    assert_int_equal(m->n_params - llama->n_params, /* q/k/v/o widen with head_dim 8 vs 6, plus the norms */
                     (size_t)2 * (20 * 8 * (4 + 2 + 2 + 4) - 20 * 6 * (4 + 2 + 2 + 4) + 2 * 8));
    int n, found = 0;
    const tkd_param_info *info = tkd_model_params(m, &n);
    for (int i = 0; i < n; i++)
        if (strstr(info[i].name, "_norm.weight") && strstr(info[i].name, "self_attn")) {
            assert_true(strstr(info[i - 1 - (found & 1)].name, "o_proj.weight") != NULL);
            assert_int_equal(info[i].ndim, 1);
            assert_int_equal(info[i].shape[0], 8);
            assert_int_equal(info[i].decay, 0);
            assert_true(m->params[info[i].offset] == 1.0f && m->params[info[i].offset + 7] == 1.0f);
            found++;
        }
    assert_int_equal(found, 2 * 2);
    assert_ptr_equal(m->w.layers[1].q_norm, m->params + info[1 + m->info_per_layer + 5].offset);
    assert_null(llama->w.layers[0].q_norm);
    /* distinct norm weights, so a load that mixed them up would show in the logits */
    tkd_test_randn(m->w.layers[0].q_norm, 8, 11, 0.5f);
    tkd_test_randn(m->w.layers[1].k_norm, 8, 12, 0.5f);
    char *dir = tkd_test_mkdtemp("model-qwen3");
    assert_int_equal(tkd_model_save_hf(m, dir, TKD_DTYPE_F32), TKD_OK);
    if (tkd_model_load_hf(dir, &r) != TKD_OK)
        fail_msg("%s", tkd_error_msg());
    assert_int_equal(r->cfg.arch, TKD_ARCH_QWEN3);
    assert_int_equal(r->cfg.head_dim, 8);
    assert_memory_equal(r->params, m->params, sizeof(float) * m->n_params);
    int32_t tok[6] = {1, 5, 9, 36, 2, 2};
    const void *h = NULL;
    float a[6 * 20];
    assert_int_equal(tkd_model_forward(m, tok, 1, 6, 0, &h), TKD_OK);
    memcpy(a, h, sizeof a);
    assert_int_equal(tkd_model_forward(r, tok, 1, 6, 0, &h), TKD_OK);
    assert_memory_equal(a, h, sizeof a);
    tkd_test_rmtree(dir);
    free(dir);
    tkd_model_free(r);
    tkd_model_free(m);
    tkd_model_free(llama);
}

/* A one-layer model with a window of W keys: position t sees tokens t − W + 1 … t only, so changing
 * token 0 moves positions < W and leaves the rest bit for bit; with the window off it moves them all. */
static void test_sliding_window_masks(void **s)
{
    (void)s;
    enum { T = 9, W = 3, D = 20 };
    for (int windowed = 0; windowed <= 1; windowed++) {
        tkd_model_config c = qwen3_cfg();
        c.num_hidden_layers = 1;
        c.sliding_window = windowed ? W : 0, c.layer_sliding[0] = (unsigned char)windowed;
        tkd_model *m = NULL;
        assert_int_equal(tkd_model_init_random(&c, 9, &m), TKD_OK);
        int32_t tok[T] = {3, 1, 4, 1, 5, 9, 2, 6, 5};
        const void *h = NULL;
        float a[T * D];
        assert_int_equal(tkd_model_forward(m, tok, 1, T, 0, &h), TKD_OK);
        memcpy(a, h, sizeof a);
        tok[0] = 30;
        assert_int_equal(tkd_model_forward(m, tok, 1, T, 1, &h), TKD_OK);
        for (int t = 0; t < T; t++) {
            int same = memcmp(a + t * D, (const float *)h + t * D, sizeof(float) * D) == 0;
            if (same != (windowed && t >= W))
                fail_msg("window %d: position %d %s when token 0 changed", windowed ? W : 0, t,
                         same ? "did not move" : "moved");
        }
        tkd_model_free(m);
    }
}

/* A backend whose attention has no window (be->attn_window 0) is refused for a layer
 * whose window is shorter than the sequence, naming it; a window the sequence fits in runs. */
static void test_window_needs_backend(void **s)
{
    (void)s;
    tkd_model_config c = qwen3_cfg();
    c.sliding_window = 4, c.layer_sliding[1] = 1;
    tkd_backend *be = NULL;
    assert_int_equal(tkd_backend_cpu_open(&be), TKD_OK);
    be->attn_window = 0;
    tkd_model *m = NULL;
    assert_int_equal(tkd_model_init_random_on(&c, 1, be, &m), TKD_OK);
    int32_t tok[5] = {1, 2, 3, 4, 5};
    assert_int_equal(tkd_model_forward(m, tok, 1, 4, 0, NULL), TKD_OK);
    assert_int_equal(tkd_model_forward(m, tok, 1, 5, 0, NULL), TKD_ERR_UNSUPPORTED);
    tkd_test_assert_msg_has("layer 1 has sliding_window 4 < sequence length 5");
    tkd_test_assert_msg_has("the cpu backend's attention does not mask a window yet");
    assert_int_equal(tkd_model_reserve(m, 1, 5, 1), TKD_ERR_UNSUPPORTED);
    /* a backend whose forward masks but whose backward does not (CUDA today): inference runs,
     * training is refused, naming the backward */
    be->attn_window = 1, be->attn_window_bwd = 0;
    assert_int_equal(tkd_model_forward(m, tok, 1, 5, 0, NULL), TKD_OK);
    assert_int_equal(tkd_model_reserve(m, 1, 5, 1), TKD_ERR_UNSUPPORTED);
    tkd_test_assert_msg_has("layer 1 has sliding_window 4 < sequence length 5");
    tkd_test_assert_msg_has("attention backward (training) does not mask a window yet");
    tkd_model_free(m);
    tkd_backend_close(be);
}

/* qwen3_cfg as Qwen3-MoE with a dense first layer and an MoE second: E 5, k 2, I 12 (!= F 28). */
static void test_errors(void **s)
{
    (void)s;
    tkd_model *m = make(0, 0, 1);
    int32_t tok[4] = {0, 1, 37, 2};
    assert_int_equal(tkd_model_forward(m, tok, 2, 2, 0, NULL), TKD_ERR_INVALID_ARG);
    assert_non_null(strstr(tkd_error_msg(), "token 37 at batch row 1, position 0"));
    int32_t many[17] = {0};
    assert_int_equal(tkd_model_forward(m, many, 1, 17, 0, NULL), TKD_ERR_INVALID_ARG);
    assert_non_null(strstr(tkd_error_msg(), "max_position_embeddings 16"));
    float dh[20] = {0};
    assert_int_equal(tkd_model_backward(m, dh), TKD_ERR_INVALID_ARG); /* no training forward yet */
    assert_int_equal(tkd_model_forward(m, many, 1, 1, 0, NULL), TKD_OK);
    assert_int_equal(tkd_model_backward(m, dh), TKD_ERR_INVALID_ARG); /* inference forward only */
    tkd_model_config bad = small_cfg(0, 0);
    bad.head_dim = 5; /* RoPE pairs need an even head_dim */
    tkd_model *x = NULL;
    assert_int_not_equal(tkd_model_init_random(&bad, 1, &x), TKD_OK);
    assert_null(x);
    char *dir = tkd_test_mkdtemp("model-err");
    assert_int_not_equal(tkd_model_load_hf(dir, &x), TKD_OK); /* no config.json */
    assert_null(x);
    tkd_test_rmtree(dir);
    free(dir);
    tkd_model_free(m);
}

static void test_schedule(void **s)
{
    (void)s;
    tkd_optim_config c;
    tkd_optim_config_defaults(&c);
    c.lr = 1.0, c.min_lr = 0.1, c.warmup_steps = 4, c.total_steps = 14;
    assert_true(fabs(tkd_optim_lr(&c, 0) - 0.25) < 1e-15);
    assert_true(fabs(tkd_optim_lr(&c, 3) - 1.0) < 1e-15);
    assert_true(fabs(tkd_optim_lr(&c, 4) - 1.0) < 1e-15);        /* cosine starts at the peak */
    assert_true(fabs(tkd_optim_lr(&c, 9) - 0.55) < 1e-12);       /* halfway: (lr + min) / 2 */
    assert_true(fabs(tkd_optim_lr(&c, 14) - 0.1) < 1e-15);       /* end and after: min_lr */
    assert_true(fabs(tkd_optim_lr(&c, 1000) - 0.1) < 1e-15);
    c.warmup_steps = 0;
    assert_true(fabs(tkd_optim_lr(&c, 0) - 1.0) < 1e-15);
}

static void test_clip(void **s)
{
    (void)s;
    float g[4] = {3, 4, 0, 0}, norm_g[4];
    double n;
    assert_int_equal(tkd_optim_clip(g, 4, 10.0, &n), TKD_OK);
    assert_true(n == 5.0 && g[0] == 3 && g[1] == 4); /* under the cap: untouched */
    assert_int_equal(tkd_optim_clip(g, 4, 1.0, &n), TKD_OK);
    assert_true(n == 5.0);
    memcpy(norm_g, g, sizeof g);
    assert_true(fabs(tkd_optim_grad_norm(norm_g, 4) - 1.0) < 1e-6);
    assert_true(fabsf(g[0] - 0.6f) < 1e-6f && fabsf(g[1] - 0.8f) < 1e-6f);
    g[2] = NAN;
    assert_int_equal(tkd_optim_clip(g, 4, 1.0, &n), TKD_ERR_NUMERIC);
    float a[3] = {1, 2, 3};
    tkd_optim_scale(a, 3, 0.5f);
    assert_true(a[0] == 0.5f && a[2] == 1.5f);
    tkd_optim_zero(a, 3);
    assert_true(a[0] == 0 && a[1] == 0 && a[2] == 0);
}

/* First AdamW step: m̂ = g, v̂ = g², so p ← p·(1 − lr·wd) − lr·g / (|g| + eps); no decay where
 * decay = 0. Second step against the recurrences written out by hand. */
static void test_adamw_step(void **s)
{
    (void)s;
    tkd_optim_config c;
    tkd_optim_config_defaults(&c);
    c.beta1 = 0.9, c.beta2 = 0.99, c.eps = 1e-8, c.weight_decay = 0.5;
    tkd_param_info info[2] = {{.name = "w", .ndim = 1, .shape = {2}, .offset = 0, .numel = 2, .decay = 1},
                              {.name = "n", .ndim = 1, .shape = {2}, .offset = 2, .numel = 2, .decay = 0}};
    float p[4] = {1, -2, 3, 4}, g[4] = {0.5f, -0.25f, 2, 0};
    tkd_adamw *o = NULL;
    assert_int_equal(tkd_adamw_init(&c, 4, &o), TKD_OK);
    double lr = 0.1;
    tkd_adamw_step(o, p, g, info, 2, lr);
    assert_int_equal(o->step, 1);
    double want[4] = {1 * (1 - 0.05) - 0.1, -2 * (1 - 0.05) + 0.1, 3 - 0.1, 4};
    for (int i = 0; i < 4; i++)
        assert_true(fabs(p[i] - want[i]) < 1e-6);
    /* step 2 with the same gradient, by the recurrences */
    double m[4], v[4], q[4];
    for (int i = 0; i < 4; i++) {
        m[i] = 0.1 * g[i] * 0.9 + 0.1 * g[i];
        v[i] = 0.01 * g[i] * g[i] * 0.99 + 0.01 * g[i] * g[i];
        q[i] = p[i];
    }
    tkd_adamw_step(o, p, g, info, 2, lr);
    for (int i = 0; i < 4; i++) {
        double wd = i < 2 ? 0.5 : 0.0, bc1 = 1 - 0.81, bc2 = 1 - 0.99 * 0.99;
        double expect = q[i] * (1 - lr * wd) - lr / bc1 * m[i] / (sqrt(v[i]) / sqrt(bc2) + 1e-8);
        assert_true(fabs(p[i] - expect) < 1e-6);
        assert_true(fabs(o->m[i] - m[i]) < 1e-7 && fabs(o->v[i] - v[i]) < 1e-7);
    }
    tkd_adamw_free(o);
}

/* tkd_adamw_clip_step_model (the clip coefficient inside the update) against tkd_optim_clip_model
 * then tkd_adamw_step_model (a pass scaling the gradients first): the same weights and moments to
 * the bit over two clipped steps and one unclipped one; the fused path leaves the gradients as
 * they were; a non-finite norm takes no step. */
static void test_clip_step_fused(void **s)
{
    (void)s;
    tkd_model *a = make(0, 1, 7), *b = make(0, 1, 7);
    assert_int_equal(tkd_model_reserve(a, 1, 4, 1), TKD_OK);
    assert_int_equal(tkd_model_reserve(b, 1, 4, 1), TKD_OK);
    size_t n = a->n_params;
    float *g = malloc(sizeof(float) * n);
    tkd_optim_config c;
    tkd_optim_config_defaults(&c);
    tkd_adamw *oa = NULL, *ob = NULL;
    assert_int_equal(tkd_adamw_init_on(&c, a, &oa), TKD_OK);
    assert_int_equal(tkd_adamw_init_on(&c, b, &ob), TKD_OK);
    const double caps[3] = {0.5, 0.25, 1e9}; /* the third does not clip */
    for (int step = 0; step < 3; step++) {
        tkd_test_randn(g, n, 40 + step, 0.3f);
        memcpy(a->grads, g, sizeof(float) * n);
        memcpy(b->grads, g, sizeof(float) * n);
        double na = 0, nb = 0;
        assert_int_equal(tkd_optim_clip_model(a, caps[step], &na), TKD_OK);
        assert_int_equal(tkd_adamw_step_model(oa, a, 1e-2), TKD_OK);
        assert_int_equal(tkd_adamw_clip_step_model(ob, b, 1e-2, caps[step], &nb), TKD_OK);
        assert_true(na == nb);
        assert_true(step == 2 || na > caps[step]); /* the first two steps do clip */
        assert_memory_equal(b->params, a->params, sizeof(float) * n);
        assert_memory_equal(ob->m, oa->m, sizeof(float) * n);
        assert_memory_equal(ob->v, oa->v, sizeof(float) * n);
        assert_memory_equal(b->grads, g, sizeof(float) * n);
    }
    float *p0 = malloc(sizeof(float) * n);
    memcpy(p0, b->params, sizeof(float) * n);
    b->grads[3] = NAN;
    double nb = 0;
    assert_int_equal(tkd_adamw_clip_step_model(ob, b, 1e-2, 1.0, &nb), TKD_ERR_NUMERIC);
    assert_true(isnan(nb));
    assert_int_equal(ob->step, 3);
    assert_memory_equal(b->params, p0, sizeof(float) * n);
    free(g);
    free(p0);
    tkd_adamw_free(oa);
    tkd_adamw_free(ob);
    tkd_model_free(a);
    tkd_model_free(b);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_init_is_seeded),
        cmocka_unit_test(test_layer_ranges),
        cmocka_unit_test(test_param_list),
        cmocka_unit_test(test_llama_o_proj_bias),
        cmocka_unit_test(test_causal_and_batch_independent),
        cmocka_unit_test(test_inference_equals_training),
        cmocka_unit_test(test_grad_accumulation_and_tied_head),
        cmocka_unit_test(test_recompute_same_gradients),
        cmocka_unit_test(test_recompute_qwen3_window),
        cmocka_unit_test(test_lend_grads),
        cmocka_unit_test(test_pick_recompute),
        cmocka_unit_test(test_qwen3_params_and_save),
        cmocka_unit_test(test_sliding_window_masks),
        cmocka_unit_test(test_window_needs_backend),
        cmocka_unit_test(test_errors),
        cmocka_unit_test(test_schedule),
        cmocka_unit_test(test_clip),
        cmocka_unit_test(test_adamw_step),
        cmocka_unit_test(test_clip_step_fused),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
