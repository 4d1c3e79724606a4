/* test_common_owned_dir.c — a tool removes only what it can prove it made (common/owned_dir.h):
 * the marker is written when a directory is taken into use; a user's folder, another kind's
 * directory, or an unmarked one without an old version's signature is refused; clearing removes the
 * kind's names and nothing else, and nothing at all while a foreign entry is present. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/fileio.h"
#include "common/owned_dir.h"
#include "tests/testutil.h"

static const char *const names[] = {"data-[0-9]*.bin", "index.yaml", "index.yaml.tmp-*", ".mark", ".lock", NULL};
static const tkd_dir_kind kind = {.tool = "maker", .what = "thing", .marker = ".mark", .names = names,
                                  .sign_name = "index.yaml", .sign_text = "# made by maker"};

static const char *at(const char *dir, const char *name) { return tkd_test_path(dir, name); }

static void test_claim(void **state)
{
    (void)state;
    char *dir = tkd_test_mkdtemp("owned-claim");
    /* a new directory, and an empty one, get the marker */
    assert_int_equal(tkd_owned_dir_claim(&kind, at(dir, "new/deeper")), TKD_OK);
    assert_true(tkd_file_exists(at(dir, "new/deeper/.mark")));
    assert_int_equal(tkd_owned_dir_claim(&kind, at(dir, "new")), TKD_ERR_INVALID_ARG); /* holds 'deeper' */
    tkd_test_assert_msg_has("'deeper'");
    assert_int_equal(tkd_mkdir_p(at(dir, "empty")), TKD_OK);
    assert_int_equal(tkd_owned_dir_claim(&kind, at(dir, "empty")), TKD_OK);
    assert_true(tkd_file_exists(at(dir, "empty/.mark")));
    /* another process's marker half-written (workers started together on a new directory): still
     * as good as empty */
    assert_int_equal(tkd_mkdir_p(at(dir, "racing")), TKD_OK);
    tkd_test_write_text(at(dir, "racing/.mark.tmp-Ab12Cd"), "A thing");
    assert_int_equal(tkd_owned_dir_claim(&kind, at(dir, "racing")), TKD_OK);
    assert_true(tkd_file_exists(at(dir, "racing/.mark")));
    /* a marked directory stays claimable whatever else it holds (writing removes nothing) */
    tkd_test_write_text(at(dir, "empty/notes.txt"), "mine");
    assert_int_equal(tkd_owned_dir_claim(&kind, at(dir, "empty")), TKD_OK);

    /* a user's folder: refused naming the folder and the entry; no marker is left in it */
    assert_int_equal(tkd_mkdir_p(at(dir, "user")), TKD_OK);
    tkd_test_write_text(at(dir, "user/data-1.bin"), "x");
    tkd_test_write_text(at(dir, "user/thesis.tex"), "y");
    assert_int_equal(tkd_owned_dir_claim(&kind, at(dir, "user")), TKD_ERR_INVALID_ARG);
    tkd_test_assert_msg_has(at(dir, "user"));
    tkd_test_assert_msg_has("'thesis.tex'");
    assert_false(tkd_file_exists(at(dir, "user/.mark")));
    /* only the kind's names but no signature: not proven ours either */
    assert_int_equal(tkd_mkdir_p(at(dir, "lookalike")), TKD_OK);
    tkd_test_write_text(at(dir, "lookalike/index.yaml"), "apiVersion: v1\n");
    assert_int_equal(tkd_owned_dir_claim(&kind, at(dir, "lookalike")), TKD_ERR_INVALID_ARG);
    tkd_test_assert_msg_has("no .mark file");
    assert_false(tkd_file_exists(at(dir, "lookalike/.mark")));
    /* an old version's directory (its names and its signature): taken over, marker written */
    assert_int_equal(tkd_mkdir_p(at(dir, "old")), TKD_OK);
    tkd_test_write_text(at(dir, "old/index.yaml"), "# made by maker\nk: 1\n");
    tkd_test_write_text(at(dir, "old/data-0.bin"), "z");
    assert_int_equal(tkd_owned_dir_claim(&kind, at(dir, "old")), TKD_OK);
    assert_true(tkd_file_exists(at(dir, "old/.mark")));
    /* a file where the directory should be */
    assert_int_not_equal(tkd_owned_dir_claim(&kind, at(dir, "user/thesis.tex")), TKD_OK);
    tkd_test_rmtree(dir);
    free(dir);
}

static void test_clear(void **state)
{
    (void)state;
    char *dir = tkd_test_mkdtemp("owned-clear");
    char d[4300]; /* at() reuses its buffers */
    snprintf(d, sizeof d, "%s", at(dir, "c"));
    assert_int_equal(tkd_owned_dir_claim(&kind, d), TKD_OK);
    tkd_test_write_text(at(d, "data-0.bin"), "a");
    tkd_test_write_text(at(d, "index.yaml"), "# made by maker\n");
    tkd_test_write_text(at(d, "index.yaml.tmp-abc123"), "half");
    tkd_test_write_text(at(d, ".lock"), "123\n");
    /* a foreign entry: nothing at all is removed, and the message names it */
    tkd_test_write_text(at(d, "notes.txt"), "mine");
    static const char *const keep[] = {".lock", NULL};
    assert_int_equal(tkd_owned_dir_clear(&kind, d, keep), TKD_ERR_INVALID_ARG);
    tkd_test_assert_msg_has(d);
    tkd_test_assert_msg_has("'notes.txt'");
    assert_true(tkd_file_exists(at(d, "data-0.bin")));
    assert_true(tkd_file_exists(at(d, "index.yaml")));
    assert_true(tkd_file_exists(at(d, "notes.txt")));
    /* without it: the kind's names go, the marker and the kept lock stay */
    assert_int_equal(remove(at(d, "notes.txt")), 0);
    assert_int_equal(tkd_owned_dir_clear(&kind, d, keep), TKD_OK);
    assert_false(tkd_file_exists(at(d, "data-0.bin")));
    assert_false(tkd_file_exists(at(d, "index.yaml")));
    assert_false(tkd_file_exists(at(d, "index.yaml.tmp-abc123")));
    assert_true(tkd_file_exists(at(d, ".mark")));
    assert_true(tkd_file_exists(at(d, ".lock")));
    /* no marker: refused naming the directory, even when every name is the kind's */
    assert_int_equal(remove(at(d, ".mark")), 0);
    tkd_test_write_text(at(d, "data-0.bin"), "a");
    assert_int_equal(tkd_owned_dir_clear(&kind, d, keep), TKD_ERR_INVALID_ARG);
    tkd_test_assert_msg_has(d);
    tkd_test_assert_msg_has("no .mark file");
    assert_true(tkd_file_exists(at(d, "data-0.bin")));
    tkd_test_rmtree(dir);
    free(dir);
}

static void test_remove_patterns(void **state)
{
    (void)state;
    char *dir = tkd_test_mkdtemp("owned-remove");
    assert_int_equal(tkd_mkdir_p(at(dir, "ckpt.tmp-XY12/inner")), TKD_OK);
    tkd_test_write_text(at(dir, "ckpt.tmp-XY12/inner/w.bin"), "partial");
    tkd_test_write_text(at(dir, "index.yaml.tmp-q"), "half");
    tkd_test_write_text(at(dir, "index.yaml"), "whole");
    static const char *const temps[] = {"ckpt.tmp-*", "index.yaml.tmp-*", NULL};
    assert_int_equal(tkd_owned_dir_remove(dir, temps), TKD_OK);
    assert_false(tkd_file_exists(at(dir, "ckpt.tmp-XY12")));
    assert_false(tkd_file_exists(at(dir, "index.yaml.tmp-q")));
    assert_true(tkd_file_exists(at(dir, "index.yaml")));
    tkd_test_rmtree(dir);
    free(dir);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_claim),
        cmocka_unit_test(test_clear),
        cmocka_unit_test(test_remove_patterns),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
