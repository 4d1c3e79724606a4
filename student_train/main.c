/* main.c — the student-train CLI: flags and config in, one run (or a sweep of several: sweep.h), a
 * summary and an exit code out.
 * Library code reports through tkd_status; this file alone prints errors, with the exit codes of
 * tkd_cli_exit_code (the same in every tool). */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/cli.h"
#include "common/launch.h"
#include "common/log.h"
#include "common/signals.h"
#include "common/test_hooks.h"
#include "student_train/sweep.h"
#include "student_train/train.h"
#include "student_train/train_config.h"

#define USAGE                                                                                           \
    "student-train --config FILE [--set key=value ...] [--resume | --overwrite] [--print-config]\n"      \
    "              [--nproc-per-node N]   (N data-parallel processes on this node, one per GPU;\n"       \
    "                                      docs/distributed.md)\n"                                          \
    "       student-train sweep [--config BASE] ABLATION.yaml ... [--set key=value ...] [--dir DIR]\n"     \
    "                                     (one run per file, on top of BASE; then a table; re-run to resume)"

/* A worker of --nproc-per-node hands its error to the launcher, which prints one line for all. */
static int fail(tkd_status st)
{
    if (!tkd_launch_send_error(tkd_error_msg()))
        fprintf(stderr, "student-train: %s\n", tkd_error_msg());
    return tkd_cli_exit_code(st, tkd_interrupted());
}

/* One machine-readable line for scripts (the demo's table reads it). A value that was not measured
 * (no evaluation ran, or no teacher to compare with) is left out, never printed as nan. */
static void print_result_line(const tkd_train_result *r)
{
    printf("RESULT");
    if (!isnan(r->val_ce))
        printf(" val_ce=%.6f val_ppl=%.4f", r->val_ce, r->val_ppl);
    if (!isnan(r->val_kd))
        printf(" val_kd=%.6f", r->val_kd);
    if (!isnan(r->top1_agree))
        printf(" top1=%.6f", r->top1_agree);
    printf(" steps=%lld tokens=%lld seconds=%.2f", (long long)r->steps, (long long)r->tokens, r->seconds);
    if (r->best_step >= 0) /* added last: scripts that read the fields before keep working */
        printf(" best_step=%lld best_%s=%.6f", (long long)r->best_step, r->best_metric, r->best_value);
    if (r->early_stopped)
        printf(" early_stop=1");
    printf("\n");
}

static void print_summary(const tkd_train_result *r)
{
    printf("run       %s\n", r->run_path);
    printf("steps     %lld (%lld tokens, %.1f s, %.0f tokens/s)\n", (long long)r->steps, (long long)r->tokens,
           r->seconds, r->seconds > 0 ? (double)r->tokens / r->seconds : 0.0);
    if (!isnan(r->val_ce))
        printf("val CE    %.4f nats/token (perplexity %.2f)\n", r->val_ce, r->val_ppl);
    else
        printf("val       no evaluation in this run\n");
    if (!isnan(r->val_kd))
        printf("val KD    %.4f\n", r->val_kd);
    if (!isnan(r->top1_agree))
        printf("top-1     %.4f agreement with the teacher\n", r->top1_agree);
    if (r->best_step >= 0)
        printf("best      step %lld: %s %.4f%s\n", (long long)r->best_step, r->best_metric, r->best_value,
               r->early_stopped ? " (stopped early: train.early_stop_patience)" : "");
    print_result_line(r);
}

/* --nproc-per-node N: the config was checked once here (an error is one line, not N); the ranks
 * then run the same command line, each finding its rank in RANK/WORLD_SIZE. A failing rank's exit
 * code is the launcher's. */
static int run_launch(int nproc, int argc, char **argv)
{
    int rc = 0;
    tkd_status st = tkd_signals_install();
    if (st == TKD_OK)
        st = tkd_launch_workers("student-train", nproc, argc, argv, 30.0, &rc);
    if (st != TKD_OK && rc > 0) {
        fprintf(stderr, "student-train: %s\n", tkd_error_msg());
        return rc;
    }
    return st == TKD_OK ? 0 : fail(st);
}

/* Takes "--dir DIR" / "--dir=DIR" out of argv (argc updated); *dir stays NULL without it. */
static tkd_status take_dir(int *argc, char **argv, const char **dir)
{
    int out = 1;
    for (int i = 1; i < *argc; i++) {
        if (!strcmp(argv[i], "--")) {
            while (i < *argc)
                argv[out++] = argv[i++];
            break;
        }
        if (strcmp(argv[i], "--dir") && strncmp(argv[i], "--dir=", 6)) {
            argv[out++] = argv[i];
            continue;
        }
        *dir = argv[i][5] == '=' ? argv[i] + 6 : i + 1 < *argc ? argv[++i] : "";
        if (!**dir)
            return tkd_error_set(TKD_ERR_INVALID_ARG, "sweep: --dir needs a directory");
    }
    *argc = out;
    argv[out] = NULL;
    return TKD_OK;
}

/* The sweep directory: --dir, else <run.dir of the base config>/sweep. */
static tkd_status sweep_dir(const tkd_cli *cli, const char *given, char *out, size_t cap)
{
    if (given) {
        snprintf(out, cap, "%s", given);
        return TKD_OK;
    }
    tkd_train_config base = {0};
    tkd_status st = tkd_config_load(&tkd_train_schema, &base, cli->config_path, cli->sets, cli->nsets);
    if (st == TKD_OK)
        snprintf(out, cap, "%s/sweep", base.run_dir);
    tkd_config_free(&tkd_train_schema, &base);
    return st;
}

/* `student-train sweep ...` (argv[0] is "sweep"): sweep.h. Exit 0 when every ablation ran, 1 when one
 * failed (the table says which), 2 for a usage error, 130/143 after a signal. */
static int run_sweep(int argc, char **argv)
{
    const char *given = NULL;
    tkd_cli cli = {0};
    tkd_status st = take_dir(&argc, argv, &given);
    if (st == TKD_OK)
        st = tkd_cli_parse(&cli, argc, argv);
    if (st == TKD_OK && (cli.resume || cli.overwrite || cli.print_config))
        st = tkd_error_set(TKD_ERR_INVALID_ARG, "sweep: %s is not a sweep option — a sweep resumes when run again, "
                           "and each run's directory is under --dir", cli.resume ? "--resume" : cli.overwrite ?
                           "--overwrite" : "--print-config");
    if (st != TKD_OK || cli.help) {
        tkd_cli_free(&cli);
        if (st == TKD_OK)
            tkd_cli_print_help(stdout, USAGE, &tkd_train_schema);
        else
            fprintf(stderr, "student-train: %s\nusage: %s\n", tkd_error_msg(), USAGE);
        return tkd_cli_exit_code(st, 0);
    }
    tkd_log_set_level(tkd_cli_log_level(&cli));
    char dir[4096];
    tkd_sweep_summary sum = {0};
    st = sweep_dir(&cli, given, dir, sizeof dir);
    tkd_sweep_opts o = {.dir = dir, .base_config = cli.config_path, .files = cli.args, .nfiles = cli.nargs,
                        .sets = cli.sets, .nsets = cli.nsets};
#ifdef TKD_TEST_HOOKS
    o.kill_after_steps = tkd_test_hook_env("TKD_TRAIN_TEST_KILL_AFTER_STEPS");
#endif
    if (st == TKD_OK)
        st = tkd_signals_install();
    if (st == TKD_OK)
        st = tkd_sweep_run(&o, stdout, &sum);
    tkd_cli_free(&cli);
    if (st != TKD_OK)
        return fail(st);
    if (sum.failed > 0)
        fprintf(stderr, "student-train: sweep: %d of %d runs failed (the table says why)\n", sum.failed, sum.runs);
    return sum.failed > 0 ? 1 : 0;
}

int main(int argc, char **argv)
{
    if (argc > 1 && !strcmp(argv[1], "sweep"))
        return run_sweep(argc - 1, argv + 1);
    int nproc;
    tkd_status st = tkd_launch_take_nproc(&argc, argv, &nproc);
    tkd_cli cli;
    if (st == TKD_OK)
        st = tkd_cli_parse(&cli, argc, argv);
    if (st != TKD_OK) {
        fprintf(stderr, "student-train: %s\nusage: %s (--help lists every key)\n", tkd_error_msg(), USAGE);
        return tkd_cli_exit_code(st, 0);
    }
    if (cli.help) {
        tkd_cli_print_help(stdout, USAGE, &tkd_train_schema);
        tkd_cli_free(&cli);
        return 0;
    }
    tkd_log_set_level(tkd_cli_log_level(&cli));
    tkd_train_config cfg = {0};
    st = tkd_cli_load_config(&cli, &tkd_train_schema, &cfg);
    char *yaml = NULL;
    size_t yaml_len = 0;
    if (st == TKD_OK) {
        FILE *mem = open_memstream(&yaml, &yaml_len);
        st = mem ? tkd_config_print(&tkd_train_schema, &cfg, mem) : tkd_error_set(TKD_ERR_NOMEM, "out of memory");
        if (mem)
            fclose(mem);
    }
    int rc = 0;
    if (st != TKD_OK) {
        rc = fail(st);
    } else if (cli.print_config) {
        fputs(yaml, stdout);
    } else if (nproc > 0) {
        st = tkd_train_check_world(&cfg, nproc, cfg.device); /* once here, not in every rank */
        rc = st == TKD_OK ? run_launch(nproc, argc, argv) : fail(st);
    } else {
        char name[512];
        if (*cfg.run_name)
            snprintf(name, sizeof name, "%s", cfg.run_name);
        else
            tkd_train_derive_name(name, sizeof name, cli.config_path, cli.sets, cli.nsets);
        tkd_log_info("student-train %s: run %s/%s", TKD_VERSION, cfg.run_dir, name);
        tkd_signals_install();
        tkd_train_opts o = {.cfg = &cfg, .run_name = name, .config_yaml = yaml, .resume = cli.resume,
                            .overwrite = cli.overwrite};
#ifdef TKD_TEST_HOOKS
        o.kill_after_steps = tkd_test_hook_env("TKD_TRAIN_TEST_KILL_AFTER_STEPS");
#endif
        tkd_train_result res;
        st = tkd_train_run(&o, &res);
        if (st == TKD_OK && res.finished_before)
            printf("run       %s finished at step %lld already; nothing to do (--overwrite starts it again)\n",
                   res.run_path, (long long)res.steps);
        else if (st == TKD_OK)
            print_summary(&res);
        else
            rc = fail(st);
    }
    free(yaml);
    tkd_config_free(&tkd_train_schema, &cfg);
    tkd_cli_free(&cli);
    return rc;
}
