/* test_gpu_train.c — training on the CUDA backend against the CPU backend (the reference).
 *
 *   1. One step on the committed transformers fixtures (tests/fixtures/hf: Llama GQA untied with
 *      llama3 RoPE and head_dim 16; Qwen2 with q/k/v bias, tied head and head_dim 10), through the
 *      backends' own loss (a synthetic teacher: 8 top-k columns per row, one row masked): the loss,
 *      and every parameter tensor's gradient by relative norm.
 *   2. Five AdamW steps (clip 1.0; the CPU scales the gradients first, the GPU clips inside the
 *      update) from the same weights on the same batch: the losses track. After them the GPU's
 *      bf16 compute weights must equal the bf16 half of its fp32 master weights' split exactly.
 *   3. The backend's AdamW step (master weights as bf16 + int16 residual on the GPU, one step with
 *      a clip scale), gradient norm and scale: bit-identical to the CPU backend's on the same
 *      arrays (segments with and without decay, a gap no segment covers); the same with bf16
 *      moments (optim.state_dtype), and their fp32 get / set in GPU memory.
 *   4. Determinism: one step twice from the same state gives the same gradient bits on the GPU.
 *   5. student-train device=cuda against device=cpu, the demo student (configs/student-demo.yaml's
 *      model, optimizer and batch) for 64 steps: CE only on the Brown token files (as
 *      scripts/make_demo_teacher.sh trains), and KD (renorm, alpha 0.5) on a synthetic teacher cache;
 *      KD again with bf16 AdamW moments (optim.state_dtype) on both devices;
 *      then a shorter run with sampled, gradient accumulation and grad_in_forward; and kd.teacher
 *      (the teacher online: the dense loss), in both gradient modes.
 *   6. Resume on the GPU: 24 steps straight against 10 steps (train.stop_after) + --resume:
 *      checkpoint files and metrics bit for bit (every GPU kernel in the step is deterministic),
 *      with fp32 and with bf16 AdamW moments.
 * Exits 77 where no GPU answers.
 *
 * Tolerances. The GPU rounds weights and every activation to bf16 (relative 2^-9 per rounding) and
 * accumulates in fp32; test_gpu_model.c measures up to ~1e-2 of a row's largest value on the
 * fixtures' final hidden states. Hence:
 *   LOSS_RTOL 1e-2        the step's loss, relative (logits off by ~1 % of their spread move a
 *                          log-softmax by less than that);
 *   GRAD_REL_NORM 5e-2    ‖g_gpu − g_cpu‖ / ‖g_cpu‖ per tensor: gradients pass twice through the
 *                          bf16 roundings (activations and their gradients), measured values are
 *                          printed for docs/PERFORMANCE.md's correctness table; an index or layout
 *                          error gives O(1);
 *   STEP_LOSS_RTOL 2e-2   the five steps' losses, relative (updates differ where a gradient's sign
 *                          is within the bf16 noise: AdamW's first steps are sign-like);
 *   CURVE_RTOL 3e-2       student-train: each logged training loss, relative to the CPU's (64 steps
 *                          of divergence between two bf16/fp32 trajectories; a GPU run that does
 *                          not learn stays ~1 nat above the CPU's by step 64: 15-30 %);
 *   VAL_RTOL 2e-2         the final validation CE / KD, relative; TOP1_ATOL 0.05 the top-1 agreement.
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
#include "model/model.h"
#include "model/optim.h"
#include "student_train/train.h"
#include "tests/gpu_check.h"
#include "tests/testutil.h"

#define FIX_B 2 /* tokens.i32 is (B, T + 1); see tests/fixtures/hf/README.md */
#define FIX_T 11
#define FIX_N (FIX_B * FIX_T)
#define FIX_K 8 /* synthetic teacher columns per row */

#define LOSS_RTOL 1e-2
#define GRAD_REL_NORM 5e-2
#define STEP_LOSS_RTOL 2e-2
#define CURVE_RTOL 3e-2
static const tkd_test_tol kCurveTol = {0.0, CURVE_RTOL, "64 steps of divergence between bf16/fp32 trajectories; "
                                                        "a GPU run that does not learn is 15-30 % off"};
#define VAL_RTOL 2e-2
#define TOP1_ATOL 0.05
#define NORM2_RTOL 1e-12 /* Σ g² in double, two summation orders */
#define STEP_LR 3e-3
#define CURVE_STEPS 64

static tkd_backend *g_gpu, *g_cpu;

static void ok(tkd_status st, const char *what)
{
    if (st != TKD_OK)
        fail_msg("%s: %s: %s", what, tkd_status_name(st), tkd_error_msg());
}

static void *xmalloc(size_t n)
{
    void *p = malloc(n ? n : 1);
    assert_non_null(p);
    return p;
}

/* ---- a fixture batch with a synthetic teacher --------------------------------------------------- */

typedef struct fix_batch {
    int v;
    int32_t inputs[FIX_N], labels[FIX_N];
    int32_t topk_idx[FIX_N * FIX_K];
    float topk_logit[FIX_N * FIX_K], lse[FIX_N];
} fix_batch;

static int gcd(int a, int b) { return b ? gcd(b, a % b) : a; }

/* Inputs and next-token labels of tokens.i32 (row 5 masked with -100); per row FIX_K distinct
 * teacher ids (an arithmetic progression mod V with a step coprime to V), logits sorted
 * descending, and an LSE that puts 70 % of the teacher's mass on them (valid for tail). */
static void make_batch(fix_batch *fb, int V)
{
    size_t n;
    int32_t *t = (int32_t *)tkd_test_slurp(tkd_test_src("fixtures/hf/tokens.i32"), &n);
    assert_int_equal(n, sizeof(int32_t) * FIX_B * (FIX_T + 1));
    fb->v = V;
    for (int b = 0; b < FIX_B; b++)
        for (int i = 0; i < FIX_T; i++) {
            fb->inputs[b * FIX_T + i] = t[b * (FIX_T + 1) + i];
            fb->labels[b * FIX_T + i] = t[b * (FIX_T + 1) + i + 1];
        }
    free(t);
    fb->labels[5] = -100;
    float noise[FIX_N * FIX_K];
    tkd_test_randn(noise, FIX_N * FIX_K, 77, 0.3f);
    for (int r = 0; r < FIX_N; r++) {
        int start = (r * 37 + 11) % V, step = 1 + (r * 13) % (V - 1);
        while (gcd(step, V) != 1)
            step++;
        double sum = 0;
        for (int j = 0; j < FIX_K; j++) {
            fb->topk_idx[r * FIX_K + j] = (start + j * step) % V;
            fb->topk_logit[r * FIX_K + j] = 4.0f - 0.6f * j + (j ? fminf(fabsf(noise[r * FIX_K + j]), 0.25f) : 0.0f);
            sum += exp(fb->topk_logit[r * FIX_K + j]);
        }
        fb->lse[r] = (float)(log(sum) + log(1.0 / 0.7));
    }
}

static tkd_kl_batch kl_batch(const fix_batch *fb, int D)
{
    tkd_kl_batch kb = {.n = FIX_N, .d = D, .v = fb->v, .topk_idx = fb->topk_idx, .topk_logit = fb->topk_logit,
                       .teacher_lse = fb->lse, .labels = fb->labels};
    return kb;
}

/* ---- one backend's model, loss and optimizer ----------------------------------------------------- */

typedef struct side {
    tkd_backend *be;
    tkd_model *m;
    tkd_backend_kl *kl;
    float *dh; // (FIX_N, D) f32 backend memory
    tkd_adamw *opt;
} side;

static void side_open(side *s, tkd_backend *be, const char *fixture, const tkd_kl_params *kp)
{
    memset(s, 0, sizeof *s);
    s->be = be;
    char dir[4096];
    snprintf(dir, sizeof dir, "%s%s", tkd_test_src("fixtures/hf/"), fixture);
    ok(tkd_model_load_hf_for_training(dir, be, &s->m), fixture);
    ok(tkd_model_reserve(s->m, FIX_B, FIX_T, 1), "reserve");
    int D = s->m->cfg.hidden_size;
    ok(be->op->kl_create(be, kp, FIX_N, D, s->m->cfg.vocab_size, &s->kl), "kl_create");
    ok(be->op->alloc(be, sizeof(float) * FIX_N * D, "dh", (void **)&s->dh), "alloc dh");
    tkd_optim_config oc;
    tkd_optim_config_defaults(&oc);
    ok(tkd_adamw_init_on(&oc, s->m, &s->opt), "adamw_init_on");
}

static void side_close(side *s)
{
    tkd_adamw_free(s->opt);
    s->be->op->kl_free(s->be, s->kl);
    s->be->op->free(s->be, s->dh);
    tkd_model_free(s->m);
}

/* zero_grad, forward (over packed documents where doc is not NULL), the loss (recompute mode),
 * backward: returns the loss, gradients in m->grads. */
static double side_step_grads_docs(side *s, const tkd_kl_params *kp, const fix_batch *fb, const int32_t *doc)
{
    const tkd_backend_ops *op = s->be->op;
    tkd_kl_batch kb = kl_batch(fb, s->m->cfg.hidden_size);
    ok(tkd_model_zero_grad(s->m), "zero_grad");
    ok(op->kl_stage(s->be, s->kl, kp, &kb), "kl_stage");
    const void *hidden = NULL;
    if (doc)
        ok(tkd_model_forward_docs(s->m, fb->inputs, doc, FIX_B, FIX_T, 1, &hidden), "forward_docs");
    else
        ok(tkd_model_forward(s->m, fb->inputs, FIX_B, FIX_T, 1, &hidden), "forward");
    tkd_kl_result r;
    const void *w = tkd_model_lm_head_dev(s->m);
    float *dw = tkd_model_lm_head_grad(s->m);
    ok(op->kl_forward(s->be, s->kl, kp, hidden, w, &r, NULL, NULL), "kl_forward");
    ok(op->kl_backward(s->be, s->kl, kp, hidden, w, 1.0f, s->dh, dw), "kl_backward");
    ok(tkd_model_backward(s->m, s->dh), "backward");
    ok(op->sync(s->be), "sync");
    return r.loss;
}

static double side_step_grads(side *s, const tkd_kl_params *kp, const fix_batch *fb)
{
    return side_step_grads_docs(s, kp, fb, NULL);
}

static float *side_grads(const side *s)
{
    float *g = xmalloc(sizeof(float) * s->m->n_params);
    ok(s->be->op->download(s->be, g, s->m->grads, sizeof(float) * s->m->n_params), "download grads");
    return g;
}

/* ‖a − b‖ / ‖b‖ over n (1 when b is all zero and a is not). */
static double rel_norm(const float *a, const float *b, size_t n)
{
    double num = 0, den = 0;
    for (size_t i = 0; i < n; i++) {
        double d = (double)a[i] - b[i];
        num += d * d;
        den += (double)b[i] * b[i];
    }
    return den > 0 ? sqrt(num / den) : (num > 0 ? 1.0 : 0.0);
}

/* Every tensor's gradient within GRAD_REL_NORM; prints each and names the offenders. */
static void check_grads(const char *what, const tkd_model *m, const float *gg, const float *gc)
{
    int n_info = 0, bad = 0;
    const tkd_param_info *info = tkd_model_params(m, &n_info);
    double worst = 0;
    const char *worst_name = "";
    char offenders[1024] = "";
    printf("  %s: gradient relative norm error per tensor:\n", what);
    for (int i = 0; i < n_info; i++) {
        double e = rel_norm(gg + info[i].offset, gc + info[i].offset, info[i].numel);
        printf("    %-48s %.3e\n", info[i].name, e);
        if (!(e <= worst)) {
            worst = e;
            worst_name = info[i].name;
        }
        if (!(e <= GRAD_REL_NORM)) {
            bad++;
            size_t o = strlen(offenders);
            snprintf(offenders + o, sizeof offenders - o, "%s%s (%.3g)", bad > 1 ? ", " : "", info[i].name, e);
        }
    }
    printf("  %s: worst %s %.3e (tolerance %.0e)\n", what, worst_name, worst, GRAD_REL_NORM);
    if (bad)
        fail_msg("%s: %d tensor gradient(s) beyond relative norm %.0e: %s", what, bad, GRAD_REL_NORM, offenders);
}

/* ---- 1. one step on the fixtures ------------------------------------------------------------------ */

/* One step on both backends (doc: packed documents, or NULL): loss and every gradient. */
static void one_step_docs(const char *fixture, tkd_kl_variant var, double alpha, const int32_t *doc)
{
    tkd_kl_params kp = tkd_test_kl_params(var, 1.0, alpha, FIX_K, FIX_K, 0);
    side c, g;
    side_open(&c, g_cpu, fixture, &kp);
    side_open(&g, g_gpu, fixture, &kp);
    fix_batch fb;
    make_batch(&fb, c.m->cfg.vocab_size);
    double lc = side_step_grads_docs(&c, &kp, &fb, doc), lg = side_step_grads_docs(&g, &kp, &fb, doc);
    char what[160];
    snprintf(what, sizeof what, "%s %s alpha %.1f%s", fixture, tkd_kl_variant_name(var), alpha,
             doc ? " packed documents" : "");
    printf("  %s: loss cpu %.6f cuda %.6f (relative %.2e, tolerance %.0e)\n", what, lc, lg, fabs(lg - lc) / fabs(lc),
           LOSS_RTOL);
    if (!tkd_test_close(lg, lc, 0, LOSS_RTOL))
        fail_msg("%s: loss cuda %.6f vs cpu %.6f: relative %.3g > %.0e", what, lg, lc, fabs(lg - lc) / fabs(lc),
                 LOSS_RTOL);
    float *gc = side_grads(&c), *gg = side_grads(&g);
    check_grads(what, c.m, gg, gc);
    free(gc);
    free(gg);
    side_close(&g);
    side_close(&c);
}

static void one_step(const char *fixture, tkd_kl_variant var, double alpha)
{
    one_step_docs(fixture, var, alpha, NULL);
}

/* Training on packed documents (the masked attention backward): sequence 0 cut at 4 and 5 (a
 * one-token document), sequence 1 at 7. The CPU computes the same documents, so a GPU backward
 * that let a query see past its document's start would differ from it in every attention weight. */
static void test_step_llama_documents(void **state)
{
    (void)state;
    int32_t doc[FIX_N];
    for (int n = 0; n < FIX_N; n++) {
        int b = n / FIX_T, i = n % FIX_T;
        doc[n] = b == 0 ? (i >= 5 ? 5 : i >= 4 ? 4 : 0) : (i >= 7 ? 7 : 0);
    }
    assert_int_equal(g_gpu->attn_docs_bwd, 1);
    one_step_docs("llama_gqa_f32", TKD_KL_VARIANT_RENORM, 0.5, doc);
}

#ifdef TKD_HF_FIXTURES_QWEN3
/* Training a model with a sliding window shorter than T (Qwen3 fixture: window 4 on layer 1,
 * head dim 32; T 11): the masked attention backward against the CPU's. */
static void test_step_qwen3_window(void **state)
{
    (void)state;
    assert_int_equal(g_gpu->attn_window_bwd, 1);
    one_step("qwen3_window_f32", TKD_KL_VARIANT_TAIL, 0.7);
}
#endif

static void test_step_llama_renorm(void **state) { (void)state; one_step("llama_gqa_f32", TKD_KL_VARIANT_RENORM, 0.5); }
static void test_step_llama_tail(void **state) { (void)state; one_step("llama_gqa_f32", TKD_KL_VARIANT_TAIL, 0.7); }
static void test_step_qwen2_renorm(void **state) { (void)state; one_step("qwen2_tied_f32", TKD_KL_VARIANT_RENORM, 0.5); }
static void test_step_qwen2_bf16_tail(void **state) { (void)state; one_step("qwen2_tied_bf16", TKD_KL_VARIANT_TAIL, 0.7); }

/* ---- 2. five AdamW steps -------------------------------------------------------------------------- */

/* The GPU's compute weights (bf16) must be the high half of its master weights' exact split
 * (round to nearest, ties away from zero: common/half.h's tkd_f32_split_bf16). */
static void check_compute_copy(const side *g)
{
    size_t n = g->m->n_params;
    float *master = xmalloc(n * sizeof(float)), *act = xmalloc(n * sizeof(float));
    ok(tkd_model_get_params(g->m, master), "get_params");
    ok(g->be->op->download_f32(g->be, act, g->m->dparams, n), "download compute weights");
    for (size_t i = 0; i < n; i++) {
        int16_t lo;
        float want = tkd_bf16_to_f32(tkd_f32_split_bf16(master[i], &lo));
        if (memcmp(&want, &act[i], sizeof want) != 0)
            fail_msg("compute weight %zu is %.9g, the bf16 half of its master weight %.9g is %.9g", i, act[i], master[i],
                     want);
    }
    free(master);
    free(act);
}

static void five_steps(const char *fixture)
{
    tkd_kl_params kp = tkd_test_kl_params(TKD_KL_VARIANT_RENORM, 1.0, 0.5, FIX_K, FIX_K, 0);
    side c, g;
    side_open(&c, g_cpu, fixture, &kp);
    side_open(&g, g_gpu, fixture, &kp);
    fix_batch fb;
    make_batch(&fb, c.m->cfg.vocab_size);
    double lc[6], lg[6], nc, ng;
    int bad = -1;
    for (int s = 0; s < 6; s++) { /* five updates; the sixth forward measures the last one */
        lc[s] = side_step_grads(&c, &kp, &fb);
        lg[s] = side_step_grads(&g, &kp, &fb);
        if (bad < 0 && !tkd_test_close(lg[s], lc[s], 0, STEP_LOSS_RTOL))
            bad = s;
        if (s == 5)
            break;
        ok(tkd_optim_clip_model(c.m, 1.0, &nc), "clip cpu"); /* the scale pass, then the update */
        ok(tkd_adamw_step_model(c.opt, c.m, STEP_LR), "adamw cpu");
        ok(tkd_adamw_clip_step_model(g.opt, g.m, STEP_LR, 1.0, &ng), "clip + adamw cuda"); /* fused */
        printf("  %s step %d: loss cpu %.6f cuda %.6f, grad norm cpu %.5f cuda %.5f\n", fixture, s + 1, lc[s], lg[s],
               nc, ng);
    }
    printf("  %s after 5 steps: loss cpu %.6f cuda %.6f\n", fixture, lc[5], lg[5]);
    if (bad >= 0)
        fail_msg("%s: after %d AdamW steps the loss is %.6f on cuda, %.6f on cpu (relative %.3g > %.0e)", fixture, bad,
                 lg[bad], lc[bad], fabs(lg[bad] - lc[bad]) / fabs(lc[bad]), STEP_LOSS_RTOL);
    if (!(lc[5] < lc[0]) || !(lg[5] < lg[0]))
        fail_msg("%s: five steps on one batch did not lower the loss (cpu %.6f -> %.6f, cuda %.6f -> %.6f)", fixture,
                 lc[0], lc[5], lg[0], lg[5]);
    assert_int_equal(g.opt->step, 5);
    check_compute_copy(&g);
    side_close(&g);
    side_close(&c);
}

static void test_five_steps_llama(void **state) { (void)state; five_steps("llama_gqa_f32"); }
static void test_five_steps_qwen2(void **state) { (void)state; five_steps("qwen2_tied_f32"); }

/* ---- 3. the optimizer ops, bit for bit ------------------------------------------------------------ */

static void *to_backend(tkd_backend *be, const void *host, size_t bytes)
{
    void *p = NULL;
    ok(be->op->alloc(be, bytes, "test array", &p), "alloc");
    ok(be->op->upload(be, p, host, bytes), "upload");
    return p;
}

static void check_bits(const char *what, const float *got, const float *want, size_t n)
{
    for (size_t i = 0; i < n; i++)
        if (memcmp(&got[i], &want[i], sizeof(float)) != 0)
            fail_msg("%s: element %zu is %.9g on cuda, %.9g on cpu (must be the same bits)", what, i, got[i], want[i]);
}

/* The device's master weights (bf16 compute copy + int16 residual) as host fp32. */
static void master_to_host(void *dact, void *dlo, float *host, size_t n)
{
    ok(g_gpu->op->master_download(g_gpu, host, dact, dlo, n), "master_download");
}

/* AdamW on both backends from the same fp32 state, three steps (the second with the clip's grad
 * scale 0.37, which the CPU applies with its separate scale pass and the device inside the update):
 * the device's master weights — joined from its bf16 half and residual — and moments must have the
 * CPU's exact bits, and its compute copy must be the master's bf16 half. A kernel that dropped or
 * mis-stored the residual would leave the master a bf16 value (the randn start has low bits set).
 * Then the gradient norm and scale. */
static void test_optimizer_ops_match_cpu(void **state)
{
    (void)state;
    enum { N = 70001 };
    const tkd_adamw_seg segs[3] = {{0, 30000, 1}, {30000, 7, 0}, {30011, N - 30011, 1}}; /* gap [30007, 30011) */
    float *p = xmalloc(N * 4), *g = xmalloc(N * 4), *m = xmalloc(N * 4), *v = xmalloc(N * 4);
    tkd_test_randn(p, N, 1, 0.5f);
    tkd_test_randn(g, N, 2, 0.01f);
    tkd_test_randn(m, N, 3, 0.001f);
    tkd_test_randn(v, N, 4, 1e-4f);
    for (int i = 0; i < N; i++)
        v[i] = v[i] * v[i];
    tkd_adamw_hparams h = {.lr = 1e-3, .beta1 = 0.9, .beta2 = 0.95, .eps = 1e-8, .weight_decay = 0.1};
    float *dg = to_backend(g_gpu, g, N * 4), *dm = to_backend(g_gpu, m, N * 4), *dv = to_backend(g_gpu, v, N * 4);
    void *dact = NULL, *dlo = NULL;
    ok(g_gpu->op->alloc(g_gpu, N * g_gpu->act_size, "bf16 copy", &dact), "alloc");
    ok(g_gpu->op->alloc(g_gpu, N * g_gpu->master_lo_size, "residuals", &dlo), "alloc");
    ok(g_gpu->op->master_upload(g_gpu, dact, dlo, p, N), "master_upload");
    float *back = xmalloc(N * 4), *act = xmalloc(N * 4), *gs = xmalloc(N * 4);
    master_to_host(dact, dlo, back, N);
    check_bits("master weights after upload", back, p, N);
    tkd_backend_adamw *tc = NULL, *tg = NULL;
    ok(g_cpu->op->adamw_create(g_cpu, segs, 3, &tc), "adamw_create cpu");
    ok(g_gpu->op->adamw_create(g_gpu, segs, 3, &tg), "adamw_create cuda");
    for (int64_t step = 1; step <= 3; step++) {
        const float s = step == 2 ? 0.37f : 1.0f;
        memcpy(gs, g, N * 4);
        ok(g_cpu->op->grad_scale(g_cpu, gs, N, s), "grad_scale cpu");
        ok(g_cpu->op->adamw_step(g_cpu, tc, p, NULL, gs, m, v, TKD_ADAMW_DTYPE_F32, &h, step, 1.0f), "adamw_step cpu");
        ok(g_gpu->op->adamw_step(g_gpu, tg, dact, dlo, dg, dm, dv, TKD_ADAMW_DTYPE_F32, &h, step, s), "adamw_step cuda");
    }
    master_to_host(dact, dlo, back, N);
    check_bits("adamw master weights", back, p, N);
    ok(g_gpu->op->download(g_gpu, back, dm, N * 4), "download");
    check_bits("adamw m", back, m, N);
    ok(g_gpu->op->download(g_gpu, back, dv, N * 4), "download");
    check_bits("adamw v", back, v, N);
    ok(g_gpu->op->download(g_gpu, back, dg, N * 4), "download");
    check_bits("gradients (the update must not write them)", back, g, N);
    ok(g_gpu->op->download_f32(g_gpu, act, dact, N), "download bf16 copy");
    for (int i = 0; i < N; i++) {
        int16_t lo;
        float want = tkd_bf16_to_f32(tkd_f32_split_bf16(p[i], &lo)); /* the gap: its uploaded value */
        if (memcmp(&act[i], &want, sizeof want) != 0)
            fail_msg("adamw bf16 copy: element %d is %.9g, want %.9g (the high half of %.9g)%s", i, act[i], want, p[i],
                     i >= 30007 && i < 30011 ? " (outside every segment: untouched)" : "");
    }
    double n2c = 0, n2g = 0;
    ok(g_cpu->op->grad_norm2(g_cpu, g, N, &n2c), "grad_norm2 cpu");
    ok(g_gpu->op->grad_norm2(g_gpu, dg, N, &n2g), "grad_norm2 cuda");
    printf("  grad norm² cpu %.17g cuda %.17g (relative %.2e)\n", n2c, n2g, fabs(n2g - n2c) / n2c);
    if (!tkd_test_close(n2g, n2c, 0, NORM2_RTOL))
        fail_msg("grad_norm2: cuda %.17g vs cpu %.17g", n2g, n2c);
    ok(g_cpu->op->grad_scale(g_cpu, g, N, 0.37f), "grad_scale cpu");
    ok(g_gpu->op->grad_scale(g_gpu, dg, N, 0.37f), "grad_scale cuda");
    ok(g_gpu->op->download(g_gpu, back, dg, N * 4), "download");
    check_bits("grad_scale", back, g, N);
    g_cpu->op->adamw_free(g_cpu, tc);
    g_gpu->op->adamw_free(g_gpu, tg);
    void *bufs[5] = {dg, dm, dv, dact, dlo};
    for (int i = 0; i < 5; i++)
        g_gpu->op->free(g_gpu, bufs[i]);
    free(p), free(g), free(m), free(v), free(back), free(act), free(gs);
}

/* optim.state_dtype bf16 through the backends' adamw_step (TKD_ADAMW_DTYPE_BF16): three steps, the
 * second with a clip scale, from bf16 moments; the master weights and the stored bf16 moments equal
 * the CPU backend's bit for bit. Then the optimizer of a model in GPU memory with bf16 state: its
 * moments set from fp32 come back rounded to nearest even as on the host (the staged conversions
 * of model/optim.c), and back in unchanged. */
static void test_optimizer_bf16_state_matches_cpu(void **state)
{
    (void)state;
    enum { N = 70001 };
    const tkd_adamw_seg segs[3] = {{0, 30000, 1}, {30000, 7, 0}, {30011, N - 30011, 1}}; /* gap [30007, 30011) */
    float *p = xmalloc(N * 4), *g = xmalloc(N * 4), *gs = xmalloc(N * 4), *back = xmalloc(N * 4);
    uint16_t *m = xmalloc(N * 2), *v = xmalloc(N * 2), *mb = xmalloc(N * 2);
    tkd_test_randn(p, N, 1, 0.5f);
    tkd_test_randn(g, N, 2, 0.01f);
    tkd_test_randn(back, N, 3, 0.001f);
    for (int i = 0; i < N; i++)
        m[i] = tkd_f32_to_bf16(back[i]);
    tkd_test_randn(back, N, 4, 1e-2f);
    for (int i = 0; i < N; i++)
        v[i] = tkd_f32_to_bf16(back[i] * back[i]);
    tkd_adamw_hparams h = {.lr = 1e-3, .beta1 = 0.9, .beta2 = 0.95, .eps = 1e-8, .weight_decay = 0.1};
    void *dg = to_backend(g_gpu, g, N * 4), *dm = to_backend(g_gpu, m, N * 2), *dv = to_backend(g_gpu, v, N * 2);
    void *dact = NULL, *dlo = NULL;
    ok(g_gpu->op->alloc(g_gpu, N * g_gpu->act_size, "bf16 copy", &dact), "alloc");
    ok(g_gpu->op->alloc(g_gpu, N * g_gpu->master_lo_size, "residuals", &dlo), "alloc");
    ok(g_gpu->op->master_upload(g_gpu, dact, dlo, p, N), "master_upload");
    tkd_backend_adamw *tc = NULL, *tg = NULL;
    ok(g_cpu->op->adamw_create(g_cpu, segs, 3, &tc), "adamw_create cpu");
    ok(g_gpu->op->adamw_create(g_gpu, segs, 3, &tg), "adamw_create cuda");
    for (int64_t step = 1; step <= 3; step++) {
        const float s = step == 2 ? 0.37f : 1.0f;
        memcpy(gs, g, N * 4);
        ok(g_cpu->op->grad_scale(g_cpu, gs, N, s), "grad_scale cpu");
        ok(g_cpu->op->adamw_step(g_cpu, tc, p, NULL, gs, m, v, TKD_ADAMW_DTYPE_BF16, &h, step, 1.0f), "adamw_step cpu");
        ok(g_gpu->op->adamw_step(g_gpu, tg, dact, dlo, dg, dm, dv, TKD_ADAMW_DTYPE_BF16, &h, step, s),
           "adamw_step cuda");
    }
    master_to_host(dact, dlo, back, N);
    check_bits("adamw (bf16 moments) master weights", back, p, N);
    for (int k = 0; k < 2; k++) {
        ok(g_gpu->op->download(g_gpu, mb, k ? dv : dm, N * 2), "download");
        for (int i = 0; i < N; i++)
            if (mb[i] != (k ? v : m)[i])
                fail_msg("adamw bf16 %s [%d]: cuda 0x%04x, cpu 0x%04x", k ? "v" : "m", i, mb[i], (k ? v : m)[i]);
    }
    g_cpu->op->adamw_free(g_cpu, tc);
    g_gpu->op->adamw_free(g_gpu, tg);
    void *bufs[5] = {dg, dm, dv, dact, dlo};
    for (int i = 0; i < 5; i++)
        g_gpu->op->free(g_gpu, bufs[i]);

    tkd_model *mg = NULL;
    char dir[4096];
    snprintf(dir, sizeof dir, "%s%s", tkd_test_src("fixtures/hf/"), "llama_gqa_f32");
    ok(tkd_model_load_hf_for_training(dir, g_gpu, &mg), "llama_gqa_f32");
    tkd_optim_config oc;
    tkd_optim_config_defaults(&oc);
    oc.state_dtype = TKD_ADAMW_DTYPE_BF16;
    tkd_adamw *o = NULL;
    ok(tkd_adamw_init_on(&oc, mg, &o), "adamw_init_on bf16");
    const size_t n = o->n;
    float *hm = xmalloc(n * 4), *hv = xmalloc(n * 4), *gm = xmalloc(n * 4), *gv = xmalloc(n * 4);
    tkd_test_randn(hm, n, 5, 1.0f);
    tkd_test_randn(hv, n, 6, 1e-3f);
    ok(tkd_adamw_moments_set(o, hm, hv), "moments_set");
    ok(tkd_adamw_moments_get(o, gm, gv), "moments_get");
    for (size_t i = 0; i < n; i++) {
        const float wm = tkd_bf16_to_f32(tkd_f32_to_bf16(hm[i])), wv = tkd_bf16_to_f32(tkd_f32_to_bf16(hv[i]));
        if (memcmp(&gm[i], &wm, 4) != 0 || memcmp(&gv[i], &wv, 4) != 0)
            fail_msg("bf16 moments in GPU memory [%zu]: got %.9g, %.9g, want %.9g, %.9g", i, gm[i], gv[i], wm, wv);
    }
    ok(tkd_adamw_moments_set(o, gm, gv), "moments_set again");
    ok(tkd_adamw_moments_get(o, hm, hv), "moments_get again");
    check_bits("bf16 moments set back", hm, gm, n);
    check_bits("bf16 moments set back", hv, gv, n);
    tkd_adamw_free(o);
    tkd_model_free(mg);
    free(p), free(g), free(gs), free(back), free(m), free(v), free(mb), free(hm), free(hv), free(gm), free(gv);
}

/* ---- 4. determinism -------------------------------------------------------------------------------- */

static void test_step_is_deterministic(void **state)
{
    (void)state;
    tkd_kl_params kp = tkd_test_kl_params(TKD_KL_VARIANT_TAIL, 1.0, 0.7, FIX_K, FIX_K, 0);
    side g;
    side_open(&g, g_gpu, "qwen2_tied_f32", &kp);
    fix_batch fb;
    make_batch(&fb, g.m->cfg.vocab_size);
    double l1 = side_step_grads(&g, &kp, &fb);
    float *g1 = side_grads(&g);
    double l2 = side_step_grads(&g, &kp, &fb);
    float *g2 = side_grads(&g);
    if (l1 != l2)
        fail_msg("the loss differs between two identical steps: %.17g vs %.17g", l1, l2);
    int n_info = 0;
    const tkd_param_info *info = tkd_model_params(g.m, &n_info);
    for (int i = 0; i < n_info; i++)
        for (size_t j = 0; j < info[i].numel; j++) {
            size_t o = info[i].offset + j;
            if (memcmp(&g1[o], &g2[o], sizeof(float)) != 0)
                fail_msg("gradient of %s [%zu] differs between two identical steps: %.9g vs %.9g (a kernel in the "
                         "step is not deterministic)", info[i].name, j, g1[o], g2[o]);
        }
    free(g1);
    free(g2);
    side_close(&g);
}

/* ---- 5. student-train cuda vs cpu ----------------------------------------------------------------- */

/* configs/student-demo.yaml's student, optimizer and batch (the data keys come from each test). */
#define DEMO_SETS                                                                                              \
    "model.arch=llama", "model.hidden_size=64", "model.intermediate_size=192", "model.num_layers=2",           \
        "model.num_heads=4", "model.num_kv_heads=2", "model.max_position_embeddings=256", "data.seq_len=64",   \
        "optim.lr=3e-3", "optim.min_lr=3e-4", "optim.warmup_steps=10", "optim.weight_decay=0.1",              \
        "optim.grad_clip=1.0", "train.batch_size=16", "train.eval_interval=0", "train.eval_batches=4",        \
        "train.log_interval=1", "train.seed=42"

static tkd_status train(const tkd_test_student_dir *f, const char *name, const char *device, const char *const *extra,
                        size_t n, int resume, tkd_train_result *res)
{
    const char *base[] = {DEMO_SETS};
    size_t nb = sizeof base / sizeof base[0];
    const char *sets[64];
    char dev[32];
    snprintf(dev, sizeof dev, "device=%s", device);
    memcpy(sets, base, nb * sizeof *sets);
    sets[nb] = dev;
    memcpy(sets + nb + 1, extra, n * sizeof *sets);
    tkd_status st = tkd_test_student_train(f->runs, name, sets, nb + 1 + n, resume, res);
    if (st != TKD_OK)
        print_error("run %s on %s: %s\n", name, device, tkd_error_msg());
    return st;
}

/* The same run on both devices: every logged loss within CURVE_RTOL, the final evaluation within
 * VAL_RTOL / TOP1_ATOL. Prints both curves every 8 steps. */
static void cpu_vs_cuda(const tkd_test_student_dir *f, const char *tag, const char *const *extra, size_t n, int steps)
{
    char nc[64], ng[64];
    snprintf(nc, sizeof nc, "%s-cpu", tag);
    snprintf(ng, sizeof ng, "%s-cuda", tag);
    tkd_train_result rc, rg;
    assert_int_equal(train(f, nc, "cpu", extra, n, 0, &rc), TKD_OK);
    assert_int_equal(train(f, ng, "cuda", extra, n, 0, &rg), TKD_OK);
    double *lc = xmalloc(sizeof(double) * steps), *lg = xmalloc(sizeof(double) * steps);
    tkd_test_train_metrics(f, nc, "loss", lc, steps);
    tkd_test_train_metrics(f, ng, "loss", lg, steps);
    char what[96];
    snprintf(what, sizeof what, "%s: training loss, cuda against cpu", tag);
    tkd_test_check k;
    tkd_test_check_begin(&k, what, kCurveTol, tkd_test_where_step, NULL);
    for (int s = 0; s < steps; s++) {
        tkd_test_check_add(&k, s, lg[s], lc[s], 0.0);
        if (s % 8 == 0 || s == steps - 1)
            printf("  %s step %3d: loss cpu %.5f cuda %.5f (%+.2e)\n", tag, s + 1, lc[s], lg[s],
                   (lg[s] - lc[s]) / lc[s]);
    }
    printf("  %s: worst step %lld, err/tol %.3f (tolerance %.0e relative); val CE cpu %.5f cuda %.5f, val KD cpu %.5f "
           "cuda %.5f, top-1 cpu %.4f cuda %.4f; %.1f s vs %.1f s\n", tag, (long long)k.worst_i + 1, k.worst,
           CURVE_RTOL, rc.val_ce, rg.val_ce, rc.val_kd, rg.val_kd, rc.top1_agree, rg.top1_agree, rc.seconds,
           rg.seconds);
    tkd_test_check_end(&k);
    assert_int_equal(rg.steps, steps);
    assert_int_equal(rg.tokens, rc.tokens);
    if (!tkd_test_close(rg.val_ce, rc.val_ce, 0, VAL_RTOL))
        fail_msg("%s: val CE cuda %.6f vs cpu %.6f", tag, rg.val_ce, rc.val_ce);
    if (isfinite(rc.val_kd) && !tkd_test_close(rg.val_kd, rc.val_kd, 0, VAL_RTOL))
        fail_msg("%s: val KD cuda %.6f vs cpu %.6f", tag, rg.val_kd, rc.val_kd);
    if (isfinite(rc.top1_agree) && !(fabs(rg.top1_agree - rc.top1_agree) <= TOP1_ATOL))
        fail_msg("%s: top-1 agreement cuda %.4f vs cpu %.4f", tag, rg.top1_agree, rc.top1_agree);
    free(lc);
    free(lg);
}

static void test_demo_ce_only_cpu_vs_cuda(void **state)
{
    char tok[4200], val[4200];
    snprintf(tok, sizeof tok, "data.tokens=[%s]", tkd_test_src("../data/brown-train.bin"));
    snprintf(val, sizeof val, "data.val_tokens=[%s]", tkd_test_src("../data/brown-val.bin"));
    const char *extra[] = {tok, val, "kd.alpha=0", "model.vocab_size=4096", "train.max_steps=64"};
    cpu_vs_cuda(*state, "demo-ce", extra, 5, CURVE_STEPS);
}

static void cache_run_sets(const tkd_test_student_dir *f, char *cache_set, size_t cap)
{
    snprintf(cache_set, cap, "data.cache=%s", f->cache);
}

static void test_demo_kd_cpu_vs_cuda(void **state)
{
    char cache[4300];
    cache_run_sets(*state, cache, sizeof cache);
    const char *extra[] = {cache, "kd.variant=renorm", "kd.alpha=0.5", "train.max_steps=64"};
    cpu_vs_cuda(*state, "demo-kd", extra, 4, CURVE_STEPS);
}

/* The same with optim.state_dtype bf16 on both devices (the moments rounded alike by both backends'
 * AdamW; the curves differ only as the f32 runs' do). */
static void test_demo_kd_bf16_state_cpu_vs_cuda(void **state)
{
    char cache[4300];
    cache_run_sets(*state, cache, sizeof cache);
    const char *extra[] = {cache, "kd.variant=renorm", "kd.alpha=0.5", "train.max_steps=64", "optim.state_dtype=bf16"};
    cpu_vs_cuda(*state, "demo-kd-bf16-state", extra, 5, CURVE_STEPS);
}

static void test_sampled_accum_gif_cpu_vs_cuda(void **state)
{
    char cache[4300];
    cache_run_sets(*state, cache, sizeof cache);
    const char *extra[] = {cache, "kd.variant=sampled", "kd.alpha=0.7", "optim.grad_accum=2",
                           "kd.grad_in_forward=true", "train.max_steps=16"};
    cpu_vs_cuda(*state, "sampled-accum-gif", extra, 6, 16);
}

/* kd.teacher (the teacher online, dense): a random 1-layer Llama teacher (D 48 ≠ the student's 64,
 * vocabulary 4096 as the demo-ce student's) saved as a checkpoint, distilled from on the Brown token
 * files; recompute at alpha 0.5 and τ 2, then grad_in_forward with reverse KL. The teacher's forward
 * runs in bf16 on the GPU, as the student's: the same tolerances. */
static void test_dense_teacher_cpu_vs_cuda(void **state)
{
    const tkd_test_student_dir *f = *state;
    char teacher[4300], tok[4200], val[4200], tset[4400];
    snprintf(teacher, sizeof teacher, "%s/dense-teacher", f->dir);
    tkd_model_config c;
    tkd_model_config_defaults(&c);
    c.vocab_size = 4096, c.hidden_size = 48, c.intermediate_size = 96, c.num_hidden_layers = 1;
    c.num_attention_heads = 4, c.num_key_value_heads = 2, c.head_dim = 12, c.max_position_embeddings = 256;
    c.initializer_range = 0.3f;
    tkd_model *m = NULL;
    ok(tkd_model_init_random(&c, 17, &m), "random teacher");
    ok(tkd_model_save_hf(m, teacher, TKD_DTYPE_F32), "save the teacher");
    tkd_model_free(m);
    snprintf(tok, sizeof tok, "data.tokens=[%s]", tkd_test_src("../data/brown-train.bin"));
    snprintf(val, sizeof val, "data.val_tokens=[%s]", tkd_test_src("../data/brown-val.bin"));
    snprintf(tset, sizeof tset, "kd.teacher=%s", teacher);
    const char *rec[] = {tok, val, tset, "kd.alpha=0.5", "kd.temperature=2.0", "model.vocab_size=4096",
                         "train.max_steps=16"};
    cpu_vs_cuda(f, "dense-teacher", rec, sizeof rec / sizeof rec[0], 16);
    const char *gif[] = {tok, val, tset, "kd.alpha=1.0", "kd.divergence=rkl", "kd.grad_in_forward=true",
                         "model.vocab_size=4096", "train.max_steps=16"};
    cpu_vs_cuda(f, "dense-teacher-rkl-gif", gif, sizeof gif / sizeof gif[0], 16);
}

/* ---- 6. resume on the GPU --------------------------------------------------------------------------- */

/* The first line where two texts differ, for the failure message. */
static void first_diff_line(const char *a, const char *b, char *out, size_t cap)
{
    int line = 1;
    const char *la = a, *lb = b;
    while (*a && *a == *b) {
        if (*a == '\n') {
            line++;
            la = a + 1;
            lb = b + 1;
        }
        a++, b++;
    }
    snprintf(out, cap, "line %d: straight \"%.*s\" / resumed \"%.*s\"", line, (int)strcspn(la, "\n"), la,
             (int)strcspn(lb, "\n"), lb);
}

/* tag names the runs; state_dtype is the optim.state_dtype setting. */
static void resume_on_gpu(tkd_test_student_dir *f, const char *tag, const char *state_dtype)
{
    char cache[4300], straight[64], split[64];
    cache_run_sets(f, cache, sizeof cache);
    snprintf(straight, sizeof straight, "%s-straight", tag);
    snprintf(split, sizeof split, "%s-split", tag);
    const char *common[9] = {cache, "kd.variant=sampled", "kd.alpha=0.7", "optim.grad_accum=2",
                             "train.max_steps=24", "train.eval_interval=8", "train.eval_batches=1", state_dtype};
    tkd_train_result ra, rb;
    assert_int_equal(train(f, straight, "cuda", common, 8, 0, &ra), TKD_OK);
    common[8] = "train.stop_after=10";
    assert_int_equal(train(f, split, "cuda", common, 9, 0, &rb), TKD_OK);
    assert_int_equal(rb.steps, 10);
    assert_int_equal(train(f, split, "cuda", common, 9, 1, &rb), TKD_OK);
    assert_int_equal(rb.steps, 24);
    const char *files[] = {"checkpoint/model.safetensors", "checkpoint/optimizer.safetensors",
                           "checkpoint/state.json"};
    char a[4400], b[4400];
    int differ = 0;
    for (int i = 0; i < 3; i++) {
        snprintf(a, sizeof a, "%s/%s/%s", f->runs, straight, files[i]);
        snprintf(b, sizeof b, "%s/%s/%s", f->runs, split, files[i]);
        if (!tkd_test_files_equal(a, b)) {
            printf("  resume on cuda (%s): %s differs between the straight and the resumed run\n", state_dtype,
                   files[i]);
            differ++;
        }
    }
    snprintf(a, sizeof a, "%s/%s/metrics.jsonl", f->runs, straight);
    snprintf(b, sizeof b, "%s/%s/metrics.jsonl", f->runs, split);
    char *ma = tkd_test_metrics_without_time(a), *mb = tkd_test_metrics_without_time(b);
    if (strcmp(ma, mb) != 0) {
        char where[1024];
        first_diff_line(ma, mb, where, sizeof where);
        printf("  resume on cuda (%s): metrics differ at %s\n", state_dtype, where);
        differ++;
    }
    free(ma);
    free(mb);
    if (differ)
        fail_msg("resume on cuda (%s) is not bit-exact (%d of 4 outputs differ; printed above)", state_dtype, differ);
    assert_true(ra.train_loss == rb.train_loss);
    printf("  resume on cuda (%s): weights, AdamW moments, state and every metrics record equal after 24 steps\n",
           state_dtype);
}

static void test_resume_on_gpu_is_bit_exact(void **state) { resume_on_gpu(*state, "gpu", "optim.state_dtype=f32"); }

/* optim.state_dtype bf16: the moments checkpointed as BF16 and resumed exactly on the GPU too. */
static void test_resume_bf16_state_on_gpu_is_bit_exact(void **state)
{
    resume_on_gpu(*state, "gpu-bf16", "optim.state_dtype=bf16");
}

/* ---- setup -------------------------------------------------------------------------------------------- */

static int setup(void **state)
{
    if (tkd_backend_open(TKD_DEVICE_CUDA, 0, &g_gpu) != TKD_OK || tkd_backend_cpu_open(&g_cpu) != TKD_OK) {
        fprintf(stderr, "backends: %s\n", tkd_error_msg());
        return -1;
    }
    /* the demo-sized cache: V 512, T 64 (the demo's), top-16 + 8 tail draws; 64 steps of 16
     * sequences are one epoch of the 1024 training sequences, 56 held out (val_fraction 0.05) */
    tkd_test_teacher_opts o = {.vocab = 512, .hidden = 32, .seq_len = 64, .k = 16, .tail_samples = 8,
                               .temperature = 1.0f, .num_seq = 1080, .shard_seqs = 256, .seed = 11};
    return tkd_test_student_setup(state, "gpu-train", &o);
}

static int teardown(void **state)
{
    tkd_backend_close(g_gpu);
    tkd_backend_close(g_cpu);
    return tkd_test_student_teardown(state);
}

int main(void)
{
    tkd_test_require_gpu();
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_step_llama_renorm),
        cmocka_unit_test(test_step_llama_tail),
        cmocka_unit_test(test_step_qwen2_renorm),
        cmocka_unit_test(test_step_qwen2_bf16_tail),
        cmocka_unit_test(test_step_llama_documents),
#ifdef TKD_HF_FIXTURES_QWEN3
        cmocka_unit_test(test_step_qwen3_window),
#endif
        cmocka_unit_test(test_five_steps_llama),
        cmocka_unit_test(test_five_steps_qwen2),
        cmocka_unit_test(test_optimizer_ops_match_cpu),
        cmocka_unit_test(test_optimizer_bf16_state_matches_cpu),
        cmocka_unit_test(test_step_is_deterministic),
        cmocka_unit_test(test_demo_ce_only_cpu_vs_cuda),
        cmocka_unit_test(test_demo_kd_cpu_vs_cuda),
        cmocka_unit_test(test_demo_kd_bf16_state_cpu_vs_cuda),
        cmocka_unit_test(test_sampled_accum_gif_cpu_vs_cuda),
        cmocka_unit_test(test_dense_teacher_cpu_vs_cuda),
        cmocka_unit_test(test_resume_on_gpu_is_bit_exact),
        cmocka_unit_test(test_resume_bf16_state_on_gpu_is_bit_exact),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
