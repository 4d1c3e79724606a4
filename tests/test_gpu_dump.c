/* test_gpu_dump.c — teacher-dump with device: cuda against device: cpu on the demo teacher
 * (data/demo-teacher: Llama, D 128, 4 layers, GQA 4/2, head_dim 32, V 4096) over the first 24
 * windows of the demo's training tokens, and resume / two workers + merge on the GPU against one
 * uninterrupted GPU run. Exits 77 where no GPU answers.
 *
 * What may differ between the devices: the GPU computes in bf16 (weights and activations rounded
 * to 8 significant bits, fp32 accumulation), the CPU in fp32, so logits differ by about 2^-8 of
 * their spread per layer. Hence: tokens identical; LSE within LSE_ATOL; a top-k id of one device
 * that the other lacks must lie within TIE_DELTA of the other's k-th logit (a near-tie); most tail
 * draws identical (a draw moves only when the logits around its CDF point moved). Resume and
 * worker splits on one device promise identical values (same kernels, same batches).
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

#include "kernels/backend.h"
#include "teacher_cache/dump.h"
#include "teacher_cache/dump_merge.h"
#include "tests/dump_testutil.h"
#include "tests/testutil.h"

/* bf16 rounding of D=128-wide activations over 4 layers moves logits of magnitude ~10 by a few
 * 1e-2: max |Δlse| measured on an H200 0.059 with our flash kernel, 0.101 with cuDNN's attention
 * (bf16 probabilities before P·V); these bounds leave a factor ~2 over that. */
#define LSE_ATOL 0.2
#define TIE_DELTA 0.25
/* A tail draw inverts the CDF of the row's tail mass at a counter-based uniform: when any logit of
 * the row moves, the draws near the moved mass move with it, so about half differ between bf16 and
 * fp32 logits (measured 0.50 on an H200). Identical draws on identical logits is test_gpu_model's
 * LM-head check; here each draw must be valid and a large share the same. */
#define MIN_SAME_TAIL 0.30

static void demo_yaml(char *buf, size_t cap, const char *out, const char *device, const char *extra)
{
    int n = snprintf(buf, cap,
                     "teacher: {path: '%s'}\n"
                     "data: {paths: ['%s'], seq_len: 64, max_sequences: 24}\n"
                     "cache: {k: 32, shard_sequences: 8, tail_samples: 16, logits_dtype: float32}\n"
                     "run: {batch_size: 4}\n"
                     "lm_head: {chunk_rows: 100}\n"
                     "device: %s\n"
                     "output: {dir: '%s'}\n---\n%s",
                     tkd_test_src("../data/demo-teacher"), tkd_test_src("../data/brown-train.bin"), device, out,
                     extra);
    assert_true(n > 0 && (size_t)n < cap);
}

static void run_dump(const char *yaml, const tkd_dump_opts *opts, tkd_status want)
{
    tkd_dump_config cfg;
    tkd_dt_config(&cfg, yaml);
    tkd_status st = tkd_dump_run(&cfg, opts, NULL);
    tkd_config_free(&tkd_dump_schema, &cfg);
    if (st != want)
        fail_msg("teacher-dump: want %s, got %s: %s", tkd_status_name(want), tkd_status_name(st), tkd_error_msg());
}

/* 1 when id lies in row[0..k) */
static int has_id(const uint32_t *row, int k, uint32_t id)
{
    for (int j = 0; j < k; j++)
        if (row[j] == id)
            return 1;
    return 0;
}

/* Every id of a's row missing from b's row must be a near-tie at b's k-th logit. Returns the
 * number of such swaps. */
static int row_swaps(const uint32_t *ia, const float *la, const uint32_t *ib, const float *lb, int k)
{
    int swaps = 0;
    for (int j = 0; j < k; j++) {
        if (has_id(ib, k, ia[j]))
            continue;
        swaps++;
        if (fabs((double)la[j] - lb[k - 1]) > TIE_DELTA)
            fail_msg("top-k: id %u (logit %.4f on one device) missing on the other, whose k-th logit is %.4f",
                     ia[j], la[j], lb[k - 1]);
    }
    return swaps;
}

static void compare_devices(const char *cpu_dir, const char *gpu_dir)
{
    tkd_cache_batch a, b;
    int64_t n = tkd_dt_read_all(cpu_dir, &a, NULL);
    assert_int_equal(tkd_dt_read_all(gpu_dir, &b, NULL), n);
    size_t T = (size_t)a.seq_len, k = (size_t)a.k, S = (size_t)a.tail_samples, rows = (size_t)n * T;
    assert_memory_equal(a.tokens, b.tokens, (size_t)n * (T + 1) * sizeof *a.tokens);
    double lse_max = 0, top1_same = 0, tail_same = 0;
    int swaps = 0;
    for (size_t r = 0; r < rows; r++) {
        lse_max = fmax(lse_max, fabs((double)a.lse[r] - b.lse[r]));
        const uint32_t *ia = a.topk_indices + r * k, *ib = b.topk_indices + r * k;
        const float *la = a.topk_logits + r * k, *lb = b.topk_logits + r * k;
        swaps += row_swaps(ia, la, ib, lb, (int)k) + row_swaps(ib, lb, ia, la, (int)k);
        top1_same += ia[0] == ib[0];
        for (size_t j = 0; j < S; j++) {
            uint32_t t = b.tail_indices[r * S + j];
            if (has_id(ib, (int)k, t) || t >= 4096)
                fail_msg("position %zu: tail draw %u is in the top-k or outside the vocabulary", r, t);
            tail_same += a.tail_indices[r * S + j] == t;
        }
    }
    tail_same /= (double)(rows * S);
    printf("cuda vs cpu over %zu positions: max |Δlse| %.4f, top-k near-tie swaps %d, top-1 equal %.4f, "
           "tail draws equal %.4f\n", rows, lse_max, swaps, top1_same / rows, tail_same);
    assert_true(lse_max <= LSE_ATOL);
    assert_true(tail_same >= MIN_SAME_TAIL);
    tkd_cache_batch_free(&a);
    tkd_cache_batch_free(&b);
}

static void test_cuda_vs_cpu_resume_workers(void **state)
{
    (void)state;
    char *dir = tkd_test_mkdtemp("gpu-dump");
    char cpu[4200], gpu[4200], res[4200], wk[4200], y[9000];
    snprintf(cpu, sizeof cpu, "%s/cpu", dir);
    snprintf(gpu, sizeof gpu, "%s/gpu", dir);
    snprintf(res, sizeof res, "%s/resumed", dir);
    snprintf(wk, sizeof wk, "%s/workers", dir);
    demo_yaml(y, sizeof y, cpu, "cpu", "");
    run_dump(y, NULL, TKD_OK);
    demo_yaml(y, sizeof y, gpu, "cuda", "");
    run_dump(y, NULL, TKD_OK);
    compare_devices(cpu, gpu);

    /* stopped after 3 batches (one whole shard and half the next), then resumed */
    demo_yaml(y, sizeof y, res, "cuda", "");
    tkd_dump_opts stop = {.stop_after_batches = 3};
    run_dump(y, &stop, TKD_ERR_INTERRUPTED);
    run_dump(y, NULL, TKD_OK);
    tkd_dt_assert_same_cache(gpu, res);

    /* two workers, then merge */
    for (int i = 0; i < 2; i++) {
        char extra[64];
        snprintf(extra, sizeof extra, "workers: {index: %d, count: 2}\n", i);
        demo_yaml(y, sizeof y, wk, "cuda", extra);
        run_dump(y, NULL, TKD_OK);
    }
    int64_t nseq = 0, nshards = 0;
    if (tkd_dump_merge(wk, &nseq, &nshards) != TKD_OK)
        fail_msg("merge: %s", tkd_error_msg());
    assert_int_equal(nseq, 24);
    tkd_dt_assert_same_cache(gpu, wk);
    tkd_test_rmtree(dir);
    free(dir);
}

int main(void)
{
    tkd_test_require_gpu();
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_cuda_vs_cpu_resume_workers),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
