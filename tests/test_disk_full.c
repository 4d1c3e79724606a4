/* test_disk_full.c — a full disk never leaves a half-written file where a later run would trust it.
 *
 * Each test mounts its own small tmpfs under /tmp (root only: CI and the dev machine run as root;
 * anyone else gets exit 77 with the reason) and fills it:
 * - teacher-dump (child process) on a tmpfs too small for the cache, at several sizes so that the
 *   disk fills before a shard, while one is flushed and while the manifest is rewritten: exit 1,
 *   one stderr line saying "disk full" and naming the directory, no temporary left, the manifest
 *   lists only whole shards with matching sha256; after growing the tmpfs a re-run completes the
 *   cache and equals an uninterrupted run;
 * - a checkpoint saved with less room than it needs (every 4 KiB step from none to enough): NOSPACE
 *   naming the directory, the previous checkpoint loads with its values, no temporary directory;
 * - tkd_file_write_atomic and tkd_cache_manifest_write: NOSPACE, old file intact, no temporary;
 * - the shard writer in process: NOSPACE, no .tmp, and HDF5 still works afterwards and exits
 *   cleanly (HDF5 1.10 keeps a freed file ID when a close fails, then crashes at exit).
 * The tmpfs are unmounted in each test's teardown, the group teardown and at exit. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include "common/fileio.h"
#include "formats/cache_manifest.h"
#include "formats/cache_shard.h"
#include "student_train/checkpoint.h"
#include "tests/dump_testutil.h"

#define BIN TKD_BINARY_DIR "/bin/teacher-dump"

/* ---- tmpfs mounts ---------------------------------------------------------------------------- */

#define MAX_MOUNTS 8
static char mounts[MAX_MOUNTS][64];

static void umount_all(void)
{
    for (int i = 0; i < MAX_MOUNTS; i++) {
        if (!mounts[i][0])
            continue;
        umount2(mounts[i], MNT_DETACH); /* EINVAL when the mount failed: nothing to undo */
        rmdir(mounts[i]);
        mounts[i][0] = 0;
    }
}

static int teardown_mounts(void **state)
{
    (void)state;
    umount_all();
    return 0;
}

/* A fresh tmpfs of size_kb KiB on a new directory /tmp/topkd-diskfull-XXXXXX; returns its path. */
static const char *tmpfs_mount(int size_kb)
{
    int i = 0;
    while (i < MAX_MOUNTS && mounts[i][0])
        i++;
    assert_true(i < MAX_MOUNTS);
    snprintf(mounts[i], sizeof mounts[i], "/tmp/topkd-diskfull-XXXXXX");
    if (!mkdtemp(mounts[i])) {
        mounts[i][0] = 0;
        fail_msg("cannot create a mount point under /tmp");
    }
    char cmd[256];
    snprintf(cmd, sizeof cmd, "mount -t tmpfs -o size=%dk tmpfs '%s'", size_kb, mounts[i]);
    if (system(cmd) != 0)
        fail_msg("'%s' failed (this test needs root and the mount command)", cmd);
    return mounts[i];
}

static void tmpfs_resize(const char *mnt, int size_kb)
{
    char cmd[256];
    snprintf(cmd, sizeof cmd, "mount -o remount,size=%dk '%s'", size_kb, mnt);
    if (system(cmd) != 0)
        fail_msg("'%s' failed", cmd);
}

/* Replaces <mnt>/ballast by a file that leaves exactly keep_kb KiB free (keep_kb a multiple of 4:
 * tmpfs counts whole 4 KiB pages), so the next writer runs out of room. */
static void ballast(const char *mnt, long keep_kb)
{
    char path[256];
    snprintf(path, sizeof path, "%s/ballast", mnt);
    unlink(path);
    struct statvfs sv;
    assert_int_equal(statvfs(mnt, &sv), 0);
    long long room = (long long)sv.f_bavail * (long long)sv.f_frsize - keep_kb * 1024LL;
    assert_true(room >= 0);
    FILE *f = fopen(path, "wb");
    assert_non_null(f);
    static char zeros[1 << 16];
    for (long long left = room; left > 0;) {
        size_t n = left < (long long)sizeof zeros ? (size_t)left : sizeof zeros;
        assert_int_equal(fwrite(zeros, 1, n, f), n);
        left -= (long long)n;
    }
    assert_int_equal(fclose(f), 0);
    assert_int_equal(statvfs(mnt, &sv), 0);
    assert_int_equal((long long)sv.f_bavail * (long long)sv.f_frsize, keep_kb * 1024LL);
}

/* Entries of dir whose name contains ".tmp" or ends in ".old" (leftovers of an interrupted write). */
static long long leftover(const char *path, const char *name, void *ctx)
{
    (void)ctx;
    size_t len = strlen(name);
    if (!strstr(name, ".tmp") && !(len > 4 && strcmp(name + len - 4, ".old") == 0))
        return 0;
    printf("# leftover %s\n", path);
    return 1;
}

static int count_leftovers(const char *dir)
{
    return (int)tkd_test_dir_sum(dir, leftover, NULL);
}

/* The calling thread's message says "disk full" and names `path`. */
static void assert_disk_full_msg(const char *path)
{
    const char *msg = tkd_error_msg();
    if (!strstr(msg, "disk full") || !strstr(msg, path) || strchr(msg, '\n'))
        fail_msg("expected one line saying 'disk full' and naming %s, got: %s", path, msg);
}

/* ---- teacher-dump ----------------------------------------------------------------------------- */

/* Runs teacher-dump -q --config cfg --set output.dir=out, stderr and stdout to err_path; returns the
 * exit code, or 1000 + the signal that killed it. */
static int run_dump(const char *cfg, const char *out, const char *err_path)
{
    char set[4400];
    snprintf(set, sizeof set, "output.dir=%s", out);
    return tkd_test_run(BIN, (const char *[]){"-q", "--config", cfg, "--set", set, NULL}, NULL, err_path);
}

/* stderr (quiet mode) is error lines only, each "teacher-dump: ...", and exactly one of them says the
 * disk is full and names the output directory. */
static void assert_dump_disk_full(const char *err_path, const char *out)
{
    char *err = tkd_test_read_file(err_path, NULL);
    assert_non_null(err);
    int full_lines = 0;
    for (char *line = strtok(err, "\n"); line; line = strtok(NULL, "\n")) {
        if (strncmp(line, "teacher-dump: ", 14) != 0)
            fail_msg("not a teacher-dump error line (a message broke across lines?): %s", line);
        if (strstr(line, "disk full") || strstr(line, "No space left")) {
            full_lines++;
            if (!strstr(line, out))
                fail_msg("the disk-full line does not name %s: %s", out, line);
        }
    }
    free(err);
    assert_int_equal(full_lines, 1);
}

/* The manifest, when there is one, reads back and every shard it lists has its size and sha256.
 * Returns the number of listed shards. */
static int64_t check_listed_shards(const char *out)
{
    char path[4300];
    assert_true(snprintf(path, sizeof path, "%s/manifest.yaml", out) < (int)sizeof path);
    if (!tkd_file_exists(path))
        return 0;
    tkd_cache_manifest m;
    if (tkd_cache_manifest_read(&m, path) != TKD_OK)
        fail_msg("%s", tkd_error_msg());
    for (int64_t i = 0; i < m.num_shards; i++)
        if (tkd_cache_manifest_verify_shard(out, &m.shards[i]) != TKD_OK)
            fail_msg("%s", tkd_error_msg());
    int64_t n = m.num_shards;
    tkd_cache_manifest_free(&m);
    return n;
}

/* 18 windows of 16 tokens in shards of 4 (five shards of about 19.5 KB each, 100 KB in all). The
 * tmpfs sizes put the failure at different places: 8 KiB before shard 0 is created (too little room
 * to start), 24 KiB while the manifest listing shard 0 is written, 40 KiB while shard 1 is flushed
 * (shard 0 listed), 64 KiB while the manifest listing shard 1 is written. Which one it is does not
 * change what must hold. */
static void test_teacher_dump_disk_full(void **state)
{
    (void)state;
    char *dir = tkd_test_mkdtemp("diskfull-dump");
    const char *cfg = tkd_dt_cli_config(dir, 5, "");
    char ref[4300], err[4300];
    snprintf(ref, sizeof ref, "%s/ref", dir);
    snprintf(err, sizeof err, "%s/ref.err", dir);
    assert_int_equal(run_dump(cfg, ref, err), 0);

    const int sizes_kb[] = {8, 24, 40, 64};
    for (size_t i = 0; i < sizeof sizes_kb / sizeof *sizes_kb; i++) {
        const char *mnt = tmpfs_mount(sizes_kb[i]);
        char out[4300];
        snprintf(out, sizeof out, "%s/cache", mnt);
        snprintf(err, sizeof err, "%s/full-%d.err", dir, sizes_kb[i]);
        int rc = run_dump(cfg, out, err);
        int64_t listed = check_listed_shards(out);
        printf("# tmpfs %d KiB: exit %d, %lld shards listed\n", sizes_kb[i], rc, (long long)listed);
        assert_int_equal(rc, 1);
        assert_dump_disk_full(err, out);
        assert_int_equal(count_leftovers(out), 0);
        assert_true(listed < 5);
        if (sizes_kb[i] >= 40)
            assert_true(listed >= 1); /* room for the first shard: it was kept */

        tmpfs_resize(mnt, 1024);
        snprintf(err, sizeof err, "%s/resume-%d.err", dir, sizes_kb[i]);
        assert_int_equal(run_dump(cfg, out, err), 0);
        assert_int_equal(count_leftovers(out), 0);
        tkd_dt_assert_same_cache(ref, out);
        umount_all();
    }
    tkd_test_rmdtemp(dir);
}

/* ---- student-train checkpoints ------------------------------------------------------------------ */

/* A tiny random Llama student (a checkpoint of about 53 KB) and its AdamW with made-up moments. */
static void tiny_student(tkd_model **m, tkd_adamw **opt)
{
    tkd_model_config mc;
    tkd_test_tiny_llama(&mc, 64, 16, 1, 32);
    mc.tie_word_embeddings = 0;
    assert_int_equal(tkd_model_init_random(&mc, 3, m), TKD_OK);
    tkd_optim_config oc;
    tkd_optim_config_defaults(&oc);
    assert_int_equal(tkd_adamw_init(&oc, (*m)->n_params, opt), TKD_OK);
    for (size_t i = 0; i < (*opt)->n; i++) {
        (*opt)->m[i] = 0.001f * (float)(i % 17);
        (*opt)->v[i] = 0.0001f * (float)(i % 13);
    }
}

/* Sum of the sizes of the regular files in dir. */
static long long file_bytes(const char *path, const char *name, void *ctx)
{
    (void)ctx;
    uint64_t sz = 0;
    return name[0] != '.' && tkd_file_size(path, &sz) == TKD_OK ? (long long)sz : 0;
}

static uint64_t dir_bytes(const char *dir)
{
    return (uint64_t)tkd_test_dir_sum(dir, file_bytes, NULL);
}

/* Loads ckpt into a fresh student and checks it holds params / moments / step. */
static void assert_checkpoint_is(const char *ckpt, const float *params, const tkd_adamw *want, int64_t step)
{
    tkd_model *m = NULL;
    tkd_adamw *opt = NULL;
    tiny_student(&m, &opt);
    memset(m->params, 0, m->n_params * sizeof(float));
    tkd_train_state st;
    memset(&st, 0, sizeof st);
    if (tkd_checkpoint_load(ckpt, m, opt, &st) != TKD_OK)
        fail_msg("%s", tkd_error_msg());
    assert_memory_equal(m->params, params, m->n_params * sizeof(float));
    assert_memory_equal(opt->m, want->m, opt->n * sizeof(float));
    assert_memory_equal(opt->v, want->v, opt->n * sizeof(float));
    assert_int_equal(st.step, step);
    assert_int_equal(opt->step, step);
    tkd_adamw_free(opt);
    tkd_model_free(m);
}

/* Checkpoint 1 is written with room; then checkpoint 2 with 0, 4, 8, ... KiB free until it fits, so
 * the disk fills in each of its files in turn (config.json, model.safetensors, optimizer, state). */
static void test_checkpoint_disk_full(void **state)
{
    (void)state;
    const char *mnt = tmpfs_mount(512);
    char ckpt[256];
    snprintf(ckpt, sizeof ckpt, "%s/checkpoint", mnt);
    tkd_model *m = NULL;
    tkd_adamw *opt = NULL;
    tiny_student(&m, &opt);
    tkd_train_state st = {.step = 1, .epoch = 0, .offset = 4, .tokens_seen = 64};
    opt->step = 1;
    assert_int_equal(tkd_checkpoint_save(ckpt, m, opt, &st, "train: {max_steps: 2}\n"), TKD_OK);
    float *params1 = malloc(m->n_params * sizeof(float));
    assert_non_null(params1);
    memcpy(params1, m->params, m->n_params * sizeof(float));
    tkd_adamw *opt1 = NULL;
    tkd_model *m1 = NULL;
    tiny_student(&m1, &opt1); /* the same moments as checkpoint 1 */
    tkd_model_free(m1);
    uint64_t ck_kb = dir_bytes(ckpt) / 1024;
    printf("# checkpoint: %llu KiB\n", (unsigned long long)ck_kb);
    assert_true(ck_kb >= 16);

    /* step 2: other weights and moments */
    for (size_t i = 0; i < m->n_params; i++)
        m->params[i] += 0.5f;
    for (size_t i = 0; i < opt->n; i++)
        opt->m[i] += 1.0f;
    opt->step = 2;
    st.step = 2;
    int failures = 0, saved = 0;
    for (long keep_kb = 0; keep_kb <= (long)ck_kb + 32 && !saved; keep_kb += 4) {
        ballast(mnt, keep_kb);
        tkd_status s = tkd_checkpoint_save(ckpt, m, opt, &st, "train: {max_steps: 2}\n");
        assert_int_equal(count_leftovers(mnt), 0);
        if (s == TKD_OK) {
            saved = 1;
            assert_checkpoint_is(ckpt, m->params, opt, 2);
            break;
        }
        assert_int_equal(s, TKD_ERR_NOSPACE);
        assert_disk_full_msg(ckpt);
        failures++;
        assert_checkpoint_is(ckpt, params1, opt1, 1);
    }
    printf("# %d disk-full saves before one fitted\n", failures);
    assert_true(saved);
    assert_true(failures >= (int)(ck_kb / 4) - 2); /* every step short of the size failed */
    free(params1);
    tkd_adamw_free(opt1);
    tkd_adamw_free(opt);
    tkd_model_free(m);
    umount_all();
}

/* ---- atomic files and the manifest ------------------------------------------------------------ */

static void test_file_write_atomic_disk_full(void **state)
{
    (void)state;
    const char *mnt = tmpfs_mount(128);
    char path[256];
    snprintf(path, sizeof path, "%s/notes.txt", mnt);
    assert_int_equal(tkd_file_write_atomic(path, "old contents\n", 13), TKD_OK);
    size_t big_n = 40 * 1024;
    char *big = malloc(big_n);
    assert_non_null(big);
    memset(big, 'x', big_n);
    for (long keep_kb = 0; keep_kb <= 36; keep_kb += 12) {
        ballast(mnt, keep_kb);
        assert_int_equal(tkd_file_write_atomic(path, big, big_n), TKD_ERR_NOSPACE);
        assert_disk_full_msg(path);
        assert_int_equal(count_leftovers(mnt), 0);
        size_t len = 0;
        char *text = tkd_test_read_file(path, &len);
        assert_non_null(text);
        assert_string_equal(text, "old contents\n");
        free(text);
    }
    free(big);
    umount_all();
}

static const char hex_a[] = "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa";
static const char hex_b[] = "bbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbb";

static void fill_identity(tkd_cache_identity *id)
{
    memset(id, 0, sizeof *id);
    id->vocab_size = 131;
    id->k = 8;
    id->seq_len = 16;
    id->temperature = 1.0f;
    id->logits_dtype = TKD_CACHE_DTYPE_HALF;
    memcpy(id->teacher_sha256, hex_a, sizeof hex_a);
    memcpy(id->dataset_sha256, hex_b, sizeof hex_b);
}

/* A manifest with n shards of 4 sequences (file names and digests made up: nothing reads them). */
static void make_manifest(tkd_cache_manifest *m, int n)
{
    tkd_cache_manifest_init(m);
    fill_identity(&m->id);
    m->dataset_tokens = 300;
    m->stride = 16;
    assert_int_equal(tkd_cache_manifest_set_str(&m->teacher_path, "/teachers/tiny"), TKD_OK);
    assert_int_equal(tkd_cache_manifest_set_str(&m->teacher_arch, "LlamaForCausalLM"), TKD_OK);
    assert_int_equal(tkd_cache_manifest_set_str(&m->dataset_path, "/data/tok.npy"), TKD_OK);
    assert_int_equal(tkd_cache_manifest_set_str(&m->tool_version, "test"), TKD_OK);
    for (int i = 0; i < n; i++) {
        tkd_cache_shard_entry e;
        memset(&e, 0, sizeof e);
        snprintf(e.file, sizeof e.file, "shard-%05d.h5", i);
        e.first_seq = 4 * i;
        e.num_seq = 4;
        e.bytes = 19000 + (uint64_t)i;
        memcpy(e.sha256, hex_a, sizeof hex_a);
        assert_int_equal(tkd_cache_manifest_add_shard(m, &e), TKD_OK);
    }
}

/* The old manifest (one shard) survives a rewrite that runs out of room (300 shards: about 40 KB). */
static void test_manifest_write_disk_full(void **state)
{
    (void)state;
    const char *mnt = tmpfs_mount(128);
    char path[256];
    snprintf(path, sizeof path, "%s/manifest.yaml", mnt);
    tkd_cache_manifest small, big, back;
    make_manifest(&small, 1);
    make_manifest(&big, 300);
    assert_int_equal(tkd_cache_manifest_write(&small, path), TKD_OK);
    for (long keep_kb = 0; keep_kb <= 24; keep_kb += 8) {
        ballast(mnt, keep_kb);
        assert_int_equal(tkd_cache_manifest_write(&big, path), TKD_ERR_NOSPACE);
        assert_disk_full_msg(path);
        assert_int_equal(count_leftovers(mnt), 0);
        assert_int_equal(tkd_cache_manifest_read(&back, path), TKD_OK);
        assert_int_equal(back.num_shards, 1);
        assert_int_equal(back.shards[0].bytes, 19000);
        tkd_cache_manifest_free(&back);
    }
    tkd_cache_manifest_free(&small);
    tkd_cache_manifest_free(&big);
    umount_all();
}

/* ---- the shard writer in process ---------------------------------------------------------------- */

/* Writes one shard of 64 sequences of pseudo-random values (about 43 KB compressed: bigger than the
 * room the writer insists on before it starts) to path, through H5Dwrite when h5dwrite is set, else
 * through the parallel chunk path on 2 threads; returns the first failing status. */
static tkd_status write_shard(const char *path, tkd_cache_shard_entry *e, int h5dwrite)
{
    enum { NSEQ = 64 };
    tkd_cache_identity id;
    fill_identity(&id);
    tkd_cache_batch b;
    assert_int_equal(tkd_cache_batch_alloc(&b, NSEQ, id.seq_len, id.k, 0), TKD_OK);
    b.num_seq = NSEQ;
    uint64_t x = 12345;
    for (int i = 0; i < NSEQ * (id.seq_len + 1); i++) {
        x = x * 6364136223846793005ull + 1442695040888963407ull;
        b.tokens[i] = (int32_t)((x >> 33) % 131);
    }
    for (int i = 0; i < NSEQ * id.seq_len * id.k; i++) {
        x = x * 6364136223846793005ull + 1442695040888963407ull;
        b.topk_indices[i] = (uint32_t)((x >> 33) % 131);
        b.topk_logits[i] = (float)((x >> 40) % 1000) * 0.01f;
    }
    for (int i = 0; i < NSEQ * id.seq_len; i++)
        b.lse[i] = 3.0f + (float)i / 64.0f;
    for (int i = 0; i < NSEQ; i++)
        b.seq_index[i] = i;
    tkd_shard_writer *w = NULL;
    tkd_shard_writer_opts o = {.zstd_level = 3, .chunk_seqs = 4, .threads = 2, .h5dwrite = h5dwrite};
    tkd_status st = tkd_shard_writer_open(&w, path, &id, 0, &o);
    if (st == TKD_OK) {
        st = tkd_shard_writer_append(w, &b);
        if (st == TKD_OK)
            st = tkd_shard_writer_finish(w, e);
        else
            tkd_shard_writer_abort(w);
    }
    tkd_cache_batch_free(&b);
    return st;
}

/* With 0 .. 28 KiB free the shard cannot be written: below 16 KiB the writer refuses before HDF5
 * starts, above it the disk fills while HDF5 flushes (H5Dwrite path) or while chunks are written or
 * the flush's room is reserved (parallel path: a full disk in HDF5's metadata flush would leave a
 * file HDF5 cannot close). Each failure is NOSPACE with no .tmp left; then, with room, a shard is
 * written and reads back (HDF5 survived the failed files). Both paths, every 4 KiB (a tmpfs page). */
static void test_shard_writer_disk_full(void **state)
{
    (void)state;
    const char *mnt = tmpfs_mount(256);
    char path[256], ballast_path[256];
    snprintf(path, sizeof path, "%s/shard-00000.h5", mnt);
    snprintf(ballast_path, sizeof ballast_path, "%s/ballast", mnt);
    tkd_cache_shard_entry e;
    if (write_shard(path, &e, 1) != TKD_OK)
        fail_msg("%s", tkd_error_msg());
    printf("# shard: %llu bytes\n", (unsigned long long)e.bytes);
    assert_true(e.bytes > 32 * 1024); /* else the loop below would not fill the disk */
    unlink(path);
    for (long keep_kb = 0; keep_kb <= 28; keep_kb += 4) {
        for (int h5dwrite = 0; h5dwrite <= 1; h5dwrite++) {
            ballast(mnt, keep_kb);
            assert_int_equal(write_shard(path, &e, h5dwrite), TKD_ERR_NOSPACE);
            assert_disk_full_msg(path);
            assert_int_equal(count_leftovers(mnt), 0);
            assert_false(tkd_file_exists(path));
        }
    }
    unlink(ballast_path);
    if (write_shard(path, &e, 0) != TKD_OK)
        fail_msg("%s", tkd_error_msg());
    tkd_shard *s = NULL;
    if (tkd_shard_open(&s, path, 0) != TKD_OK)
        fail_msg("%s", tkd_error_msg());
    assert_int_equal(tkd_shard_get_info(s)->num_seq, 64);
    tkd_shard_close(s);
    umount_all();
}

int main(void)
{
    if (geteuid() != 0) {
        printf("skipped: mounting a small tmpfs to fill needs root (euid %d)\n", (int)geteuid());
        return 77;
    }
    if (access(BIN, X_OK) != 0) {
        printf("%s not built: build the whole tree first\n", BIN);
        return 1;
    }
    atexit(umount_all);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_teardown(test_file_write_atomic_disk_full, teardown_mounts),
        cmocka_unit_test_teardown(test_manifest_write_disk_full, teardown_mounts),
        cmocka_unit_test_teardown(test_shard_writer_disk_full, teardown_mounts),
        cmocka_unit_test_teardown(test_checkpoint_disk_full, teardown_mounts),
        cmocka_unit_test_teardown(test_teacher_dump_disk_full, teardown_mounts),
    };
    return cmocka_run_group_tests(tests, NULL, teardown_mounts);
}
