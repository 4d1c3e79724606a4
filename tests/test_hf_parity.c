/* test_hf_parity.c — the CPU model against transformers: logits of four committed checkpoints
 * (tests/fixtures/hf, made by make_hf_fixtures.py), five AdamW steps against PyTorch's losses,
 * checkpoint write/read round trips, and broken checkpoints that must name the bad tensor. With
 * TKD_HF_FIXTURES_QWEN3 (tests/CMakeLists.txt defines it once the fixtures of
 * `make_hf_fixtures.py --only qwen3_hd32,qwen3_window,mistral_window` are in tests/fixtures/hf)
 * also Qwen3 (F32, BF16; head_dim != D/H) and sliding windows shorter than the sequence (Qwen3 on
 * one layer, Mistral on all), each fixture required. With TKD_HF_FIXTURES_QWEN3_MOE (the fixtures of
 * `make_hf_fixtures.py --only qwen3_moe`) also Qwen3-MoE, F32 and BF16: a dense first layer, then
 * two MoE layers (inference only: a model with MoE layers refuses training). With
 * TKD_HF_FIXTURES_GPT_OSS (`make_hf_fixtures.py --only gpt_oss`) also gpt-oss, F32, BF16 and MXFP4
 * (against transformers' dequantised load): sinks, q/k/v/o biases, a window shorter than T on layer
 * 0, YaRN, MoE with router biases in both layers.
 *
 * Relative error, per position n: max_v |ours − ref| / max_v |ref|; asserted ≤ 1e-4 everywhere
 * (fp32 everywhere on both sides, so only summation order differs: ~1e-6 is typical).
 *
 * Setting TKD_HF_VERIFY_OUT=<dir> additionally writes checkpoints made by this code plus their
 * logits there, for make_hf_fixtures.py --verify to load with transformers.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <cjson/cJSON.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/status.h"
#include "kernels/cpu/cpu_ops.h"
#include "model/model.h"
#include "model/optim.h"
#include "tests/optim_testutil.h"
#include "common/mxfp4_codec.h"
#include "tests/testutil.h"

#define FIX_B 2  /* tokens.i32 is (B, T + 1); see tests/fixtures/hf/README.md */
#define FIX_T 11
#define FIX_N (FIX_B * FIX_T)

/* A file under tests/ (malloc'd, NUL-terminated). */
static void *slurp(const char *rel, size_t *size)
{
    return tkd_test_slurp(tkd_test_src(rel), size);
}

/* inputs (B, T) and labels (B, T) from the fixture's (B, T + 1) tokens */
static void fixture_tokens(int32_t *inputs, int32_t *labels)
{
    size_t n;
    int32_t *t = slurp("fixtures/hf/tokens.i32", &n);
    assert_int_equal(n, sizeof(int32_t) * FIX_B * (FIX_T + 1));
    for (int b = 0; b < FIX_B; b++)
        for (int i = 0; i < FIX_T; i++) {
            inputs[b * FIX_T + i] = t[b * (FIX_T + 1) + i];
            labels[b * FIX_T + i] = t[b * (FIX_T + 1) + i + 1];
        }
    free(t);
}

static tkd_model *load_fixture(const char *name)
{
    char dir[4096];
    snprintf(dir, sizeof dir, "%s", tkd_test_src("fixtures/hf/"));
    strncat(dir, name, sizeof dir - strlen(dir) - 1);
    tkd_model *m = NULL;
    tkd_status st = tkd_model_load_hf(dir, &m);
    if (st != TKD_OK)
        fail_msg("%s: %s", name, tkd_error_msg());
    return m;
}

/* max over positions of max_v |a − b| / max_v |b| */
static double max_rel_err(const float *a, const float *b, int n, int v)
{
    double worst = 0;
    for (int i = 0; i < n; i++) {
        double num = 0, den = 0;
        for (int j = 0; j < v; j++) {
            num = fmax(num, fabs((double)a[i * v + j] - b[i * v + j]));
            den = fmax(den, fabs((double)b[i * v + j]));
        }
        worst = fmax(worst, num / den);
    }
    return worst;
}

static float *model_logits(tkd_model *m, const int32_t *inputs, int training)
{
    const void *h = NULL;
    if (tkd_model_forward(m, inputs, FIX_B, FIX_T, training, &h) != TKD_OK)
        fail_msg("forward: %s", tkd_error_msg());
    float *lg = malloc(sizeof(float) * FIX_N * m->cfg.vocab_size);
    tkd_model_logits(m, h, FIX_N, lg);
    return lg;
}

static void check_logits(const char *name)
{
    int32_t in[FIX_N], lab[FIX_N];
    fixture_tokens(in, lab);
    tkd_model *m = load_fixture(name);
    int V = m->cfg.vocab_size;
    char rel[256];
    snprintf(rel, sizeof rel, "fixtures/hf/%s.logits.f32", name);
    size_t n;
    float *ref = slurp(rel, &n);
    assert_int_equal(n, sizeof(float) * FIX_N * V);
    /* both forwards where the model trains; MoE models are teachers (forward only) */
    for (int training = 0; training <= !tkd_model_config_has_moe(&m->cfg); training++) {
        float *lg = model_logits(m, in, training);
        double err = max_rel_err(lg, ref, FIX_N, V);
        printf("%s (training=%d): max relative error per position %.3e\n", name, training, err);
        assert_true(err <= 1e-4);
        free(lg);
    }
    free(ref);
    tkd_model_free(m);
}

static void test_logits_llama_gqa_f32(void **s) { (void)s; check_logits("llama_gqa_f32"); }
static void test_logits_llama_gqa_bf16(void **s) { (void)s; check_logits("llama_gqa_bf16"); }
static void test_logits_qwen2_tied_f32(void **s) { (void)s; check_logits("qwen2_tied_f32"); }
static void test_logits_qwen2_tied_bf16(void **s) { (void)s; check_logits("qwen2_tied_bf16"); }

#ifdef TKD_HF_FIXTURES_QWEN3
static void test_logits_qwen3_hd32_f32(void **s) { (void)s; check_logits("qwen3_hd32_f32"); }
static void test_logits_qwen3_hd32_bf16(void **s) { (void)s; check_logits("qwen3_hd32_bf16"); }
static void test_logits_qwen3_window_f32(void **s) { (void)s; check_logits("qwen3_window_f32"); }
static void test_logits_mistral_window_f32(void **s) { (void)s; check_logits("mistral_window_f32"); }

/* The new fixtures are what their names say: Qwen3's q/k norms with head_dim != D/H, and windows
 * shorter than the T = 11 the logits are compared at, read from transformers 5's own config.json. */
static void test_fixture_shapes_qwen3_windows(void **s)
{
    (void)s;
    tkd_model *m = load_fixture("qwen3_hd32_bf16");
    assert_int_equal(m->cfg.arch, TKD_ARCH_QWEN3);
    assert_int_equal(m->cfg.head_dim, 32); /* != D/H = 8 */
    assert_int_equal(m->cfg.hidden_size / m->cfg.num_attention_heads, 8);
    assert_non_null(m->w.layers[1].k_norm);
    assert_int_equal(tkd_model_config_window(&m->cfg, 0) + tkd_model_config_window(&m->cfg, 1), 0);
    tkd_model_free(m);
    m = load_fixture("qwen3_window_f32");
    assert_int_equal(tkd_model_config_window(&m->cfg, 0), 0);
    assert_int_equal(tkd_model_config_window(&m->cfg, 1), 4);
    assert_true(m->cfg.tie_word_embeddings);
    tkd_model_free(m);
    m = load_fixture("mistral_window_f32");
    assert_int_equal(m->cfg.arch, TKD_ARCH_MISTRAL);
    assert_int_equal(tkd_model_config_window(&m->cfg, 0), 5);
    assert_int_equal(tkd_model_config_window(&m->cfg, 1), 5);
    assert_int_equal(m->cfg.head_dim, 16);
    tkd_model_free(m);
}
#endif

static void test_fixture_shapes(void **s)
{
    (void)s;
    tkd_model *m = load_fixture("llama_gqa_f32");
    assert_int_equal(m->cfg.head_dim, 16); /* != D/H = 12: exercises head_dim */
    assert_int_equal(m->cfg.rope_scaling, TKD_ROPE_SCALING_LLAMA3);
    assert_false(m->cfg.tie_word_embeddings);
    assert_ptr_not_equal(tkd_model_lm_head(m), m->w.embed);
    tkd_model_free(m);
    m = load_fixture("qwen2_tied_bf16");
    assert_true(m->cfg.tie_word_embeddings && m->cfg.attention_bias);
    assert_ptr_equal(tkd_model_lm_head(m), m->w.embed);
    assert_non_null(m->w.layers[1].bk);
    tkd_model_free(m);
}

/* Mean next-token CE over N rows from logits (N, V); writes dlogits = ∂CE/∂logits. */
static double cross_entropy(const float *lg, const int32_t *lab, int N, int V, float *dlg)
{
    double loss = 0;
    for (int i = 0; i < N; i++) {
        const float *r = lg + (size_t)i * V;
        double mx = -INFINITY, sum = 0;
        for (int j = 0; j < V; j++)
            mx = fmax(mx, r[j]);
        for (int j = 0; j < V; j++)
            sum += exp(r[j] - mx);
        loss += mx + log(sum) - r[lab[i]];
        for (int j = 0; j < V; j++)
            dlg[(size_t)i * V + j] = (float)((exp(r[j] - mx) / sum - (j == lab[i])) / N);
    }
    return loss / N;
}

/* One full-logits CE forward + backward: returns the loss, leaves gradients in m->grads. */
static double ce_step(tkd_model *m, const int32_t *in, const int32_t *lab)
{
    int V = m->cfg.vocab_size, D = m->cfg.hidden_size;
    const void *h = NULL;
    assert_int_equal(tkd_model_forward(m, in, FIX_B, FIX_T, 1, &h), TKD_OK);
    float *lg = malloc(sizeof(float) * FIX_N * V), *dlg = malloc(sizeof(float) * FIX_N * V);
    float *dh = calloc((size_t)FIX_N * D, sizeof(float));
    tkd_model_logits(m, h, FIX_N, lg);
    double loss = cross_entropy(lg, lab, FIX_N, V, dlg);
    /* the LM head's part, as the fused loss does it: dH = dS·W, dW += dSᵀ·H */
    tkd_cpu_linear_bwd(dlg, h, tkd_model_lm_head(m), FIX_N, D, V, dh, tkd_model_lm_head_grad(m), NULL);
    assert_int_equal(tkd_model_backward(m, dh), TKD_OK);
    free(lg);
    free(dlg);
    free(dh);
    return loss;
}

static double jnum(const cJSON *o, const char *k)
{
    const cJSON *x = cJSON_GetObjectItemCaseSensitive(o, k);
    assert_true(cJSON_IsNumber(x));
    return x->valuedouble;
}

static double jat(const cJSON *o, const char *k, int i)
{
    const cJSON *x = cJSON_GetArrayItem(cJSON_GetObjectItemCaseSensitive(o, k), i);
    assert_true(cJSON_IsNumber(x));
    return x->valuedouble;
}

/* Five AdamW steps of plain next-token CE from llama_gqa_f32 against PyTorch (refs.json "train":
 * lr 1e-2 peak, warmup 2, cosine to 1e-3 over 5 steps, betas (0.9, 0.95), eps 1e-8, wd 0.1 except
 * norms and biases, clip 1.0). Losses must agree to 1e-5 relative: the loss falls from 5.14 to 1.59,
 * so a wrong gradient, decay mask, bias correction or clip shows up at the first decimals. */
static void test_train_parity(void **s)
{
    (void)s;
    char *txt = slurp("fixtures/hf/refs.json", NULL);
    cJSON *refs = cJSON_Parse(txt);
    assert_non_null(refs);
    const cJSON *tr = cJSON_GetObjectItemCaseSensitive(refs, "train");
    assert_non_null(tr);
    tkd_optim_config oc;
    tkd_optim_config_defaults(&oc);
    oc.lr = jat(tr, "lr", 1); /* peak (step 1 is the end of warmup) */
    oc.min_lr = jnum(tr, "min_lr");
    oc.warmup_steps = (int64_t)jnum(tr, "warmup_steps");
    oc.total_steps = (int64_t)jnum(tr, "steps");
    oc.beta1 = jat(tr, "betas", 0);
    oc.beta2 = jat(tr, "betas", 1);
    oc.eps = jnum(tr, "eps");
    oc.weight_decay = jnum(tr, "weight_decay");
    oc.clip_norm = jnum(tr, "clip_norm");

    int32_t in[FIX_N], lab[FIX_N];
    fixture_tokens(in, lab);
    tkd_model *m = load_fixture("llama_gqa_f32");
    tkd_adamw *opt = NULL;
    assert_int_equal(tkd_adamw_init(&oc, m->n_params, &opt), TKD_OK);
    int n_info;
    const tkd_param_info *info = tkd_model_params(m, &n_info);
    int norms = 0;
    for (int i = 0; i < n_info; i++)
        norms += !info[i].decay;
    assert_int_equal(norms, 2 * 2 + 1); /* 2 per layer + final: exactly the norms skip decay */
    for (int step = 0; step < oc.total_steps; step++) {
        double lr = tkd_optim_lr(&oc, step);
        assert_true(tkd_test_close(lr, jat(tr, "lr", step), 1e-12, 1e-9));
        tkd_model_zero_grad(m);
        double loss = ce_step(m, in, lab), norm;
        assert_int_equal(tkd_optim_clip(m->grads, m->n_params, oc.clip_norm, &norm), TKD_OK);
        tkd_adamw_step(opt, m->params, m->grads, info, n_info, lr);
        double rl = jat(tr, "loss", step), rn = jat(tr, "grad_norm", step);
        printf("step %d: loss %.8f (torch %.8f, rel %.2e)  grad norm %.6f (torch %.6f)\n", step, loss, rl,
               fabs(loss - rl) / rl, norm, rn);
        assert_true(fabs(loss - rl) <= 1e-5 * rl);
        assert_true(fabs(norm - rn) <= 1e-4 * rn); /* clipping engages at every step here */
    }
    int32_t dummy_lab[FIX_N];
    memcpy(dummy_lab, lab, sizeof lab);
    float *lg = model_logits(m, in, 0), *dlg = malloc(sizeof(float) * FIX_N * m->cfg.vocab_size);
    double fin = cross_entropy(lg, dummy_lab, FIX_N, m->cfg.vocab_size, dlg), rf = jnum(tr, "final_loss");
    printf("after 5 steps: loss %.8f (torch %.8f)\n", fin, rf);
    assert_true(fabs(fin - rf) <= 1e-5 * rf);
    free(lg);
    free(dlg);
    tkd_adamw_free(opt);
    tkd_model_free(m);
    cJSON_Delete(refs);
    free(txt);
}

/* Save → load gives the same parameters: exactly in F32; in BF16 exactly the bf16 rounding. */
static void test_save_roundtrip(void **s)
{
    const char *dir = *s; /* this test's own temp dir (TKD_TEST_EACH_DIR) */
    char sub[4200];
#ifdef TKD_HF_FIXTURES_QWEN3
    const char *names[] = {"llama_gqa_f32", "qwen2_tied_f32", "qwen3_hd32_f32", "qwen3_window_f32", "mistral_window_f32"};
#else
    const char *names[] = {"llama_gqa_f32", "qwen2_tied_f32"};
#endif
    for (size_t k = 0; k < sizeof names / sizeof names[0]; k++)
        for (int bf = 0; bf <= 1; bf++) {
            tkd_model *m = load_fixture(names[k]), *r = NULL;
            snprintf(sub, sizeof sub, "%s/%s_%d", dir, names[k], bf);
            assert_int_equal(tkd_model_save_hf(m, sub, bf ? TKD_DTYPE_BF16 : TKD_DTYPE_F32), TKD_OK);
            if (tkd_model_load_hf(sub, &r) != TKD_OK)
                fail_msg("%s", tkd_error_msg());
            assert_int_equal(r->n_params, m->n_params);
            assert_int_equal(r->cfg.tie_word_embeddings, m->cfg.tie_word_embeddings);
            assert_int_equal(r->cfg.rope_scaling, m->cfg.rope_scaling);
            assert_memory_equal(&r->cfg, &m->cfg, sizeof m->cfg); /* the arch and its windows too */
            for (size_t i = 0; i < m->n_params; i++) {
                float want = bf ? tkd_bf16_to_f32(tkd_f32_to_bf16(m->params[i])) : m->params[i];
                if (r->params[i] != want)
                    fail_msg("%s: parameter %zu: %g != %g", sub, i, r->params[i], want);
            }
            tkd_model_free(m);
            tkd_model_free(r);
        }
}

/* Writes m's tensors to <dir> except `skip`, with `reshape` given shape (d0, d1); copies config. */
static void write_broken(const tkd_model *m, const char *dir, const char *skip, const char *reshape,
                         const char *extra)
{
    char path[4200];
    assert_int_equal(tkd_model_save_hf(m, dir, TKD_DTYPE_F32), TKD_OK); /* config.json */
    tkd_st_writer *w = NULL;
    assert_int_equal(tkd_st_writer_init(&w, TKD_DTYPE_F32), TKD_OK);
    int n;
    const tkd_param_info *info = tkd_model_params(m, &n);
    for (int i = 0; i < n; i++) {
        if (skip && !strcmp(info[i].name, skip))
            continue;
        int64_t shape[2] = {info[i].shape[0], info[i].shape[1]};
        int nd = info[i].ndim;
        if (reshape && !strcmp(info[i].name, reshape)) { /* same bytes, transposed shape */
            shape[0] = info[i].shape[1];
            shape[1] = info[i].shape[0];
        }
        assert_int_equal(tkd_st_writer_add(w, info[i].name, nd, shape, m->params + info[i].offset), TKD_OK);
    }
    int64_t one = 4;
    if (extra)
        assert_int_equal(tkd_st_writer_add(w, extra, 1, &one, m->params), TKD_OK);
    snprintf(path, sizeof path, "%s/model.safetensors", dir);
    assert_int_equal(tkd_st_writer_finish(w, path), TKD_OK);
    tkd_st_writer_free(w);
}

static void expect_load_error(const char *dir, tkd_status want, const char *needle)
{
    tkd_model *r = NULL;
    tkd_status st = tkd_model_load_hf(dir, &r);
    printf("expected error: %s\n", tkd_error_msg());
    assert_int_equal(st, want);
    assert_null(r);
    assert_non_null(strstr(tkd_error_msg(), needle));
}

static void test_bad_checkpoints(void **s)
{
    (void)s;
    tkd_model *m = load_fixture("llama_gqa_f32");
    char *dir = tkd_test_mkdtemp("model-bad");
    char sub[4200];
    snprintf(sub, sizeof sub, "%s/missing", dir);
    write_broken(m, sub, "model.layers.1.mlp.up_proj.weight", NULL, NULL);
    expect_load_error(sub, TKD_ERR_NOT_FOUND, "model.layers.1.mlp.up_proj.weight");
    snprintf(sub, sizeof sub, "%s/nohead", dir);
    write_broken(m, sub, "lm_head.weight", NULL, NULL); /* untied: the head is required */
    expect_load_error(sub, TKD_ERR_NOT_FOUND, "lm_head.weight");
    snprintf(sub, sizeof sub, "%s/shape", dir);
    write_broken(m, sub, NULL, "model.layers.0.self_attn.k_proj.weight", NULL);
    expect_load_error(sub, TKD_ERR_MISMATCH, "model.layers.0.self_attn.k_proj.weight");
    snprintf(sub, sizeof sub, "%s/extra", dir);
    write_broken(m, sub, NULL, NULL, "model.layers.0.self_attn.q_proj.bias");
    expect_load_error(sub, TKD_ERR_FORMAT, "model.layers.0.self_attn.q_proj.bias");
    tkd_test_rmtree(dir);
    free(dir);
    tkd_model_free(m);
}

/* Writes checkpoints for transformers to load (TKD_HF_VERIFY_OUT): the Llama fixture after one
 * AdamW step (BF16), a random-init Qwen2-shaped student (F32), a random-init Qwen3 student with
 * head_dim != D/H, non-unit q/k norms and a window of 4 keys on layer 1 (F32), and a random
 * Qwen3-MoE (dense layer 0, MoE layer 1; F32), with our logits of each. */
static void test_write_for_transformers(void **s)
{
    (void)s;
    const char *out = getenv("TKD_HF_VERIFY_OUT");
    if (!out || !*out)
        skip();
    int32_t in[FIX_N], lab[FIX_N];
    fixture_tokens(in, lab);
    char path[4200];
    tkd_model *q = load_fixture("qwen2_tied_f32"), *r = NULL;
    tkd_model_config cfg = q->cfg;
    tkd_model_free(q);
    assert_int_equal(tkd_model_init_random(&cfg, 42, &r), TKD_OK);
    tkd_model *t = load_fixture("llama_gqa_f32");
    tkd_optim_config oc;
    tkd_optim_config_defaults(&oc);
    tkd_adamw *opt = NULL;
    assert_int_equal(tkd_adamw_init(&oc, t->n_params, &opt), TKD_OK);
    ce_step(t, in, lab);
    tkd_adamw_step(opt, t->params, t->grads, t->info, t->n_info, 1e-2);
    /* bf16 file: compare transformers with our logits of the bf16-rounded weights */
    for (size_t i = 0; i < t->n_params; i++)
        t->params[i] = tkd_bf16_to_f32(tkd_f32_to_bf16(t->params[i]));
    tkd_model_config c3 = cfg;
    c3.arch = TKD_ARCH_QWEN3, c3.attention_bias = 0, c3.head_dim = 16; /* D/H = 10 */
    c3.sliding_window = 4, c3.layer_sliding[1] = 1, c3.initializer_range = 0.2f;
    tkd_model *q3 = NULL;
    assert_int_equal(tkd_model_init_random(&c3, 43, &q3), TKD_OK);
    for (int l = 0; l < c3.num_hidden_layers; l++) /* norms away from 1, so transformers must apply them */
        for (int j = 0; j < c3.head_dim; j++) {
            q3->w.layers[l].q_norm[j] = 1.0f + 0.05f * (float)(j % 7) - 0.1f * (float)l;
            q3->w.layers[l].k_norm[j] = 0.8f + 0.03f * (float)(j % 5);
        }
    /* Qwen3-MoE as a teacher is saved too (the per-expert names, mlp_only_layers): layer 0 dense,
     * layer 1 four experts, top-2, routers spread so tokens pick different experts */
    tkd_model_config cm = c3;
    cm.arch = TKD_ARCH_QWEN3_MOE, cm.sliding_window = 0, cm.layer_sliding[1] = 0;
    cm.num_experts = 4, cm.num_experts_per_tok = 2, cm.moe_intermediate_size = 12, cm.norm_topk_prob = 1;
    cm.layer_moe[1] = 1;
    tkd_model *qm = NULL;
    assert_int_equal(tkd_model_init_random(&cm, 44, &qm), TKD_OK);
    tkd_test_randn(qm->w.layers[1].router, (size_t)4 * cm.hidden_size, 45, 1.0f);
    struct { tkd_model *m; const char *name; tkd_dtype dt; } ck[] = {
        {r, "ours_qwen2_random_f32", TKD_DTYPE_F32}, {t, "ours_llama_step_bf16", TKD_DTYPE_BF16},
        {q3, "ours_qwen3_window_random_f32", TKD_DTYPE_F32}, {qm, "ours_qwen3_moe_random_f32", TKD_DTYPE_F32}};
    for (int k = 0; k < 4; k++) {
        snprintf(path, sizeof path, "%s/%s", out, ck[k].name);
        assert_int_equal(tkd_model_save_hf(ck[k].m, path, ck[k].dt), TKD_OK);
        float *lg = model_logits(ck[k].m, in, 0);
        snprintf(path, sizeof path, "%s/%s.logits.f32", out, ck[k].name);
        FILE *f = fopen(path, "wb");
        assert_non_null(f);
        fwrite(lg, sizeof(float), (size_t)FIX_N * ck[k].m->cfg.vocab_size, f);
        fclose(f);
        free(lg);
    }
    tkd_adamw_free(opt);
    tkd_model_free(r);
    tkd_model_free(t);
    tkd_model_free(q3);
    tkd_model_free(qm);
}

#ifdef TKD_HF_FIXTURES_QWEN3_MOE
static void test_logits_qwen3_moe_f32(void **s) { (void)s; check_logits("qwen3_moe_f32"); }
static void test_logits_qwen3_moe_bf16(void **s) { (void)s; check_logits("qwen3_moe_bf16"); }

/* The MoE fixtures are what their name says, as read from transformers 5's own config.json: a dense
 * first layer (mlp_only_layers [0]) with F 64, then MoE layers of 8 experts, top-2, renormalised,
 * I 24, beside Qwen3's q/k norms. */
static void test_fixture_shapes_qwen3_moe(void **s)
{
    (void)s;
    for (int bf = 0; bf <= 1; bf++) {
        tkd_model *m = load_fixture(bf ? "qwen3_moe_bf16" : "qwen3_moe_f32");
        const tkd_model_config *c = &m->cfg;
        assert_int_equal(c->arch, TKD_ARCH_QWEN3_MOE);
        assert_int_equal(c->num_hidden_layers, 3);
        assert_false(tkd_model_config_moe(c, 0));
        assert_true(tkd_model_config_moe(c, 1) && tkd_model_config_moe(c, 2));
        assert_int_equal(c->num_experts, 8);
        assert_int_equal(c->num_experts_per_tok, 2);
        assert_int_equal(c->moe_intermediate_size, 24);
        assert_int_equal(c->intermediate_size, 64);
        assert_true(c->norm_topk_prob);
        assert_int_equal(c->head_dim, 16);
        assert_non_null(m->w.layers[0].wg);
        assert_non_null(m->w.layers[2].router);
        assert_non_null(m->w.layers[2].k_norm);
        tkd_model_free(m);
    }
}
#endif

#ifdef TKD_HF_FIXTURES_GPT_OSS
static void test_logits_gpt_oss_f32(void **s) { (void)s; check_logits("gpt_oss_f32"); }
static void test_logits_gpt_oss_bf16(void **s) { (void)s; check_logits("gpt_oss_bf16"); }
static void test_logits_gpt_oss_mxfp4(void **s) { (void)s; check_logits("gpt_oss_mxfp4"); }

/* The gpt-oss fixtures are what make_hf_fixtures.py says, as read from transformers 5's config.json:
 * layer 0 slides (window 4), layer 1 full, YaRN factor 4 over 4 positions, E 4 top-2, biases and
 * sinks present; the three checkpoints hold the same weights (MXFP4 values, exact in bf16). */
static void test_fixture_shapes_gpt_oss(void **s)
{
    (void)s;
    tkd_model *f = load_fixture("gpt_oss_f32");
    for (int i = 0; i < 3; i++) {
        static const char *names[3] = {"gpt_oss_f32", "gpt_oss_bf16", "gpt_oss_mxfp4"};
        tkd_model *m = load_fixture(names[i]);
        const tkd_model_config *c = &m->cfg;
        assert_int_equal(c->arch, TKD_ARCH_GPT_OSS);
        assert_int_equal(c->quant_mxfp4, i == 2);
        assert_int_equal(tkd_model_config_window(c, 0), 4);
        assert_int_equal(tkd_model_config_window(c, 1), 0);
        assert_int_equal(c->rope_scaling, TKD_ROPE_SCALING_YARN);
        assert_int_equal(c->rope_original_max_pos, 4);
        assert_int_equal(c->num_experts, 4);
        assert_int_equal(c->num_experts_per_tok, 2);
        assert_int_equal(c->head_dim, 16);
        assert_non_null(m->w.layers[1].sinks);
        assert_non_null(m->w.layers[1].bo);
        assert_non_null(m->w.layers[1].router_b);
        const size_t n = (size_t)c->num_experts * c->moe_intermediate_size * c->hidden_size;
        if (i == 1) /* the experts: MXFP4 values in all three */
            assert_memory_equal(m->w.layers[1].eg, f->w.layers[1].eg, sizeof(float) * n);
        if (i == 2) { /* kept as MXFP4 on the CPU: W_gate decodes to the same values */
            assert_int_equal(c->experts_mxfp4, 1);
            assert_null(m->w.layers[1].eg);
            float *eg = malloc(sizeof(float) * n);
            assert_non_null(eg);
            assert_int_equal(tkd_mxfp4_decode_f32(m->qlayer[1].blocks[0], m->qlayer[1].scales[0],
                                                  (int64_t)c->num_experts * c->moe_intermediate_size,
                                                  c->hidden_size / 32, eg, "test"), TKD_OK);
            assert_memory_equal(eg, f->w.layers[1].eg, sizeof(float) * n);
            free(eg);
        }
        tkd_model_free(m);
    }
    tkd_model_free(f);
}
#endif

/* The Qwen3 and window cases are compiled in once their fixtures are all in the tree
 * (tests/CMakeLists.txt defines TKD_HF_FIXTURES_QWEN3). */
int main(void)
{
#if defined(TKD_HF_FIXTURES_QWEN3_MOE)
    int moe = TKD_TEST_RUN_WITH(NULL, NULL, TKD_TEST_EACH_DIR, test_fixture_shapes_qwen3_moe,
                                test_logits_qwen3_moe_f32, test_logits_qwen3_moe_bf16);
    if (moe != 0)
        return moe;
#endif
#if defined(TKD_HF_FIXTURES_GPT_OSS)
    int oss = TKD_TEST_RUN_WITH(NULL, NULL, TKD_TEST_EACH_DIR, test_fixture_shapes_gpt_oss, test_logits_gpt_oss_f32,
                                test_logits_gpt_oss_bf16, test_logits_gpt_oss_mxfp4);
    if (oss != 0)
        return oss;
#endif
#ifdef TKD_HF_FIXTURES_QWEN3
    return TKD_TEST_RUN_WITH(NULL, NULL, TKD_TEST_EACH_DIR, test_fixture_shapes, test_logits_llama_gqa_f32,
        test_logits_llama_gqa_bf16, test_logits_qwen2_tied_f32, test_logits_qwen2_tied_bf16,
        test_fixture_shapes_qwen3_windows, test_logits_qwen3_hd32_f32, test_logits_qwen3_hd32_bf16,
        test_logits_qwen3_window_f32, test_logits_mistral_window_f32, test_train_parity, test_save_roundtrip,
        test_bad_checkpoints, test_write_for_transformers);
#else
    return TKD_TEST_RUN_WITH(NULL, NULL, TKD_TEST_EACH_DIR, test_fixture_shapes, test_logits_llama_gqa_f32,
        test_logits_llama_gqa_bf16, test_logits_qwen2_tied_f32, test_logits_qwen2_tied_bf16, test_train_parity,
        test_save_roundtrip, test_bad_checkpoints, test_write_for_transformers);
#endif
}
