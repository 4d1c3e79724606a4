/* test_common_dist.c — common/dist.h on the CPU: rank and world from the environment (good and bad
 * values), the rank-0 blob exchange by file and by TCP among forked processes (a rank that never
 * comes is named, a file or a client of another job is never taken, a wrong world size is a clear
 * error on both sides, SIGINT ends a wait), and heartbeats that name a late rank.
 * Timeouts are a second or less so the suite stays fast. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "common/dist.h"
#include "common/fileio.h"
#include "common/signals.h"
#include "tests/testutil.h"

/* ---- environment ------------------------------------------------------------------------------ */

static tkd_status info_of(const char *const *env, tkd_dist_info *d)
{
    tkd_test_env = env;
    memset(d, 0x55, sizeof *d);
    return tkd_dist_from_getenv(d, tkd_test_getenv);
}

static void assert_info(const tkd_dist_info *d, int rank, int world, int lr, int lw, const char *src)
{
    assert_int_equal(d->rank, rank);
    assert_int_equal(d->world, world);
    assert_int_equal(d->local_rank, lr);
    assert_int_equal(d->local_world, lw);
    assert_string_equal(tkd_dist_source_name(d->source), src);
}

static void test_env_good(void **state)
{
    (void)state;
    tkd_dist_info d;
    assert_int_equal(info_of((const char *[]){NULL}, &d), TKD_OK);
    assert_info(&d, 0, 1, 0, 1, "single");
    /* RANK alone defaults the local rank to the rank (one node) */
    assert_int_equal(info_of((const char *[]){"RANK", "2", "WORLD_SIZE", "3", NULL}, &d), TKD_OK);
    assert_info(&d, 2, 3, 2, 3, "env");
    assert_int_equal(info_of((const char *[]){"RANK", "5", "WORLD_SIZE", "8", "LOCAL_RANK", "1",
                                              "LOCAL_WORLD_SIZE", "4", NULL}, &d), TKD_OK);
    assert_info(&d, 5, 8, 1, 4, "env");
    /* srun: 11 tasks as 4, 4, 3 over three nodes; this is the third node's second task */
    assert_int_equal(info_of((const char *[]){"SLURM_PROCID", "9", "SLURM_NTASKS", "11", "SLURM_LOCALID", "1",
                                              "SLURM_NODEID", "2", "SLURM_STEP_TASKS_PER_NODE", "4(x2),3", NULL}, &d),
                     TKD_OK);
    assert_info(&d, 9, 11, 1, 3, "slurm");
    /* a launcher inside an allocation sets RANK for its children: it wins over the batch step's */
    assert_int_equal(info_of((const char *[]){"SLURM_PROCID", "0", "SLURM_NTASKS", "1", "RANK", "1",
                                              "WORLD_SIZE", "2", NULL}, &d), TKD_OK);
    assert_info(&d, 1, 2, 1, 2, "env");
    /* a batch script run without srun has SLURM_PROCID but no SLURM_NTASKS: one process */
    assert_int_equal(info_of((const char *[]){"SLURM_PROCID", "0", NULL}, &d), TKD_OK);
    assert_info(&d, 0, 1, 0, 1, "single");
}

static void test_env_bad(void **state)
{
    (void)state;
    tkd_dist_info d;
    struct { const char *env[9]; const char *msg; } bad[] = {
        {{"RANK", "1", NULL}, "RANK is set without WORLD_SIZE"},
        {{"WORLD_SIZE", "2", NULL}, "WORLD_SIZE is set without RANK"},
        {{"RANK", "x1", "WORLD_SIZE", "2", NULL}, "RANK=x1: not a number"},
        {{"RANK", "", "WORLD_SIZE", "2", NULL}, "WORLD_SIZE is set without RANK"}, /* empty = unset */
        {{"RANK", "0", "WORLD_SIZE", "0", NULL}, "WORLD_SIZE=0: not a number in 1.."},
        {{"RANK", "2", "WORLD_SIZE", "2", NULL}, "RANK=2 is not below WORLD_SIZE=2"},
        {{"RANK", "-1", "WORLD_SIZE", "2", NULL}, "RANK=-1"},
        {{"RANK", "0", "WORLD_SIZE", "4", "LOCAL_RANK", "2", "LOCAL_WORLD_SIZE", "2", NULL}, "LOCAL_RANK=2"},
        {{"SLURM_PROCID", "4", "SLURM_NTASKS", "4", NULL}, "SLURM_PROCID=4 is not below SLURM_NTASKS=4"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        assert_int_equal(info_of(bad[i].env, &d), TKD_ERR_CONFIG);
        tkd_test_assert_msg_has(bad[i].msg);
    }
}

/* ---- the exchange among forked ranks ------------------------------------------------------------ */

typedef struct rdzv_case {
    char *dir;
    tkd_rdzv_config c;
} rdzv_case;

static void case_begin(rdzv_case *rc, tkd_rdzv_kind kind, double timeout_s)
{
    rc->dir = tkd_test_mkdtemp("dist");
    rc->c = (tkd_rdzv_config){.kind = kind, .dir = rc->dir, .host = "127.0.0.1", .job_id = "job7",
                              .timeout_s = timeout_s};
    if (kind == TKD_RDZV_TCP)
        assert_int_equal(tkd_dist_free_port(&rc->c.port), TKD_OK);
}

static void case_end(rdzv_case *rc)
{
    tkd_test_rmdtemp(rc->dir);
}

static const char want_blob[] = "nccl-unique-id:0123456789abcdef";

/* One rank's side: returns its status; on success the blob must be rank 0's. */
static tkd_status one_rank(const tkd_rdzv_config *c, int rank, int world, size_t n)
{
    tkd_dist_info d = {.rank = rank, .world = world, .local_rank = rank, .local_world = world};
    char blob[64] = {0};
    if (rank == 0)
        memcpy(blob, want_blob, sizeof want_blob);
    tkd_status st = tkd_rdzv_share(c, &d, blob, n);
    if (st == TKD_OK && memcmp(blob, want_blob, n) != 0)
        st = tkd_error_set(TKD_ERR_INTERNAL, "rank %d received another blob", rank);
    return st;
}

/* Forks a rank; its status is its exit code (0 or -status) and its message goes to <dir>/msg-<tag>. */
static pid_t fork_rank(const rdzv_case *rc, const tkd_rdzv_config *c, int rank, int world, size_t n, const char *tag)
{
    fflush(NULL);
    pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid > 0)
        return pid;
    tkd_status st = one_rank(c, rank, world, n);
    tkd_file_write_atomic(tkd_test_path(rc->dir, tag), tkd_error_msg(), strlen(tkd_error_msg()));
    _exit(-st);
}

static char *msg_of(const rdzv_case *rc, const char *tag) { return tkd_test_slurp(tkd_test_path(rc->dir, tag), NULL); }

static void assert_child(const rdzv_case *rc, pid_t pid, tkd_status st, const char *tag, const char *needle)
{
    int code = tkd_test_wait_timeout(pid, 10.0);
    char *msg = msg_of(rc, tag);
    if (code != -st || (needle && !strstr(msg, needle)))
        fail_msg("%s: exit %d (want %d), message '%s' (want '%s')", tag, code, -st, msg, needle ? needle : "");
    free(msg);
}

/* Ranks 1..world-1 in children, rank 0 here: every rank holds the blob and no file is left. */
static void run_world(tkd_rdzv_kind kind, int world)
{
    rdzv_case rc;
    case_begin(&rc, kind, 5.0);
    pid_t pids[8];
    char tags[8][16];
    for (int r = 1; r < world; r++) {
        snprintf(tags[r], sizeof tags[r], "msg-%d", r);
        pids[r] = fork_rank(&rc, &rc.c, r, world, sizeof want_blob, tags[r]);
    }
    assert_int_equal(one_rank(&rc.c, 0, world, sizeof want_blob), TKD_OK);
    for (int r = 1; r < world; r++)
        assert_child(&rc, pids[r], TKD_OK, tags[r], NULL);
    assert_false(tkd_file_exists(tkd_test_path(rc.dir, ".rdzv-job7")));
    assert_false(tkd_file_exists(tkd_test_path(rc.dir, ".rdzv-job7.rank1")));
    case_end(&rc);
}

static void test_file_exchange(void **state)
{
    (void)state;
    run_world(TKD_RDZV_FILE, 4);
}

static void test_tcp_exchange(void **state)
{
    (void)state;
    run_world(TKD_RDZV_TCP, 4);
}

/* World 3 with rank 2 never started: rank 0 names it after the timeout; rank 1 got the blob. */
static void missing_rank(tkd_rdzv_kind kind)
{
    rdzv_case rc;
    case_begin(&rc, kind, 1.0);
    pid_t p1 = fork_rank(&rc, &rc.c, 1, 3, sizeof want_blob, "msg-1");
    assert_int_equal(one_rank(&rc.c, 0, 3, sizeof want_blob), TKD_ERR_IO);
    tkd_test_assert_msg_has("rendezvous: rank 2 of 3 did not arrive within 1 s");
    tkd_test_assert_msg_has("was every rank started");
    assert_child(&rc, p1, TKD_OK, "msg-1", NULL);
    /* and rank 0 itself missing: a rank names it */
    assert_int_equal(one_rank(&rc.c, 1, 3, sizeof want_blob), TKD_ERR_IO);
    tkd_test_assert_msg_has("rendezvous: rank 0 did not arrive within 1 s");
    case_end(&rc);
}

static void test_file_missing_rank(void **state)
{
    (void)state;
    missing_rank(TKD_RDZV_FILE);
}

static void test_tcp_missing_rank(void **state)
{
    (void)state;
    missing_rank(TKD_RDZV_TCP);
}

/* A blob file an older job left is never taken (rank 0 of this job is reported missing); one of
 * this job written for another world size is a mismatch naming both. */
static void test_file_stale_and_other_world(void **state)
{
    (void)state;
    rdzv_case rc;
    case_begin(&rc, TKD_RDZV_FILE, 0.5);
    static const char old[] = "topkd-rdzv 1 job=job6 world=2 n=32\nnccl-unique-id:0123456789abcdef";
    assert_int_equal(tkd_file_write_atomic(tkd_test_path(rc.dir, ".rdzv-job6"), old, sizeof old - 1), TKD_OK);
    assert_int_equal(one_rank(&rc.c, 1, 2, sizeof want_blob), TKD_ERR_IO);
    tkd_test_assert_msg_has("rank 0 did not arrive");
    assert_true(tkd_file_exists(tkd_test_path(rc.dir, ".rdzv-job6"))); /* not ours to remove */

    pid_t p0 = fork_rank(&rc, &rc.c, 0, 2, sizeof want_blob, "msg-0");
    assert_int_equal(one_rank(&rc.c, 1, 3, sizeof want_blob), TKD_ERR_MISMATCH);
    tkd_test_assert_msg_has("world=2");
    tkd_test_assert_msg_has("world=3");
    assert_child(&rc, p0, TKD_ERR_IO, "msg-0", "rank 1 of 2 did not arrive");
    case_end(&rc);
}

/* TCP: a rank started with another world size ends the exchange on both sides; a client of another
 * job is refused (its error says so) and rank 0 waits past it, noting it when it times out. */
static void test_tcp_other_world_and_job(void **state)
{
    (void)state;
    rdzv_case rc;
    case_begin(&rc, TKD_RDZV_TCP, 2.0);
    pid_t p1 = fork_rank(&rc, &rc.c, 1, 3, sizeof want_blob, "msg-1");
    assert_int_equal(one_rank(&rc.c, 0, 2, sizeof want_blob), TKD_ERR_MISMATCH);
    tkd_test_assert_msg_has("rank 1 (127.0.0.1:");
    tkd_test_assert_msg_has("runs with world 3");
    tkd_test_assert_msg_has("rank 0 with world 2");
    assert_child(&rc, p1, TKD_ERR_MISMATCH, "msg-1", "runs another world size");

    tkd_rdzv_config other = rc.c;
    other.job_id = "job8";
    pid_t stray = fork_rank(&rc, &other, 1, 2, sizeof want_blob, "msg-stray");
    rc.c.timeout_s = 1.0;
    assert_int_equal(one_rank(&rc.c, 0, 2, sizeof want_blob), TKD_ERR_IO);
    tkd_test_assert_msg_has("rank 1 of 2 did not arrive");
    tkd_test_assert_msg_has("refused 127.0.0.1:");
    tkd_test_assert_msg_has("of job job8 (this is job job7)");
    assert_child(&rc, stray, TKD_ERR_MISMATCH, "msg-stray", "belongs to another job");
    case_end(&rc);
}

/* SIGINT ends a rank's wait at once (here for a rank 0 that never comes, with a long timeout). */
static void interrupt_wait(tkd_rdzv_kind kind)
{
    rdzv_case rc;
    case_begin(&rc, kind, 60.0);
    fflush(NULL);
    pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        tkd_signals_install();
        _exit(-one_rank(&rc.c, 1, 2, sizeof want_blob));
    }
    nanosleep(&(struct timespec){0, 200000000}, NULL);
    kill(pid, SIGINT);
    assert_int_equal(tkd_test_wait_timeout(pid, 5.0), -TKD_ERR_INTERRUPTED);
    case_end(&rc);
}

static void test_interrupt_ends_wait(void **state)
{
    (void)state;
    interrupt_wait(TKD_RDZV_FILE);
    interrupt_wait(TKD_RDZV_TCP);
}

/* World 1 exchanges nothing; world > 1 without a job id is a config error. */
static void test_no_job_id(void **state)
{
    (void)state;
    rdzv_case rc;
    case_begin(&rc, TKD_RDZV_FILE, 0.2);
    assert_int_equal(one_rank(&rc.c, 0, 1, sizeof want_blob), TKD_OK);
    unsetenv("TKD_JOB_ID");
    unsetenv("SLURM_JOB_ID");
    unsetenv("TORCHELASTIC_RUN_ID");
    rc.c.job_id = NULL;
    assert_int_equal(one_rank(&rc.c, 1, 2, sizeof want_blob), TKD_ERR_CONFIG);
    tkd_test_assert_msg_has("no job id");
    setenv("SLURM_JOB_ID", "77", 1);
    setenv("SLURM_STEP_ID", "3", 1);
    char job[64];
    tkd_dist_job_id(job, sizeof job);
    assert_string_equal(job, "77.3");
    setenv("SLURM_RESTART_COUNT", "2", 1); /* a requeued job: not the first attempt's files */
    tkd_dist_job_id(job, sizeof job);
    assert_string_equal(job, "77.3.r2");
    setenv("SLURM_RESTART_COUNT", "0", 1);
    tkd_dist_job_id(job, sizeof job);
    assert_string_equal(job, "77.3");
    unsetenv("SLURM_RESTART_COUNT");
    setenv("TKD_JOB_ID", "a/b c", 1); /* the launcher's nonce wins; unsafe characters are replaced */
    tkd_dist_job_id(job, sizeof job);
    assert_string_equal(job, "a_b_c");
    unsetenv("TKD_JOB_ID");
    unsetenv("SLURM_JOB_ID");
    unsetenv("SLURM_STEP_ID");
    case_end(&rc);
}

static void test_rdzv_config_from_env(void **state)
{
    (void)state;
    tkd_rdzv_config c;
    unsetenv("MASTER_ADDR");
    unsetenv("MASTER_PORT");
    assert_int_equal(tkd_rdzv_config_from_env(&c, -1, "/runs/x", 5), TKD_OK);
    assert_int_equal(c.kind, TKD_RDZV_FILE);
    assert_int_equal(tkd_rdzv_config_from_env(&c, TKD_RDZV_TCP, "/runs/x", 5), TKD_ERR_CONFIG);
    tkd_test_assert_msg_has("MASTER_ADDR and MASTER_PORT");
    setenv("MASTER_ADDR", "node7", 1);
    setenv("MASTER_PORT", "29500", 1);
    assert_int_equal(tkd_rdzv_config_from_env(&c, -1, "/runs/x", 5), TKD_OK);
    assert_int_equal(c.kind, TKD_RDZV_TCP);
    assert_string_equal(c.host, "node7");
    assert_int_equal(c.port, 29500);
    assert_int_equal(tkd_rdzv_config_from_env(&c, TKD_RDZV_FILE, "/runs/x", 5), TKD_OK);
    assert_int_equal(c.kind, TKD_RDZV_FILE);
    setenv("MASTER_PORT", "70000", 1);
    assert_int_equal(tkd_rdzv_config_from_env(&c, -1, "/runs/x", 5), TKD_ERR_CONFIG);
    tkd_test_assert_msg_has("MASTER_PORT=70000");
    unsetenv("MASTER_ADDR");
    unsetenv("MASTER_PORT");
}

/* ---- heartbeats ------------------------------------------------------------------------------- */

static void test_heartbeats_name_late_ranks(void **state)
{
    const char *dir = *state; /* this test's own temp dir (TKD_TEST_EACH_DIR) */
    char buf[256];
    assert_int_equal(tkd_dist_beat(dir, 0, 41), TKD_OK);
    assert_int_equal(tkd_dist_beat(dir, 0, 42), TKD_OK);
    assert_int_equal(tkd_dist_beat(dir, 1, 42), TKD_OK);
    tkd_dist_late_ranks(dir, 2, 60, buf, sizeof buf);
    assert_string_equal(buf, "");
    /* rank 2 is a step behind, rank 3 never beat */
    assert_int_equal(tkd_dist_beat(dir, 2, 41), TKD_OK);
    tkd_dist_late_ranks(dir, 4, 60, buf, sizeof buf);
    assert_non_null(strstr(buf, "rank 2 (last step 41, 0 s ago)"));
    assert_non_null(strstr(buf, "rank 3 (no heartbeat)"));
    assert_null(strstr(buf, "rank 0"));
    assert_null(strstr(buf, "rank 1"));
    /* rank 1 at the same step but silent for 95 s (a hang): named by age */
    char line[64];
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    int len = snprintf(line, sizeof line, "step 42 time %.3f\n", (double)ts.tv_sec + ts.tv_nsec * 1e-9 - 95);
    assert_int_equal(tkd_file_write_atomic(tkd_test_path(dir, ".beat-rank1"), line, (size_t)len), TKD_OK);
    tkd_dist_late_ranks(dir, 2, 60, buf, sizeof buf);
    assert_string_equal(buf, "rank 1 (last step 42, 95 s ago)");
    /* a short buffer is cut, never overrun */
    char small[8];
    tkd_dist_late_ranks(dir, 4, 60, small, sizeof small);
    assert_int_equal(strlen(small), 7);
}

/* A heartbeat's temporary is never written through a link: a symbolic link planted under its name
 * (pointing at a user's file) makes the beat fail and leaves the file as it was. */
static void test_heartbeat_not_through_a_link(void **state)
{
    const char *dir = *state; /* this test's own temp dir (TKD_TEST_EACH_DIR) */
    char victim[4300];
    snprintf(victim, sizeof victim, "%s", tkd_test_path(dir, "thesis.tex"));
    tkd_test_write_text(victim, "three years of work\n");
    assert_int_equal(symlink(victim, tkd_test_path(dir, ".beat-rank0.tmp")), 0);
    assert_int_equal(tkd_dist_beat(dir, 0, 7), TKD_ERR_IO);
    tkd_test_assert_msg_has(".beat-rank0.tmp");
    char buf[64] = "";
    FILE *f = fopen(victim, "r");
    assert_non_null(f);
    assert_non_null(fgets(buf, sizeof buf, f));
    fclose(f);
    assert_string_equal(buf, "three years of work\n");
}

TKD_TEST_MAIN_EACH_DIR(test_env_good, test_env_bad, test_file_exchange, test_tcp_exchange, test_file_missing_rank,
    test_tcp_missing_rank, test_file_stale_and_other_world, test_tcp_other_world_and_job, test_interrupt_ends_wait,
    test_no_job_id, test_rdzv_config_from_env, test_heartbeats_name_late_ranks, test_heartbeat_not_through_a_link)
