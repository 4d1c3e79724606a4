/* test_common_owned_dir.c — a tool removes only what it can prove it made (common/owned_dir.h):
 * the marker is written when a directory is taken into use; a user's folder, another kind's
 * directory, or an unmarked one without an old version's signature is refused; clearing and the
 * start-up tidy remove only entries proven by their content (regular files) or their marker (built
 * directories), and nothing at all while an entry of the tool's name fails its proof — a directory,
 * a symbolic link or a file of other content under that name. Directories built whole (checkpoints)
 * carry their marker from the start and are swapped into place and removed only when proven. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/dir_lock.h"
#include "common/fileio.h"
#include "common/owned_dir.h"
#include "tests/testutil.h"

static bool begins_data(const char *path, void *ctx)
{
    (void)ctx;
    return tkd_owned_file_begins(path, "DATA", 4, false);
}

static bool begins_index(const char *path, void *ctx)
{
    (void)ctx;
    return tkd_owned_file_begins(path, "# made by maker", 15, false);
}

static bool begins_index_cut(const char *path, void *ctx)
{
    (void)ctx;
    return tkd_owned_file_begins(path, "# made by maker", 15, true);
}

static const char *const box_files[] = {"w.bin", "w.bin.tmp-*", "step.txt", "step.txt.tmp-*", NULL};
static const tkd_built_kind box = {.tool = "maker", .what = "box", .files = box_files, .old_sign = "step.txt"};

static const tkd_owned_name names[] = {
    {"data-[0-9]*.bin", begins_data, "it does not begin with DATA", NULL, false},
    {"index.yaml", begins_index, "it does not begin with the index's first line", NULL, false},
    {"index.yaml.tmp-*", begins_index_cut, "it does not begin like the index", NULL, false},
    {".lock", tkd_dir_lock_file_proof, "it holds something other than a pid", NULL, false},
    {"box", NULL, NULL, &box, true},
    {"box.tmp-*", NULL, NULL, &box, false},
    {NULL, NULL, NULL, NULL, false},
};
static const char *const keep[] = {".lock", NULL};
static const tkd_dir_kind kind = {.tool = "maker", .what = "thing", .marker = ".mark", .names = names,
                                  .keep = keep, .sign_name = "index.yaml", .sign_text = "# made by maker"};

static const char *at(const char *dir, const char *name) { return tkd_test_path(dir, name); }

static void test_claim(void **state)
{
    const char *dir = *state; /* this test's own temp dir (TKD_TEST_EACH_DIR) */
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
    tkd_test_write_text(at(dir, "user/data-1.bin"), "DATA");
    tkd_test_write_text(at(dir, "user/thesis.tex"), "y");
    assert_int_equal(tkd_owned_dir_claim(&kind, at(dir, "user")), TKD_ERR_INVALID_ARG);
    tkd_test_assert_msg_has(at(dir, "user"));
    tkd_test_assert_msg_has("'thesis.tex'");
    assert_false(tkd_file_exists(at(dir, "user/.mark")));
    /* only the kind's names but no signature: not proven ours either */
    assert_int_equal(tkd_mkdir_p(at(dir, "lookalike")), TKD_OK);
    tkd_test_write_text(at(dir, "lookalike/index.yaml.tmp-1"), "");
    assert_int_equal(tkd_owned_dir_claim(&kind, at(dir, "lookalike")), TKD_ERR_INVALID_ARG);
    tkd_test_assert_msg_has("no .mark file");
    assert_false(tkd_file_exists(at(dir, "lookalike/.mark")));
    /* the signature's name, not its content */
    tkd_test_write_text(at(dir, "lookalike/index.yaml"), "apiVersion: v1\n");
    assert_int_equal(tkd_owned_dir_claim(&kind, at(dir, "lookalike")), TKD_ERR_INVALID_ARG);
    tkd_test_assert_msg_has("'index.yaml', a file maker did not write");
    /* an old version's directory (its names, proven, and its signature): taken over, marker written */
    assert_int_equal(tkd_mkdir_p(at(dir, "old")), TKD_OK);
    tkd_test_write_text(at(dir, "old/index.yaml"), "# made by maker\nk: 1\n");
    tkd_test_write_text(at(dir, "old/data-0.bin"), "DATAz");
    assert_int_equal(tkd_owned_dir_claim(&kind, at(dir, "old")), TKD_OK);
    assert_true(tkd_file_exists(at(dir, "old/.mark")));
    /* ... but not when one of its entries is a directory of a file's name */
    assert_int_equal(tkd_mkdir_p(at(dir, "old2/data-7.bin")), TKD_OK);
    tkd_test_write_text(at(dir, "old2/index.yaml"), "# made by maker\nk: 1\n");
    assert_int_equal(tkd_owned_dir_claim(&kind, at(dir, "old2")), TKD_ERR_INVALID_ARG);
    tkd_test_assert_msg_has("'data-7.bin', a directory");
    /* a file where the directory should be */
    assert_int_not_equal(tkd_owned_dir_claim(&kind, at(dir, "user/thesis.tex")), TKD_OK);
}

/* A claimed directory d holding one of each entry the kind makes, all proven. */
static void fill(const char *d)
{
    tkd_test_write_text(at(d, "data-0.bin"), "DATA0");
    tkd_test_write_text(at(d, "index.yaml"), "# made by maker\n");
    tkd_test_write_text(at(d, "index.yaml.tmp-abc123"), "# made");
    tkd_test_write_text(at(d, ".lock"), "123\n");
}

static void assert_filled(const char *d)
{
    assert_true(tkd_file_exists(at(d, "data-0.bin")));
    assert_true(tkd_file_exists(at(d, "index.yaml")));
    assert_true(tkd_file_exists(at(d, "index.yaml.tmp-abc123")));
}

static void test_clear(void **state)
{
    const char *dir = *state; /* this test's own temp dir (TKD_TEST_EACH_DIR) */
    char d[4300]; /* at() reuses its buffers */
    snprintf(d, sizeof d, "%s", at(dir, "c"));
    assert_int_equal(tkd_owned_dir_claim(&kind, d), TKD_OK);
    fill(d);
    /* a foreign entry: nothing at all is removed, and the message names it */
    tkd_test_write_text(at(d, "notes.txt"), "mine");
    assert_int_equal(tkd_owned_dir_clear(&kind, d, NULL, NULL), TKD_ERR_INVALID_ARG);
    tkd_test_assert_msg_has(d);
    tkd_test_assert_msg_has("'notes.txt'");
    assert_filled(d);
    assert_true(tkd_file_exists(at(d, "notes.txt")));
    assert_int_equal(remove(at(d, "notes.txt")), 0);
    /* without it: the kind's entries go, the marker and the kept lock stay */
    assert_int_equal(tkd_owned_dir_clear(&kind, d, NULL, NULL), TKD_OK);
    assert_false(tkd_file_exists(at(d, "data-0.bin")));
    assert_false(tkd_file_exists(at(d, "index.yaml")));
    assert_false(tkd_file_exists(at(d, "index.yaml.tmp-abc123")));
    assert_true(tkd_file_exists(at(d, ".mark")));
    assert_true(tkd_file_exists(at(d, ".lock")));
    /* no marker: refused naming the directory, even when every entry is the kind's */
    assert_int_equal(remove(at(d, ".mark")), 0);
    tkd_test_write_text(at(d, "data-0.bin"), "DATA");
    assert_int_equal(tkd_owned_dir_clear(&kind, d, NULL, NULL), TKD_ERR_INVALID_ARG);
    tkd_test_assert_msg_has(d);
    tkd_test_assert_msg_has("no .mark file");
    assert_true(tkd_file_exists(at(d, "data-0.bin")));
    /* a marker of other content proves nothing */
    tkd_test_write_text(at(d, ".mark"), "not a marker\n");
    assert_int_equal(tkd_owned_dir_clear(&kind, d, NULL, NULL), TKD_ERR_INVALID_ARG);
    tkd_test_assert_msg_has("'.mark'");
    assert_true(tkd_file_exists(at(d, "data-0.bin")));
}

/* Entries with the kind's names that the kind did not write: each makes a clear and a tidy refuse,
 * naming it, with nothing removed — whatever else is proven. */
static void test_name_is_no_proof(void **state)
{
    const char *dir = *state; /* this test's own temp dir (TKD_TEST_EACH_DIR) */
    char d[4300], target[4300];
    snprintf(d, sizeof d, "%s", at(dir, "c"));
    snprintf(target, sizeof target, "%s", at(dir, "precious.txt"));
    tkd_test_write_text(target, "DATA the user's");
    static const char *const temps[] = {"index.yaml.tmp-*", NULL};
    struct {
        const char *name, *why;
    } cases[] = {
        {"data-5.bin", "'data-5.bin', a directory"},          /* a user's directory */
        {"data-6.bin", "'data-6.bin', a symbolic link"},      /* a link to a file that would pass */
        {"data-7.bin", "'data-7.bin', a file maker did not write (it does not begin with DATA)"},
        {"index.yaml.tmp-keep", "'index.yaml.tmp-keep', a file maker did not write"},
        {".lock", "'.lock', a file maker did not write (it holds something other than a pid)"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        assert_int_equal(tkd_owned_dir_claim(&kind, d), TKD_OK);
        fill(d);
        const char *bad = at(d, cases[i].name);
        if (i == 0) {
            assert_int_equal(tkd_mkdir_p(bad), TKD_OK);
            tkd_test_write_text(at(bad, "DATA.txt"), "DATA mine");
        } else if (i == 1) {
            assert_int_equal(symlink(target, bad), 0);
        } else {
            tkd_test_write_text(bad, "user text\n");
        }
        assert_int_equal(tkd_owned_dir_clear(&kind, d, NULL, NULL), TKD_ERR_INVALID_ARG);
        tkd_test_assert_msg_has(cases[i].why);
        tkd_test_assert_msg_has("--overwrite removes nothing there");
        assert_filled(d);
        assert_true(tkd_file_exists(bad));
        assert_int_equal(tkd_owned_dir_tidy(&kind, d, temps), TKD_ERR_INVALID_ARG);
        tkd_test_assert_msg_has(cases[i].why);
        assert_filled(d);
        assert_true(tkd_file_exists(bad));
        tkd_test_rmtree(d);
    }
    assert_true(tkd_file_exists(target));
}

/* Start-up: the proven temporaries go; the other entries (foreign names included) stay. */
static void test_tidy(void **state)
{
    const char *dir = *state; /* this test's own temp dir (TKD_TEST_EACH_DIR) */
    assert_int_equal(tkd_owned_dir_claim(&kind, dir), TKD_OK);
    fill(dir);
    tkd_test_write_text(at(dir, "index.yaml.tmp-q"), ""); /* created, then its writer died */
    tkd_test_write_text(at(dir, "notes.txt"), "mine");
    static const char *const temps[] = {"index.yaml.tmp-*", NULL};
    assert_int_equal(tkd_owned_dir_tidy(&kind, dir, temps), TKD_OK);
    assert_false(tkd_file_exists(at(dir, "index.yaml.tmp-abc123")));
    assert_false(tkd_file_exists(at(dir, "index.yaml.tmp-q")));
    assert_true(tkd_file_exists(at(dir, "index.yaml")));
    assert_true(tkd_file_exists(at(dir, "data-0.bin")));
    assert_true(tkd_file_exists(at(dir, "notes.txt")));
}

static void write_box(const char *dir, const char *step)
{
    char f[4500];
    snprintf(f, sizeof f, "%s/step.txt", dir);
    assert_int_equal(tkd_file_write_atomic(f, step, strlen(step)), TKD_OK);
}

static void assert_step(const char *dir, const char *want)
{
    void *data;
    size_t size;
    char f[4500];
    snprintf(f, sizeof f, "%s/step.txt", dir);
    assert_int_equal(tkd_read_file(f, &data, &size), TKD_OK);
    assert_string_equal(data, want);
    free(data);
}

/* Built whole: made with the marker, swapped into place; a stale ".old" goes only when proven; an
 * older version's (unmarked, with its signature) is replaced; a user's folder of that name is not. */
static void test_built_dir_rename(void **state)
{
    const char *dir = *state; /* this test's own temp dir (TKD_TEST_EACH_DIR) */
    char final[4300], old[4300], tmp[4400];
    snprintf(final, sizeof final, "%s/box", dir);
    snprintf(old, sizeof old, "%s/box.old", dir);
    assert_int_equal(tkd_built_dir_make_temp(&box, final, tmp, sizeof tmp), TKD_OK);
    assert_true(tkd_file_exists(at(tmp, TKD_BUILT_MARKER)));
    write_box(tmp, "100");
    assert_int_equal(tkd_built_dir_rename(&box, tmp, final), TKD_OK);
    assert_step(final, "100");
    /* a stale ".old" of ours (a crash) is removed first */
    assert_int_equal(tkd_built_dir_make(&box, old), TKD_OK);
    write_box(old, "50");
    assert_int_equal(tkd_built_dir_make_temp(&box, final, tmp, sizeof tmp), TKD_OK);
    write_box(tmp, "200");
    assert_int_equal(tkd_built_dir_rename(&box, tmp, final), TKD_OK);
    assert_step(final, "200");
    assert_false(tkd_file_exists(old));
    assert_false(tkd_file_exists(tmp));
    /* a user's ".old" (no marker, or a file a box never holds): refused, kept, the box unchanged */
    assert_int_equal(tkd_mkdir_p(old), TKD_OK);
    write_box(old, "mine");
    assert_int_equal(tkd_built_dir_make_temp(&box, final, tmp, sizeof tmp), TKD_OK);
    write_box(tmp, "300");
    assert_int_equal(tkd_built_dir_rename(&box, tmp, final), TKD_ERR_INVALID_ARG);
    tkd_test_assert_msg_has(old);
    tkd_test_assert_msg_has("no " TKD_BUILT_MARKER " file in it");
    assert_step(old, "mine");
    assert_step(final, "200");
    assert_int_equal(tkd_built_dir_make(&box, old), TKD_OK); /* only box files: marked now */
    tkd_test_write_text(at(old, "thesis.tex"), "mine");
    assert_int_equal(tkd_built_dir_rename(&box, tmp, final), TKD_ERR_INVALID_ARG);
    tkd_test_assert_msg_has("holds 'thesis.tex', which a box never holds");
    assert_true(tkd_file_exists(at(old, "thesis.tex")));
    assert_int_equal(tkd_built_dir_make(&box, old), TKD_ERR_INVALID_ARG); /* not taken for staging either */
    tkd_test_rmtree(old);
    /* an older version's box (no marker, its signature): replaced, and none of it left behind */
    tkd_test_rmtree(final);
    assert_int_equal(tkd_mkdir_p(final), TKD_OK);
    write_box(final, "250");
    assert_int_equal(tkd_built_dir_check(&box, final, false), TKD_ERR_INVALID_ARG);
    assert_int_equal(tkd_built_dir_check(&box, final, true), TKD_OK);
    assert_int_equal(tkd_built_dir_rename(&box, tmp, final), TKD_OK);
    assert_step(final, "300");
    assert_false(tkd_file_exists(old));
    /* a directory inside a box is never removed (nothing is removed recursively) */
    assert_int_equal(tkd_mkdir_p(at(final, "sub")), TKD_OK);
    assert_int_equal(tkd_built_dir_remove(&box, final, false), TKD_ERR_INVALID_ARG);
    tkd_test_assert_msg_has("holds 'sub', which is not a regular file");
    assert_step(final, "300");
    assert_int_equal(rmdir(at(final, "sub")), 0);
    assert_int_equal(tkd_built_dir_remove(&box, final, false), TKD_OK);
    assert_false(tkd_file_exists(final));
}

/* A crash between the two renames leaves final missing and final.old complete: recover puts it
 * back; a final.old beside final is removed — each only when proven. */
static void test_built_dir_recover(void **state)
{
    const char *dir = *state; /* this test's own temp dir (TKD_TEST_EACH_DIR) */
    char final[4300], old[4300];
    snprintf(final, sizeof final, "%s/box", dir);
    snprintf(old, sizeof old, "%s/box.old", dir);
    assert_int_equal(tkd_built_dir_recover(&box, final), TKD_OK); /* nothing there: nothing to do */
    assert_int_equal(tkd_built_dir_make(&box, old), TKD_OK);
    write_box(old, "7");
    assert_int_equal(tkd_built_dir_recover(&box, final), TKD_OK);
    assert_step(final, "7");
    assert_false(tkd_file_exists(old));
    assert_int_equal(tkd_built_dir_make(&box, old), TKD_OK);
    assert_int_equal(tkd_built_dir_recover(&box, final), TKD_OK);
    assert_false(tkd_file_exists(old));
    assert_step(final, "7");
    /* a user's box.old beside it stays, named */
    assert_int_equal(tkd_mkdir_p(old), TKD_OK);
    tkd_test_write_text(at(old, "notes.txt"), "mine");
    assert_int_equal(tkd_built_dir_recover(&box, final), TKD_ERR_INVALID_ARG);
    tkd_test_assert_msg_has("'notes.txt'");
    assert_true(tkd_file_exists(at(old, "notes.txt")));
}

/* A built directory in an owned one: proven by its marker (or, where the kind allows, an older
 * version's signature); a user's directory of a staging name stops the tidy and the clear. */
static void test_built_dir_in_owned(void **state)
{
    const char *dir = *state; /* this test's own temp dir (TKD_TEST_EACH_DIR) */
    char tmp[4400], stage[4300];
    assert_int_equal(tkd_owned_dir_claim(&kind, dir), TKD_OK);
    assert_int_equal(tkd_built_dir_make_temp(&box, at(dir, "box"), tmp, sizeof tmp), TKD_OK);
    write_box(tmp, "1");
    static const char *const temps[] = {"box.tmp-*", NULL};
    assert_int_equal(tkd_owned_dir_tidy(&kind, dir, temps), TKD_OK);
    assert_false(tkd_file_exists(tmp));
    /* a user's copy of a box under a staging name (no marker): kept, named */
    snprintf(stage, sizeof stage, "%s", at(dir, "box.tmp-keep"));
    assert_int_equal(tkd_mkdir_p(stage), TKD_OK);
    write_box(stage, "mine");
    assert_int_equal(tkd_owned_dir_tidy(&kind, dir, temps), TKD_ERR_INVALID_ARG);
    tkd_test_assert_msg_has("'box.tmp-keep', a directory maker did not build");
    assert_int_equal(tkd_owned_dir_clear(&kind, dir, NULL, NULL), TKD_ERR_INVALID_ARG);
    assert_step(stage, "mine");
    tkd_test_rmtree(stage);
    /* an older version's "box" (allowed for that name): cleared */
    assert_int_equal(tkd_mkdir_p(at(dir, "box")), TKD_OK);
    write_box(at(dir, "box"), "2");
    assert_int_equal(tkd_owned_dir_clear(&kind, dir, NULL, NULL), TKD_OK);
    assert_false(tkd_file_exists(at(dir, "box")));
}

TKD_TEST_MAIN_EACH_DIR(test_claim, test_clear, test_name_is_no_proof, test_tidy, test_built_dir_rename,
    test_built_dir_recover, test_built_dir_in_owned)
