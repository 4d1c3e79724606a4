/* test_backend_seam.c — what the tools may ask a backend (kernels/backend.h's capabilities) and how
 * a process's backend is opened, on the CPU:
 * - the CPU backend's capabilities (host-addressable fp32 memory, no master residual, no data
 *   parallel, 256-row LM-head chunks), what kernels/backend_profile.h's wrapper reports for it, and
 *   the launcher's check of a configured device;
 * - tkd_backend_open takes a resolved device only (auto is decided once, by tkd_backend_resolve);
 * - the local GPU both tools take (tkd_dist_local_gpu) from LOCAL_RANK, SLURM_LOCALID or neither,
 *   wrapping when there are more local ranks than GPUs, through an injected environment;
 * - tkd_model_logits goes through the backend's op table (the profiling wrapper counts it). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <stdlib.h>
#include <string.h>

#include "common/dist.h"
#include "kernels/backend.h"
#include "kernels/backend_profile.h"
#include "kernels/cpu/cpu_ops.h"
#include "model/model.h"
#include "tests/testutil.h"

static void assert_cpu_caps(const tkd_backend *be)
{
    assert_int_equal(be->host_addressable, 1);
    assert_int_equal(be->act_size, sizeof(float));
    assert_int_equal(be->master_lo_size, 0);
    assert_int_equal(be->attn_window, 1); /* its attention masks sliding windows */
    assert_int_equal(be->attn_window_bwd, 1);
    assert_non_null(be->op->act_to_f32);
    assert_int_equal(tkd_backend_host_f32(be), 1);
    /* a fixed 256 rows whatever the vocabulary */
    assert_non_null(be->op->lmhead_chunk_rows);
    assert_int_equal(be->op->lmhead_chunk_rows(be, 32), 256);
    assert_int_equal(be->op->lmhead_chunk_rows(be, 151936), 256);
}

static void test_cpu_capabilities(void **s)
{
    (void)s;
    tkd_backend *be = NULL;
    assert_int_equal(tkd_backend_cpu_open(&be), TKD_OK);
    assert_cpu_caps(be);
    assert_int_equal(be->data_parallel, 0);
    assert_null(be->policy);
    tkd_backend_close(be);
    /* what a launcher checks before any backend opens agrees with the open backend's flag */
    assert_int_equal(tkd_backend_device_data_parallel(TKD_DEVICE_CPU), 0);
    assert_int_equal(tkd_backend_device_data_parallel(TKD_DEVICE_CUDA), 1);
    assert_int_equal(tkd_backend_device_data_parallel(TKD_DEVICE_AUTO), 1); /* may resolve to CUDA */
}

/* The wrapper reports its inner backend's capabilities, except data parallel: the collectives need
 * a stream the wrapper does not show. */
static void test_profile_capabilities(void **s)
{
    (void)s;
    tkd_backend *inner = NULL, *prof = NULL;
    assert_int_equal(tkd_backend_cpu_open(&inner), TKD_OK);
    inner->data_parallel = 1; /* as CUDA's: the wrapper must still say no */
    assert_int_equal(tkd_backend_profile_wrap(inner, &prof), TKD_OK);
    assert_cpu_caps(prof);
    assert_int_equal(prof->data_parallel, 0);
    tkd_backend_close(prof);
    tkd_backend_close(inner);
}

/* auto is resolved once, before the open; the open refuses an unresolved device. */
static void test_open_takes_resolved_device(void **s)
{
    (void)s;
    tkd_backend *be = NULL;
    assert_int_equal(tkd_backend_open(TKD_DEVICE_AUTO, 0, &be), TKD_ERR_INVALID_ARG);
    assert_null(be);
    tkd_test_assert_msg_has("not resolved (tkd_backend_resolve first)");
    tkd_dist_info one = {.rank = 0, .world = 1, .local_rank = 0, .local_world = 1, .source = TKD_DIST_SINGLE};
    assert_int_equal(tkd_backend_open_local(TKD_DEVICE_AUTO, &one, &be), TKD_ERR_INVALID_ARG);
    tkd_device got = TKD_DEVICE_AUTO;
    assert_int_equal(tkd_backend_resolve(TKD_DEVICE_CPU, &got), TKD_OK);
    assert_int_equal(got, TKD_DEVICE_CPU);
    assert_int_equal(tkd_backend_open_local(got, &one, &be), TKD_OK);
    assert_cpu_caps(be);
    tkd_backend_close(be);
    if (tkd_backend_cuda_devices() == 0) { /* where a GPU answers, the GPU tests open CUDA */
        assert_int_equal(tkd_backend_resolve(TKD_DEVICE_AUTO, &got), TKD_OK);
        assert_int_equal(got, TKD_DEVICE_CPU);
        assert_int_equal(tkd_backend_open(TKD_DEVICE_CUDA, 0, &be), TKD_ERR_UNSUPPORTED);
        tkd_test_assert_msg_has("device: cuda asked for, but ");
        tkd_test_assert_msg_has("use device: cpu (or auto)");
    }
}

/* The GPU among n that the process the environment env describes takes. */
static int gpu_of(const char *const *env, int n)
{
    tkd_dist_info d;
    tkd_test_env = env;
    assert_int_equal(tkd_dist_from_getenv(&d, tkd_test_getenv), TKD_OK);
    return tkd_dist_local_gpu(&d, n);
}

static void test_local_gpu(void **s)
{
    (void)s;
    static const char *const none[] = {NULL};
    static const char *const torch[] = {"RANK", "6", "WORLD_SIZE", "8", "LOCAL_RANK", "2", "LOCAL_WORLD_SIZE", "4",
                                        NULL};
    static const char *const torch_one_node[] = {"RANK", "3", "WORLD_SIZE", "4", NULL}; /* LOCAL_RANK = RANK */
    static const char *const slurm[] = {"SLURM_PROCID", "5", "SLURM_NTASKS", "6", "SLURM_LOCALID", "1",
                                        "SLURM_NODEID", "2", "SLURM_STEP_TASKS_PER_NODE", "2(x3)", NULL};
    assert_int_equal(gpu_of(none, 8), 0);
    assert_int_equal(gpu_of(torch, 8), 2);
    assert_int_equal(gpu_of(torch_one_node, 8), 3);
    assert_int_equal(gpu_of(slurm, 8), 1);
    /* more local ranks than GPUs visible (srun --gpus-per-task=1: each task sees one) wraps */
    assert_int_equal(gpu_of(torch, 1), 0);
    assert_int_equal(gpu_of(torch_one_node, 2), 1);
    assert_int_equal(gpu_of(slurm, 1), 0);
    /* no GPU answers: GPU 0 (the open then says none answers) */
    assert_int_equal(gpu_of(slurm, 0), 0);
    /* junk is refused by the one parse, never read as GPU 0 */
    tkd_dist_info d;
    tkd_test_env = (const char *const[]){"RANK", "1", "WORLD_SIZE", "2", "LOCAL_RANK", "one", NULL};
    assert_int_equal(tkd_dist_from_getenv(&d, tkd_test_getenv), TKD_ERR_CONFIG);
    tkd_test_assert_msg_has("LOCAL_RANK=one");
}

/* tkd_model_logits is the backend's linear (counted by the profiling wrapper), equal to the CPU
 * reference it replaced. */
static void test_model_logits_through_backend(void **s)
{
    (void)s;
    enum { V = 37, D = 16, N = 5 };
    tkd_backend *inner = NULL, *prof = NULL;
    assert_int_equal(tkd_backend_cpu_open(&inner), TKD_OK);
    assert_int_equal(tkd_backend_profile_wrap(inner, &prof), TKD_OK);
    tkd_model_config mc;
    tkd_test_tiny_llama(&mc, V, D, 1, 16);
    tkd_model *m = NULL;
    assert_int_equal(tkd_model_init_random_on(&mc, 7, prof, &m), TKD_OK);
    float h[N * D], got[N * V], want[N * V];
    tkd_test_randn(h, N * D, 3, 1.0f);
    tkd_cpu_linear_fwd(h, tkd_model_lm_head(m), NULL, N, D, V, 0, want);
    tkd_backend_profile_reset(prof);
    assert_int_equal(tkd_model_logits(m, h, N, got), TKD_OK);
    assert_memory_equal(got, want, sizeof want);
    tkd_profile_row rows[TKD_PROFILE_OPS];
    int n = 0, linear = 0;
    assert_int_equal(tkd_backend_profile_report(prof, rows, &n), TKD_OK);
    for (int i = 0; i < n; i++)
        if (!strcmp(rows[i].op, "linear_fwd"))
            linear = (int)rows[i].calls;
    assert_int_equal(linear, 1);
    tkd_model_free(m);
    tkd_backend_close(prof);
    tkd_backend_close(inner);
}

/* The LM head + top-k op's argument rules, one function for every backend and the tools: the top-k
 * rules always, the tail's only with draws. */
static void test_lmhead_topk_check(void **state)
{
    (void)state;
    assert_int_equal(tkd_backend_lmhead_topk_check(256, 151936, 100, 1.0f, 0), TKD_OK);
    assert_int_equal(tkd_backend_lmhead_topk_check(256, 151936, 100, 1.0f, 80), TKD_OK);
    assert_int_equal(tkd_backend_lmhead_topk_check(256, 151936, 0, 1.0f, 0), TKD_ERR_INVALID_ARG);
    assert_int_equal(tkd_backend_lmhead_topk_check(256, 151936, 129, 1.0f, 0), TKD_ERR_INVALID_ARG);
    assert_int_equal(tkd_backend_lmhead_topk_check(256, 64, 100, 1.0f, 0), TKD_ERR_INVALID_ARG); /* k > V */
    assert_int_equal(tkd_backend_lmhead_topk_check(256, 151936, 100, 0.0f, 0), TKD_ERR_INVALID_ARG);
    /* a vocabulary the tail's integer weights cannot sum: refused only when draws are asked for */
    assert_int_equal(tkd_backend_lmhead_topk_check(256, (1 << 20) + 1, 100, 1.0f, 0), TKD_OK);
    assert_int_equal(tkd_backend_lmhead_topk_check(256, (1 << 20) + 1, 100, 1.0f, 4), TKD_ERR_INVALID_ARG);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_cpu_capabilities),
        cmocka_unit_test(test_profile_capabilities),
        cmocka_unit_test(test_open_takes_resolved_device),
        cmocka_unit_test(test_local_gpu),
        cmocka_unit_test(test_model_logits_through_backend),
        cmocka_unit_test(test_lmhead_topk_check),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
