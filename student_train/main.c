/* main.c — the student-train CLI: flags and config in, one run, a summary and an exit code out.
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
#include "student_train/train.h"
#include "student_train/train_config.h"

#define USAGE                                                                                           \
    "student-train --config FILE [--set key=value ...] [--resume | --overwrite] [--print-config]\n"      \
    "              [--nproc-per-node N]   (N data-parallel processes on this node, one per GPU;\n"       \
    "                                      docs/distributed.md)"

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

int main(int argc, char **argv)
{
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
