/* test_gpu_moe.c — the CUDA mixture-of-experts layer (kernels/cuda/moe_cuda.h) against the float64
 * reference tkd_ref_moe_fwd on the same bf16-rounded inputs and weights, for both routers (Qwen3-MoE
 * with and without norm_topk_prob; gpt-oss with biases and the clamped SwiGLU) over awkward shapes:
 * one token, an expert no token picks, k = 1 and k = E, token counts not a multiple of anything;
 * and the same bits from a second call (deterministic); every case with each way of running the
 * experts' GEMMs, our own grouped GEMMs included (mma.sync, and Hopper's on both schedules). Then our
 * grouped GEMMs alone (test_grouped_gemm, test_grouped_gemm_sm90) against a float64 GEMM, their
 * tolerances derived beside them.
 *
 * Routing must equal the reference's wherever the reference's k-th and (k+1)-th routing scores are
 * apart by more than ROUTE_GAP: the device computes the logits in fp32 from the same bf16 products
 * (relative error ~1e-6), so only a near-tie may choose differently; such tokens are counted and
 * excluded from the output check, and a case with more than 2 % of them fails (the inputs are
 * drawn so that ties are rare).
 *
 * Output tolerance, per element: |Δ| ≤ 2e-2·max|y_row| + 1e-2·|ref|. The device rounds h (the
 * expert's activation) to bf16 before the down projection (2^-9 relative per element, summed over I
 * terms of both signs: ~2^-9·‖h‖·‖W_down row‖, a few 1e-3 of the row's scale) and y to bf16 (2^-9
 * relative); fp32 GEMM accumulation adds ~1e-6. Over a case ‖Δ‖/‖ref‖ ≤ 1e-2.
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
#include "tests/gpu_check.h"
#include "tests/gpu_testutil.h"
#include "tests/testutil.h"

#ifdef TKD_HAVE_CUDA
#include <cuda_runtime.h>

#include "common/mxfp4_codec.h"
#include "kernels/cpu/cpu_moe.h"
#include "kernels/cpu/cpu_ops_ref.h"
#include "kernels/cuda/moe_cuda.h"
#include "kernels/cuda/moe_gemm_cuda.h"
#include "kernels/gemm_sm90/lmhead_sm90.h"
#include "kernels/gemm_sm90/moe_gemm_sm90.h"

#define ROUTE_GAP 1e-4

/* One tensor: bf16-rounded floats on the host, their bits on the device. */
typedef struct tensor {
    float *f;
    uint16_t *d;
    size_t n;
} tensor;

static tensor tensor_make(size_t n, uint64_t seed, float std)
{
    tensor t = {tkd_test_xmalloc(sizeof(float) * (n ? n : 1)), NULL, n};
    uint16_t *b = tkd_test_xmalloc(2 * (n ? n : 1));
    tkd_test_fill_bf16(t.f, b, (int64_t)n, seed, std);
    t.d = tkd_test_dev_alloc(2 * n);
    tkd_test_to_dev(t.d, b, 2 * n);
    free(b);
    return t;
}

static void tensor_free(tensor *t)
{
    free(t->f);
    cudaFree(t->d);
}

typedef struct mcase {
    const char *what;
    int qwen; /* 1: Qwen3-MoE's router and experts; 0: gpt-oss's */
    int N, D, I, E, k, norm;
    float x_std;
} mcase;

/* The routing score the reference ranks by: the softmax probability (Qwen3) or the logit (gpt-oss),
 * in double from the same floats. */
static void scores(const mcase *c, const float *x, const float *rw, const float *rb, int n, double *s)
{
    for (int e = 0; e < c->E; e++) {
        double a = rb ? rb[e] : 0.0;
        for (int d = 0; d < c->D; d++)
            a += (double)x[(size_t)n * c->D + d] * rw[(size_t)e * c->D + d];
        s[e] = a;
    }
}

/* 1 when the k-th and (k+1)-th scores of token n are further apart than ROUTE_GAP (relative). */
static int clear_route(const mcase *c, const double *s)
{
    if (c->k == c->E)
        return 1;
    double *v = tkd_test_xmalloc(sizeof(double) * c->E);
    memcpy(v, s, sizeof(double) * c->E);
    for (int a = 0; a <= c->k; a++) /* partial selection sort: the k + 1 largest first */
        for (int b = a + 1; b < c->E; b++)
            if (v[b] > v[a]) {
                double t = v[a];
                v[a] = v[b], v[b] = t;
            }
    const int ok = v[c->k - 1] - v[c->k] > ROUTE_GAP * fmax(1.0, fabs(v[c->k - 1]));
    free(v);
    return ok;
}

static const char *mode_name(int mode)
{
    return mode < 0 ? "auto" : mode == TKD_CUDA_MOE_GEMM_OURS ? "ours" : mode ? "grouped" : "loop";
}

static const char *ours_name(int kernel)
{
    return kernel == TKD_CUDA_MOE_OURS_MMA_SYNC         ? "mma.sync"
           : kernel == TKD_CUDA_MOE_OURS_SM90_PINGPONG ? "sm90 pp"
           : kernel == TKD_CUDA_MOE_OURS_SM90_COOP     ? "sm90 co"
                                                       : "default";
}

/* One case with the experts' GEMMs grouped (two cuBLAS calls a layer), in a loop per expert, auto
 * (grouped -1) or ours (moe_gemm_cuda.h, or gemm_sm90/moe_gemm_sm90.h on Hopper; ours_kernel picks
 * which), each expert's rows rounded up to a multiple of pad for the loop (the spill into the next
 * expert's rows must not show). */
static void run_case(const mcase *c, int grouped, int pad, int ours_kernel)
{
    const tkd_moe_params p = c->qwen ? tkd_moe_params_qwen3(c->D, c->I, c->E, c->k, c->norm)
                                     : tkd_moe_params_gpt_oss(c->D, c->I, c->E, c->k, 7.0f);
    const size_t N = (size_t)c->N, D = (size_t)c->D, I = (size_t)c->I, E = (size_t)c->E, k = (size_t)c->k;
    const float ws = 1.0f / sqrtf((float)D), wd = 1.0f / sqrtf((float)I);
    tensor x = tensor_make(N * D, 11, c->x_std), rw = tensor_make(E * D, 12, 2.0f * ws);
    tensor wg = tensor_make(E * I * D, 13, ws), wu = tensor_make(E * I * D, 14, ws), wdn = tensor_make(E * D * I, 15, wd);
    tensor rb = {0}, bg = {0}, bu = {0}, bd = {0};
    if (!c->qwen)
        rb = tensor_make(E, 16, 0.5f), bg = tensor_make(E * I, 17, 0.2f), bu = tensor_make(E * I, 18, 0.2f),
        bd = tensor_make(E * D, 19, 0.2f);
    const tkd_moe_weights fw = {rw.f, rb.f, wg.f, wu.f, wdn.f, bg.f, bu.f, bd.f, {{NULL}, {NULL}}};
    double *ref = tkd_test_xmalloc(sizeof(double) * N * D);
    int32_t *ref_e = tkd_test_xmalloc(sizeof(int32_t) * N * k);
    tkd_ref_moe_fwd(&p, &fw, x.f, c->N, ref, ref_e, NULL);

    tkd_cuda_moe_ws *ws_ = NULL;
    assert_int_equal(tkd_cuda_moe_ws_create(&ws_, &p, c->N + 3, NULL), TKD_OK);
    tkd_cuda_moe_ws_set_grouped(ws_, grouped);
    assert_int_equal(tkd_cuda_moe_ws_set_pad(ws_, pad), TKD_OK);
    assert_int_equal(tkd_cuda_moe_ws_set_ours_kernel(ws_, ours_kernel), TKD_OK);
    if (ours_kernel == TKD_CUDA_MOE_OURS_MMA_SYNC && tkd_cuda_moe_ws_ours_sm90(ws_))
        fail_msg("%s: asked for the mma.sync kernel, the workspace holds the Hopper one", c->what);
    const tkd_cuda_moe_weights cw = {rw.d, rb.d, wg.d, wu.d, wdn.d, bg.d, bu.d, bd.d, {{NULL}, {NULL}}};
    uint16_t *dy = tkd_test_dev_alloc(2 * N * D), *dy2 = tkd_test_dev_alloc(2 * N * D);
    int32_t *de = tkd_test_dev_alloc(4 * N * k);
    tkd_test_poison(dy, 2 * N * D);
    tkd_test_poison(dy2, 2 * N * D);
    if (tkd_cuda_moe_fwd(ws_, &cw, x.d, c->N, dy, de, NULL) != TKD_OK)
        fail_msg("%s: %s", c->what, tkd_error_msg());
    assert_int_equal(tkd_cuda_moe_fwd(ws_, &cw, x.d, c->N, dy2, NULL, NULL), TKD_OK);
    assert_int_equal(cudaDeviceSynchronize(), cudaSuccess);
    /* auto: ours where the Hopper kernel runs (D and I multiples of 8), else these cases' experts
     * are tiny, so grouped; a mismatch: e.g. cuBLAS refused the grouped call and fell back to the
     * loop */
    const int auto_ours = tkd_cuda_moe_ws_ours_sm90(ws_) && c->D % 8 == 0 && c->I % 8 == 0;
    const int want = grouped < 0 ? (auto_ours ? TKD_CUDA_MOE_GEMM_OURS : TKD_CUDA_MOE_GEMM_GROUPED) : grouped;
    const int ran = tkd_cuda_moe_ws_ran(ws_);
    if (ran != want || tkd_cuda_moe_ws_grouped(ws_) != (ran == TKD_CUDA_MOE_GEMM_GROUPED))
        fail_msg("%s: asked for %s GEMMs, ran %s", c->what, mode_name(grouped), mode_name(ran));
    uint16_t *y = tkd_test_xmalloc(2 * N * D), *y2 = tkd_test_xmalloc(2 * N * D);
    int32_t *e = tkd_test_xmalloc(4 * N * k);
    tkd_test_to_host(y, dy, 2 * N * D, NULL);
    tkd_test_to_host(y2, dy2, 2 * N * D, NULL);
    tkd_test_to_host(e, de, 4 * N * k, NULL);
    assert_memory_equal(y, y2, 2 * N * D); /* deterministic */

    double *s = tkd_test_xmalloc(sizeof(double) * E);
    int near = 0;
    char what[160];
    snprintf(what, sizeof what, "%s: y against the float64 reference", c->what);
    const tkd_test_tol tol = {0.0, 1e-2, "bf16 G, U, h, O and y (2^-9 each), fp32 accumulation"};
    tkd_test_check chk;
    tkd_test_check_begin(&chk, what, tol, tkd_test_where_rowcol, &D);
    for (size_t n = 0; n < N; n++) {
        scores(c, x.f, rw.f, rb.f, (int)n, s);
        if (!clear_route(c, s)) {
            near++;
            continue;
        }
        if (memcmp(e + n * k, ref_e + n * k, 4 * k) != 0)
            fail_msg("%s: token %zu routed to expert %d first, the reference to %d (not a near tie)", c->what, n,
                     e[n * k], ref_e[n * k]);
        double scale = 0.0;
        for (size_t d = 0; d < D; d++)
            scale = fmax(scale, fabs(ref[n * D + d]));
        for (size_t d = 0; d < D; d++)
            tkd_test_check_add(&chk, (int64_t)(n * D + d), tkd_bf16_to_f32(y[n * D + d]), ref[n * D + d],
                               2e-2 * scale);
    }
    tkd_test_check_end(&chk);
    if (!(tkd_test_check_norm(&chk) <= 1e-2))
        fail_msg("%s: relative norm %.3g over 1e-2", what, tkd_test_check_norm(&chk));
    if (near > (int)(0.02 * N) + 1)
        fail_msg("%s: %d of %zu tokens are near ties of the router: the case does not test routing", c->what, near, N);
    print_message("%-40s %-7s %-8s pad %3d N %5d D %4d I %4d E %3d k %2d: worst err/tol %.3f, norm %.2e, "
                  "%d near ties\n", c->what, mode_name(ran),
                  ran == TKD_CUDA_MOE_GEMM_OURS ? ours_name(ours_kernel) : "", pad, c->N, c->D, c->I, c->E, c->k,
                  chk.worst, tkd_test_check_norm(&chk), near);
    free(s), free(y), free(y2), free(e), free(ref), free(ref_e);
    cudaFree(dy), cudaFree(dy2), cudaFree(de);
    tkd_cuda_moe_ws_free(ws_);
    tensor *all[] = {&x, &rw, &wg, &wu, &wdn, &rb, &bg, &bu, &bd};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++)
        if (all[i]->f)
            tensor_free(all[i]);
}

static const mcase kCases[] = {
    {"qwen3: one token", 1, 1, 64, 48, 8, 2, 1, 1.0f},
    {"qwen3: norm_topk_prob off, k 1", 1, 37, 48, 40, 6, 1, 0, 1.0f},
    {"qwen3: k = E", 1, 61, 32, 24, 4, 4, 1, 1.0f},
    {"qwen3: D 36, I 20 (rows not 16-byte)", 1, 29, 36, 20, 6, 2, 1, 1.0f},
    {"qwen3: 128 experts, k 8 (30B-A3B-like)", 1, 700, 256, 96, 128, 8, 1, 1.0f},
    {"gpt-oss: biases, clamp, k 4", 0, 301, 96, 64, 32, 4, 0, 3.0f},
    {"gpt-oss: one token, many clamped", 0, 1, 64, 32, 8, 4, 0, 8.0f},
};

static void test_matches_reference(void **state)
{
    (void)state;
    static const int kModes[][3] = {
        {TKD_CUDA_MOE_GEMM_GROUPED, 1, 0}, {TKD_CUDA_MOE_GEMM_LOOP, 1, 0},
        {TKD_CUDA_MOE_GEMM_LOOP, 128, 0},  {TKD_CUDA_MOE_GEMM_AUTO, 128, TKD_CUDA_MOE_OURS_DEFAULT},
        {TKD_CUDA_MOE_GEMM_AUTO, 128, TKD_CUDA_MOE_OURS_MMA_SYNC},
        {TKD_CUDA_MOE_GEMM_OURS, 1, TKD_CUDA_MOE_OURS_DEFAULT}, {TKD_CUDA_MOE_GEMM_OURS, 1, TKD_CUDA_MOE_OURS_MMA_SYNC},
        {TKD_CUDA_MOE_GEMM_OURS, 1, TKD_CUDA_MOE_OURS_SM90_PINGPONG},
        {TKD_CUDA_MOE_GEMM_OURS, 1, TKD_CUDA_MOE_OURS_SM90_COOP}}; /* mode, pad, our kernel */
    for (size_t m = 0; m < sizeof kModes / sizeof kModes[0]; m++)
        for (size_t i = 0; i < sizeof kCases / sizeof kCases[0]; i++)
            if (kModes[m][0] != TKD_CUDA_MOE_GEMM_OURS || (kCases[i].D % 8 == 0 && kCases[i].I % 8 == 0))
                run_case(&kCases[i], kModes[m][0], kModes[m][1], kModes[m][2]); /* else refused: test_errors */
}

/* A random MXFP4 stack of rows x groups blocks on the device (*blk codes, *sc scales) and its exact
 * bf16 decoding (common/mxfp4_codec.h) on the device (*deq): every code; scales 2^-6 .. 2^-3, but
 * every 7th block one of the scales the Hopper decoder takes another way (0, 1: values below
 * 2^-126; 129, 130: ≥ 4) or that bound its fast way (2, 128). */
static void mx_stack(int64_t rows, int64_t groups, uint64_t seed, uint8_t **blk, uint8_t **sc, uint16_t **deq)
{
    static const uint8_t kEdge[] = {0, 1, 2, 128, 129, 130};
    const size_t nb = (size_t)(rows * groups);
    uint8_t *hb = tkd_test_xmalloc(nb * 16), *hs = tkd_test_xmalloc(nb);
    uint16_t *hd = tkd_test_xmalloc(nb * 32 * 2);
    uint64_t r = seed;
    for (size_t i = 0; i < nb * 16; i++)
        hb[i] = (uint8_t)((r = r * 6364136223846793005ull + 1442695040888963407ull) >> 56);
    for (size_t i = 0; i < nb; i++) {
        r = r * 6364136223846793005ull + 1442695040888963407ull;
        hs[i] = i % 7 == 3 ? kEdge[(r >> 33) % sizeof kEdge] : (uint8_t)(121 + (r >> 62));
    }
    assert_int_equal(tkd_mxfp4_decode_bf16(hb, hs, rows, groups, hd, "test"), TKD_OK);
    *blk = tkd_test_dev_alloc(nb * 16), *sc = tkd_test_dev_alloc(nb), *deq = tkd_test_dev_alloc(nb * 64);
    tkd_test_to_dev(*blk, hb, nb * 16), tkd_test_to_dev(*sc, hs, nb), tkd_test_to_dev(*deq, hd, nb * 64);
    free(hb), free(hs), free(hd);
}

/* MXFP4 experts (params.mxfp4) against the op on the bf16 stacks decoded on the host (exact), bit
 * for bit, gpt-oss's router and clamp: D 128, I 192 decoded inside the Hopper GEMM (where the
 * device has it) and a layer at a time (tkd_cuda_moe_ws_set_mxfp4_layer); D 64, I 96 (I not a
 * multiple of 64) always a layer at a time. */
static void run_mxfp4_case(int D, int I, int layer)
{
    enum { N = 257, E = 8, K = 2 };
    const int64_t rows[3] = {(int64_t)E * I, (int64_t)E * I, (int64_t)E * D};
    const int64_t groups[3] = {D / 32, D / 32, I / 32};
    tkd_cuda_moe_weights wb = {0}, wq = {0};
    void *owned[9];
    for (int j = 0; j < 3; j++) {
        uint8_t *blk, *sc;
        uint16_t *deq;
        mx_stack(rows[j], groups[j], 4242 + (uint64_t)j, &blk, &sc, &deq);
        wq.q.blocks[j] = blk, wq.q.scales[j] = sc;
        *(j == 0 ? &wb.w_gate : j == 1 ? &wb.w_up : &wb.w_down) = deq;
        owned[3 * j] = blk, owned[3 * j + 1] = sc, owned[3 * j + 2] = deq;
    }
    tensor x = tensor_make((size_t)N * D, 31, 1.0f), rw = tensor_make((size_t)E * D, 32, 0.25f);
    tensor rb = tensor_make(E, 33, 0.5f), bg = tensor_make((size_t)E * I, 34, 0.2f);
    tensor bu = tensor_make((size_t)E * I, 35, 0.2f), bd = tensor_make((size_t)E * D, 36, 0.2f);
    wb.router_w = wq.router_w = rw.d, wb.router_b = wq.router_b = rb.d;
    wb.b_gate = wq.b_gate = bg.d, wb.b_up = wq.b_up = bu.d, wb.b_down = wq.b_down = bd.d;
    tkd_moe_params pb = tkd_moe_params_gpt_oss(D, I, E, K, 7.0f), pq = pb;
    pq.mxfp4 = 1;
    tkd_cuda_moe_ws *wsb = NULL, *wsq = NULL;
    assert_int_equal(tkd_cuda_moe_ws_create(&wsb, &pb, N, NULL), TKD_OK);
    assert_int_equal(tkd_cuda_moe_ws_create(&wsq, &pq, N, NULL), TKD_OK);
    tkd_cuda_moe_ws_set_mxfp4_layer(wsq, layer);
    uint16_t *yb = tkd_test_dev_alloc(2 * (size_t)N * D), *yq = tkd_test_dev_alloc(2 * (size_t)N * D);
    assert_int_equal(tkd_cuda_moe_fwd(wsb, &wb, x.d, N, yb, NULL, NULL), TKD_OK);
    if (tkd_cuda_moe_fwd(wsq, &wq, x.d, N, yq, NULL, NULL) != TKD_OK)
        fail_msg("MXFP4 D %d I %d: %s", D, I, tkd_error_msg());
    assert_int_equal(cudaDeviceSynchronize(), cudaSuccess);
    const int in_gemm = tkd_cuda_moe_ws_ours_sm90(wsq) && !layer && D % 64 == 0 && I % 64 == 0;
    if (tkd_cuda_moe_ws_mxfp4_in_gemm(wsq) != in_gemm)
        fail_msg("MXFP4 D %d I %d layer %d: decoded %s the GEMM, expected %s", D, I, layer,
                 in_gemm ? "before" : "inside", in_gemm ? "inside" : "before");
    uint16_t *hb = tkd_test_xmalloc(2 * (size_t)N * D), *hq = tkd_test_xmalloc(2 * (size_t)N * D);
    tkd_test_to_host(hb, yb, 2 * (size_t)N * D, NULL);
    tkd_test_to_host(hq, yq, 2 * (size_t)N * D, NULL);
    assert_memory_equal(hb, hq, 2 * (size_t)N * D);
    int nonzero = 0;
    for (int i = 0; i < N * D; i++)
        nonzero += (hb[i] & 0x7fff) != 0;
    assert_true(nonzero > N * D / 2);
    print_message("MXFP4 experts D %d I %d: decoded %s the GEMM, the bf16 op's bits\n", D, I,
                  in_gemm ? "inside" : "before");
    free(hb), free(hq);
    cudaFree(yb), cudaFree(yq);
    tkd_cuda_moe_ws_free(wsb), tkd_cuda_moe_ws_free(wsq);
    tensor *all[] = {&x, &rw, &rb, &bg, &bu, &bd};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++)
        tensor_free(all[i]);
    for (int i = 0; i < 9; i++)
        cudaFree(owned[i]);
}

static void test_mxfp4_experts(void **state)
{
    (void)state;
    run_mxfp4_case(128, 192, 0);
    run_mxfp4_case(128, 192, 1);
    run_mxfp4_case(64, 96, 0);
}

/* ---- our grouped GEMM alone (moe_gemm_cuda.h) against a host float64 GEMM ----------------------
 *
 * Tolerance per element: |got − ref| ≤ 2^-8·|ref| + 2·k·2^-23·Σ_d |x_d w_d|. The products of two
 * bf16 values are exact in fp32; a sum of k of them in fp32, in whatever order the MMAs add, is
 * within k·u·Σ|x_d w_d| of the exact sum, with u = 2^-24 for rounded additions and 2^-23 taken
 * here because the tensor cores may truncate inside an MMA's additions. Rounding that sum v once
 * to bf16 (8 significant bits, round to nearest even) moves it by at most 2^-8·|v|, and
 * 2^-8·|v| ≤ 2^-8·|ref| + 2^-8·k·2^-23·Σ|x w|, so (1 + 2^-8)·k·2^-23·Σ|x w| ≤ the second term. */

/* Expert e's rows start after e + 1 runs of kGap unlisted rows (poisoned: never written), and the
 * last expert's last kPast rows lie past m (neither read nor written). Tiles of 1, 127, 128, 129
 * (128 + 1), 300 (128 + 128 + 44) rows, an expert with none, and one of 1030 rows: 17 tiles of 64,
 * so two groups (16 + 1, kernels/moe.h). */
static const int32_t kGemmCounts[] = {1, 127, 0, 128, 129, 300, 7, 1030};
enum { kGemmE = 8, kGap = 3, kPast = 2 };

typedef struct gemm_case {
    int n, k, two; /* two: gate and up in one launch (w1, c1) */
} gemm_case;

/* The tile list of kGemmCounts with tile_m rows a tile, laid out with the gaps, uploaded; *rows_out
 * the rows of x and c (the last kPast of them past m). */
static int32_t *gemm_tiles(int tile_m, int *n_tiles, int *rows_out, int32_t *first)
{
    enum { I = TKD_MOE_TILE_INTS };
    int32_t h[I * 64];
    const int nt = tkd_moe_gemm_tiles(kGemmCounts, kGemmE, tile_m, h);
    int want = 0;
    for (int e = 0; e < kGemmE; e++)
        want += (kGemmCounts[e] + tile_m - 1) / tile_m;
    assert_int_equal(nt, want);
    assert_true(nt <= 64);
    int32_t r = kGap;
    for (int e = 0; e < kGemmE; r += kGemmCounts[e] + kGap, e++)
        first[e] = r;
    for (int t = 0; t < nt; t++) { /* packed rows → the layout with gaps */
        int32_t packed = 0;
        for (int e = 0; e < h[I * t]; e++)
            packed += kGemmCounts[e];
        assert_true(h[I * t + 2] >= 1 && h[I * t + 2] <= tile_m);
        /* its group: consecutive tiles of its expert, at most TKD_MOE_GROUP_TILES, holding it */
        const int g0 = h[I * t + 3], c = h[I * t + 4];
        assert_true(c >= 1 && c <= TKD_MOE_GROUP_TILES && g0 <= t && t < g0 + c && g0 + c <= nt);
        assert_int_equal(h[I * g0], h[I * t]), assert_int_equal(h[I * (g0 + c - 1)], h[I * t]);
        assert_true(g0 == 0 || h[I * (g0 - 1)] != h[I * t] || h[I * (g0 - 1) + 4] == TKD_MOE_GROUP_TILES);
        h[I * t + 1] += first[h[I * t]] - packed;
    }
    if (tile_m == 128)
        assert_int_equal(h[I * 4 + 0], 4), assert_int_equal(h[I * 4 + 2], 1); /* 129 = 128 + 1 */
    *rows_out = r - kGap; /* the end of the last expert's rows; m = rows_out − kPast, inside its tile */
    *n_tiles = nt;
    int32_t *d = tkd_test_dev_alloc(sizeof h);
    tkd_test_to_dev(d, h, sizeof(int32_t) * I * (size_t)nt);
    return d;
}

/* Every row of c (rows, n) that listed[] does not mark (not in a tile, or past m) still holds the
 * poison; frees listed. */
static void check_unlisted(const char *what, const uint16_t *c, char *listed, int rows, int n, int m)
{
    for (int r = 0; r < rows; r++)
        for (int j = 0; j < n && !listed[r]; j++)
            if (c[(size_t)r * n + j] != 0xffff)
                fail_msg("%s: row %d (not in a tile, or past m %d) written at column %d", what, r, m, j);
    free(listed);
}

/* c (rows, n) from the device against x·W_eᵀ in float64 over the listed rows below m; every other
 * row still poisoned. */
static void check_gemm_out(const char *what, const uint16_t *c, const float *x, const float *w, const int32_t *first,
                           int m, int rows, int n, int k)
{
    const tkd_test_tol tol = {0.0, 1.0 / 256, "bf16 output rounded once (2^-8) from an fp32 sum (k·2^-23·Σ|x w|)"};
    tkd_test_check chk;
    const size_t cols = (size_t)n;
    tkd_test_check_begin(&chk, what, tol, tkd_test_where_rowcol, &cols);
    char *listed = calloc((size_t)rows, 1);
    for (int e = 0; e < kGemmE; e++)
        for (int i = 0; i < kGemmCounts[e] && first[e] + i < m; i++) {
            const int r = first[e] + i;
            listed[r] = 1;
            for (int j = 0; j < n; j++) {
                double s = 0.0, sa = 0.0;
                for (int d = 0; d < k; d++) {
                    const double p = (double)x[(size_t)r * k + d] * w[((size_t)e * n + j) * k + d];
                    s += p, sa += fabs(p);
                }
                tkd_test_check_add(&chk, (int64_t)r * n + j, tkd_bf16_to_f32(c[(size_t)r * n + j]), s,
                                   2.0 * k * ldexp(sa, -23));
            }
        }
    tkd_test_check_end(&chk);
    check_unlisted(what, c, listed, rows, n, m);
}

static void run_gemm_case(const gemm_case *g)
{
    int nt = 0, rows = 0;
    int32_t first[kGemmE];
    int32_t *tiles = gemm_tiles(TKD_MOE_GEMM_TILE_M, &nt, &rows, first);
    const int m = rows - kPast, nz = g->two ? 2 : 1;
    const size_t nx = (size_t)rows * g->k, nw = (size_t)kGemmE * g->n * g->k, nc = (size_t)rows * g->n;
    tensor x = tensor_make(nx, 41, 1.0f), w[2] = {tensor_make(nw, 42, 1.0f), tensor_make(nw, 43, 1.0f)};
    uint16_t *c[2][2], *h = tkd_test_xmalloc(2 * nc), *h2 = tkd_test_xmalloc(2 * nc);
    for (int run = 0; run < 2; run++)
        for (int z = 0; z < 2; z++)
            tkd_test_poison(c[run][z] = tkd_test_dev_alloc(2 * nc), 2 * nc);
    for (int run = 0; run < 2; run++)
        tkd_test_ok(tkd_cuda_moe_gemm(x.d, w[0].d, g->two ? w[1].d : NULL, tiles, nt, m, g->n, g->k, c[run][0],
                                      g->two ? c[run][1] : NULL, NULL), "tkd_cuda_moe_gemm");
    assert_int_equal(cudaDeviceSynchronize(), cudaSuccess);
    for (int z = 0; z < nz; z++) {
        char what[96];
        snprintf(what, sizeof what, "moe grouped GEMM n %d k %d: c%d", g->n, g->k, z);
        tkd_test_to_host(h, c[0][z], 2 * nc, NULL);
        tkd_test_to_host(h2, c[1][z], 2 * nc, NULL);
        assert_memory_equal(h, h2, 2 * nc); /* deterministic */
        check_gemm_out(what, h, x.f, w[z].f, first, m, rows, g->n, g->k);
    }
    if (!g->two) { /* one product: c1 untouched (the second buffer is still all poison) */
        tkd_test_to_host(h, c[0][1], 2 * nc, NULL);
        for (size_t i = 0; i < nc; i++)
            assert_int_equal(h[i], 0xffff);
    }
    print_message("moe grouped GEMM: %d tiles, m %d, n %4d, k %4d, %s\n", nt, m, g->n, g->k,
                  g->two ? "gate and up in one launch" : "one product");
    free(h), free(h2);
    for (int run = 0; run < 2; run++)
        cudaFree(c[run][0]), cudaFree(c[run][1]);
    tensor_free(&x), tensor_free(&w[0]), tensor_free(&w[1]);
    cudaFree(tiles);
}

/* n not a multiple of the 128-column block (8, 40, 136, 2880 as gpt-oss), k short, not a multiple
 * of the 32-wide k step (40, 1032) and long (2048). */
static void test_grouped_gemm(void **state)
{
    (void)state;
    static const gemm_case kGemmCases[] = {{8, 8, 1},    {40, 40, 1},    {136, 2048, 1},
                                           {2880, 40, 1}, {2880, 1032, 0}, {8, 2048, 0}};
    for (size_t i = 0; i < sizeof kGemmCases / sizeof kGemmCases[0]; i++)
        run_gemm_case(&kGemmCases[i]);
}

/* ---- our Hopper grouped GEMM alone (gemm_sm90/moe_gemm_sm90.h) --------------------------------
 *
 * down: check_gemm_out's bound. gate_up: h = act(bf16(g) + b_g, bf16(u) + b_u) against act(g + b_g,
 * u + b_u) of the float64 sums, each element allowed 2^-8·|h| (h rounded once to bf16) plus
 *   1.1·(|u| + δu + 1)·δg + (|g| + δg)·δu,
 * where g and u include the biases, δg = 2^-8·|g| + 2k·2^-23·Σ|x w_g| + 2^-23·(|g| + |b_g|) bounds
 * the device's g against the exact one (the fp32 sum as check_gemm_out bounds it, rounded to bf16,
 * the bias added in fp32), likewise δu; 1.1 bounds the slope of g·σ(αg) for any α (its largest is
 * 1.0998), |g·σ(αg)| ≤ |g|, and the clamps are 1-Lipschitz, so the mean value theorem gives the
 * sum. */

typedef struct sm90_case {
    int fused, clamp, bias; /* gate/up with the activation (SwiGLU or gpt-oss's clamped one), biases */
    int n, k;
} sm90_case;

static double act_ref(int clamp, double g, double u)
{
    if (!clamp)
        return g / (1.0 + exp(-g)) * u;
    const double lim = 7.0, alpha = 1.702;
    g = fmin(g, lim);
    u = fmin(fmax(u, -lim), lim);
    return (u + 1.0) * (g / (1.0 + exp(-alpha * g)));
}

static void check_gate_up(const char *what, const uint16_t *h, const float *x, const float *wg, const float *wu,
                          const float *bg, const float *bu, const int32_t *first, int m, int rows, const sm90_case *c)
{
    const tkd_test_tol tol = {0.0, 1.0 / 256, "h rounded once (2^-8) from act of bf16 g, u (the bound above)"};
    const int n = c->n, k = c->k;
    tkd_test_check chk;
    const size_t cols = (size_t)n;
    tkd_test_check_begin(&chk, what, tol, tkd_test_where_rowcol, &cols);
    char *listed = calloc((size_t)rows, 1);
    for (int e = 0; e < kGemmE; e++)
        for (int i = 0; i < kGemmCounts[e] && first[e] + i < m; i++) {
            const int r = first[e] + i;
            listed[r] = 1;
            for (int j = 0; j < n; j++) {
                double g = 0.0, u = 0.0, sg = 0.0, su = 0.0;
                const size_t wrow = ((size_t)e * n + j) * k;
                for (int d = 0; d < k; d++) {
                    const double pg = (double)x[(size_t)r * k + d] * wg[wrow + d];
                    const double pu = (double)x[(size_t)r * k + d] * wu[wrow + d];
                    g += pg, sg += fabs(pg), u += pu, su += fabs(pu);
                }
                const double b_g = bg ? bg[(size_t)e * n + j] : 0.0, b_u = bu ? bu[(size_t)e * n + j] : 0.0;
                const double dg = ldexp(fabs(g), -8) + 2.0 * k * ldexp(sg, -23) + ldexp(fabs(g) + fabs(b_g), -23);
                const double du = ldexp(fabs(u), -8) + 2.0 * k * ldexp(su, -23) + ldexp(fabs(u) + fabs(b_u), -23);
                g += b_g, u += b_u;
                const double extra = 1.1 * (fabs(u) + du + 1.0) * dg + (fabs(g) + dg) * du;
                tkd_test_check_add(&chk, (int64_t)r * n + j, tkd_bf16_to_f32(h[(size_t)r * n + j]),
                                   act_ref(c->clamp, g, u), extra);
            }
        }
    tkd_test_check_end(&chk);
    check_unlisted(what, h, listed, rows, n, m);
    print_message("%s: worst err/tol %.3f over %lld elements\n", what, chk.worst, (long long)chk.n);
}

/* One case on both schedules, each run twice: the same bits every run and on both schedules (each
 * element is the same fp32 sum in the same order; only the tile rows differ). */
static void run_sm90_case(const sm90_case *c, tkd_lmhead_sm90_ws *const ws[2])
{
    const int n = c->n, k = c->k;
    const tkd_moe_params p = c->clamp ? tkd_moe_params_gpt_oss(k, n, kGemmE, 2, 7.0f)
                                      : tkd_moe_params_qwen3(k, n, kGemmE, 2, 1);
    const size_t nw = (size_t)kGemmE * n * k;
    tensor x = {0}, w[2] = {tensor_make(nw, 52, 1.0f), tensor_make(nw, 53, 1.0f)}, b[2] = {{0}, {0}};
    if (c->bias)
        b[0] = tensor_make((size_t)kGemmE * n, 54, 0.5f), b[1] = tensor_make((size_t)kGemmE * n, 55, 0.5f);
    uint16_t *ref_bits = NULL;
    for (int sc = 0; sc < 2; sc++) {
        int nt = 0, rows = 0;
        int32_t first[kGemmE];
        int32_t *tiles = gemm_tiles(tkd_moe_gemm_sm90_tile_rows(ws[sc]), &nt, &rows, first);
        const int m = rows - kPast;
        const size_t nc = (size_t)rows * n;
        if (!x.f)
            x = tensor_make((size_t)rows * k, 51, c->clamp ? 0.1f : 1.0f); /* clamp: g both sides of the limit */
        uint16_t *d[2], *h[2];
        for (int run = 0; run < 2; run++) {
            tkd_test_poison(d[run] = tkd_test_dev_alloc(2 * nc), 2 * nc);
            h[run] = tkd_test_xmalloc(2 * nc);
            if (c->fused)
                tkd_test_ok(tkd_moe_gemm_sm90_gate_up(ws[sc], x.d, w[0].d, w[1].d, b[0].d, b[1].d, &p, tiles, nt, m,
                                                      n, k, d[run]), "tkd_moe_gemm_sm90_gate_up");
            else
                tkd_test_ok(tkd_moe_gemm_sm90_down(ws[sc], x.d, w[0].d, kGemmE, tiles, nt, m, n, k, d[run]),
                            "tkd_moe_gemm_sm90_down");
        }
        tkd_test_ok(tkd_lmhead_sm90_sync(ws[sc]), "tkd_lmhead_sm90_sync");
        for (int run = 0; run < 2; run++)
            tkd_test_to_host(h[run], d[run], 2 * nc, NULL);
        assert_memory_equal(h[0], h[1], 2 * nc); /* deterministic */
        char what[128];
        snprintf(what, sizeof what, "moe_gemm_sm90 %s %s%s n %d k %d, %d-row tiles", sc ? "ping-pong" : "coop",
                 c->fused ? (c->clamp ? "gate/up clamped" : "gate/up SwiGLU") : "down", c->bias ? " +bias" : "", n,
                 k, tkd_moe_gemm_sm90_tile_rows(ws[sc]));
        if (c->fused)
            check_gate_up(what, h[0], x.f, w[0].f, w[1].f, b[0].f, b[1].f, first, m, rows, c);
        else
            check_gemm_out(what, h[0], x.f, w[0].f, first, m, rows, n, k);
        if (!ref_bits)
            ref_bits = h[0], h[0] = NULL;
        else if (memcmp(ref_bits, h[0], 2 * nc) != 0)
            fail_msg("%s: bits differ from the cooperative schedule's", what);
        free(h[0]), free(h[1]);
        cudaFree(d[0]), cudaFree(d[1]), cudaFree(tiles);
    }
    free(ref_bits);
    tensor_free(&x), tensor_free(&w[0]), tensor_free(&w[1]);
    if (c->bias)
        tensor_free(&b[0]), tensor_free(&b[1]);
}

/* n below one tile (40: 128 columns fused, 256 down), not a multiple of it (136, 264, 2880 as
 * gpt-oss), k below one K step of 64 (40), not a multiple of it (72, 264) and long (2048); the rows
 * of kGemmCounts (an expert with none, one split into two groups, rows past m). On a device other
 * than compute capability 9.0 the kernel must refuse. */
/* A cooperative (ws[0]) and a ping-pong (ws[1]) Hopper workspace; 0 on a device other than
 * compute capability 9.0, where creating one must be refused, naming it. */
static int sm90_pair(tkd_lmhead_sm90_ws *ws[2], const char *what)
{
    const tkd_status st = tkd_lmhead_sm90_ws_create(&ws[0], TKD_LMHEAD_SM90_SCHED_COOP);
    if (st == TKD_ERR_UNSUPPORTED) {
        tkd_test_assert_msg_has("compute capability");
        print_message("%s: not compute capability 9.0: refused, as it must be\n", what);
        return 0;
    }
    tkd_test_ok(st, "tkd_lmhead_sm90_ws_create");
    tkd_test_ok(tkd_lmhead_sm90_ws_create(&ws[1], TKD_LMHEAD_SM90_SCHED_PINGPONG), "tkd_lmhead_sm90_ws_create");
    return 1;
}

static void test_grouped_gemm_sm90(void **state)
{
    (void)state;
    tkd_lmhead_sm90_ws *ws[2] = {NULL, NULL};
    if (!sm90_pair(ws, "moe_gemm_sm90"))
        return;
    assert_int_equal(tkd_moe_gemm_sm90_tile_rows(ws[0]), 128);
    assert_int_equal(tkd_moe_gemm_sm90_tile_rows(ws[1]), 64);
    static const sm90_case kCases[] = {
        {1, 0, 0, 40, 40},   {1, 0, 0, 136, 2048}, {1, 1, 1, 2880, 264}, {1, 0, 1, 264, 72},
        {0, 0, 0, 40, 40},   {0, 0, 0, 264, 2048}, {0, 0, 0, 2880, 264},
    };
    for (size_t i = 0; i < sizeof kCases / sizeof kCases[0]; i++)
        run_sm90_case(&kCases[i], ws);
    /* refusals, naming the shape, before anything runs */
    uint16_t *b = tkd_test_dev_alloc(4096);
    const int32_t *t = (const int32_t *)b;
    assert_int_equal(tkd_moe_gemm_sm90_down(ws[0], b, b, 2, t, 1, 4, 16, 12, b), TKD_ERR_UNSUPPORTED);
    tkd_test_assert_msg_has("(4, 12) · (16, 12)ᵀ needs n and k multiples of 8");
    assert_int_equal(tkd_moe_gemm_sm90_down(ws[0], b + 1, b, 2, t, 1, 4, 16, 16, b), TKD_ERR_UNSUPPORTED);
    assert_int_equal(tkd_moe_gemm_sm90_down(ws[0], b, b, 0, t, 1, 4, 16, 16, b), TKD_ERR_INVALID_ARG);
    assert_int_equal(tkd_moe_gemm_sm90_down(ws[0], b, b, 2, NULL, 1, 4, 16, 16, b), TKD_ERR_INVALID_ARG);
    assert_int_equal(tkd_moe_gemm_sm90_gate_up(ws[0], b, b, b, NULL, NULL, NULL, t, 1, 4, 16, 16, b),
                     TKD_ERR_INVALID_ARG);
    tkd_test_assert_msg_has("activation");
    assert_int_equal(tkd_moe_gemm_sm90_down(ws[0], b, b, 2, t, 0, 4, 16, 16, b), TKD_OK); /* nothing to do */
    tkd_test_ok(tkd_lmhead_sm90_sync(ws[0]), "tkd_lmhead_sm90_sync");
    cudaFree(b);
    tkd_lmhead_sm90_ws_free(ws[0]), tkd_lmhead_sm90_ws_free(ws[1]);
}

/* The MXFP4 launches against the bf16 ones over the decoded stacks (mx_stack: every code, scales on
 * both of the decoder's ways), bit for bit on the cooperative schedule, their one: so they inherit
 * test_grouped_gemm_sm90's float64 checks, and leave the same rows unwritten. n below a tile, not
 * a multiple of it, and gpt-oss's 2880; k one K step, several (2880 = 45). */
static void run_sm90_mx_case(const sm90_case *c, tkd_lmhead_sm90_ws *coop)
{
    const int n = c->n, k = c->k;
    const tkd_moe_params p = c->clamp ? tkd_moe_params_gpt_oss(k, n, kGemmE, 2, 7.0f)
                                      : tkd_moe_params_qwen3(k, n, kGemmE, 2, 1);
    const int nstacks = c->fused ? 2 : 1;
    tkd_moe_mxfp4 q = {{NULL}, {NULL}};
    uint16_t *deq[2] = {NULL, NULL};
    for (int j = 0; j < nstacks; j++) {
        uint8_t *blk, *sc;
        mx_stack((int64_t)kGemmE * n, k / 32, 77 + (uint64_t)j, &blk, &sc, &deq[j]);
        q.blocks[c->fused ? j : 2] = blk, q.scales[c->fused ? j : 2] = sc;
    }
    tensor b[2] = {{0}, {0}};
    if (c->bias)
        b[0] = tensor_make((size_t)kGemmE * n, 54, 0.5f), b[1] = tensor_make((size_t)kGemmE * n, 55, 0.5f);
    int nt = 0, rows = 0;
    int32_t first[kGemmE];
    int32_t *tiles = gemm_tiles(tkd_moe_gemm_sm90_tile_rows(coop), &nt, &rows, first);
    const int m = rows - kPast;
    const size_t nc = (size_t)rows * n;
    tensor x = tensor_make((size_t)rows * k, 51, 1.0f);
    uint16_t *d[2], *h[2];
    for (int z = 0; z < 2; z++) {
        tkd_test_poison(d[z] = tkd_test_dev_alloc(2 * nc), 2 * nc);
        h[z] = tkd_test_xmalloc(2 * nc);
    }
    if (c->fused) {
        tkd_test_ok(tkd_moe_gemm_sm90_gate_up(coop, x.d, deq[0], deq[1], b[0].d, b[1].d, &p, tiles, nt, m, n, k, d[0]),
                    "tkd_moe_gemm_sm90_gate_up");
        tkd_test_ok(tkd_moe_gemm_sm90_gate_up_mxfp4(coop, x.d, &q, b[0].d, b[1].d, &p, tiles, nt, m, n, k, d[1]),
                    "tkd_moe_gemm_sm90_gate_up_mxfp4");
    } else {
        tkd_test_ok(tkd_moe_gemm_sm90_down(coop, x.d, deq[0], kGemmE, tiles, nt, m, n, k, d[0]),
                    "tkd_moe_gemm_sm90_down");
        tkd_test_ok(tkd_moe_gemm_sm90_down_mxfp4(coop, x.d, &q, kGemmE, tiles, nt, m, n, k, d[1]),
                    "tkd_moe_gemm_sm90_down_mxfp4");
    }
    tkd_test_ok(tkd_lmhead_sm90_sync(coop), "tkd_lmhead_sm90_sync");
    for (int z = 0; z < 2; z++)
        tkd_test_to_host(h[z], d[z], 2 * nc, NULL);
    size_t diff = 0, written = 0;
    for (size_t i = 0; i < nc; i++)
        diff += h[0][i] != h[1][i], written += h[0][i] != 0xffff;
    if (diff)
        fail_msg("moe_gemm_sm90 MXFP4 %s n %d k %d: %zu of %zu elements differ from the bf16 launch's",
                 c->fused ? "gate/up" : "down", n, k, diff, nc);
    assert_true(written > nc / 2);
    print_message("moe_gemm_sm90 MXFP4 %s n %d k %d: the bf16 launch's bits (%zu elements written)\n",
                  c->fused ? (c->clamp ? "gate/up clamped" : "gate/up SwiGLU") : "down", n, k, written);
    for (int z = 0; z < 2; z++)
        free(h[z]), cudaFree(d[z]);
    cudaFree(tiles);
    tensor_free(&x);
    if (c->bias)
        tensor_free(&b[0]), tensor_free(&b[1]);
    for (int j = 0; j < 3; j++)
        cudaFree((void *)q.blocks[j]), cudaFree((void *)q.scales[j]);
    for (int j = 0; j < nstacks; j++)
        cudaFree(deq[j]);
}

static void test_grouped_gemm_sm90_mxfp4(void **state)
{
    (void)state;
    tkd_lmhead_sm90_ws *ws[2] = {NULL, NULL};
    if (!sm90_pair(ws, "moe_gemm_sm90 MXFP4"))
        return;
    static const sm90_case kCases[] = {
        {1, 1, 1, 264, 128}, {1, 0, 0, 40, 64}, {1, 1, 1, 2880, 2880}, {0, 0, 0, 40, 64}, {0, 0, 0, 136, 2880},
        {0, 0, 0, 2880, 192},
    };
    for (size_t i = 0; i < sizeof kCases / sizeof kCases[0]; i++)
        run_sm90_mx_case(&kCases[i], ws[0]);
    /* refusals, naming what, before anything runs */
    uint16_t *b = tkd_test_dev_alloc(4096);
    const int32_t *t = (const int32_t *)b;
    tkd_moe_mxfp4 q = {{(const uint8_t *)b, (const uint8_t *)b, (const uint8_t *)b},
                       {(const uint8_t *)b, (const uint8_t *)b, (const uint8_t *)b}};
    assert_int_equal(tkd_moe_gemm_sm90_down_mxfp4(ws[1], b, &q, 2, t, 1, 4, 16, 64, b), TKD_ERR_UNSUPPORTED);
    tkd_test_assert_msg_has("cooperative schedule only");
    assert_int_equal(tkd_moe_gemm_sm90_down_mxfp4(ws[0], b, &q, 2, t, 1, 4, 16, 96, b), TKD_ERR_UNSUPPORTED);
    tkd_test_assert_msg_has("k 96 must be a multiple of 64");
    q.scales[2] = (const uint8_t *)b + 2;
    assert_int_equal(tkd_moe_gemm_sm90_down_mxfp4(ws[0], b, &q, 2, t, 1, 4, 16, 64, b), TKD_ERR_UNSUPPORTED);
    tkd_test_assert_msg_has("scales 4-byte aligned");
    q.scales[1] = NULL;
    const tkd_moe_params p = tkd_moe_params_qwen3(64, 16, 2, 1, 1);
    assert_int_equal(tkd_moe_gemm_sm90_gate_up_mxfp4(ws[0], b, &q, NULL, NULL, &p, t, 1, 4, 16, 64, b),
                     TKD_ERR_INVALID_ARG);
    tkd_test_assert_msg_has("no codes or scales");
    cudaFree(b);
    tkd_lmhead_sm90_ws_free(ws[0]), tkd_lmhead_sm90_ws_free(ws[1]);
}

/* Shapes and pointers the kernel cannot take are refused, naming them, before anything runs. */
static void test_grouped_gemm_refusals(void **state)
{
    (void)state;
    uint16_t *b = tkd_test_dev_alloc(4096);
    const int32_t *t = (const int32_t *)b;
    assert_int_equal(tkd_cuda_moe_gemm(b, b, NULL, t, 1, 4, 16, 12, b, NULL, NULL), TKD_ERR_UNSUPPORTED);
    tkd_test_assert_msg_has("(4, 12) · (16, 12)ᵀ: needs k and n multiples of 8");
    assert_int_equal(tkd_cuda_moe_gemm(b, b, NULL, t, 1, 4, 20, 16, b, NULL, NULL), TKD_ERR_UNSUPPORTED);
    assert_int_equal(tkd_cuda_moe_gemm(b + 1, b, NULL, t, 1, 4, 16, 16, b, NULL, NULL), TKD_ERR_UNSUPPORTED);
    tkd_test_assert_msg_has("16-byte aligned");
    assert_int_equal(tkd_cuda_moe_gemm(b, b, b, t, 1, 4, 16, 16, b, b + 4, NULL), TKD_ERR_UNSUPPORTED);
    assert_int_equal(tkd_cuda_moe_gemm(b, b, NULL, t, 70000, 4, 16, 16, b, NULL, NULL), TKD_ERR_INVALID_ARG);
    tkd_test_assert_msg_has("70000 tiles");
    assert_int_equal(tkd_cuda_moe_gemm(b, b, b, t, 1, 4, 16, 16, b, NULL, NULL), TKD_ERR_INVALID_ARG);
    assert_int_equal(tkd_cuda_moe_gemm(b, b, NULL, t, 0, 4, 16, 16, b, NULL, NULL), TKD_OK); /* nothing to do */
    cudaFree(b);
}

static void test_errors(void **state)
{
    (void)state;
    tkd_moe_params p = tkd_moe_params_qwen3(32, 16, 2048, 2, 1);
    tkd_cuda_moe_ws *ws = NULL;
    assert_int_equal(tkd_cuda_moe_ws_create(&ws, &p, 8, NULL), TKD_ERR_UNSUPPORTED);
    tkd_test_assert_msg_has("2048 experts");
    p = tkd_moe_params_qwen3(32, 16, 8, 9, 1);
    assert_int_equal(tkd_cuda_moe_ws_create(&ws, &p, 8, NULL), TKD_ERR_INVALID_ARG);
    p = tkd_moe_params_qwen3(32, 16, 8, 2, 1);
    assert_int_equal(tkd_cuda_moe_ws_create(&ws, &p, 8, NULL), TKD_OK);
    const tkd_cuda_moe_weights w = {0};
    assert_int_equal(tkd_cuda_moe_fwd(ws, &w, NULL, 9, NULL, NULL, NULL), TKD_ERR_INVALID_ARG);
    tkd_test_assert_msg_has("9 tokens, the workspace holds 8");
    assert_int_equal(tkd_cuda_moe_fwd(ws, &w, NULL, 0, NULL, NULL, NULL), TKD_OK); /* nothing to do */
    assert_int_equal(tkd_cuda_moe_ws_set_pad(ws, 0), TKD_ERR_INVALID_ARG);
    assert_int_equal(tkd_cuda_moe_ws_set_pad(ws, 257), TKD_ERR_INVALID_ARG);
    tkd_test_assert_msg_has("pad 257 rows: 1 to 256");
    tkd_cuda_moe_ws_free(ws);
    /* ours needs D and I multiples of 8: refused before anything is enqueued */
    p = tkd_moe_params_qwen3(36, 16, 8, 2, 1);
    assert_int_equal(tkd_cuda_moe_ws_create(&ws, &p, 8, NULL), TKD_OK);
    tkd_cuda_moe_ws_set_grouped(ws, TKD_CUDA_MOE_GEMM_OURS);
    assert_int_equal(tkd_cuda_moe_fwd(ws, &w, NULL, 1, NULL, NULL, NULL), TKD_ERR_UNSUPPORTED);
    tkd_test_assert_msg_has("D 36, I 16: our grouped GEMM needs both multiples of 8");
    assert_int_equal(tkd_cuda_moe_ws_set_ours_kernel(ws, 7), TKD_ERR_INVALID_ARG);
    tkd_test_assert_msg_has("our GEMM's kernel 7");
    tkd_cuda_moe_ws_free(ws);
    /* MXFP4 stacks off their alignment: refused naming the stack, before anything is enqueued */
    p = tkd_moe_params_gpt_oss(64, 64, 8, 2, 7.0f);
    p.mxfp4 = 1;
    assert_int_equal(tkd_cuda_moe_ws_create(&ws, &p, 8, NULL), TKD_OK);
    uint8_t *buf = tkd_test_dev_alloc(4096);
    tkd_cuda_moe_weights wq = {0};
    for (int j = 0; j < 3; j++)
        wq.q.blocks[j] = buf, wq.q.scales[j] = buf + 2048;
    wq.q.blocks[1] = buf + 8;
    assert_int_equal(tkd_cuda_moe_fwd(ws, &wq, NULL, 1, NULL, NULL, NULL), TKD_ERR_INVALID_ARG);
    tkd_test_assert_msg_has("MXFP4 W_up: codes must be 16-byte and scales 4-byte aligned");
    wq.q.blocks[1] = buf, wq.q.scales[2] = buf + 2050;
    assert_int_equal(tkd_cuda_moe_fwd(ws, &wq, NULL, 1, NULL, NULL, NULL), TKD_ERR_INVALID_ARG);
    tkd_test_assert_msg_has("MXFP4 W_down");
    cudaFree(buf);
    tkd_cuda_moe_ws_free(ws);
}

static const struct CMUnitTest kTests[] = {
    cmocka_unit_test(test_matches_reference),
    cmocka_unit_test(test_mxfp4_experts),
    cmocka_unit_test(test_errors),
    cmocka_unit_test(test_grouped_gemm),
    cmocka_unit_test(test_grouped_gemm_refusals),
    cmocka_unit_test(test_grouped_gemm_sm90),
    cmocka_unit_test(test_grouped_gemm_sm90_mxfp4),
};
#endif /* TKD_HAVE_CUDA */

TKD_TEST_GPU_MAIN(kTests, NULL, NULL)
