/* test_common_fileio.c — atomic writes leave no temporaries, path helpers (directories built whole
 * and swapped into place: test_common_owned_dir.c). */
#include <setjmp.h>
#include <stdbool.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/fileio.h"
#include "tests/testutil.h"

/* Number of entries in d whose name contains ".tmp-". */
static long long is_temp(const char *path, const char *name, void *ctx)
{
    (void)path, (void)ctx;
    return strstr(name, ".tmp-") != NULL;
}

static int count_temps(const char *d)
{
    return (int)tkd_test_dir_sum(d, is_temp, NULL);
}

static const char *p(const char *name)
{
    static char buf[4][4200];
    static int k;
    k = (k + 1) % 4;
    assert_int_equal(tkd_path_join(buf[k], sizeof buf[k], tkd_test_group_dir, name), TKD_OK);
    return buf[k];
}

static void test_write_atomic_success(void **state)
{
    (void)state;
    const char *f = p("manifest.yaml");
    assert_int_equal(tkd_file_write_atomic(f, "one\n", 4), TKD_OK);
    assert_int_equal(tkd_file_write_atomic(f, "second\n", 7), TKD_OK); /* replaces */
    void *data;
    size_t size;
    assert_int_equal(tkd_read_file(f, &data, &size), TKD_OK);
    assert_int_equal(size, 7);
    assert_string_equal(data, "second\n"); /* NUL-terminated */
    free(data);
    uint64_t sz;
    assert_int_equal(tkd_file_size(f, &sz), TKD_OK);
    assert_int_equal(sz, 7);
    struct stat sb;
    assert_int_equal(stat(f, &sb), 0);
    assert_int_equal(sb.st_mode & 0777, 0644);
    assert_int_equal(count_temps(tkd_test_group_dir), 0);
    /* an empty file is a valid output */
    assert_int_equal(tkd_file_write_atomic(p("empty"), NULL, 0), TKD_OK);
    assert_int_equal(tkd_file_size(p("empty"), &sz), TKD_OK);
    assert_int_equal(sz, 0);
}

static void test_write_atomic_failure_leaves_nothing(void **state)
{
    (void)state;
    /* directory missing: nothing can be created */
    assert_int_equal(tkd_file_write_atomic(p("nodir/x.yaml"), "x", 1), TKD_ERR_NOT_FOUND);
    assert_non_null(strstr(tkd_error_msg(), "nodir/x.yaml"));
    /* the final rename fails (target is a non-empty directory) after the data was written:
     * the temporary must be gone and the directory untouched */
    assert_int_equal(tkd_mkdir_p(p("busy/inner")), TKD_OK);
    assert_int_equal(tkd_file_write_atomic(p("busy"), "data", 4), TKD_ERR_IO);
    assert_non_null(strstr(tkd_error_msg(), "renaming the temporary file"));
    assert_int_equal(count_temps(tkd_test_group_dir), 0);
    assert_true(tkd_file_exists(p("busy/inner")));
    /* the streaming form: abort removes the temp */
    tkd_atomic_file af;
    assert_int_equal(tkd_atomic_file_open(&af, p("stream.txt")), TKD_OK);
    fprintf(af.fp, "partial");
    assert_int_equal(count_temps(tkd_test_group_dir), 1);
    tkd_atomic_file_abort(&af);
    assert_int_equal(count_temps(tkd_test_group_dir), 0);
    assert_false(tkd_file_exists(p("stream.txt")));
    assert_int_equal(tkd_atomic_file_open(&af, p("stream.txt")), TKD_OK);
    fprintf(af.fp, "k: %d\n", 5);
    assert_int_equal(tkd_atomic_file_commit(&af), TKD_OK);
    assert_int_equal(count_temps(tkd_test_group_dir), 0);
    assert_true(tkd_file_exists(p("stream.txt")));
}

static void test_read_and_size_errors(void **state)
{
    (void)state;
    void *data = (void *)1;
    size_t size = 9;
    uint64_t sz;
    assert_int_equal(tkd_read_file(p("missing"), &data, &size), TKD_ERR_NOT_FOUND);
    assert_null(data);
    assert_int_equal(size, 0);
    assert_int_equal(tkd_file_size(p("missing"), &sz), TKD_ERR_NOT_FOUND);
    assert_false(tkd_file_exists(p("missing")));
    assert_int_equal(tkd_mkdir_p(p("d")), TKD_OK);
    assert_int_equal(tkd_read_file(p("d"), &data, &size), TKD_ERR_IO);
}

/* In a child (a FIFO open that blocks must fail the test, not hang it): the input helpers refuse
 * a FIFO nobody writes to before opening it, naming the path and what it is. */
static int refuse_fifo_in_child(const char *fifo)
{
    fflush(NULL);
    pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        void *data = NULL;
        size_t size = 0;
        tkd_status st = tkd_read_input(fifo, "token file", &data, &size);
        const char *want = "token file is a FIFO (named pipe), not a regular file";
        _exit(st == TKD_ERR_IO && strstr(tkd_error_msg(), fifo) && strstr(tkd_error_msg(), want) ? 0 : 1);
    }
    return tkd_test_wait_timeout(pid, 10.0);
}

static void test_inputs_must_be_regular_files(void **state)
{
    (void)state;
    const char *fifo = p("fifo");
    assert_int_equal(mkfifo(fifo, 0600), 0);
    assert_int_equal(refuse_fifo_in_child(fifo), 0);
    void *data = NULL;
    size_t size = 0;
    assert_int_equal(tkd_read_file("/dev/null", &data, &size), TKD_ERR_IO);
    tkd_test_assert_msg_has("/dev/null: file is a character device, not a regular file");
    assert_int_equal(tkd_mkdir_p(p("adir")), TKD_OK);
    FILE *fp = NULL;
    assert_int_equal(tkd_fopen_input(p("adir"), "config file", &fp), TKD_ERR_IO);
    assert_null(fp);
    tkd_test_assert_msg_has("adir: config file is a directory, not a regular file");
    assert_int_equal(tkd_input_check(p("absent"), "shard"), TKD_ERR_NOT_FOUND);
    tkd_test_assert_msg_has("absent: cannot open shard: No such file or directory");
    /* a symbolic link to a regular file is fine, and the descriptor reads normally */
    assert_int_equal(tkd_file_write_atomic(p("real"), "abc", 3), TKD_OK);
    assert_int_equal(symlink(p("real"), p("link")), 0);
    assert_int_equal(tkd_fopen_input(p("link"), "file", &fp), TKD_OK);
    char buf[8];
    size_t got = 0;
    assert_int_equal(tkd_fread_input(fp, buf, sizeof buf, &got, p("link")), TKD_OK);
    assert_int_equal(got, 3); /* fewer at the end of the file, not an error */
    assert_memory_equal(buf, "abc", 3);
    fclose(fp);
}

static void test_mkdir_and_join(void **state)
{
    (void)state;
    assert_int_equal(tkd_mkdir_p(p("a/b/c/")), TKD_OK);
    assert_int_equal(tkd_mkdir_p(p("a/b/c")), TKD_OK); /* again: fine */
    assert_int_equal(tkd_file_write_atomic(p("a/file"), "x", 1), TKD_OK);
    assert_int_equal(tkd_mkdir_p(p("a/file/sub")), TKD_ERR_IO); /* a file in the way */
    assert_int_equal(tkd_mkdir_p(p("a/file")), TKD_ERR_IO);
    char out[16];
    assert_int_equal(tkd_path_join(out, sizeof out, "runs", "x"), TKD_OK);
    assert_string_equal(out, "runs/x");
    assert_int_equal(tkd_path_join(out, sizeof out, "runs/", "x"), TKD_OK);
    assert_string_equal(out, "runs/x");
    assert_int_equal(tkd_path_join(out, sizeof out, "runs", "/abs"), TKD_OK);
    assert_string_equal(out, "/abs");
    assert_int_equal(tkd_path_join(out, sizeof out, "", "x"), TKD_OK);
    assert_string_equal(out, "x");
    assert_int_equal(tkd_path_join(out, sizeof out, "0123456789", "abcde"), TKD_ERR_INVALID_ARG);
    assert_int_equal(tkd_path_join(out, sizeof out, "0123456789", "abcd"), TKD_OK); /* 15 + NUL */
}

/* tkd_mkdir_p_made names the shallowest folder it made; tkd_rmdir_made removes those folders and no
 * folder that was there before, nor one that holds anything (issue 26). */
static void test_mkdir_made_and_undone(void **state)
{
    (void)state;
    char made[4300];
    assert_int_equal(tkd_mkdir_p(p("m/have")), TKD_OK);
    assert_int_equal(tkd_mkdir_p_made(p("m/have/new1/new2/"), made, sizeof made), TKD_OK);
    assert_string_equal(made, p("m/have/new1"));
    tkd_rmdir_made(p("m/have/new1/new2/"), made);
    assert_false(tkd_file_exists(p("m/have/new1")));
    assert_true(tkd_file_exists(p("m/have")));
    /* all there: nothing made, nothing removed */
    assert_int_equal(tkd_mkdir_p_made(p("m/have"), made, sizeof made), TKD_OK);
    assert_string_equal(made, "");
    tkd_rmdir_made(p("m/have"), made);
    assert_true(tkd_file_exists(p("m/have")));
    /* a folder made that then got a file: it stays, and so do those above it */
    assert_int_equal(tkd_mkdir_p_made(p("m/n1/n2"), made, sizeof made), TKD_OK);
    assert_string_equal(made, p("m/n1"));
    assert_int_equal(tkd_file_write_atomic(p("m/n1/keep"), "x", 1), TKD_OK);
    tkd_rmdir_made(p("m/n1/n2"), made);
    assert_false(tkd_file_exists(p("m/n1/n2")));
    assert_true(tkd_file_exists(p("m/n1/keep")));
    /* a relative path from a fresh top folder */
    char cwd[4096];
    assert_non_null(getcwd(cwd, sizeof cwd));
    assert_int_equal(chdir(tkd_test_group_dir), 0);
    assert_int_equal(tkd_mkdir_p_made("r1/r2", made, sizeof made), TKD_OK);
    assert_string_equal(made, "r1");
    tkd_rmdir_made("r1/r2", made);
    assert_false(tkd_file_exists("r1"));
    assert_int_equal(chdir(cwd), 0);
}

static void test_path_join_alloc(void **state)
{
    (void)state;
    char *out = (char *)1;
    assert_int_equal(tkd_path_join_alloc(&out, "cache", "shard-00000.h5"), TKD_OK);
    assert_string_equal(out, "cache/shard-00000.h5");
    free(out);
    assert_int_equal(tkd_path_join_alloc(&out, "cache/", "manifest.yaml"), TKD_OK); /* no "//" */
    assert_string_equal(out, "cache/manifest.yaml");
    free(out);
    assert_int_equal(tkd_path_join_alloc(&out, "cache", "/abs/m.yaml"), TKD_OK);
    assert_string_equal(out, "/abs/m.yaml");
    free(out);
    char longdir[5000]; /* longer than any fixed buffer the project uses */
    memset(longdir, 'd', sizeof longdir - 1);
    longdir[sizeof longdir - 1] = '\0';
    assert_int_equal(tkd_path_join_alloc(&out, longdir, "x"), TKD_OK);
    assert_int_equal(strlen(out), sizeof longdir + 1);
    assert_string_equal(out + sizeof longdir - 1, "/x");
    free(out);
}

static void test_fsync_and_rename_durable(void **state)
{
    (void)state;
    assert_int_equal(tkd_file_write_atomic(p("s.h5.tmp"), "shard", 5), TKD_OK);
    assert_int_equal(tkd_fsync_file(p("s.h5.tmp")), TKD_OK);
    assert_int_equal(tkd_fsync_file(p("missing")), TKD_ERR_NOT_FOUND);
    assert_non_null(strstr(tkd_error_msg(), "missing"));
    assert_int_equal(tkd_rename_durable(p("s.h5.tmp"), p("s.h5")), TKD_OK);
    assert_false(tkd_file_exists(p("s.h5.tmp")));
    uint64_t sz = 0;
    assert_int_equal(tkd_file_size(p("s.h5"), &sz), TKD_OK);
    assert_int_equal(sz, 5);
    /* a missing source is NOT_FOUND naming both names; the target is untouched */
    assert_int_equal(tkd_rename_durable(p("s.h5.tmp"), p("s.h5")), TKD_ERR_NOT_FOUND);
    assert_non_null(strstr(tkd_error_msg(), "s.h5.tmp -> "));
    assert_true(tkd_file_exists(p("s.h5")));
    assert_int_equal(tkd_rename_durable(p("s.h5"), p("nodir/s.h5")), TKD_ERR_NOT_FOUND);
}

static bool within(const char *inner, const char *outer)
{
    bool w = true; /* the false cases below fail unless the call sets it */
    assert_int_equal(tkd_path_within(inner, outer, &w), TKD_OK);
    return w;
}

/* By device and inode: the same directory under other spellings and through a symlink; a name that
 * merely starts with the other's is not inside it; a tail that does not exist yet counts where its
 * existing ancestor is. */
static void test_path_within(void **state)
{
    (void)state;
    assert_int_equal(tkd_mkdir_p(p("w/a/b")), TKD_OK);
    assert_int_equal(tkd_mkdir_p(p("w/ab")), TKD_OK);
    assert_int_equal(symlink(p("w/a"), p("w/link")), 0);
    assert_true(within(p("w/a"), p("w/a")));
    assert_true(within(p("w/a/b"), p("w/a")));
    assert_true(within(p("w/a/b/../b/"), p("w/a")));
    assert_true(within(p("w/link"), p("w/a")));
    assert_true(within(p("w/link/new/deeper"), p("w/a")));
    assert_true(within(p("w/a/b"), p("w/link")));
    assert_true(within(p("w/a"), "/"));
    assert_false(within(p("w/ab"), p("w/a")));
    assert_false(within(p("w/a"), p("w/a/b")));
    assert_false(within(p("w/new"), p("w/a")));
    assert_false(within(p("w/a"), p("w/missing")));
    assert_int_equal(tkd_remove_tree(p("w")), TKD_OK);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_write_atomic_success),
        cmocka_unit_test(test_write_atomic_failure_leaves_nothing),
        cmocka_unit_test(test_read_and_size_errors),
        cmocka_unit_test(test_inputs_must_be_regular_files),
        cmocka_unit_test(test_mkdir_and_join),
        cmocka_unit_test(test_mkdir_made_and_undone),
        cmocka_unit_test(test_path_join_alloc),
        cmocka_unit_test(test_fsync_and_rename_durable),
        cmocka_unit_test(test_path_within),
    };
    return cmocka_run_group_tests(tests, tkd_test_group_dir_setup, tkd_test_group_dir_teardown);
}
