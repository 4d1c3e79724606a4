/* test_config.c — YAML config through a schema: defaults, file, --set, errors with line:column,
 * print -> reload round trip, --help. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "common/config.h"
#include "tests/testutil.h"

typedef struct test_cfg {
    char *out_dir;
    int seed;
    struct {
        double temperature;
        double alpha;
        int loss;
        int top_k;
    } kd;
    struct {
        int64_t steps;
        bool bf16;
        tkd_strlist files;
        struct {
            double lr;
            char *name;
        } optim;
    } train;
} test_cfg;

static const char *const loss_names[] = {"renorm", "tail", "sampled", NULL};

static const tkd_config_field test_fields[] = {
    TKD_CFG_STRING(test_cfg, out_dir, "out_dir", "runs/demo", "Where the run is written."),
    TKD_CFG_INT(test_cfg, seed, "seed", "1234", 0, 1000000, "RNG seed."),
    TKD_CFG_FLOAT(test_cfg, kd.temperature, "kd.temperature", "2.0", 0.01, 100, "Softmax temperature."),
    TKD_CFG_FLOAT(test_cfg, kd.alpha, "kd.alpha", "0.5", 0, 1, "Weight of the KD term."),
    TKD_CFG_ENUM(test_cfg, kd.loss, "kd.loss", "renorm", loss_names, "KD loss variant."),
    TKD_CFG_INT(test_cfg, kd.top_k, "kd.top_k", "64", 1, 1024, "Teacher columns used."),
    TKD_CFG_INT64(test_cfg, train.steps, "train.steps", "1000", 1, 1e12, "Optimizer steps."),
    TKD_CFG_BOOL(test_cfg, train.bf16, "train.bf16", "false", "Compute in bf16."),
    TKD_CFG_STRING_LIST(test_cfg, train.files, "train.files", "[a.bin, b.bin]", "Token files."),
    TKD_CFG_FLOAT(test_cfg, train.optim.lr, "train.optim.lr", "3e-4", 0, 1, "Peak learning rate."),
    TKD_CFG_STRING(test_cfg, train.optim.name, "train.optim.name", NULL, "Optimizer label."),
};
static const tkd_config_schema schema = TKD_CONFIG_SCHEMA("test-tool", test_fields);

/* Writes text to <the group temp dir>/name and returns the path (tkd_test_path's buffer). */
static const char *write_yaml(const char *name, const char *text)
{
    const char *path = tkd_test_path(tkd_test_group_dir, name);
    tkd_test_write_text(path, text);
    return path;
}

/* Loads defaults + the YAML text; returns the status, message in tkd_error_msg(). */
static tkd_status load_text(test_cfg *c, const char *text)
{
    assert_int_equal(tkd_config_defaults(&schema, c), TKD_OK);
    return tkd_config_apply_file(&schema, c, write_yaml("c.yaml", text));
}

/* Asserts the message contains "c.yaml:<where>: " and each of the extra fragments. */
static void expect_error(const char *where, const char *frag1, const char *frag2)
{
    char want[64];
    snprintf(want, sizeof want, "c.yaml:%s: ", where);
    const char *msg = tkd_error_msg();
    if (!strstr(msg, want) || (frag1 && !strstr(msg, frag1)) || (frag2 && !strstr(msg, frag2)))
        fail_msg("message '%s' lacks '%s' / '%s' / '%s'", msg, want, frag1 ? frag1 : "",
                 frag2 ? frag2 : "");
    assert_null(strchr(msg, '\n')); /* one line */
}

static void test_defaults_fill_missing_keys(void **state)
{
    (void)state;
    test_cfg c = {0};
    assert_int_equal(load_text(&c, "kd:\n  alpha: 0.25\ntrain:\n  optim:\n    lr: 1e-3\n"), TKD_OK);
    assert_true(c.kd.alpha == 0.25);
    assert_true(c.train.optim.lr == 1e-3);
    assert_true(c.kd.temperature == 2.0); /* default */
    assert_int_equal(c.kd.loss, 0);
    assert_int_equal(c.kd.top_k, 64);
    assert_int_equal(c.seed, 1234);
    assert_true(c.train.steps == 1000);
    assert_false(c.train.bf16);
    assert_string_equal(c.out_dir, "runs/demo");
    assert_string_equal(c.train.optim.name, "");
    assert_int_equal(c.train.files.n, 2);
    assert_string_equal(c.train.files.items[1], "b.bin");
    tkd_config_free(&schema, &c);
    tkd_config_free(&schema, &c); /* twice is harmless */
}

static void test_value_forms(void **state)
{
    (void)state;
    test_cfg c = {0};
    /* dotted keys at the top level, a single string as a list, 1e6 as an integer, yes as bool */
    assert_int_equal(load_text(&c, "kd.loss: tail\ntrain:\n  files: only.bin\n  steps: 1e6\n"
                                   "  bf16: yes\nout_dir: 'null'\nseed:\n"
                                   "  # comment only\n"),
                     TKD_ERR_CONFIG);
    expect_error("7:1", "seed: expected an integer, got ''", NULL); /* null value for an int */
    tkd_config_free(&schema, &c);
    assert_int_equal(load_text(&c, "kd.loss: tail\ntrain:\n  files: only.bin\n  steps: 1e6\n"
                                   "  bf16: yes\nout_dir: 'null'\n"),
                     TKD_OK);
    assert_int_equal(c.kd.loss, 1);
    assert_int_equal(c.train.files.n, 1);
    assert_string_equal(c.train.files.items[0], "only.bin");
    assert_true(c.train.steps == 1000000);
    assert_true(c.train.bf16);
    assert_string_equal(c.out_dir, "null"); /* quoted: a string, not null */
    tkd_config_free(&schema, &c);
    /* an empty file and a file with only comments change nothing */
    assert_int_equal(load_text(&c, ""), TKD_OK);
    assert_int_equal(tkd_config_apply_file(&schema, &c, write_yaml("e.yaml", "# nothing\n")), TKD_OK);
    assert_int_equal(c.seed, 1234);
    tkd_config_free(&schema, &c);
}

static void test_unknown_key(void **state)
{
    (void)state;
    test_cfg c = {0};
    assert_int_equal(load_text(&c, "kd:\n  alpha: 0.5\n  temprature: 3\n"), TKD_ERR_CONFIG);
    expect_error("3:3", "unknown key 'kd.temprature' (did you mean 'kd.temperature'?)",
                 "keys allowed under 'kd': temperature, alpha, loss, top_k");
    tkd_config_free(&schema, &c);
    /* right name at the wrong level */
    assert_int_equal(load_text(&c, "seed: 3\nlr: 0.1\n"), TKD_ERR_CONFIG);
    expect_error("2:1", "did you mean 'train.optim.lr'?",
                 "keys allowed at the top level: out_dir, seed, kd, train");
    tkd_config_free(&schema, &c);
    /* a section given a scalar */
    assert_int_equal(load_text(&c, "train: 5\n"), TKD_ERR_CONFIG);
    expect_error("1:8", "'train' is a section", "steps, bf16, files, optim");
    tkd_config_free(&schema, &c);
}

static void test_wrong_type(void **state)
{
    (void)state;
    test_cfg c = {0};
    assert_int_equal(load_text(&c, "kd:\n  alpha: abc\n"), TKD_ERR_CONFIG);
    expect_error("2:10", "kd.alpha: expected a finite number, got 'abc'", NULL);
    tkd_config_free(&schema, &c);
    assert_int_equal(load_text(&c, "seed: \"7\"\n"), TKD_ERR_CONFIG);
    expect_error("1:7", "seed: expected an integer, got the quoted string '7'", NULL);
    tkd_config_free(&schema, &c);
    assert_int_equal(load_text(&c, "train:\n  bf16: 1\n"), TKD_ERR_CONFIG);
    expect_error("2:9", "train.bf16: expected true or false, got '1'", NULL);
    tkd_config_free(&schema, &c);
    assert_int_equal(load_text(&c, "out_dir: [a, b]\n"), TKD_ERR_CONFIG);
    expect_error("1:10", "out_dir: expected a string, got a sequence", NULL);
    tkd_config_free(&schema, &c);
    assert_int_equal(load_text(&c, "kd:\n  top_k: 2.5\n"), TKD_ERR_CONFIG);
    expect_error("2:10", "kd.top_k: expected an integer, got '2.5'", NULL);
    tkd_config_free(&schema, &c);
    assert_int_equal(load_text(&c, "train:\n  files: [a, {b: 1}]\n"), TKD_ERR_CONFIG);
    expect_error("2:14", "train.files: expected a list of strings, got a mapping", NULL);
    tkd_config_free(&schema, &c);
    assert_int_equal(load_text(&c, "- a\n- b\n"), TKD_ERR_CONFIG);
    expect_error("1:1", "expected a mapping of keys at the top level", NULL);
    tkd_config_free(&schema, &c);
}

static void test_out_of_range(void **state)
{
    (void)state;
    test_cfg c = {0};
    assert_int_equal(load_text(&c, "kd:\n  temperature: 0\n"), TKD_ERR_CONFIG);
    expect_error("2:16", "kd.temperature = 0 is out of range; it must be in [0.01, 100]", NULL);
    tkd_config_free(&schema, &c);
    assert_int_equal(load_text(&c, "kd: {top_k: 1025}\n"), TKD_ERR_CONFIG);
    expect_error("1:13", "kd.top_k = 1025 is out of range; it must be in [1, 1024]", NULL);
    tkd_config_free(&schema, &c);
    assert_int_equal(load_text(&c, "seed: 99999999999\n"), TKD_ERR_CONFIG);
    expect_error("1:7", "does not fit a 32-bit int", NULL);
    tkd_config_free(&schema, &c);
    /* overflow is refused, not saturated; hex floats are not integers */
    assert_int_equal(load_text(&c, "seed: 99999999999999999999\n"), TKD_ERR_CONFIG);
    expect_error("1:7", "seed: expected an integer, got '99999999999999999999'", NULL);
    tkd_config_free(&schema, &c);
    assert_int_equal(load_text(&c, "seed: 0x1p3\n"), TKD_ERR_CONFIG);
    expect_error("1:7", "seed: expected an integer, got '0x1p3'", NULL);
    tkd_config_free(&schema, &c);
    /* bounds are inclusive */
    assert_int_equal(load_text(&c, "kd: {top_k: 1024, temperature: 100}\n"), TKD_OK);
    assert_int_equal(c.kd.top_k, 1024);
    tkd_config_free(&schema, &c);
}

static void test_bad_enum(void **state)
{
    (void)state;
    test_cfg c = {0};
    assert_int_equal(load_text(&c, "kd:\n  loss: dense\n"), TKD_ERR_CONFIG);
    expect_error("2:9", "kd.loss: 'dense' is not one of: renorm, tail, sampled", NULL);
    tkd_config_free(&schema, &c);
}

static void test_duplicate_key(void **state)
{
    (void)state;
    test_cfg c = {0};
    assert_int_equal(load_text(&c, "seed: 1\nout_dir: x\nseed: 2\n"), TKD_ERR_CONFIG);
    expect_error("3:1", "duplicate key 'seed' (first at line 1)", NULL);
    tkd_config_free(&schema, &c);
    /* the same key through a nested and a dotted spelling */
    assert_int_equal(load_text(&c, "kd:\n  alpha: 0.5\nkd.alpha: 0.3\n"), TKD_ERR_CONFIG);
    expect_error("3:1", "duplicate key 'kd.alpha' (first set at line 2)", NULL);
    tkd_config_free(&schema, &c);
    /* a repeated section with different keys is still a duplicate */
    assert_int_equal(load_text(&c, "kd:\n  alpha: 0.5\nseed: 3\nkd:\n  loss: tail\n"), TKD_ERR_CONFIG);
    expect_error("4:1", "duplicate key 'kd' (first at line 1)", NULL);
    tkd_config_free(&schema, &c);
}

static void test_yaml_syntax_error(void **state)
{
    (void)state;
    test_cfg c = {0};
    /* libyaml reports an unclosed flow sequence where the stream ends */
    assert_int_equal(load_text(&c, "kd:\n  alpha: 0.5\ntrain:\n  files: [a, b\n"), TKD_ERR_CONFIG);
    expect_error("5:1", "YAML syntax error", NULL);
    tkd_config_free(&schema, &c);
    /* a tab where indentation is expected */
    assert_int_equal(load_text(&c, "kd:\n\talpha: 0.5\n"), TKD_ERR_CONFIG);
    expect_error("2:1", "YAML syntax error", "cannot start any token");
    tkd_config_free(&schema, &c);
    assert_int_equal(load_text(&c, "seed: 1\n---\nseed: 2\n"), TKD_ERR_CONFIG);
    expect_error("3:1", "second YAML document", NULL);
    tkd_config_free(&schema, &c);
}

static void test_set_overrides(void **state)
{
    (void)state;
    test_cfg c = {0};
    const char *path = write_yaml("o.yaml", "kd:\n  temperature: 3\ntrain:\n  optim:\n    lr: 0.01\n");
    const char *sets[] = {"kd.temperature=4.5", "train.optim.lr=2e-3", "train.files=[x, 'y z']",
                          "kd.temperature=5", "train.optim.name='adamw: v2'"};
    assert_int_equal(tkd_config_load(&schema, &c, path, sets, 5), TKD_OK);
    assert_true(c.kd.temperature == 5.0); /* the later --set wins */
    assert_true(c.train.optim.lr == 2e-3);
    assert_string_equal(c.train.optim.name, "adamw: v2");
    assert_int_equal(c.train.files.n, 2);
    assert_string_equal(c.train.files.items[1], "y z");
    tkd_config_free(&schema, &c);

    assert_int_equal(tkd_config_defaults(&schema, &c), TKD_OK);
    assert_int_equal(tkd_config_apply_set(&schema, &c, "kd.temprature=3"), TKD_ERR_CONFIG);
    assert_non_null(strstr(tkd_error_msg(), "--set kd.temprature: unknown key"));
    assert_non_null(strstr(tkd_error_msg(), "did you mean 'kd.temperature'?"));
    assert_int_equal(tkd_config_apply_set(&schema, &c, "kdd.alpha=3"), TKD_ERR_CONFIG);
    assert_non_null(strstr(tkd_error_msg(), "--set kdd.alpha: unknown key 'kdd.alpha' (did you mean 'kd.alpha'?)"));
    /* a section named as a key: said so, never "did you mean" the very key typed (that was the
     * hint for both, with "unknown key") */
    assert_int_equal(tkd_config_apply_set(&schema, &c, "kd=3"), TKD_ERR_CONFIG);
    assert_string_equal(tkd_error_msg(), "--set kd: 'kd' is a section, not a key; set one of its keys: "
                                         "temperature, alpha, loss, top_k");
    assert_int_equal(tkd_config_apply_set(&schema, &c, "train.optim=3"), TKD_ERR_CONFIG);
    assert_string_equal(tkd_error_msg(), "--set train.optim: 'train.optim' is a section, not a key; set one of "
                                         "its keys: lr, name");
    const char *cands[] = {"seed", "speed"};
    assert_string_equal(tkd_config_suggest("seed", cands, 2), "speed");
    assert_null(tkd_config_suggest("seed", cands, 1));
    assert_int_equal(tkd_config_apply_set(&schema, &c, "kd.alpha=2"), TKD_ERR_CONFIG);
    assert_string_equal(tkd_error_msg(),
                        "--set kd.alpha=2: kd.alpha = 2 is out of range; it must be in [0, 1]");
    assert_int_equal(tkd_config_apply_set(&schema, &c, "kd.loss=x"), TKD_ERR_CONFIG);
    assert_non_null(strstr(tkd_error_msg(), "'x' is not one of: renorm, tail, sampled"));
    assert_int_equal(tkd_config_apply_set(&schema, &c, "seed"), TKD_ERR_CONFIG);
    assert_non_null(strstr(tkd_error_msg(), "expected key=value"));
    assert_int_equal(tkd_config_apply_set(&schema, &c, "seed=[1"), TKD_ERR_CONFIG);
    assert_non_null(strstr(tkd_error_msg(), "--set seed=[1: YAML syntax error"));
    /* a value is YAML: "a: b" is a mapping, so a string with ": " needs quotes */
    assert_int_equal(tkd_config_apply_set(&schema, &c, "out_dir=a: b"), TKD_ERR_CONFIG);
    assert_string_equal(tkd_error_msg(), "--set out_dir=a: b: out_dir: expected a string, got a mapping");
    assert_int_equal(tkd_config_apply_set(&schema, &c, "out_dir="), TKD_OK);
    assert_string_equal(c.out_dir, "");
    tkd_config_free(&schema, &c);
}

static void test_print_reload_round_trip(void **state)
{
    (void)state;
    test_cfg a = {0}, b = {0};
    const char *sets[] = {
        "out_dir='null'", "seed=0", "kd.temperature=0.1", "kd.alpha=0.3333333333333333",
        "kd.loss=sampled", "kd.top_k=1", "train.steps=123456789012", "train.bf16=true",
        "train.files=['', 'a, b', '#x', 'ünï', \"q'\\\"\", '~', ' lead']",
        "train.optim.lr=1e-300", "train.optim.name='two\\nlines: yes'",
    };
    assert_int_equal(tkd_config_load(&schema, &a, NULL, sets, sizeof sets / sizeof sets[0]), TKD_OK);
    assert_string_equal(a.out_dir, "null");
    assert_int_equal(a.train.files.n, 7);
    assert_string_equal(a.train.files.items[4], "q'\"");

    char path[4200];
    snprintf(path, sizeof path, "%s/printed.yaml", tkd_test_group_dir);
    FILE *fp = fopen(path, "w");
    assert_non_null(fp);
    assert_int_equal(tkd_config_print(&schema, &a, fp), TKD_OK);
    fclose(fp);
    assert_int_equal(tkd_config_load(&schema, &b, path, NULL, 0), TKD_OK);
    assert_true(tkd_config_equal(&schema, &a, &b));
    b.kd.alpha = 0.5;
    assert_false(tkd_config_equal(&schema, &a, &b)); /* equal() can say no */

    /* defaults round trip too, and print nests sections */
    tkd_config_free(&schema, &a);
    assert_int_equal(tkd_config_defaults(&schema, &a), TKD_OK);
    char *buf = NULL; /* tkd_config_to_text: the same document as a string */
    assert_int_equal(tkd_config_to_text(&schema, &a, &buf), TKD_OK);
    assert_non_null(strstr(buf, "kd:\n  temperature: 2.0\n"));
    assert_non_null(strstr(buf, "  optim:\n    lr: 0.0003\n"));
    assert_int_equal(tkd_config_apply_string(&schema, &b, "printed", buf, strlen(buf)), TKD_OK);
    assert_true(tkd_config_equal(&schema, &a, &b));
    free(buf);
    tkd_config_free(&schema, &a);
    tkd_config_free(&schema, &b);
}

static void test_help_lists_every_key(void **state)
{
    (void)state;
    char *buf = NULL;
    size_t len = 0;
    FILE *mem = open_memstream(&buf, &len);
    tkd_config_print_help(&schema, mem);
    fclose(mem);
    for (size_t i = 0; i < schema.nfields; i++) {
        const tkd_config_field *f = &schema.fields[i];
        char want[256];
        snprintf(want, sizeof want, "  %s  (%s, default %s", f->key, tkd_config_type_name(f->type),
                 f->def ? f->def : (f->type == TKD_CONFIG_STRING ? "\"\"" : "[]"));
        if (!strstr(buf, want))
            fail_msg("help lacks '%s':\n%s", want, buf);
        assert_non_null(strstr(buf, f->help));
    }
    assert_non_null(strstr(buf, "(float, default 2.0, range [0.01, 100])"));
    assert_non_null(strstr(buf, "(enum, default renorm, one of: renorm, tail, sampled)"));
    assert_non_null(strstr(buf, "(int64, default 1000, range [1, 1000000000000])"));
    free(buf);
}

typedef struct bad_cfg {
    int a, b, c;
} bad_cfg;

static void test_schema_check(void **state)
{
    (void)state;
    static const tkd_config_field split[] = {
        TKD_CFG_INT(bad_cfg, a, "x.a", "1", 0, 9, ""),
        TKD_CFG_INT(bad_cfg, b, "y", "1", 0, 9, ""),
        TKD_CFG_INT(bad_cfg, c, "x.c", "1", 0, 9, ""),
    };
    static const tkd_config_field leaf_and_section[] = {
        TKD_CFG_INT(bad_cfg, a, "x", "1", 0, 9, ""),
        TKD_CFG_INT(bad_cfg, b, "x.b", "1", 0, 9, ""),
    };
    static const tkd_config_field bad_default[] = {
        TKD_CFG_INT(bad_cfg, a, "a", "10", 0, 9, ""),
    };
    const tkd_config_schema s1 = TKD_CONFIG_SCHEMA("t", split);
    const tkd_config_schema s2 = TKD_CONFIG_SCHEMA("t", leaf_and_section);
    const tkd_config_schema s3 = TKD_CONFIG_SCHEMA("t", bad_default);
    bad_cfg c = {0};
    assert_int_equal(tkd_config_check_schema(&s1), TKD_ERR_INTERNAL);
    assert_non_null(strstr(tkd_error_msg(), "keys under 'x' are not adjacent"));
    assert_int_equal(tkd_config_check_schema(&s2), TKD_ERR_INTERNAL);
    assert_int_equal(tkd_config_defaults(&s3, &c), TKD_ERR_INTERNAL);
    assert_non_null(strstr(tkd_error_msg(), "default of 'a'"));
    assert_int_equal(tkd_config_check_schema(&schema), TKD_OK);
}

static void test_missing_file(void **state)
{
    (void)state;
    test_cfg c = {0};
    assert_int_equal(tkd_config_load(&schema, &c, "/nonexistent/x.yaml", NULL, 0), TKD_ERR_NOT_FOUND);
    assert_non_null(strstr(tkd_error_msg(), "/nonexistent/x.yaml: cannot open config file"));
    tkd_config_free(&schema, &c);
}

/* Mutated configs (byte flips, insertions of YAML punctuation, truncation) must each load or fail
 * with TKD_ERR_CONFIG and a one-line message naming the source; never crash (run under ASan). */
static void test_fuzz_mutations(void **state)
{
    (void)state;
    static const char base[] = "out_dir: runs/x\nseed: 7\nkd:\n  temperature: 2.5\n  loss: tail\n"
                               "train:\n  files: [a, 'b c']\n  optim: {lr: 0.01, name: adam}\n";
    static const char punct[] = ":-[]{},'\"#&*!|>%@ \n\t.~";
    uint64_t x = 0x1234567;
    char buf[sizeof base];
    int ok = 0;
    for (int iter = 0; iter < 3000; iter++) {
        memcpy(buf, base, sizeof base);
        size_t len = sizeof base - 1;
        for (int m = 0; m < 1 + iter % 3 && len > 0; m++) {
            x ^= x << 13, x ^= x >> 7, x ^= x << 17; /* xorshift64 */
            size_t pos = (size_t)(x >> 8) % len;
            if ((x & 3) == 0)
                len = pos; /* truncate */
            else
                buf[pos] = (x & 3) == 1 ? (char)(x >> 40) : punct[(x >> 40) % (sizeof punct - 1)];
        }
        test_cfg c = {0};
        assert_int_equal(tkd_config_defaults(&schema, &c), TKD_OK);
        tkd_status st = tkd_config_apply_string(&schema, &c, "fuzz", buf, len);
        if (st == TKD_OK) {
            ok++;
        } else {
            assert_int_equal(st, TKD_ERR_CONFIG);
            assert_true(strncmp(tkd_error_msg(), "fuzz:", 5) == 0);
        }
        tkd_config_free(&schema, &c);
    }
    assert_true(ok > 0 && ok < 3000); /* both outcomes were exercised */
}

static tkd_status open_broken(const char *path)
{
    test_cfg c = {0};
    assert_int_equal(tkd_config_defaults(&schema, &c), TKD_OK);
    tkd_status st = tkd_config_apply_file(&schema, &c, path);
    tkd_config_free(&schema, &c);
    return st;
}

static void test_broken_files(void **state)
{
    (void)state;
    assert_true(tkd_test_broken_files("cfg_", open_broken) >= 2);
}

/* Nesting is bounded at TKD_YAML_MAX_DEPTH (64) levels, counting the top-level mapping: libyaml
 * takes time quadratic in the depth, so 100,000 levels took over a minute before being refused. */
static void test_nesting_depth(void **state)
{
    (void)state;
    enum { DEEP = 100000 };
    char *text = malloc(2 * DEEP + 64);
    assert_non_null(text);
    int n = sprintf(text, "train:\n  files: ");
    memset(text + n, '[', DEEP);
    memset(text + n + DEEP, ']', DEEP);
    strcpy(text + n + 2 * DEEP, "\n");
    test_cfg c = {0};
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    assert_int_equal(load_text(&c, text), TKD_ERR_CONFIG);
    clock_gettime(CLOCK_MONOTONIC, &t1);
    /* the 63rd '[' is the 65th level: top mapping, train, then the lists */
    expect_error("2:72", "YAML nested deeper than 64 levels", NULL);
    assert_true((double)(t1.tv_sec - t0.tv_sec) + 1e-9 * (double)(t1.tv_nsec - t0.tv_nsec) < 5.0);
    tkd_config_free(&schema, &c);
    /* 64 levels are read (and then refused for their type, not their depth) */
    strcpy(text + n, "[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[");  /* 62 */
    memset(text + n + 62, ']', 62);
    strcpy(text + n + 124, "\n");
    assert_int_equal(load_text(&c, text), TKD_ERR_CONFIG);
    expect_error("2:11", "train.files: expected a list of strings, got a sequence", NULL);
    tkd_config_free(&schema, &c);
    /* --set values go through the same check */
    assert_int_equal(tkd_config_defaults(&schema, &c), TKD_OK);
    strcpy(text, "train.files=");
    memset(text + 12, '[', 100);
    memset(text + 112, ']', 100);
    text[212] = '\0';
    assert_int_equal(tkd_config_apply_set(&schema, &c, text), TKD_ERR_CONFIG);
    tkd_test_assert_msg_has("YAML nested deeper than 64 levels at column 65");
    tkd_config_free(&schema, &c);
    free(text);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_defaults_fill_missing_keys),
        cmocka_unit_test(test_value_forms),
        cmocka_unit_test(test_unknown_key),
        cmocka_unit_test(test_wrong_type),
        cmocka_unit_test(test_out_of_range),
        cmocka_unit_test(test_bad_enum),
        cmocka_unit_test(test_duplicate_key),
        cmocka_unit_test(test_yaml_syntax_error),
        cmocka_unit_test(test_set_overrides),
        cmocka_unit_test(test_print_reload_round_trip),
        cmocka_unit_test(test_help_lists_every_key),
        cmocka_unit_test(test_schema_check),
        cmocka_unit_test(test_missing_file),
        cmocka_unit_test(test_fuzz_mutations),
        cmocka_unit_test(test_broken_files),
        cmocka_unit_test(test_nesting_depth),
    };
    return cmocka_run_group_tests(tests, tkd_test_group_dir_setup, tkd_test_group_dir_teardown);
}
