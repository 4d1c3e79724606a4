/* main.c — the teacher-dump CLI: parse flags, load the config, run (or resume) the dump with a
 * progress line, print the summary; `teacher-dump merge DIR` joins split workers' manifests.
 * Every error is one line "teacher-dump: <file>:<place>: <what> — <what to do>" and a non-zero exit
 * from tkd_cli_exit_code (2 usage or config, 130 / 143 after SIGINT / SIGTERM, 1 otherwise). */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "common/cli.h"
#include "common/fileio.h"
#include "common/log.h"
#include "common/owned_dir.h"
#include "common/progress.h"
#include "common/signals.h"
#include "common/test_hooks.h"
#include "formats/cache_shard.h"
#include "teacher_cache/dump.h"
#include "teacher_cache/dump_config.h"
#include "teacher_cache/dump_dir.h"
#include "teacher_cache/dump_merge.h"
#include "common/launch.h"
#include "teacher_cache/tokenize.h"

static const char usage[] =
    "teacher-dump --config FILE [--set key=value ...] [--overwrite] [--print-config] [-v|-q]\n"
    "             [--nproc-per-node N]   (N workers on this node, one per GPU, then merge)\n"
    "       teacher-dump merge DIR\n"
    "       teacher-dump tokenize --tokenizer PATH --output OUT.bin FILE...   (tokenize --help)\n"
    "Runs the teacher once over a token dataset and writes its top-k logits, LSE and optional tail\n"
    "draws to a cache directory (docs/teacher-dump.md). Re-running the same command resumes.";

/* A worker of --nproc-per-node hands its error to the launcher, which prints one line for all. */
static int fail(tkd_status st)
{
    if (!tkd_launch_send_error(tkd_error_msg()))
        fprintf(stderr, "teacher-dump: %s\n", tkd_error_msg());
    return tkd_cli_exit_code(st, tkd_interrupted());
}

typedef struct progress_state {
    tkd_progress bar;
    long batches;
    long signal_after; /* test builds: raise SIGINT after this many batches */
    long stall_after;  /* test builds: wait for a signal after this many batches */
    long fail_rank;    /* test builds: the worker of this RANK (>= 1) exits 3 at its first batch */
} progress_state;

static void on_progress(const tkd_dump_progress *p, void *user)
{
    progress_state *ps = user;
    char extra[48] = "";
    /* the cache's size per position so far, from the shards finished by this run */
    if (p->tokens_written > 0)
        snprintf(extra, sizeof extra, "%.1f B/token", (double)p->bytes_written / (double)p->tokens_written);
    /* The rate and ETA are about this run's compute (not the teacher's load), so sequences done
     * before a resume are left out. */
    ps->bar.t_start = tkd_progress_now() - p->elapsed_s;
    ps->bar.total = p->seq_total - p->seq_start;
    tkd_progress_update_rate(&ps->bar, p->seq_done - p->seq_start, p->tokens_run, extra);
#ifdef TKD_TEST_HOOKS
    ++ps->batches;
    if (ps->signal_after > 0 && ps->batches == ps->signal_after)
        raise(SIGINT);
    if (ps->fail_rank > 0 && getenv("RANK") && atol(getenv("RANK")) == ps->fail_rank)
        _exit(3);
    if (ps->stall_after > 0 && ps->batches == ps->stall_after)
        while (!tkd_interrupted())
            nanosleep(&(struct timespec){0, 10000000}, NULL);
#endif
}

static void print_summary(const tkd_dump_summary *s)
{
    if (s->shards_damaged > 0)
        tkd_log_info("teacher-dump: re-made %lld listed shard(s) found missing or damaged; the first: %s",
                     (long long)s->shards_damaged, s->damaged_note);
    if (s->resumed_at >= s->range_end && s->seqs_run == 0) {
        tkd_log_info("teacher-dump: %s is complete (sequences [%lld, %lld)); nothing to do", s->manifest,
                     (long long)s->range_first, (long long)s->range_end);
        return;
    }
    double tps = s->seconds > 0 ? (double)s->tokens_run / s->seconds : 0;
    double bpt = s->tokens_written > 0 ? (double)s->bytes_run / (double)s->tokens_written : 0;
    tkd_log_info("teacher-dump: done: %lld sequences, %lld tokens in %.1f s (%.0f tokens/s); %lld shards, "
                 "%.1f bytes/token, compression %.2fx vs raw %.0f bytes/token; manifest %s",
                 (long long)s->seqs_run, (long long)s->tokens_run, s->seconds, tps, (long long)s->shards_run, bpt,
                 bpt > 0 ? s->raw_bytes_per_token / bpt : 0.0, s->raw_bytes_per_token, s->manifest);
}

static int run_merge(const tkd_cli *cli)
{
    if (cli->nargs != 2) {
        tkd_error_set(TKD_ERR_INVALID_ARG, "merge: expected one directory (teacher-dump merge DIR) — see --help");
        return fail(TKD_ERR_INVALID_ARG);
    }
    int64_t nseq = 0, nshards = 0;
    tkd_status st = tkd_dump_merge(cli->args[1], &nseq, &nshards);
    if (st != TKD_OK)
        return fail(st);
    tkd_log_info("teacher-dump: merged %lld shards, %lld sequences into %s/manifest.yaml", (long long)nshards,
                 (long long)nseq, cli->args[1]);
    return 0;
}

static int run_dump(const tkd_cli *cli)
{
    tkd_dump_config cfg = {0};
    tkd_status st = tkd_cli_load_config(cli, &tkd_dump_schema, &cfg);
    if (st == TKD_OK)
        st = tkd_dump_config_finalize(&cfg, NULL);
    if (st != TKD_OK) {
        int rc = fail(st);
        tkd_config_free(&tkd_dump_schema, &cfg);
        return rc;
    }
    if (cli->print_config) {
        st = tkd_config_print(&tkd_dump_schema, &cfg, stdout);
        tkd_config_free(&tkd_dump_schema, &cfg);
        return st == TKD_OK ? 0 : fail(st);
    }
    if (tkd_log_enabled(TKD_LOG_LEVEL_DEBUG))
        tkd_config_print(&tkd_dump_schema, &cfg, stderr);
    tkd_log_info("teacher-dump: %s -> %s (worker %d of %d, k %d, %s, tail %d)", cfg.teacher_path, cfg.output_dir,
                 cfg.worker_index, cfg.worker_count, cfg.k, tkd_cache_dtype_name((tkd_cache_dtype)cfg.logits_dtype),
                 cfg.tail_samples);
    progress_state ps = {0};
    tkd_progress_begin(&ps.bar, "teacher-dump", 0, "seq");
    tkd_progress_set_rate_unit(&ps.bar, "tok");
    tkd_dump_opts opts = {
        .overwrite = cli->overwrite,
        .progress = on_progress,
        .progress_user = &ps,
    };
#ifdef TKD_TEST_HOOKS
    ps.signal_after = tkd_test_hook_env("TKD_DUMP_TEST_SIGINT_AFTER_BATCHES");
    opts.kill_after_batches = tkd_test_hook_env("TKD_DUMP_TEST_KILL_AFTER_BATCHES");
    ps.stall_after = tkd_test_hook_env("TKD_DUMP_TEST_STALL_AFTER_BATCHES");
    ps.fail_rank = tkd_test_hook_env("TKD_DUMP_TEST_FAIL_RANK");
#endif
    tkd_dump_summary sum;
    st = tkd_signals_install();
    if (st == TKD_OK)
        st = tkd_dump_run(&cfg, &opts, &sum);
    tkd_config_free(&tkd_dump_schema, &cfg);
    if (st != TKD_OK)
        return fail(st);
    if (ps.bar.done > 0)
        tkd_progress_finish(&ps.bar, NULL);
    print_summary(&sum);
    return 0;
}

/* --nproc-per-node N: the config is checked once here (a config error is one line, not N), the
 * workers run, then their parts are merged. The split comes from the launcher, so workers.* must
 * be left to it. */
static int run_launch(const tkd_cli *cli, int nproc, int argc, char **argv)
{
    tkd_dump_config cfg = {0};
    tkd_status st = tkd_cli_load_config(cli, &tkd_dump_schema, &cfg);
    if (st == TKD_OK && (cfg.worker_index != 0 || cfg.worker_count != 1)) {
        tkd_error_set(TKD_ERR_CONFIG, "workers.index/workers.count are set (%d/%d) with --nproc-per-node %d",
                      cfg.worker_index, cfg.worker_count, nproc);
        st = tkd_error_hint(TKD_ERR_CONFIG, "leave them out: the launcher gives each worker its index");
    }
    /* Made and marked once here, before the workers start: a directory that is not a cache is
     * refused with one error instead of one per worker. */
    char made[4096] = ""; /* the folders made here, removed again when every worker is refused */
    if (st == TKD_OK)
        st = tkd_mkdir_p_made(cfg.output_dir, made, sizeof made);
    if (st == TKD_OK)
        st = tkd_owned_dir_claim(&tkd_dump_dir_kind, cfg.output_dir);
    int rc = 0;
    if (st == TKD_OK)
        st = tkd_signals_install();
    if (st == TKD_OK)
        st = tkd_launch_workers("teacher-dump", nproc, argc, argv, 30.0, &rc);
    if (st != TKD_OK && made[0]) /* a directory a worker wrote into stays (tkd_dump_dir_abandon) */
        tkd_dump_dir_abandon(cfg.output_dir, made, NULL);
    int64_t nseq = 0, nshards = 0;
    if (st == TKD_OK && nproc > 1)
        st = tkd_dump_merge(cfg.output_dir, &nseq, &nshards);
    if (st == TKD_OK && nproc > 1)
        tkd_log_info("teacher-dump: %d workers done; merged %lld shards, %lld sequences into %s/manifest.yaml", nproc,
                     (long long)nshards, (long long)nseq, cfg.output_dir);
    tkd_config_free(&tkd_dump_schema, &cfg);
    if (st != TKD_OK && rc > 0) { /* a worker failed: its exit code */
        fprintf(stderr, "teacher-dump: %s\n", tkd_error_msg());
        return rc;
    }
    return st == TKD_OK ? 0 : fail(st);
}

static void on_tokenize_progress(const tkd_tokenize_progress *p, void *user)
{
    tkd_progress *bar = user;
    bar->total = (int64_t)((p->bytes_total + 999999) / 1000000);
    char extra[96], rate[32];
    tkd_progress_format_rate(rate, sizeof rate, p->elapsed_s > 0 ? (double)p->tokens / p->elapsed_s : 0.0);
    snprintf(extra, sizeof extra, "%lld docs  %.2fM tokens  %s tok/s", (long long)p->docs, (double)p->tokens / 1e6,
             rate);
    tkd_progress_update(bar, (int64_t)(p->bytes_done / 1000000), extra);
}

static void print_tokenize_summary(const tkd_tokenize_summary *s)
{
    tkd_log_info("teacher-dump tokenize: wrote %s%s; each document: %d id(s) before, %d after%s", s->first,
                 s->files > 1 ? ", ..." : "", s->nprefix, s->nsuffix, s->eos_id >= 0 ? " + the EOS" : "");
    if (s->chat_source[0])
        tkd_log_info("teacher-dump tokenize: chat template %s; %lld of %lld tokens are trained targets (%.1f %%), "
                     "flags in %s.flags.npy%s", s->chat_source, (long long)s->trained, (long long)s->tokens,
                     s->tokens > 0 ? 100.0 * (double)s->trained / (double)s->tokens : 0.0, s->first,
                     s->files > 1 ? ", ..." : "");
    if (s->stale[0])
        tkd_log_warn("teacher-dump tokenize: %s is from an earlier run and was not rewritten; remove it before reading "
                     "these shards with a glob", s->stale);
}

/* `teacher-dump tokenize ...`: its own flags (argv[0] is "tokenize"). */
static int run_tokenize(int argc, char **argv)
{
    tkd_tokenize_opts o;
    bool help;
    int verbosity;
    tkd_status st = tkd_tokenize_parse_args(argc, argv, &o, &help, &verbosity);
    if (st != TKD_OK || help) {
        tkd_tokenize_opts_free(&o);
        if (st != TKD_OK)
            return fail(st);
        printf("usage: %s\n", tkd_tokenize_usage);
        return 0;
    }
    tkd_log_set_level(verbosity > 0 ? TKD_LOG_LEVEL_DEBUG : verbosity < 0 ? TKD_LOG_LEVEL_WARN : TKD_LOG_LEVEL_INFO);
    tkd_progress bar;
    tkd_progress_begin(&bar, "tokenize", 0, "MB");
    o.progress = on_tokenize_progress;
    o.progress_user = &bar;
    tkd_tokenize_summary sum;
    st = tkd_signals_install();
    if (st == TKD_OK)
        st = tkd_tokenize_run(&o, &sum);
    tkd_tokenize_opts_free(&o);
    if (st != TKD_OK)
        return fail(st);
    char totals[256]; /* the real counts: a small input is "0/1" in the bar's MB */
    tkd_tokenize_format_totals(totals, sizeof totals, &sum);
    tkd_progress_finish_text(&bar, totals);
    print_tokenize_summary(&sum);
    return 0;
}

int main(int argc, char **argv)
{
    if (argc > 1 && strcmp(argv[1], "tokenize") == 0)
        return run_tokenize(argc - 1, argv + 1);
    int nproc;
    tkd_status st = tkd_launch_take_nproc(&argc, argv, &nproc);
    if (st != TKD_OK)
        return fail(st);
    tkd_cli cli;
    st = tkd_cli_parse(&cli, argc, argv);
    if (st != TKD_OK)
        return fail(st);
    tkd_log_set_level(tkd_cli_log_level(&cli));
    /* accepted so that old scripts keep working; a re-run resumes on its own */
    if (cli.resume)
        tkd_log_info("teacher-dump: --resume is not needed (re-running the same command resumes) and is ignored");
    int rc;
    if (cli.help) {
        tkd_cli_print_help(stdout, usage, &tkd_dump_schema);
        rc = 0;
    } else if (cli.nargs > 0 && strcmp(cli.args[0], "merge") == 0) {
        rc = run_merge(&cli);
    } else if (cli.nargs > 0) {
        tkd_error_set(TKD_ERR_INVALID_ARG, "unexpected argument '%s' — the commands are 'merge DIR' and 'tokenize'; see --help",
                      cli.args[0]);
        rc = fail(TKD_ERR_INVALID_ARG);
    } else if (nproc > 0 && !cli.print_config) {
        rc = run_launch(&cli, nproc, argc, argv);
    } else {
        rc = run_dump(&cli);
    }
    tkd_cli_free(&cli);
    return rc;
}
