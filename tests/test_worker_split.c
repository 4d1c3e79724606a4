/* test_worker_split.c — who a worker is, and the split it joins (issue 20, items 10 and 12):
 * - a half-set RANK/WORLD_SIZE, SLURM_PROCID/SLURM_NTASKS or LOCAL_RANK/LOCAL_WORLD_SIZE is an error
 *   naming the variable set and the one missing (never rank 0 of 1 in silence);
 * - a worker of another count, or of another split of the sequences, is refused before it writes,
 *   naming the file that records the other split and both counts; merge records the count;
 * - merge checks every shard's sha256 against the worker manifest that lists it, and refuses worker
 *   files of another split;
 * - `--nproc-per-node 2` where every worker fails at start-up prints one line, without "resume"
 *   (teacher-dump and student-train, which share the launcher);
 * - two workers merged write the same shard files, byte for byte, as one worker (issue 26).
 * The dumps are 18 windows of 16 tokens in shards of 4: workers of 2 cover [0, 8) and [8, 18),
 * workers of 3 [0, 4), [4, 12) and [12, 18). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "common/dist.h"
#include "common/fileio.h"
#include "teacher_cache/dump_merge.h"
#include "tests/dump_testutil.h"

#define BIN TKD_BINARY_DIR "/bin/teacher-dump"
#define STUDENT_BIN TKD_BINARY_DIR "/bin/student-train"

/* ---- half-set variables ------------------------------------------------------------------------ */

static tkd_status dist_of(const char *const *env, tkd_dist_info *d)
{
    tkd_test_env = env;
    return tkd_dist_from_getenv(d, tkd_test_getenv);
}

static void test_half_set_variables_are_refused(void **state)
{
    (void)state;
    static const struct {
        const char *env[7];
        const char *msg;
    } bad[] = {
        {{"SLURM_PROCID", "1", NULL}, "environment SLURM_PROCID=1 is set without SLURM_NTASKS"},
        {{"SLURM_NTASKS", "4", NULL}, "environment SLURM_NTASKS=4 is set without SLURM_PROCID"},
        {{"SLURM_NTASKS", "4", "SLURM_PROCID", "", NULL}, "SLURM_NTASKS=4 is set without SLURM_PROCID"},
        {{"LOCAL_RANK", "1", NULL}, "environment LOCAL_RANK=1 is set without RANK and WORLD_SIZE"},
        {{"LOCAL_WORLD_SIZE", "2", NULL}, "environment LOCAL_WORLD_SIZE=2 is set without RANK and WORLD_SIZE"},
        {{"RANK", "1", "SLURM_PROCID", "1", "SLURM_NTASKS", "2", NULL}, "RANK is set without WORLD_SIZE"},
        {{"WORLD_SIZE", "2", NULL}, "WORLD_SIZE is set without RANK"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        tkd_dist_info d;
        if (dist_of(bad[i].env, &d) != TKD_ERR_CONFIG)
            fail_msg("case %zu (%s) was accepted as rank %d of %d", i, bad[i].msg, d.rank, d.world);
        tkd_test_assert_msg_has(bad[i].msg);
    }
    /* what a batch script or salloc shell has without srun: one process, as before */
    static const char *const single[][5] = {
        {"SLURM_PROCID", "0", NULL}, {"SLURM_NTASKS", "1", NULL}, {"LOCAL_RANK", "0", "LOCAL_WORLD_SIZE", "1", NULL}};
    for (size_t i = 0; i < sizeof single / sizeof single[0]; i++) {
        tkd_dist_info d;
        assert_int_equal(dist_of(single[i], &d), TKD_OK);
        assert_int_equal(d.rank, 0);
        assert_int_equal(d.world, 1);
    }
}

/* ---- a worker of another split ------------------------------------------------------------------ */

typedef struct split_case {
    char out[4200];
    const char *tok;
    char tok_path[4200];
} split_case;

/* A split's files in dir (made when missing; a test's own temp dir, TKD_TEST_EACH_DIR): 300 random
 * tokens in <dir>/tok.npy, the cache <dir>/out. */
static void split_begin(split_case *c, const char *dir)
{
    assert_int_equal(tkd_mkdir_p(dir), TKD_OK);
    snprintf(c->out, sizeof c->out, "%s/out", dir);
    snprintf(c->tok_path, sizeof c->tok_path, "%s", tkd_dt_random_tokens(dir, "tok.npy", 300, 131, 3));
    c->tok = c->tok_path;
}

/* Runs worker index of count (count 1: a single run) with extra YAML; the status, message kept. */
static tkd_status run_worker(const split_case *c, int index, int count, const char *extra, bool overwrite)
{
    char more[512], yaml[16384];
    snprintf(more, sizeof more, "workers: {index: %d, count: %d}\n%s", index, count, extra ? extra : "");
    tkd_dt_small_yaml(yaml, sizeof yaml, TKD_DT_LLAMA, c->tok, c->out, more);
    tkd_dump_opts o = {.overwrite = overwrite};
    tkd_dump_summary s;
    return tkd_dt_run(yaml, &o, &s);
}

static void run_worker_ok(const split_case *c, int index, int count)
{
    if (run_worker(c, index, count, NULL, false) != TKD_OK)
        fail_msg("worker %d of %d: %s", index, count, tkd_error_msg());
}

/* A split in dir whose both workers of 2 have finished (not merged). */
static void two_workers_done(split_case *c, const char *dir)
{
    split_begin(c, dir);
    run_worker_ok(c, 0, 2);
    run_worker_ok(c, 1, 2);
}

static void assert_refused(tkd_status st, const char *what)
{
    if (st != TKD_ERR_MISMATCH)
        fail_msg("%s: status %d, not refused (%s)", what, st, st ? tkd_error_msg() : "accepted");
}

static int exists(const char *dir, const char *name) { return access(tkd_test_path(dir, name), F_OK) == 0; }

/* RANK=1 WORLD_SIZE=3 (and 2 of 3, and a single run) into a cache being made by 2 workers: refused
 * before writing anything, naming the file and both counts; the 2-worker cache then completes. */
static void test_worker_of_another_count_is_refused(void **state)
{
    split_case c;
    split_begin(&c, *state);
    run_worker_ok(&c, 0, 2);
    assert_refused(run_worker(&c, 1, 3, NULL, false), "worker 1 of 3");
    tkd_test_assert_msg_has("manifest.worker-0.yaml: records worker 0 of 2, but this run is worker 1 of 3 — ");
    tkd_test_assert_msg_has("run it as one of 2 workers");
    tkd_test_assert_msg_has("--overwrite on every worker, or use another output.dir");
    assert_refused(run_worker(&c, 2, 3, NULL, false), "worker 2 of 3");
    assert_false(exists(c.out, "manifest.worker-2.yaml"));
    assert_int_equal(tkd_dt_count_suffix(c.out, ".h5"), 2); /* worker 0's shards, no others */
    /* a single run would rewrite the shards the workers list */
    assert_refused(run_worker(&c, 0, 1, NULL, false), "a single run");
    tkd_test_assert_msg_has("records worker 0 of 2, but this run is one worker");
    assert_false(exists(c.out, "manifest.yaml"));

    run_worker_ok(&c, 1, 2);
    /* a finished worker's marker records the count too */
    assert_int_equal(unlink(tkd_test_path(c.out, "manifest.worker-0.yaml")), 0);
    assert_int_equal(unlink(tkd_test_path(c.out, "manifest.worker-1.yaml")), 0);
    assert_refused(run_worker(&c, 0, 3, NULL, false), "worker 0 of 3 beside markers");
    tkd_test_assert_msg_has("worker-0.done: records worker 0 of 2, but this run is worker 0 of 3");
}

/* Same count, another split of the sequences (data.max_sequences changed for one worker). */
static void test_worker_of_another_range_is_refused(void **state)
{
    split_case c;
    split_begin(&c, *state);
    run_worker_ok(&c, 0, 2);
    assert_refused(run_worker(&c, 1, 2, "data: {max_sequences: 10}\n", false), "worker 1 of 2 over 10 sequences");
    tkd_test_assert_msg_has("manifest.worker-0.yaml: records sequences [0, 8) for worker 0 of 2, where this config "
                            "gives that worker [0, 4) — ");
    assert_false(exists(c.out, "manifest.worker-1.yaml"));
}

/* merge records the count; a worker of another count is refused by manifest.yaml alone; one
 * written by a single run refuses any worker; an older manifest.yaml (no `workers` key) beside
 * worker manifests of this count is taken as merged from them. */
static void test_merged_manifest_records_the_count(void **state)
{
    split_case c;
    two_workers_done(&c, *state);
    assert_int_equal(tkd_dump_merge(c.out, NULL, NULL), TKD_OK);
    tkd_cache_manifest m;
    assert_int_equal(tkd_cache_manifest_read(&m, tkd_test_path(c.out, "manifest.yaml")), TKD_OK);
    assert_int_equal(m.workers, 2);
    run_worker_ok(&c, 1, 2); /* the same split again: nothing to do */
    run_worker_ok(&c, 0, 1); /* one worker continues the merged cache */

    /* an older merge: no `workers` key */
    m.workers = 0;
    assert_int_equal(tkd_cache_manifest_write(&m, tkd_test_path(c.out, "manifest.yaml")), TKD_OK);
    run_worker_ok(&c, 0, 2);
    m.workers = 2;
    assert_int_equal(tkd_cache_manifest_write(&m, tkd_test_path(c.out, "manifest.yaml")), TKD_OK);
    tkd_cache_manifest_free(&m);

    static const char *const parts[] = {"manifest.worker-0.yaml", "manifest.worker-1.yaml", "worker-0.done",
                                        "worker-1.done"};
    for (size_t i = 0; i < 4; i++)
        assert_int_equal(unlink(tkd_test_path(c.out, parts[i])), 0);
    assert_refused(run_worker(&c, 2, 3, NULL, false), "worker 2 of 3 over a merge of 2");
    tkd_test_assert_msg_has("manifest.yaml: was merged from 2 workers, but this run is worker 2 of 3 — ");
    assert_false(exists(c.out, "manifest.worker-2.yaml"));

    split_begin(&c, tkd_test_path(*state, "single")); /* a second cache beside */
    run_worker_ok(&c, 0, 1);
    assert_refused(run_worker(&c, 1, 2, NULL, false), "worker 1 of 2 over a single run's cache");
    tkd_test_assert_msg_has("manifest.yaml: was written by one worker, but this run is worker 1 of 2 — ");
    tkd_test_assert_msg_has("run it as 1 worker");
}

/* ---- merge ------------------------------------------------------------------------------------- */

/* Flips one byte in the middle of a file (its size stays). */
static void flip_byte(const char *path)
{
    FILE *f = fopen(path, "r+b");
    assert_non_null(f);
    assert_int_equal(fseek(f, 0, SEEK_END), 0);
    long mid = ftell(f) / 2;
    assert_int_equal(fseek(f, mid, SEEK_SET), 0);
    int b = fgetc(f);
    assert_int_equal(fseek(f, mid, SEEK_SET), 0);
    fputc(b ^ 0x5a, f);
    assert_int_equal(fclose(f), 0);
}

static void test_merge_checks_every_sha256(void **state)
{
    split_case c;
    two_workers_done(&c, *state);
    /* one byte of a shard, same size */
    char shard[4300];
    snprintf(shard, sizeof shard, "%s", tkd_test_path(c.out, "shard-00003.h5"));
    flip_byte(shard);
    assert_int_equal(tkd_dump_merge(c.out, NULL, NULL), TKD_ERR_CHECKSUM);
    tkd_test_assert_msg_has("shard-00003.h5: listed by worker 1 of 2 (");
    tkd_test_assert_msg_has("manifest.worker-1.yaml) but not as listed: ");
    tkd_test_assert_msg_has("re-run that worker with workers.index=1");
    assert_false(exists(c.out, "manifest.yaml"));
    flip_byte(shard); /* back as it was */
    assert_int_equal(tkd_dump_merge(c.out, NULL, NULL), TKD_OK);
    assert_int_equal(unlink(tkd_test_path(c.out, "manifest.yaml")), 0);

    /* the manifest's sha256 edited instead */
    tkd_cache_manifest m;
    const char *w0 = tkd_test_path(c.out, "manifest.worker-0.yaml");
    char w0_path[4300];
    snprintf(w0_path, sizeof w0_path, "%s", w0);
    assert_int_equal(tkd_cache_manifest_read(&m, w0_path), TKD_OK);
    m.shards[1].sha256[0] = m.shards[1].sha256[0] == '0' ? '1' : '0';
    assert_int_equal(tkd_cache_manifest_write(&m, w0_path), TKD_OK);
    tkd_cache_manifest_free(&m);
    assert_int_equal(tkd_dump_merge(c.out, NULL, NULL), TKD_ERR_CHECKSUM);
    tkd_test_assert_msg_has("shard-00001.h5: listed by worker 0 of 2 (");
    assert_false(exists(c.out, "manifest.yaml"));
}

/* A marker of 3 workers left beside 2 workers' parts: merge refuses the directory's two splits,
 * naming it. */
static void test_merge_refuses_two_splits(void **state)
{
    split_case c;
    two_workers_done(&c, *state);
    tkd_test_write_text(tkd_test_path(c.out, "worker-2.done"), "worker: 2\nworkers: 3\nfirst_seq: 12\nend_seq: 18\n");
    assert_int_equal(tkd_dump_merge(c.out, NULL, NULL), TKD_ERR_MISMATCH);
    tkd_test_assert_msg_has("worker-2.done: records worker 2 of 3, but ");
    tkd_test_assert_msg_has("manifest.worker-0.yaml records a split into 2 workers — ");
    assert_false(exists(c.out, "manifest.yaml"));
}

/* What the refusal advises works: every worker of a new count with --overwrite leaves nothing of
 * the old split, and merge joins the new one into the same cache. */
static void test_overwrite_on_every_worker_starts_a_new_split(void **state)
{
    split_case c;
    split_begin(&c, *state);
    for (int i = 0; i < 3; i++)
        run_worker_ok(&c, i, 3);
    assert_int_equal(tkd_dump_merge(c.out, NULL, NULL), TKD_OK);
    char ref[4300];
    snprintf(ref, sizeof ref, "%s/ref", (const char *)*state);
    assert_int_equal(rename(c.out, ref), 0);
    for (int i = 0; i < 3; i++)
        run_worker_ok(&c, i, 3);
    assert_refused(run_worker(&c, 0, 2, NULL, false), "worker 0 of 2 over 3 workers' parts");
    for (int i = 0; i < 2; i++)
        if (run_worker(&c, i, 2, NULL, true) != TKD_OK)
            fail_msg("worker %d of 2 with --overwrite: %s", i, tkd_error_msg());
    assert_false(exists(c.out, "manifest.worker-2.yaml"));
    assert_false(exists(c.out, "worker-2.done"));
    assert_int_equal(tkd_dump_merge(c.out, NULL, NULL), TKD_OK);
    tkd_dt_assert_same_cache(ref, c.out);
}

/* A dump split over two workers and merged writes the very files one worker writes (issue 26): the
 * same shards, equal byte for byte, with equal sha256 in the manifests; a second later, so that a
 * time recorded in a shard would show. */
static void test_split_gives_the_same_files(void **state)
{
    split_case c;
    split_begin(&c, *state);
    run_worker_ok(&c, 0, 1);
    char ref[4300];
    snprintf(ref, sizeof ref, "%s", tkd_test_path(*state, "ref"));
    assert_int_equal(rename(c.out, ref), 0);
    tkd_dt_next_second();
    run_worker_ok(&c, 0, 2);
    run_worker_ok(&c, 1, 2);
    assert_int_equal(tkd_dump_merge(c.out, NULL, NULL), TKD_OK);
    tkd_dt_assert_same_bytes(ref, c.out);
}

/* ---- the launcher's one line -------------------------------------------------------------------- */

/* The lines of a file. */
static int count_lines(const char *text)
{
    int n = 0;
    for (const char *p = text; *p; p++)
        n += *p == '\n';
    return n;
}

/* Every worker fails at start-up (a teacher that is not there): one line on stderr, naming the
 * worker and its error, without resume advice (nothing was written to resume), and no output.dir
 * left behind. */
static void test_nproc_start_failure_is_one_line(void **state)
{
    const char *dir = *state; /* this test's own temp dir (TKD_TEST_EACH_DIR) */
    const char *cfg = tkd_dt_cli_config(dir, 5, "");
    char out[4400], teacher[4400], err[4400];
    snprintf(out, sizeof out, "output.dir=%s/out", dir);
    snprintf(teacher, sizeof teacher, "teacher.path=%s/no-teacher", dir);
    snprintf(err, sizeof err, "%s/launch.err", dir);
    const char *args[] = {"-q", "--config", cfg, "--set", out, "--set", teacher, "--nproc-per-node", "2", NULL};
    int rc = tkd_test_run(BIN, args, NULL, err);
    char *text = tkd_test_slurp(err, NULL);
    if (rc == 0 || count_lines(text) != 1 || !strstr(text, "no-teacher") || strstr(text, "resume") ||
        !strstr(text, "teacher-dump: worker ") || !strstr(text, " failed with exit code "))
        fail_msg("exit %d, stderr not one line naming the worker and its error:\n%s", rc, text);
    free(text);
    /* the launcher made output.dir for the workers: nothing was written, so it is gone again */
    assert_false(tkd_file_exists(tkd_test_path(dir, "out")));

    /* the same through a half-set variable: one line, exit 2 */
    const char *plain[] = {"--config", cfg, "--set", out, NULL};
    rc = tkd_test_run(BIN, plain, "SLURM_PROCID=1", err);
    text = tkd_test_slurp(err, NULL);
    if (rc != 2 || count_lines(text) != 1 || !strstr(text, "SLURM_PROCID=1 is set without SLURM_NTASKS"))
        fail_msg("SLURM_PROCID alone: exit %d:\n%s", rc, text);
    free(text);
}

/* student-train shares the launcher: two ranks that cannot start (here a cache that is not there,
 * and on a build without CUDA, no device for two ranks) give one line too. */
static void test_student_nproc_start_failure_is_one_line(void **state)
{
    const char *dir = *state; /* this test's own temp dir (TKD_TEST_EACH_DIR) */
    char run_dir[4400], cache[4400], err[4400];
    snprintf(run_dir, sizeof run_dir, "run.dir=%s/runs", dir);
    snprintf(cache, sizeof cache, "data.cache=%s/no-cache", dir);
    snprintf(err, sizeof err, "%s/launch.err", dir);
    const char *args[] = {"-q", "--config", tkd_test_src("../configs/student-demo.yaml"), "--set", run_dir, "--set", cache,
                          "--nproc-per-node", "2", NULL};
    int rc = tkd_test_run(STUDENT_BIN, args, NULL, err);
    char *text = tkd_test_slurp(err, NULL);
    if (rc == 0 || count_lines(text) != 1 || strstr(text, "resume") || !strstr(text, "student-train: worker ") ||
        !strstr(text, " failed with exit code "))
        fail_msg("exit %d, stderr not one line naming the worker and its error:\n%s", rc, text);
    free(text);
}

TKD_TEST_MAIN_EACH_DIR(test_half_set_variables_are_refused, test_worker_of_another_count_is_refused,
    test_worker_of_another_range_is_refused, test_merged_manifest_records_the_count,
    test_merge_checks_every_sha256, test_merge_refuses_two_splits,
    test_overwrite_on_every_worker_starts_a_new_split, test_split_gives_the_same_files,
    test_nproc_start_failure_is_one_line, test_student_nproc_start_failure_is_one_line)
