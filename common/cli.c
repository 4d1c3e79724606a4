/* cli.c — see cli.h. */
#include "common/cli.h"

#include <ctype.h>
#include <errno.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>

static const char *const flag_names[] = {"--config", "--set", "--print-config", "--help",
                                         "--resume", "--overwrite", "--verbose", "--quiet"};
#define NFLAGS (sizeof flag_names / sizeof flag_names[0])

void tkd_cli_free(tkd_cli *cli)
{
    free(cli->sets);
    free(cli->args);
    cli->sets = cli->args = NULL;
    cli->nsets = cli->nargs = 0;
}

static tkd_status fail(tkd_cli *cli, tkd_status st)
{
    tkd_cli_free(cli);
    return st;
}

static tkd_status unknown_flag(tkd_cli *cli, const char *arg)
{
    char name[128];
    size_t n = strcspn(arg, "=");
    snprintf(name, sizeof name, "%.*s", (int)(n < 100 ? n : 100), arg);
    const char *close = tkd_config_suggest(name, flag_names, NFLAGS);
    tkd_error_set(TKD_ERR_INVALID_ARG, "unknown option '%s'%s%s%s; see --help", name,
                  close ? " (did you mean '" : "", close ? close : "", close ? "'?)" : "");
    return fail(cli, TKD_ERR_INVALID_ARG);
}

/* Value of a flag that takes one: "--flag=value" or the next argv. */
static const char *flag_value(const char *arg, size_t flag_len, int argc, char *const *argv, int *i)
{
    if (arg[flag_len] == '=')
        return arg + flag_len + 1;
    if (*i + 1 < argc)
        return argv[++*i];
    return NULL;
}

/* Short flags, possibly clustered: -v, -vv, -q, -h, -hv. */
static bool parse_short(tkd_cli *cli, const char *arg)
{
    for (const char *c = arg + 1; *c; c++)
        if (*c != 'v' && *c != 'q' && *c != 'h')
            return false;
    for (const char *c = arg + 1; *c; c++) {
        if (*c == 'v')
            cli->verbosity++;
        else if (*c == 'q')
            cli->verbosity--;
        else
            cli->help = true;
    }
    return true;
}

static bool is_flag(const char *arg, const char *flag)
{
    size_t n = strlen(flag);
    return !strncmp(arg, flag, n) && (arg[n] == '\0' || arg[n] == '=');
}

tkd_status tkd_cli_parse(tkd_cli *cli, int argc, char *const *argv)
{
    memset(cli, 0, sizeof *cli);
    size_t cap = argc > 0 ? (size_t)argc : 1;
    cli->sets = malloc(cap * sizeof *cli->sets);
    cli->args = malloc(cap * sizeof *cli->args);
    if (!cli->sets || !cli->args)
        return fail(cli, tkd_error_set(TKD_ERR_NOMEM, "out of memory parsing arguments"));
    bool flags_done = false;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (flags_done || a[0] != '-' || !strcmp(a, "-")) {
            cli->args[cli->nargs++] = a;
        } else if (!strcmp(a, "--")) {
            flags_done = true;
        } else if (is_flag(a, "--config")) {
            const char *v = flag_value(a, strlen("--config"), argc, argv, &i);
            /* "--config --print-config": the file name is missing, not "--print-config" */
            if (v && v[0] == '-' && v[1] && a[strlen("--config")] != '=')
                return fail(cli, tkd_error_set(TKD_ERR_INVALID_ARG, "--config needs a file name, got the option "
                                               "'%s' — put the file right after --config", v));
            if (!v || !*v)
                return fail(cli, tkd_error_set(TKD_ERR_INVALID_ARG, "--config needs a file name"));
            if (cli->config_path)
                return fail(cli, tkd_error_set(TKD_ERR_INVALID_ARG,
                                               "--config given twice ('%s' and '%s'); use --set for overrides",
                                               cli->config_path, v));
            cli->config_path = v;
        } else if (is_flag(a, "--set")) {
            const char *v = flag_value(a, strlen("--set"), argc, argv, &i);
            if (!v || !strchr(v, '='))
                return fail(cli, tkd_error_set(TKD_ERR_INVALID_ARG,
                                               "--set needs key=value, e.g. --set kd.temperature=2"));
            cli->sets[cli->nsets++] = v;
        } else if (!strcmp(a, "--print-config")) {
            cli->print_config = true;
        } else if (!strcmp(a, "--help")) {
            cli->help = true;
        } else if (!strcmp(a, "--resume")) {
            cli->resume = true;
        } else if (!strcmp(a, "--overwrite")) {
            cli->overwrite = true;
        } else if (!strcmp(a, "--verbose")) {
            cli->verbosity++;
        } else if (!strcmp(a, "--quiet")) {
            cli->verbosity--;
        } else if (a[1] == '-' || !parse_short(cli, a)) {
            return unknown_flag(cli, a);
        }
    }
    if (cli->resume && cli->overwrite)
        return fail(cli, tkd_error_set(TKD_ERR_INVALID_ARG,
                                       "--resume and --overwrite contradict each other; pick one"));
    return TKD_OK;
}

tkd_status tkd_cli_parse_int(const char *flag, const char *v, int64_t lo, int64_t hi, int64_t *out)
{
    if (!v || !*v)
        return tkd_error_set(TKD_ERR_INVALID_ARG, "%s needs an integer value", flag);
    const char *d = v + (*v == '+' || *v == '-');
    char *end;
    errno = 0;
    long long x = strtoll(v, &end, 10);
    /* strtoll alone takes " 7", "7x" (stopping early) and saturates 1e30's digits: all refused */
    if (!isdigit((unsigned char)*d) || *end)
        return tkd_error_set(TKD_ERR_INVALID_ARG, "%s: '%s' is not an integer", flag, v);
    if (errno == ERANGE || x < lo || x > hi)
        return tkd_error_set(TKD_ERR_INVALID_ARG, "%s: %s is out of range; it must be in [%lld, %lld]", flag, v,
                             (long long)lo, (long long)hi);
    *out = x;
    return TKD_OK;
}

tkd_log_level tkd_cli_log_level(const tkd_cli *cli)
{
    if (cli->verbosity >= 1)
        return TKD_LOG_LEVEL_DEBUG;
    if (cli->verbosity == 0)
        return TKD_LOG_LEVEL_INFO;
    return cli->verbosity == -1 ? TKD_LOG_LEVEL_WARN : TKD_LOG_LEVEL_ERROR;
}

tkd_status tkd_cli_load_config(const tkd_cli *cli, const tkd_config_schema *schema, void *cfg)
{
    return tkd_config_load(schema, cfg, cli->config_path, cli->sets, cli->nsets);
}

void tkd_cli_print_help(FILE *out, const char *usage, const tkd_config_schema *schema)
{
    fprintf(out, "usage: %s\n\n", usage);
    fputs("options:\n"
          "  --config FILE      read settings from a YAML file\n"
          "  --set KEY=VALUE    override one setting (repeatable; VALUE is YAML: 2, true, [a, b], 'x: y')\n"
          "  --print-config     print the effective config as YAML and exit\n",
          out);
    /* only a tool that has something to resume from (student-train's checkpoint) offers --resume */
    if (strstr(usage, "--resume"))
        fputs("  --resume           continue an interrupted run from its last checkpoint\n", out);
    fputs("  --overwrite        replace an existing output instead of refusing\n"
          "  -v, --verbose      more messages (debug)\n"
          "  -q, --quiet        fewer messages (-q: warnings and errors, -qq: errors only)\n"
          "  -h, --help         show this help\n\n",
          out);
    if (schema)
        tkd_config_print_help(schema, out);
}

int tkd_cli_exit_code(tkd_status st, int signo)
{
    if (st == TKD_OK)
        return 0;
    if (st == TKD_ERR_INTERRUPTED)
        return 128 + (signo > 0 ? signo : SIGINT); /* what a shell reports for a process the signal killed */
    if (st == TKD_ERR_CONFIG || st == TKD_ERR_INVALID_ARG)
        return 2;
    return 1;
}
