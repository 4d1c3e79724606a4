/* test_cache_broken.c — every broken cache input gives one clear error naming the file and place,
 * never a crash, and HDF5 prints nothing of its own: truncated shard, a flipped byte inside a
 * compressed chunk (fletcher32), wrong format version (shard and manifest), missing dataset,
 * k / vocab mismatch between shard and manifest, a listed shard that is missing, malformed
 * manifest YAML (line:col), a file that is not HDF5. The broken files are made by the test from
 * a good cache, so they always match the current writer. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <fcntl.h>
#include <hdf5.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <unistd.h>

#include "formats/cache_manifest.h"
#include "formats/cache_reader.h"
#include "tests/cache_testutil.h"
#include "tests/testutil.h"

typedef struct fixture {
    char *dir;
    char shard0[4200], shard1[4200], manifest[4200];
    tkd_cache_identity id;
    tkd_test_stderr_capture cap;
} fixture;

/* A good two-shard cache (6 + 4 sequences, chunks of 2), then stderr captured until teardown. */
static int setup(void **state)
{
    fixture *f = calloc(1, sizeof *f);
    f->dir = tkd_test_mkdtemp("broken");
    snprintf(f->shard0, sizeof f->shard0, "%s/shard-00000.h5", f->dir);
    snprintf(f->shard1, sizeof f->shard1, "%s/shard-00001.h5", f->dir);
    snprintf(f->manifest, sizeof f->manifest, "%s/manifest.yaml", f->dir);
    f->id = tkd_test_cache_identity(8, 4, 0, TKD_CACHE_DTYPE_HALF);
    if (tkd_test_cache_make(f->dir, &f->id, 2, 6, 4, 2) != TKD_OK)
        return -1;
    tkd_test_stderr_begin(&f->cap);
    *state = f;
    return 0;
}

static int teardown(void **state)
{
    fixture *f = *state;
    long printed = tkd_test_stderr_end(&f->cap);
    tkd_test_rmdtemp(f->dir);
    free(f);
    return printed == 0 ? 0 : -1; /* HDF5 (or we) printed something: fail the test */
}

static void expect_error(tkd_status got, tkd_status want, const char *must_contain)
{
    if (getenv("TKD_SHOW_ERRORS")) printf("  -> %s\n", tkd_error_msg());
    if (got != want || !strstr(tkd_error_msg(), must_contain))
        print_error("got %s '%s', want %s containing '%s'\n", tkd_status_name(got), tkd_error_msg(),
                    tkd_status_name(want), must_contain);
    assert_int_equal(got, want);
    assert_non_null(strstr(tkd_error_msg(), must_contain));
}

static tkd_status open_reader(const fixture *f)
{
    tkd_cache_reader *r = NULL;
    tkd_status st = tkd_cache_reader_open(&r, f->dir, NULL);
    tkd_cache_reader_close(r);
    return st;
}

static void test_truncated_shard(void **state)
{
    fixture *f = *state;
    assert_int_equal(truncate(f->shard1, 3000), 0);
    expect_error(open_reader(f), TKD_ERR_FORMAT, "shard-00001.h5: 3000 bytes");
    tkd_shard *s = NULL;
    expect_error(tkd_shard_open(&s, f->shard1, 0), TKD_ERR_FORMAT, "shard-00001.h5: not a readable HDF5 file");
    assert_null(s);
}

static void test_flipped_byte_in_chunk(void **state)
{
    fixture *f = *state;
    tkd_test_flip_chunk_byte(f->shard0, "/topk/logits", 0); /* chunk 0: sequences 0 and 1 */
    tkd_cache_reader *r = NULL;
    assert_int_equal(tkd_cache_reader_open(&r, f->dir, NULL), TKD_OK); /* size is unchanged */
    tkd_cache_batch b;
    assert_int_equal(tkd_cache_batch_alloc(&b, 4, 8, 4, 0), TKD_OK);
    assert_int_equal(tkd_cache_reader_read(r, 3, 1, &b, 0), TKD_OK); /* chunk 1 is intact */
    expect_error(tkd_cache_reader_read(r, 1, 1, &b, 0), TKD_ERR_CHECKSUM, "shard-00000.h5: reading /topk/logits");
    assert_non_null(strstr(tkd_error_msg(), "cache 1..1"));
    /* through the loader thread: the error reaches the consumer with the same detail */
    int64_t order[4] = {8, 9, 0, 1};
    tkd_cache_stream *s = NULL;
    tkd_cache_stream_opts o = {2, 0, 0, 2};
    assert_int_equal(tkd_cache_stream_open(&s, r, order, 4, &o), TKD_OK);
    const tkd_cache_batch *got;
    assert_int_equal(tkd_cache_stream_next(s, &got), TKD_OK);
    assert_int_equal(got->cache_seq[1], 9);
    expect_error(tkd_cache_stream_next(s, &got), TKD_ERR_CHECKSUM, "/topk/logits");
    assert_null(got);
    assert_int_equal(tkd_cache_stream_next(s, &got), TKD_OK); /* finished after an error */
    assert_null(got);
    tkd_cache_stream_close(s);
    tkd_cache_reader_close(r);
    /* the manifest's sha256 catches it before any read when asked to verify */
    tkd_cache_reader_opts ro = {0, 1, NULL};
    expect_error(tkd_cache_reader_open(&r, f->dir, &ro), TKD_ERR_CHECKSUM, "shard-00000.h5");
    assert_null(r);
    tkd_cache_batch_free(&b);
}

static void set_int_attr(const char *path, const char *name, int64_t v)
{
    hid_t file = H5Fopen(path, H5F_ACC_RDWR, H5P_DEFAULT);
    hid_t a = H5Aopen(file, name, H5P_DEFAULT);
    assert_true(H5Awrite(a, H5T_NATIVE_INT64, &v) >= 0);
    H5Aclose(a);
    H5Fclose(file);
}

static void test_wrong_format_version(void **state)
{
    fixture *f = *state;
    set_int_attr(f->shard0, "version", 3);
    tkd_shard *s = NULL;
    expect_error(tkd_shard_open(&s, f->shard0, 0), TKD_ERR_UNSUPPORTED,
                 "shard-00000.h5: cache format version 3, this build reads versions 1 and 2");
    /* version 2 is for packed or trained-only caches: a plain shard claiming it is inconsistent */
    set_int_attr(f->shard0, "version", 2);
    expect_error(tkd_shard_open(&s, f->shard0, 0), TKD_ERR_FORMAT,
                 "shard-00000.h5: format version 2 does not match its attributes (packing, positions: version 1)");
    tkd_test_write_text(f->manifest, "format: topkd-cache\nversion: 3\n");
    expect_error(open_reader(f), TKD_ERR_UNSUPPORTED, "manifest.yaml:2:10: cache format version 3");
    tkd_test_write_text(f->manifest, "format: something-else\nversion: 1\n");
    expect_error(open_reader(f), TKD_ERR_FORMAT, "manifest.yaml:1:9: format is 'something-else'");
}

/* first_seq + num_seq past 2^63 is refused at open (found by fuzz_shard: reading such a shard
 * overflowed the sequence numbers it reports) */
static void test_sequence_range_overflow(void **state)
{
    fixture *f = *state;
    set_int_attr(f->shard0, "first_seq", INT64_MAX);
    tkd_shard *s = NULL;
    expect_error(tkd_shard_open(&s, f->shard0, 0), TKD_ERR_FORMAT,
                 "shard-00000.h5: first_seq 9223372036854775807 / num_seq 6 negative or past 2^63");
    assert_null(s);
}

static void test_missing_dataset(void **state)
{
    fixture *f = *state;
    hid_t file = H5Fopen(f->shard1, H5F_ACC_RDWR, H5P_DEFAULT);
    assert_true(H5Ldelete(file, "/lse", H5P_DEFAULT) >= 0);
    H5Fclose(file);
    tkd_shard *s = NULL;
    expect_error(tkd_shard_open(&s, f->shard1, 0), TKD_ERR_NOT_FOUND, "shard-00001.h5: dataset /lse missing");
    file = H5Fopen(f->shard0, H5F_ACC_RDWR, H5P_DEFAULT);
    assert_true(H5Ldelete(file, "/topk", H5P_DEFAULT) >= 0); /* a whole group */
    H5Fclose(file);
    expect_error(tkd_shard_open(&s, f->shard0, 0), TKD_ERR_NOT_FOUND, "dataset /topk/indices missing");
}

/* Rewrites the manifest with one identity field changed. */
static void rewrite_manifest(const fixture *f, void (*edit)(tkd_cache_manifest *))
{
    tkd_cache_manifest m;
    assert_int_equal(tkd_cache_manifest_read(&m, f->manifest), TKD_OK);
    edit(&m);
    assert_int_equal(tkd_cache_manifest_write(&m, f->manifest), TKD_OK);
    tkd_cache_manifest_free(&m);
}

static void edit_k(tkd_cache_manifest *m) { m->id.k = 3; }
static void edit_vocab(tkd_cache_manifest *m) { m->id.vocab_size = 999; }
static void edit_temperature(tkd_cache_manifest *m) { m->id.temperature = 2.0f; }
static void edit_drop_first(tkd_cache_manifest *m)
{
    memmove(m->shards, m->shards + 1, sizeof *m->shards);
    m->num_shards = 1;
}

static void test_shard_manifest_mismatch(void **state)
{
    fixture *f = *state;
    rewrite_manifest(f, edit_k);
    expect_error(open_reader(f), TKD_ERR_MISMATCH,
                 "shard-00000.h5: k differs (3 vs 4) — the shard belongs to another cache; repair it by re-running the teacher-dump command");
    rewrite_manifest(f, edit_k); /* k stays 3; now the vocab differs too, k is reported first */
    rewrite_manifest(f, edit_vocab);
    expect_error(open_reader(f), TKD_ERR_MISMATCH, "vocab_size differs (999 vs 1000)");
}

static void test_temperature_mismatch_and_gap(void **state)
{
    fixture *f = *state;
    rewrite_manifest(f, edit_temperature);
    expect_error(open_reader(f), TKD_ERR_MISMATCH, "temperature differs");
    rewrite_manifest(f, edit_drop_first);
    expect_error(open_reader(f), TKD_ERR_FORMAT, "shard-00001.h5 starts at sequence 6, expected 0");
}

static void test_missing_shard(void **state)
{
    fixture *f = *state;
    assert_int_equal(unlink(f->shard1), 0);
    expect_error(open_reader(f), TKD_ERR_NOT_FOUND, "shard-00001.h5: listed in the manifest but missing");
    assert_int_equal(unlink(f->manifest), 0);
    expect_error(open_reader(f), TKD_ERR_NOT_FOUND, "manifest.yaml: no manifest");
}

static void test_malformed_manifest(void **state)
{
    fixture *f = *state;
    tkd_test_write_text(f->manifest, "format: topkd-cache\nversion: 1\nteacher: [unclosed\nk: 3\n");
    expect_error(open_reader(f), TKD_ERR_FORMAT, "manifest.yaml:4:");
    assert_non_null(strstr(tkd_error_msg(), "malformed YAML"));
    /* well-formed YAML with a bad value: the value's line:col */
    char text[4096];
    FILE *fp = fopen(f->manifest, "w");
    fprintf(fp, "format: topkd-cache\nversion: 1\nteacher:\n  vocab_size: 1000\n  sha256: \"%064d\"\n"
                "dataset:\n  sha256: \"%064d\"\n  seq_len: 8\nk: four\n", 0, 0);
    fclose(fp);
    expect_error(open_reader(f), TKD_ERR_FORMAT, "manifest.yaml:9:4: 'k' must be an integer");
    snprintf(text, sizeof text, "format: topkd-cache\nversion: 1\nteacher:\n  vocab_size: 1000\n"
                                "dataset:\n  sha256: \"%064d\"\n  seq_len: 8\n", 0);
    tkd_test_write_text(f->manifest, text);
    expect_error(open_reader(f), TKD_ERR_FORMAT, "manifest.yaml:4:3: required key 'sha256'");
    tkd_test_write_text(f->manifest, "- just\n- a list\n");
    expect_error(open_reader(f), TKD_ERR_FORMAT, "manifest.yaml:1:1: the manifest must be a mapping");
    tkd_test_write_text(f->manifest, "");
    expect_error(open_reader(f), TKD_ERR_FORMAT, "empty manifest");
}

static void test_not_hdf5(void **state)
{
    fixture *f = *state;
    tkd_test_write_text(f->shard0, "this is not an HDF5 file\n");
    tkd_shard *s = NULL;
    expect_error(tkd_shard_open(&s, f->shard0, 0), TKD_ERR_FORMAT, "not a readable HDF5 file");
    expect_error(tkd_shard_open(&s, "/nonexistent/shard.h5", 0), TKD_ERR_NOT_FOUND, "/nonexistent/shard.h5");
    /* an HDF5 file that is not a shard */
    hid_t file = H5Fcreate(f->shard1, H5F_ACC_TRUNC, H5P_DEFAULT, H5P_DEFAULT);
    H5Fclose(file);
    expect_error(tkd_shard_open(&s, f->shard1, 0), TKD_ERR_FORMAT, "root attribute 'format' missing");
}

/* Every prefix of a good manifest either parses (a shorter shard list) or is a FORMAT error with a
 * line:col — never a crash or another status. */
/* An exclusive flock on path, as a program holding the file open for writing has (HDF5 locks the
 * files it opens); the fd to close is returned. */
static int lock_file(const char *path)
{
    int fd = open(path, O_RDWR | O_CREAT, 0644);
    assert_true(fd >= 0);
    assert_int_equal(flock(fd, LOCK_EX | LOCK_NB), 0);
    return fd;
}

/* A shard open for writing in another program: the reader and the writer say so in words (HDF5's
 * own "unable to lock file, errno = 11" is not the message), and HDF5 prints nothing (teardown).
 * The proposed action, closing it there, makes both work. */
static void test_locked_shard(void **state)
{
    fixture *f = *state;
    int fd = lock_file(f->shard1);
    tkd_shard *s = NULL;
    const char *what = "shard-00001.h5: locked: another program has this file open (HDF5 file lock) — close it there";
    expect_error(tkd_shard_open(&s, f->shard1, 0), TKD_ERR_IO, what);
    assert_null(strstr(tkd_error_msg(), "errno"));
    expect_error(open_reader(f), TKD_ERR_IO, what);
    close(fd); /* the other program closes it */
    assert_int_equal(open_reader(f), TKD_OK);

    char path[4200], tmp[4300];
    snprintf(path, sizeof path, "%s/shard-00009.h5", f->dir);
    snprintf(tmp, sizeof tmp, "%s.tmp", path);
    fd = lock_file(tmp);
    tkd_shard_writer *w = NULL;
    expect_error(tkd_shard_writer_open(&w, path, &f->id, 0, NULL), TKD_ERR_IO, "shard-00009.h5.tmp: locked: ");
    assert_null(w);
    close(fd);
    assert_int_equal(tkd_shard_writer_open(&w, path, &f->id, 0, NULL), TKD_OK);
    tkd_shard_writer_abort(w);
}

static void test_manifest_every_truncation(void **state)
{
    fixture *f = *state;
    FILE *fp = fopen(f->manifest, "rb");
    static char text[8192];
    size_t len = fread(text, 1, sizeof text, fp);
    fclose(fp);
    assert_true(len > 200 && len < sizeof text);
    char path[4300];
    snprintf(path, sizeof path, "%s/cut.yaml", f->dir);
    int parsed = 0;
    for (size_t cut = 0; cut < len; cut++) {
        fp = fopen(path, "wb");
        fwrite(text, 1, cut, fp);
        fclose(fp);
        tkd_cache_manifest m;
        tkd_status st = tkd_cache_manifest_read(&m, path);
        if (st == TKD_OK) {
            parsed++;
            assert_true(m.num_shards <= 2);
        } else {
            assert_int_equal(st, TKD_ERR_FORMAT);
            assert_non_null(strstr(tkd_error_msg(), "cut.yaml:"));
        }
        tkd_cache_manifest_free(&m);
    }
    assert_true(parsed > 0); /* cuts after the last required key parse */
}

/* A shard cut anywhere is refused at open (HDF5 compares the stored end of file with the size). */
static void test_shard_every_16th_truncation(void **state)
{
    fixture *f = *state;
    FILE *fp = fopen(f->shard0, "rb");
    fseek(fp, 0, SEEK_END);
    long size = ftell(fp);
    fclose(fp);
    char path[4300];
    snprintf(path, sizeof path, "%s/cut.h5", f->dir);
    for (long cut = 0; cut < size; cut += size / 16) {
        char cmd[9000];
        snprintf(cmd, sizeof cmd, "head -c %ld '%s' > '%s'", cut, f->shard0, path);
        assert_int_equal(system(cmd), 0);
        tkd_shard *s = NULL;
        expect_error(tkd_shard_open(&s, path, 0), TKD_ERR_FORMAT, "cut.h5: not a readable HDF5 file");
        assert_null(s);
    }
}

static tkd_status open_broken_manifest(const char *path)
{
    tkd_cache_manifest m;
    tkd_status st = tkd_cache_manifest_read(&m, path);
    tkd_cache_manifest_free(&m);
    return st;
}

/* The man_* files of tests/data/broken/: a key given twice (the first value used to win) and
 * nesting past the depth bound. */
static void test_broken_manifests(void **state)
{
    (void)state;
    assert_true(tkd_test_broken_files("man_", open_broken_manifest) >= 3);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_truncated_shard, setup, teardown),
        cmocka_unit_test_setup_teardown(test_flipped_byte_in_chunk, setup, teardown),
        cmocka_unit_test_setup_teardown(test_wrong_format_version, setup, teardown),
        cmocka_unit_test_setup_teardown(test_sequence_range_overflow, setup, teardown),
        cmocka_unit_test_setup_teardown(test_missing_dataset, setup, teardown),
        cmocka_unit_test_setup_teardown(test_shard_manifest_mismatch, setup, teardown),
        cmocka_unit_test_setup_teardown(test_temperature_mismatch_and_gap, setup, teardown),
        cmocka_unit_test_setup_teardown(test_missing_shard, setup, teardown),
        cmocka_unit_test_setup_teardown(test_malformed_manifest, setup, teardown),
        cmocka_unit_test_setup_teardown(test_not_hdf5, setup, teardown),
        cmocka_unit_test_setup_teardown(test_locked_shard, setup, teardown),
        cmocka_unit_test_setup_teardown(test_manifest_every_truncation, setup, teardown),
        cmocka_unit_test_setup_teardown(test_shard_every_16th_truncation, setup, teardown),
        cmocka_unit_test(test_broken_manifests),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
