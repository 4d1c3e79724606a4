/* test_student_sweep.c — `student-train sweep` (student_train/sweep.h, docs/student-train.md
 * "Sweeps"): three tiny CPU ablations of one base config, one of them broken (kd.topk beyond the
 * cache's k). The table (terminal, sweep.md, sweep.csv) holds each run's last evaluation as its
 * metrics.jsonl has it and the broken run as failed with its message, while the others finish;
 * sweep.svg draws one curve per run that evaluated; a sweep killed inside its third run (SIGKILL,
 * the test build's hook) and run again resumes to the table and files of a sweep never stopped;
 * two files of one name, or a sweep.md student-train did not write, stop it before any run. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "student_train/sweep.h"
#include "student_train/sweep_plot.h"
#include "tests/testutil.h"

#define BIN TKD_BINARY_DIR "/bin/student-train-testhooks"

/* <dir>/cache, <dir>/base.yaml (a tiny student: 6 steps, evaluated and checkpointed every 2) and
 * the ablations <dir>/a.yaml, b.yaml (broken), c.yaml. */
static void make_fixture(const char *dir)
{
    char cache[4200], text[9000];
    snprintf(cache, sizeof cache, "%s/cache", dir);
    tkd_test_teacher_opts o = {.vocab = 64, .hidden = 16, .seq_len = 16, .k = 8, .temperature = 1.0f,
                               .num_seq = 40, .shard_seqs = 20, .seed = 13};
    assert_int_equal(tkd_test_teacher_cache(cache, &o), TKD_OK);
    snprintf(text, sizeof text,
             "data: {cache: '%s', val_fraction: 0.2}\n"
             "model: {hidden_size: 32, intermediate_size: 64, num_layers: 1, num_heads: 2, num_kv_heads: 2,\n"
             "        max_position_embeddings: 16}\n"
             "train: {batch_size: 4, max_steps: 6, eval_interval: 2, checkpoint_interval: 2, log_interval: 1}\n"
             "device: cpu\n",
             cache);
    tkd_test_write_text(tkd_test_path(dir, "base.yaml"), text);
    tkd_test_write_text(tkd_test_path(dir, "a.yaml"), "kd.alpha: 0.5\n");
    tkd_test_write_text(tkd_test_path(dir, "b.yaml"), "kd.topk: 99\n");
    tkd_test_write_text(tkd_test_path(dir, "c.yaml"), "kd.alpha: 1\nkd.temperature: 2\n");
}

/* student-train sweep --config base.yaml a b c --dir <dir>/<sweep>, with the kill hook at kill
 * steps (0: none); its exit code, its output in *out (malloc'd; NULL: dropped). */
static int sweep(const char *dir, const char *sweep_name, int kill, char **out)
{
    char base[4200], a[4200], b[4200], c[4200], sdir[4200], log[4300], env[64];
    snprintf(base, sizeof base, "%s/base.yaml", dir);
    snprintf(a, sizeof a, "%s/a.yaml", dir);
    snprintf(b, sizeof b, "%s/b.yaml", dir);
    snprintf(c, sizeof c, "%s/c.yaml", dir);
    snprintf(sdir, sizeof sdir, "%s/%s", dir, sweep_name);
    snprintf(log, sizeof log, "%s/%s-%d.out", dir, sweep_name, kill);
    snprintf(env, sizeof env, "TKD_TRAIN_TEST_KILL_AFTER_STEPS=%d", kill);
    const char *args[] = {"sweep", "--config", base, a, b, c, "--dir", sdir, NULL};
    int rc = tkd_test_run(BIN, args, kill ? env : NULL, log);
    char *text = tkd_test_slurp(log, NULL);
    if (out)
        *out = text;
    else
        free(text);
    return rc;
}

static char *slurp_in(const char *dir, const char *sweep_name, const char *file)
{
    char path[4600];
    snprintf(path, sizeof path, "%s/%s/%s", dir, sweep_name, file);
    return tkd_test_slurp(path, NULL);
}

/* The CSV line of run name (a static copy, its '\n' cut). */
static const char *csv_line(const char *csv, const char *name)
{
    static char line[2048];
    char pat[64];
    snprintf(pat, sizeof pat, "\n%s,", name);
    const char *l = strstr(csv, pat);
    if (!l)
        fail_msg("no row %s in:\n%s", name, csv);
    snprintf(line, sizeof line, "%.*s", (int)strcspn(l + 1, "\n"), l + 1);
    return line;
}

/* A successful run's row equals its metrics.jsonl's last evaluation. */
static void check_ok_row(const char *dir, const char *csv, const char *name)
{
    char metrics[4600], status[16];
    snprintf(metrics, sizeof metrics, "%s/s/%s/metrics.jsonl", dir, name);
    double ce[16], ppl[16], kd[16], top1[16], best[16], rate;
    int n = tkd_test_metrics(metrics, "eval", "val_ce", ce, 16);
    assert_int_equal(n, 3); /* steps 2, 4 and the end */
    tkd_test_metrics(metrics, "eval", "val_ppl", ppl, 16);
    tkd_test_metrics(metrics, "eval", "val_kd", kd, 16);
    tkd_test_metrics(metrics, "eval", "top1_agree", top1, 16);
    tkd_test_metrics(metrics, "eval", "best_step", best, 16);
    double v[5];
    long long best_step, steps;
    const char *line = csv_line(csv, name);
    char fmt[128];
    snprintf(fmt, sizeof fmt, "%s,%%15[^,],%%lf,%%lf,%%lf,%%lf,%%lf,%%lld,%%lld,", name);
    if (sscanf(line, fmt, status, &v[0], &v[1], &v[2], &v[3], &rate, &best_step, &steps) != 8)
        fail_msg("row '%s' does not parse", line);
    assert_string_equal(status, "ok");
    /* the CSV prints %.9g as metrics.jsonl does: the same numbers */
    assert_true(v[0] == ce[2] && v[1] == ppl[2] && v[2] == kd[2] && v[3] == top1[2]);
    assert_int_equal(best_step, (long long)best[2]);
    assert_int_equal(steps, 6);
    assert_true(rate > 0);
}

static int count(const char *text, const char *needle)
{
    int n = 0;
    for (const char *p = strstr(text, needle); p; p = strstr(p + 1, needle))
        n++;
    return n;
}

static void test_sweep_table(void **state)
{
    const char *dir = *state;
    make_fixture(dir);
    char *out = NULL;
    assert_int_equal(sweep(dir, "s", 0, &out), 1); /* b failed: exit 1, after the others ran */
    if (!strstr(out, "run  status  val CE") || !strstr(out, "b failed: ") || !strstr(out, "kd.topk = 99") ||
        !strstr(out, "sweep: 1 of 3 runs failed"))
        fail_msg("terminal output:\n%s", out);
    char *csv = slurp_in(dir, "s", "sweep.csv");
    const char *head = "name,status,val_ce,val_ppl,val_kd,top1_agree,tokens_per_s,best_step,steps,error\n";
    assert_true(strncmp(csv, head, strlen(head)) == 0);
    assert_int_equal(count(csv, "\n"), 4);
    check_ok_row(dir, csv, "a");
    check_ok_row(dir, csv, "c");
    const char *b = csv_line(csv, "b");
    if (strncmp(b, "b,failed,,,,,,,,\"", 17) != 0 || !strstr(b, "kd.topk = 99 but the cache"))
        fail_msg("row b: %s", b);
    char *md = slurp_in(dir, "s", "sweep.md");
    if (!strstr(md, "| run | status | val CE | ppl | KD | top-1 | tokens/s | best step |") ||
        !strstr(md, "| a | ok | ") || !strstr(md, "| b | failed | - | - | - | - | - | - |") ||
        !strstr(md, "**b failed:** `") || !strstr(md, "kd.topk = 99"))
        fail_msg("sweep.md:\n%s", md);
    char *svg = slurp_in(dir, "s", "sweep.svg");
    const char *svg_head = "<!-- student-train sweep: validation curves -->\n<svg ";
    assert_true(strncmp(svg, svg_head, strlen(svg_head)) == 0);
    assert_int_equal(count(svg, "<polyline"), 3); /* a and c with points; b's legend entry only */
    assert_int_equal(count(svg, "points=\"\""), 1);
    assert_non_null(strstr(svg, ">a</text>"));
    assert_non_null(strstr(svg, ">b (failed)</text>"));
    assert_non_null(strstr(svg, ">c</text>"));
    assert_non_null(strstr(svg, "</svg>\n"));
    free(out);
    free(csv);
    free(md);
    free(svg);
}

/* The CSV without its tokens/s column (timing, the one thing two sweeps write differently). */
static char *csv_without_rate(char *csv)
{
    for (char *l = csv; l && *l; l = strchr(l, '\n') ? strchr(l, '\n') + 1 : NULL) {
        char *f = l;
        for (int k = 0; k < 6 && f; k++)
            f = strchr(f + 1, ',');
        char *g = f ? strchr(f + 1, ',') : NULL;
        if (g)
            memmove(f, g, strlen(g) + 1);
    }
    return csv;
}

/* Killed after 9 steps: a finished (6), b failed, c at step 3 (its checkpoint at 2). Run again, a
 * is finished already, b fails again, c resumes: the table equals a sweep's never stopped (tokens/s
 * aside), a's tokens/s is kept from the first attempt, and c's files are those of c in that sweep. */
static void test_sweep_resumes_after_kill(void **state)
{
    const char *dir = *state;
    make_fixture(dir);
    assert_int_equal(sweep(dir, "straight", 0, NULL), 1);
    char *killed = NULL, *again = NULL;
    assert_int_equal(sweep(dir, "k", 9, &killed), 1000 + 9);
    char *partial = slurp_in(dir, "k", "sweep.csv"); /* the rows of a and b, written as they ended */
    assert_int_equal(count(partial, "\n"), 3);
    assert_int_equal(sweep(dir, "k", 0, &again), 1);
    if (!strstr(again, "c: resuming") || !strstr(again, "a: finished at step 6 already"))
        fail_msg("re-run output:\n%s", again);
    char *sa = slurp_in(dir, "straight", "sweep.csv"), *sk = slurp_in(dir, "k", "sweep.csv");
    assert_string_equal(csv_line(partial, "a"), csv_line(sk, "a")); /* tokens/s included */
    assert_string_equal(csv_without_rate(sa), csv_without_rate(sk));
    const char *files[] = {"checkpoint/model.safetensors", "checkpoint/optimizer.safetensors",
                           "checkpoint/state.json"};
    for (int i = 0; i < 3; i++) {
        char fa[4600], fb[4600];
        snprintf(fa, sizeof fa, "%s/straight/c/%s", dir, files[i]);
        snprintf(fb, sizeof fb, "%s/k/c/%s", dir, files[i]);
        if (!tkd_test_files_equal(fa, fb))
            fail_msg("c's %s differs between the straight and the resumed sweep", files[i]);
    }
    char *ma = slurp_in(dir, "straight", "sweep.md"), *mk = slurp_in(dir, "k", "sweep.md");
    assert_int_equal(count(ma, "| ok |"), count(mk, "| ok |"));
    free(killed);
    free(again);
    free(partial);
    free(sa);
    free(sk);
    free(ma);
    free(mk);
}

/* Refused before any run, exit 2: two files that name one run; a sweep.md that is not the tool's. */
static void test_sweep_refusals(void **state)
{
    const char *dir = *state;
    make_fixture(dir);
    assert_int_equal(mkdir(tkd_test_path(dir, "other"), 0755), 0);
    tkd_test_write_text(tkd_test_path(dir, "other/a.yaml"), "kd.alpha: 0.7\n");
    char base[4200], a[4200], a2[4200], sdir[4200];
    snprintf(base, sizeof base, "%s/base.yaml", dir);
    snprintf(a, sizeof a, "%s/a.yaml", dir);
    snprintf(a2, sizeof a2, "%s/other/a.yaml", dir);
    snprintf(sdir, sizeof sdir, "%s/s", dir);
    const char *dup[] = {"sweep", "--config", base, a, a2, "--dir", sdir, NULL};
    assert_int_equal(tkd_test_run(BIN, dup, NULL, tkd_test_path(dir, "dup.out")), 2);
    char *text = tkd_test_slurp(tkd_test_path(dir, "dup.out"), NULL);
    if (!strstr(text, "would both be run 'a'") || !strstr(text, "rename one"))
        fail_msg("%s", text);
    free(text);
    assert_int_equal(access(sdir, F_OK), -1); /* nothing made */

    assert_int_equal(mkdir(sdir, 0755), 0);
    tkd_test_write_text(tkd_test_path(sdir, "sweep.md"), "# my notes\n");
    const char *one[] = {"sweep", "--config", base, a, "--dir", sdir, NULL};
    assert_int_equal(tkd_test_run(BIN, one, NULL, tkd_test_path(dir, "md.out")), 2);
    text = tkd_test_slurp(tkd_test_path(dir, "md.out"), NULL);
    if (!strstr(text, "sweep.md: not a file of student-train sweep") || !strstr(text, "another --dir"))
        fail_msg("%s", text);
    free(text);
    assert_int_equal(access(tkd_test_path(sdir, "a"), F_OK), -1); /* no run started */
    char *md = tkd_test_slurp(tkd_test_path(sdir, "sweep.md"), NULL);
    assert_string_equal(md, "# my notes\n");
    free(md);
}

/* The plot's ticks: 1, 2 or 5 times a power of ten, inside the range, at most the count asked; and
 * the run names the files give. */
static void test_ticks_and_names(void **state)
{
    (void)state;
    double t[16], step;
    assert_int_equal(tkd_plot_ticks(0.5, 6.3, 7, t, 16, &step), 6);
    assert_true(step == 1 && t[0] == 1 && t[5] == 6);
    int n = tkd_plot_ticks(4.1, 4.3, 7, t, 16, &step);
    assert_int_equal(n, 5); /* 4.1, 4.15, ..., 4.3: the end is kept despite rounding */
    assert_true(tkd_test_close(step, 0.05, 1e-15, 0) && tkd_test_close(t[0], 4.1, 1e-12, 0) &&
                tkd_test_close(t[4], 4.3, 1e-12, 0));
    n = tkd_plot_ticks(0, 1000, 7, t, 16, &step);
    assert_true(step == 200 && n == 6 && t[0] == 0 && t[5] == 1000);
    n = tkd_plot_ticks(-0.3, 0.3, 7, t, 16, &step);
    assert_true(step == 0.1 && n == 7 && t[3] == 0.0); /* zero exactly, not 5.55e-17 */
    char name[64];
    tkd_sweep_name(name, sizeof name, "configs/ablations/alpha-0.9.yaml");
    assert_string_equal(name, "alpha-0.9");
    tkd_sweep_name(name, sizeof name, "/x/my ablation$.yml");
    assert_string_equal(name, "my-ablation-");
    tkd_sweep_name(name, sizeof name, "noext");
    assert_string_equal(name, "noext");
}

TKD_TEST_MAIN_EACH_DIR(test_sweep_table, test_sweep_resumes_after_kill, test_sweep_refusals, test_ticks_and_names)
