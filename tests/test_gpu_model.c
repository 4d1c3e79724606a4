/* test_gpu_model.c — the whole forward on the CUDA backend: the committed transformers fixtures
 * (tests/fixtures/hf: Llama GQA untied with llama3 RoPE, Qwen2 with q/k/v bias and tied head, Qwen3
 * with per-head q/k norms; F32 and BF16 checkpoints) loaded onto the GPU, their logits against transformers' fp32 logits, their
 * final hidden states against the CPU backend's; and the backend's LM head + top-k consumer against
 * the CPU one on the same bf16-rounded hidden states; sliding windows (Qwen3, Mistral) against
 * transformers, and training with one refused (the backward does not mask yet); the MoE teachers
 * (Qwen3-MoE, gpt-oss with sinks, YaRN and MXFP4 experts). Exits 77 where no
 * GPU answers.
 *
 * Tolerances: the GPU rounds weights and every activation the GEMMs read to bf16 (8 significant
 * bits: relative error 2^-9 per rounding), accumulating in fp32, over 2 layers of width 40–80:
 * errors of ~1 % of a row's largest logit are expected. HIDDEN_RTOL / LOGIT_RTOL bound the error per
 * position relative to the row's largest magnitude; the printed maxima are recorded in
 * docs/PERFORMANCE.md's correctness table.
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

#include "common/half.h"
#include "kernels/backend.h"
#include "kernels/cpu/topk.h"
#include "model/model.h"
#include "tests/gpu_check.h"
#include "tests/testutil.h"

#define FIX_B 2 /* tokens.i32 is (B, T + 1); see tests/fixtures/hf/README.md */
#define FIX_T 11
#define FIX_N (FIX_B * FIX_T)
#define HIDDEN_RTOL 4e-2
#define LOGIT_RTOL 4e-2

static tkd_backend *g_gpu;

static void fixture_inputs(int32_t *inputs)
{
    size_t n;
    int32_t *t = (int32_t *)tkd_test_slurp(tkd_test_src("fixtures/hf/tokens.i32"), &n);
    assert_int_equal(n, sizeof(int32_t) * FIX_B * (FIX_T + 1));
    for (int b = 0; b < FIX_B; b++)
        for (int i = 0; i < FIX_T; i++)
            inputs[b * FIX_T + i] = t[b * (FIX_T + 1) + i];
    free(t);
}

static tkd_model *load(const char *name, tkd_backend *be)
{
    char dir[4096];
    snprintf(dir, sizeof dir, "%s%s", tkd_test_src("fixtures/hf/"), name);
    tkd_model *m = NULL;
    tkd_status st = be ? tkd_model_load_hf_on(dir, be, &m) : tkd_model_load_hf(dir, &m);
    if (st != TKD_OK)
        fail_msg("%s: %s", name, tkd_error_msg());
    return m;
}

/* got (n, w) against ref, each element within rtol of its row's largest |ref| (file comment); fails with
 * the worst, returns max over rows of max_j |Δ| / max_j |ref| for the record. */
static double check_rows(const char *what, const float *got, const float *ref, int n, int w, double rtol)
{
    const tkd_test_tol tol = {0.0, 0.0, "bf16 weights and activations over 2 layers: ~1 % of a row's largest value"};
    const size_t cols = (size_t)w;
    tkd_test_check k;
    tkd_test_check_begin(&k, what, tol, tkd_test_where_rowcol, &cols);
    for (int i = 0; i < n; i++) {
        double den = 1e-30;
        for (int j = 0; j < w; j++)
            den = fmax(den, fabs((double)ref[(size_t)i * w + j]));
        for (int j = 0; j < w; j++)
            tkd_test_check_add(&k, (int64_t)i * w + j, got[(size_t)i * w + j], ref[(size_t)i * w + j], rtol * den);
    }
    tkd_test_check_end(&k);
    return k.worst * rtol;
}

/* The GPU's final hidden states (N, D), as fp32 on the host. */
static float *gpu_hidden(tkd_model *g, const int32_t *in)
{
    const void *h = NULL;
    if (tkd_model_forward(g, in, FIX_B, FIX_T, 0, &h) != TKD_OK)
        fail_msg("cuda forward: %s", tkd_error_msg());
    size_t n = (size_t)FIX_N * g->cfg.hidden_size;
    float *out = malloc(n * sizeof(float));
    assert_int_equal(g_gpu->op->download_f32(g_gpu, out, h, n), TKD_OK);
    return out;
}

static void check_fixture(const char *name)
{
    int32_t in[FIX_N];
    fixture_inputs(in);
    tkd_model *c = load(name, NULL), *g = load(name, g_gpu);
    int D = c->cfg.hidden_size, V = c->cfg.vocab_size;
    const void *hc = NULL;
    assert_int_equal(tkd_model_forward(c, in, FIX_B, FIX_T, 0, &hc), TKD_OK);
    float *hg = gpu_hidden(g, in);
    char what[2][128];
    snprintf(what[0], sizeof what[0], "%s: cuda hidden against cpu", name);
    snprintf(what[1], sizeof what[1], "%s: logits of the cuda hidden against transformers", name);
    double eh = check_rows(what[0], hg, hc, FIX_N, D, HIDDEN_RTOL);
    /* logits of the GPU's hidden states through the fp32 head, against transformers */
    float *lg = malloc(sizeof(float) * FIX_N * V);
    tkd_model_logits(c, hg, FIX_N, lg);
    char rel[256];
    snprintf(rel, sizeof rel, "fixtures/hf/%s.logits.f32", name);
    size_t n;
    float *ref = (float *)tkd_test_slurp(tkd_test_src(rel), &n);
    assert_int_equal(n, sizeof(float) * FIX_N * V);
    double el = check_rows(what[1], lg, ref, FIX_N, V, LOGIT_RTOL);
    printf("%s on cuda: hidden vs cpu %.3e, logits vs transformers %.3e (per-position max relative)\n", name, eh,
           el);
    free(ref);
    free(lg);
    free(hg);
    tkd_model_free(g);
    tkd_model_free(c);
}

static void test_llama_f32(void **state) { (void)state; check_fixture("llama_gqa_f32"); }
static void test_llama_bf16(void **state) { (void)state; check_fixture("llama_gqa_bf16"); }
static void test_qwen2_f32(void **state) { (void)state; check_fixture("qwen2_tied_f32"); }
static void test_qwen2_bf16(void **state) { (void)state; check_fixture("qwen2_tied_bf16"); }

#ifdef TKD_HF_FIXTURES_QWEN3
/* Qwen3's per-head q/k norms on CUDA: the projection converted to fp32 (act_to_f32), then the row
 * RMSNorm over (N·heads, head_dim) rows, as on the CPU. */
static void test_qwen3_f32(void **state) { (void)state; check_fixture("qwen3_hd32_f32"); }
static void test_qwen3_bf16(void **state) { (void)state; check_fixture("qwen3_hd32_bf16"); }

/* Sliding windows on CUDA: the forward masks them (our kernels' masked variants; cuDNN is skipped),
 * checked against transformers on Qwen3 (window 4 on layer 1, head dim 32: the simple kernel) and
 * Mistral (window 5 on every layer, head dim 16). Training such a model (the masked backward) is
 * test_gpu_train's test_step_qwen3_window. */
static void test_window_fixtures(void **state)
{
    (void)state;
    assert_int_equal(g_gpu->attn_window, 1);
    check_fixture("qwen3_window_f32");
    check_fixture("mistral_window_f32");
}
#endif

#ifdef TKD_HF_FIXTURES_QWEN3_MOE
/* Qwen3-MoE on CUDA (kernels/cuda/moe_cuda.h through the seam): softmax router, top-k with
 * norm_topk_prob, a dense first layer (mlp_only_layers). The fixture's routing keeps a margin of
 * 0.05 logits between each token's k-th and (k+1)-th expert, so bf16 activations choose as
 * transformers does. */
static void test_qwen3_moe_f32(void **state) { (void)state; check_fixture("qwen3_moe_f32"); }
static void test_qwen3_moe_bf16(void **state) { (void)state; check_fixture("qwen3_moe_bf16"); }
#endif

#ifdef TKD_HF_FIXTURES_GPT_OSS
/* gpt-oss on CUDA: q/k/v/o biases, sinks, a sliding and a full layer, YaRN, the biased router with
 * softmax over the top-k and the clamped SwiGLU experts; F32, BF16 and MXFP4 checkpoints (the
 * MXFP4 experts kept as MXFP4 on the device, be->moe_mxfp4, and decoded a layer at a time by the
 * MoE op). */
static void test_gpt_oss_f32(void **state) { (void)state; check_fixture("gpt_oss_f32"); }
static void test_gpt_oss_bf16(void **state) { (void)state; check_fixture("gpt_oss_bf16"); }
static void test_gpt_oss_mxfp4(void **state)
{
    (void)state;
    assert_int_equal(g_gpu->moe_mxfp4, 1);
    tkd_model *g = load("gpt_oss_mxfp4", g_gpu);
    assert_true(g->cfg.experts_mxfp4 && g->qexp); /* the experts stayed MXFP4 on the device */
    tkd_model_free(g);
    check_fixture("gpt_oss_mxfp4");
}
#endif

/* Packed documents on CUDA (tkd_model_forward_docs): the fixture's two sequences cut into
 * documents, the GPU's hidden states against the CPU's under the same documents (training on them:
 * test_gpu_train's test_step_llama_documents). */
static void test_documents(void **state)
{
    (void)state;
    int32_t in[FIX_N], doc[FIX_N];
    fixture_inputs(in);
    for (int n = 0; n < FIX_N; n++) { /* sequence 0: documents at 0, 4, 5; sequence 1: at 0, 7 */
        int b = n / FIX_T, i = n % FIX_T;
        doc[n] = b == 0 ? (i >= 5 ? 5 : i >= 4 ? 4 : 0) : (i >= 7 ? 7 : 0);
    }
    assert_int_equal(g_gpu->attn_docs, 1);
    tkd_model *c = load("llama_gqa_f32", NULL), *g = load("llama_gqa_f32", g_gpu);
    const void *hc = NULL, *hg = NULL;
    assert_int_equal(tkd_model_forward_docs(c, in, doc, FIX_B, FIX_T, 0, &hc), TKD_OK);
    if (tkd_model_forward_docs(g, in, doc, FIX_B, FIX_T, 0, &hg) != TKD_OK)
        fail_msg("cuda forward with documents: %s", tkd_error_msg());
    size_t n = (size_t)FIX_N * g->cfg.hidden_size;
    float *h = malloc(n * sizeof(float));
    assert_int_equal(g_gpu->op->download_f32(g_gpu, h, hg, n), TKD_OK);
    double e = check_rows("llama_gqa_f32 with documents: cuda hidden against cpu", h, hc, FIX_N, g->cfg.hidden_size,
                          HIDDEN_RTOL);
    printf("llama_gqa_f32 with packed documents on cuda: hidden vs cpu %.3e\n", e);
    free(h);
    tkd_model_free(g);
    tkd_model_free(c);
}

/* One consumer run on backend be over host fp32 hidden (rows, D) and head W (V, D). */
static void lmhead_on(tkd_backend *be, const float *h, const float *w, int64_t rows, int D, int64_t V, int k,
                      int S, uint32_t *idx, float *val, float *lse, uint32_t *tail)
{
    void *dh = NULL, *dw = NULL;
    assert_int_equal(be->op->alloc(be, (size_t)rows * D * be->act_size, "h", &dh), TKD_OK);
    assert_int_equal(be->op->alloc(be, (size_t)V * D * be->act_size, "w", &dw), TKD_OK);
    assert_int_equal(be->op->upload_f32(be, dh, h, (size_t)rows * D), TKD_OK);
    assert_int_equal(be->op->upload_f32(be, dw, w, (size_t)V * D), TKD_OK);
    int64_t *seq = malloc(sizeof(int64_t) * rows);
    int32_t *pos = malloc(sizeof(int32_t) * rows);
    for (int64_t r = 0; r < rows; r++) {
        seq[r] = 1000 + r / 7;
        pos[r] = (int32_t)(r % 7);
    }
    tkd_lmhead_topk_args a = {.hidden = dh, .w = dw, .rows = rows, .d = D, .v = V, .k = k, .tau = 1.0f,
                              .chunk_rows = 37, .s = S, .seed = 99, .row_seq = seq, .row_pos = pos,
                              .idx = idx, .val = val, .lse = lse, .tail = tail};
    if (be->op->lmhead_topk(be, &a) != TKD_OK)
        fail_msg("lmhead_topk on %s: %s", be->name, tkd_error_msg());
    free(seq);
    free(pos);
    be->op->free(be, dh);
    be->op->free(be, dw);
}

/* Inputs rounded to bf16 first, so both devices multiply the same numbers: the logits then differ
 * only by summation order (fp32 both), ids agree but for exact near-ties, LSE to ~1e-6. */
static void test_lmhead_topk_matches_cpu(void **state)
{
    (void)state;
    enum { R = 100, D = 72, K = 20, S = 8 };
    const int64_t V = 1001; /* not a multiple of 8 */
    float *h = malloc(sizeof(float) * R * D), *w = malloc(sizeof(float) * V * D);
    tkd_test_randn(h, (size_t)R * D, 1, 1.0f);
    tkd_test_randn(w, (size_t)V * D, 2, 0.3f);
    for (size_t i = 0; i < (size_t)R * D; i++)
        h[i] = tkd_bf16_to_f32(tkd_f32_to_bf16(h[i]));
    for (size_t i = 0; i < (size_t)V * D; i++)
        w[i] = tkd_bf16_to_f32(tkd_f32_to_bf16(w[i]));
    tkd_backend *cpu = NULL;
    assert_int_equal(tkd_backend_cpu_open(&cpu), TKD_OK);
    uint32_t ic[R * K], ig[R * K], tc[R * S], tg[R * S];
    float vc[R * K], vg[R * K], lc[R], lg[R];
    lmhead_on(cpu, h, w, R, D, V, K, S, ic, vc, lc, tc);
    lmhead_on(g_gpu, h, w, R, D, V, K, S, ig, vg, lg, tg);
    int same_ids = 0, same_tail = 0;
    for (int r = 0; r < R; r++) {
        assert_true(tkd_test_close(lg[r], lc[r], 1e-5, 1e-5));
        for (int j = 0; j < K; j++) {
            same_ids += ic[r * K + j] == ig[r * K + j];
            assert_true(tkd_test_close(vg[r * K + j], vc[r * K + j], 1e-4, 1e-5));
        }
        for (int j = 0; j < S; j++)
            same_tail += tc[r * S + j] == tg[r * S + j];
    }
    printf("lmhead_topk cuda vs cpu: ids equal %d/%d, tail draws equal %d/%d\n", same_ids, R * K, same_tail, R * S);
    assert_true(same_ids >= R * K - 2);    /* a swap needs two logits within ~1e-6 */
    assert_true(same_tail >= R * S * 98 / 100);
    tkd_backend_close(cpu);
    free(h);
    free(w);
}

/* Activations that cannot fit: TKD_ERR_DEVICE_OOM naming what, how much, and what to lower; the
 * model stays usable at a size that fits. */
static void test_device_oom(void **state)
{
    (void)state;
    tkd_model *g = load("llama_gqa_f32", g_gpu);
    int T = g->cfg.max_position_embeddings < 64 ? g->cfg.max_position_embeddings : 64;
    assert_int_equal(tkd_model_reserve(g, 1 << 22, T, 0), TKD_ERR_DEVICE_OOM); /* ~TBs of activations */
    tkd_test_assert_msg_has("out of device memory asking for");
    tkd_test_assert_msg_has("lower");
    int32_t in[FIX_N];
    fixture_inputs(in);
    float *h = gpu_hidden(g, in);
    free(h);
    tkd_model_free(g);
}

static int setup(void **state)
{
    (void)state;
    return tkd_backend_open(TKD_DEVICE_CUDA, 0, &g_gpu) == TKD_OK ? 0 : -1;
}

static int teardown(void **state)
{
    (void)state;
    tkd_backend_close(g_gpu);
    return 0;
}

int main(void)
{
    tkd_test_require_gpu();
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_llama_f32),
        cmocka_unit_test(test_llama_bf16),
        cmocka_unit_test(test_qwen2_f32),
        cmocka_unit_test(test_qwen2_bf16),
#ifdef TKD_HF_FIXTURES_QWEN3
        cmocka_unit_test(test_qwen3_f32),
        cmocka_unit_test(test_qwen3_bf16),
        cmocka_unit_test(test_window_fixtures),
#endif
#ifdef TKD_HF_FIXTURES_QWEN3_MOE
        cmocka_unit_test(test_qwen3_moe_f32),
        cmocka_unit_test(test_qwen3_moe_bf16),
#endif
#ifdef TKD_HF_FIXTURES_GPT_OSS
        cmocka_unit_test(test_gpt_oss_f32),
        cmocka_unit_test(test_gpt_oss_bf16),
        cmocka_unit_test(test_gpt_oss_mxfp4),
#endif
        cmocka_unit_test(test_documents),
        cmocka_unit_test(test_lmhead_topk_matches_cpu),
        cmocka_unit_test(test_device_oom),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
