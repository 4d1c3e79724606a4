/* test_gpu_dist.c — data-parallel student training over NCCL (student_train/zero.h,
 * kernels/comm/comm_nccl.h), every run in a forked child process: CUDA must not be initialised in a
 * process that forks, so this parent never touches the GPU (even the GPU count comes from a child).
 *
 *   1. One rank (RANK=0 WORLD_SIZE=1: a real 1-rank communicator) against the plain single-process
 *      path, the demo student on a synthetic teacher cache for 8 steps: every logged loss and
 *      grad_norm, the checkpoint's model.safetensors and its AdamW moments (the one-process file
 *      against the one rank's shard file, which a world of 1 also names optimizer.safetensors),
 *      BIT-IDENTICAL; again with bf16 AdamW moments (optim.state_dtype).
 *      Why exact: with one rank every collective is an identity (a reduce into itself, a broadcast
 *      from itself, a sum of doubles over one rank), the loss scale n_r / N is exactly 1, the shard
 *      is the whole array with the same AdamW segment table, and the norm is the same sum.
 *   2. Two ranks (needs 2 GPUs; skipped, saying so, with fewer): global batch 16 as 2 x 8 against
 *      one GPU with 16, 20 steps: each logged loss within CURVE_RTOL, the token counts equal.
 *   3. Two ranks, rank 1 killed (SIGKILL) after the communicator is up: rank 0's next all-reduce must
 *      fail within timeout + SLACK_S with a message naming rank 1 (heartbeats, tkd_dist_late_ranks).
 *
 * Tolerance. CURVE_RTOL 1e-2: the two runs compute the same gradients up to fp32 summation order
 * (the loss's dW summed over 8 + 8 rows on two GPUs instead of 16 on one; the bucket sums); such
 * differences (~1e-6 relative) are amplified by AdamW's sign-like first steps and by the bf16
 * compute copy (a weight near a rounding boundary rounds the other way), which test_gpu_train's
 * resume test shows does not happen between identical runs. Over 20 steps a bug (a rank's rows
 * counted twice, a missing bucket, a wrong shard) moves the loss by far more than 1 %: a missing
 * bucket leaves a block untrained (~0.1 nat by step 20 at lr 3e-3).
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "common/dist.h"
#include "common/fileio.h"
#include "formats/safetensors.h"
#include "kernels/backend.h"
#include "kernels/comm/comm_nccl.h"
#include "student_train/train.h"
#include "tests/gpu_check.h"
#include "tests/testutil.h"

#define CURVE_RTOL 1e-2
static const tkd_test_tol kCurveTol = {0.0, CURVE_RTOL, "fp32 summation order, amplified by AdamW's sign-like first "
                                                        "steps and bf16 rounding (file comment)"};
#define STEPS_EXACT 8
#define STEPS_CURVE 20
#define KILL_TIMEOUT_S 10.0 /* the communicator's deadline in test 3 */
#define SLACK_S 20.0        /* NCCL's abort and process teardown on top of it */

static int g_gpus = -1; /* GPUs that answer, counted in a child */

/* ---- children ------------------------------------------------------------------------------------ */

static void set_rank_env(int rank, int world, const char *job)
{
    char r[16], w[16];
    snprintf(r, sizeof r, "%d", rank);
    snprintf(w, sizeof w, "%d", world);
    unsetenv("SLURM_PROCID"), unsetenv("SLURM_NTASKS"), unsetenv("SLURM_LOCALID");
    setenv("RANK", r, 1), setenv("WORLD_SIZE", w, 1), setenv("LOCAL_RANK", r, 1);
    setenv("LOCAL_WORLD_SIZE", w, 1), setenv("TKD_JOB_ID", job, 1);
}

static void clear_rank_env(void)
{
    unsetenv("RANK"), unsetenv("WORLD_SIZE"), unsetenv("LOCAL_RANK"), unsetenv("LOCAL_WORLD_SIZE");
    unsetenv("SLURM_PROCID"), unsetenv("SLURM_NTASKS"), unsetenv("SLURM_LOCALID");
}

/* A child's exit code; one that runs past 10 minutes (an NCCL hang) is killed: -1. */
static int wait_child(pid_t pid) { return tkd_test_wait_timeout(pid, 600.0); }

static int count_gpus(void)
{
    pid_t pid = fork();
    if (pid == 0)
        _exit(tkd_backend_cuda_devices() > 100 ? 100 : tkd_backend_cuda_devices());
    return pid > 0 ? wait_child(pid) : 0;
}

/* The demo student (configs/student-demo.yaml's shape) on the group's cache, device cuda. */
#define DEMO_SETS                                                                                              \
    "model.arch=llama", "model.hidden_size=64", "model.intermediate_size=192", "model.num_layers=2",           \
        "model.num_heads=4", "model.num_kv_heads=2", "model.max_position_embeddings=256", "data.seq_len=64",   \
        "optim.lr=3e-3", "optim.min_lr=3e-4", "optim.warmup_steps=10", "optim.weight_decay=0.1",              \
        "optim.grad_clip=1.0", "train.batch_size=16", "train.eval_interval=0", "train.eval_batches=4",        \
        "train.log_interval=1", "train.seed=42", "device=cuda", "kd.variant=renorm", "kd.alpha=0.5"

/* One student-train run in a child: rank/world < 0 runs without a launcher's environment; dtype is
 * optim.state_dtype. Exits 0 on success, else prints the error and exits 1. */
static pid_t spawn_train(const tkd_test_student_dir *f, const char *name, int rank, int world, const char *job,
                         int steps, const char *dtype)
{
    pid_t pid = fork();
    if (pid != 0)
        return pid;
    if (rank >= 0)
        set_rank_env(rank, world, job);
    else
        clear_rank_env();
    char cache[4300], max[64], state[64];
    snprintf(cache, sizeof cache, "data.cache=%s", f->cache);
    snprintf(max, sizeof max, "train.max_steps=%d", steps);
    snprintf(state, sizeof state, "optim.state_dtype=%s", dtype);
    const char *sets[] = {DEMO_SETS, cache, max, state};
    tkd_train_result res;
    tkd_status st = tkd_test_student_train(f->runs, name, sets, sizeof sets / sizeof sets[0], 0, &res);
    if (st != TKD_OK)
        fprintf(stderr, "  run %s (rank %d of %d): %s\n", name, rank, world, tkd_error_msg());
    _exit(st == TKD_OK ? 0 : 1);
}

static void run_ok(const tkd_test_student_dir *f, const char *name, int rank, int world, int steps, const char *dtype)
{
    int rc = wait_child(spawn_train(f, name, rank, world, "job-single", steps, dtype));
    if (rc != 0)
        fail_msg("run %s (rank %d of %d) exited with %d (its error is printed above)", name, rank, world, rc);
}

static void same_file(const tkd_test_student_dir *f, const char *a, const char *b, const char *file)
{
    char pa[4400], pb[4400];
    snprintf(pa, sizeof pa, "%s/%s/checkpoint/%s", f->runs, a, file);
    snprintf(pb, sizeof pb, "%s/%s/checkpoint/%s", f->runs, b, file);
    if (!tkd_test_files_equal(pa, pb))
        fail_msg("%s differs between %s and %s", file, a, b);
}

/* The AdamW moments of two checkpoints, the same bits: a one-process file against a rank's shard
 * file (a one-rank shard holds the whole arrays under the same tensor names; its header differs). */
static void same_moments(const tkd_test_student_dir *f, const char *a, const char *fa, const char *b,
                         const char *fb)
{
    char p[2][4400];
    snprintf(p[0], sizeof p[0], "%s/%s/checkpoint/%s", f->runs, a, fa);
    snprintf(p[1], sizeof p[1], "%s/%s/checkpoint/%s", f->runs, b, fb);
    tkd_st_dir *d[2] = {NULL, NULL};
    for (int i = 0; i < 2; i++)
        if (tkd_st_open(p[i], &d[i]) != TKD_OK)
            fail_msg("%s: %s", p[i], tkd_error_msg());
    for (int k = 0; k < 2; k++) {
        const char *name = k ? "adamw.v" : "adamw.m";
        const tkd_st_tensor *ta = tkd_st_find(d[0], name), *tb = tkd_st_find(d[1], name);
        if (!ta || !tb)
            fail_msg("%s missing in %s", name, ta ? p[1] : p[0]);
        size_t i = 0;
        while (i < ta->nbytes && i < tb->nbytes && ((const char *)ta->data)[i] == ((const char *)tb->data)[i])
            i++;
        if (ta->nbytes != tb->nbytes || i < ta->nbytes)
            fail_msg("%s differs between %s and %s: %zu / %zu bytes, first differing byte %zu", name, p[0], p[1],
                     ta->nbytes, tb->nbytes, i);
    }
    tkd_st_close(d[0]);
    tkd_st_close(d[1]);
}

/* ---- 1. one rank over NCCL == the plain path ------------------------------------------------------- */

/* plain and nccl1 are the runs' names, dtype their optim.state_dtype. */
static void one_rank_nccl(tkd_test_student_dir *f, const char *plain, const char *nccl1, const char *dtype)
{
    run_ok(f, plain, -1, 0, STEPS_EXACT, dtype);
    run_ok(f, nccl1, 0, 1, STEPS_EXACT, dtype);
    const char *keys[] = {"loss", "grad_norm", "kd", "ce"};
    for (size_t k = 0; k < sizeof keys / sizeof keys[0]; k++) {
        double a[STEPS_EXACT], b[STEPS_EXACT];
        tkd_test_train_metrics(f, plain, keys[k], a, STEPS_EXACT);
        tkd_test_train_metrics(f, nccl1, keys[k], b, STEPS_EXACT);
        for (int s = 0; s < STEPS_EXACT; s++)
            if (memcmp(&a[s], &b[s], sizeof a[s]) != 0)
                fail_msg("step %d (%s moments): %s plain %.9g, one-rank NCCL %.9g (must be the same bits)", s + 1,
                         dtype, keys[k], a[s], b[s]);
    }
    same_file(f, plain, nccl1, "model.safetensors");
    same_moments(f, plain, "optimizer.safetensors", nccl1, "optimizer.safetensors");
}

static void test_one_rank_nccl_is_bit_identical(void **state) { one_rank_nccl(*state, "plain", "nccl1", "f32"); }

/* The same with optim.state_dtype bf16: the ZeRO-1 shard of bf16 moments (here the whole array) on
 * the GPU, stored BF16, equal to the plain path's. */
static void test_one_rank_nccl_bf16_state_is_bit_identical(void **state)
{
    one_rank_nccl(*state, "plain-bf16", "nccl1-bf16", "bf16");
}

/* ---- 2. two ranks follow one GPU ------------------------------------------------------------------- */

static int need_two(void)
{
    if (g_gpus >= 2)
        return 1;
    printf("  skipped: %d GPU%s answer%s; two ranks need two GPUs (run on nvidia-h200-x2)\n", g_gpus,
           g_gpus == 1 ? "" : "s", g_gpus == 1 ? "s" : "");
    return 0;
}

static void test_two_ranks_follow_one_gpu(void **state)
{
    if (!need_two())
        skip();
    tkd_test_student_dir *f = *state;
    run_ok(f, "one-gpu", -1, 0, STEPS_CURVE, "f32");
    char job[64];
    snprintf(job, sizeof job, "curve-%ld", (long)getpid());
    pid_t p0 = spawn_train(f, "two-gpu", 0, 2, job, STEPS_CURVE, "f32"),
          p1 = spawn_train(f, "two-gpu", 1, 2, job, STEPS_CURVE, "f32");
    int r0 = wait_child(p0), r1 = wait_child(p1);
    if (r0 != 0 || r1 != 0)
        fail_msg("two ranks exited with %d and %d (errors printed above)", r0, r1);
    double a[STEPS_CURVE], b[STEPS_CURVE], ta[STEPS_CURVE], tb[STEPS_CURVE];
    tkd_test_train_metrics(f, "one-gpu", "loss", a, STEPS_CURVE);
    tkd_test_train_metrics(f, "two-gpu", "loss", b, STEPS_CURVE);
    tkd_test_train_metrics(f, "one-gpu", "tokens", ta, STEPS_CURVE);
    tkd_test_train_metrics(f, "two-gpu", "tokens", tb, STEPS_CURVE);
    tkd_test_check k;
    tkd_test_check_begin(&k, "losses, two ranks against one GPU", kCurveTol, tkd_test_where_step, NULL);
    for (int s = 0; s < STEPS_CURVE; s++) {
        tkd_test_check_add(&k, s, b[s], a[s], 0.0);
        if (ta[s] != tb[s])
            fail_msg("step %d: tokens seen one GPU %.0f, two ranks %.0f", s + 1, ta[s], tb[s]);
        printf("  step %2d: loss one GPU %.6f, two ranks %.6f (%+.2e)\n", s + 1, a[s], b[s], (b[s] - a[s]) / a[s]);
    }
    tkd_test_check_end(&k);
}

/* ---- 3. a killed rank is named within the timeout --------------------------------------------------- */

typedef struct beat_ctx {
    const char *dir;
    int rank;
} beat_ctx;

static void late(void *ctx, char *buf, size_t n)
{
    tkd_dist_late_ranks(((beat_ctx *)ctx)->dir, 2, KILL_TIMEOUT_S / 2, buf, n);
}

static void beating(void *ctx)
{
    (void)tkd_dist_beat(((beat_ctx *)ctx)->dir, ((beat_ctx *)ctx)->rank, 1);
}

/* A rank of test 3: joins, beats step 1, then rank 1 dies and rank 0 waits in an all-reduce.
 * Rank 0 exits 0 when that fails naming rank 1 within the deadline, else 2..5 (printed why). */
static void kill_rank_child(const char *dir, int rank, const char *job)
{
    set_rank_env(rank, 2, job);
    tkd_dist_info d;
    tkd_backend *be = NULL;
    tkd_comm *c = NULL;
    tkd_comm_id id = {{0}};
    beat_ctx bc = {dir, rank};
    tkd_rdzv_config rc = {.kind = TKD_RDZV_FILE, .dir = dir, .timeout_s = 60};
    tkd_comm_opts co = {.rank = rank, .world = 2, .timeout_s = KILL_TIMEOUT_S, .late = late, .waiting = beating,
                        .ctx = &bc};
    if (tkd_dist_from_env(&d) != TKD_OK || tkd_backend_open(TKD_DEVICE_CUDA, rank, &be) != TKD_OK ||
        (rank == 0 && tkd_comm_make_id(&id) != TKD_OK) || tkd_rdzv_share(&rc, &d, &id, sizeof id) != TKD_OK ||
        tkd_comm_init(&id, &co, be, &c) != TKD_OK || tkd_comm_barrier(c, "barrier") != TKD_OK ||
        tkd_dist_beat(dir, rank, 1) != TKD_OK) {
        fprintf(stderr, "  rank %d: setup failed: %s\n", rank, tkd_error_msg());
        _exit(2);
    }
    if (rank == 1)
        raise(SIGKILL);
    sleep(1);
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    double v = 1;
    tkd_status st = tkd_comm_allreduce_sum(c, &v, 1, "loss all-reduce");
    clock_gettime(CLOCK_MONOTONIC, &t1);
    double el = (double)(t1.tv_sec - t0.tv_sec) + 1e-9 * (double)(t1.tv_nsec - t0.tv_nsec);
    printf("  rank 0: %s after %.1f s: %s\n", tkd_status_name(st), el, tkd_error_msg());
    if (st == TKD_OK)
        _exit(3);
    if (el > KILL_TIMEOUT_S + SLACK_S)
        _exit(4);
    _exit(strstr(tkd_error_msg(), "rank 1") && strstr(tkd_error_msg(), "loss all-reduce") ? 0 : 5);
}

static void test_killed_rank_is_named(void **state)
{
    if (!need_two())
        skip();
    tkd_test_student_dir *f = *state;
    char dir[4300], job[64];
    snprintf(dir, sizeof dir, "%s/rdzv-kill", f->dir);
    snprintf(job, sizeof job, "kill-%ld", (long)getpid());
    assert_int_equal(tkd_mkdir_p(dir), TKD_OK);
    pid_t p[2];
    for (int r = 0; r < 2; r++)
        if ((p[r] = fork()) == 0)
            kill_rank_child(dir, r, job);
    int r0 = wait_child(p[0]), r1 = wait_child(p[1]);
    if (r1 != 1000 + SIGKILL) /* tkd_test_wait_timeout: 1000 + the signal */
        fail_msg("rank 1 should have died of SIGKILL, exited with %d", r1);
    const char *why[] = {"ok", "?", "setup failed", "the all-reduce succeeded without rank 1",
                         "the failure came after timeout + slack", "the message names no rank 1 or no operation"};
    if (r0 != 0)
        fail_msg("rank 0 exited with %d: %s", r0, r0 >= 0 && r0 < 6 ? why[r0] : "crashed");
}

/* ---- setup -------------------------------------------------------------------------------------------- */

static int setup(void **state)
{
    /* the demo-sized cache of test_gpu_train: V 512, T 64, top-16 + 8 tail draws */
    tkd_test_teacher_opts o = {.vocab = 512, .hidden = 32, .seq_len = 64, .k = 16, .tail_samples = 8,
                               .temperature = 1.0f, .num_seq = 1080, .shard_seqs = 256, .seed = 11};
    return tkd_test_student_setup(state, "gpu-dist", &o);
}

int main(void)
{
    if (!tkd_comm_built()) {
        printf("skipped: this build has no NCCL\n");
        return 77;
    }
    g_gpus = count_gpus(); /* in a child: this process must stay free of CUDA to fork */
    if (g_gpus <= 0) {
        printf("skipped: no GPU answers\n");
        return 77;
    }
    printf("%d GPU%s answer%s\n", g_gpus, g_gpus == 1 ? "" : "s", g_gpus == 1 ? "s" : "");
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_one_rank_nccl_is_bit_identical),
        cmocka_unit_test(test_one_rank_nccl_bf16_state_is_bit_identical),
        cmocka_unit_test(test_two_ranks_follow_one_gpu),
        cmocka_unit_test(test_killed_rank_is_named),
    };
    return cmocka_run_group_tests(tests, setup, tkd_test_student_teardown);
}
