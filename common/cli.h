/* cli.h — the command-line flags every topkd tool shares.
 *
 * Parses --config FILE, --set k=v (repeated; also --set=k=v and --config=FILE), --print-config,
 * --help/-h, --resume, --overwrite, --verbose/-v, --quiet/-q and "--" (end of flags). Everything
 * else that does not start with '-' is a positional argument left to the tool (e.g. the "merge"
 * and "<dir>" of `teacher-dump merge <dir>`); an unknown flag is an error. Then
 * tkd_cli_load_config builds the tool's config: schema defaults, the file, the --set overrides.
 */
#ifndef TKD_CLI_H
#define TKD_CLI_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "common/config.h"
#include "common/log.h"
#include "common/status.h"

typedef struct tkd_cli {
    const char *config_path; /* --config FILE; NULL when absent. Points into argv. */
    const char **sets;       /* --set assignments "k=v" in command-line order; array owned, */
    size_t nsets;            /*   strings point into argv */
    const char **args;       /* positional arguments in order; array owned, strings in argv */
    size_t nargs;
    bool print_config;       /* --print-config: print the effective config and exit */
    bool help;               /* --help / -h */
    bool resume;             /* --resume: continue an interrupted run */
    bool overwrite;          /* --overwrite: replace an existing output */
    int verbosity;           /* +1 per -v, -1 per -q */
} tkd_cli;

/* Parses argv[1..argc) into cli (which is overwritten). On error (TKD_ERR_INVALID_ARG: unknown
 * flag, missing value, --resume with --overwrite) cli holds nothing to free. Otherwise the caller
 * calls tkd_cli_free. argv must outlive cli. */
tkd_status tkd_cli_parse(tkd_cli *cli, int argc, char *const *argv);

/* Frees the arrays; safe on a zeroed cli and twice. */
void tkd_cli_free(tkd_cli *cli);

/* Log level from -v/-q: info by default, debug with -v, warn with -q, error with -qq. */
tkd_log_level tkd_cli_log_level(const tkd_cli *cli);

/* Defaults, then --config FILE, then every --set, into cfg (zeroed or freed before). */
tkd_status tkd_cli_load_config(const tkd_cli *cli, const tkd_config_schema *schema, void *cfg);

/* The value v of a numeric flag (e.g. "--threads") as a decimal integer in [lo, hi]: an optional
 * sign and digits, nothing else (no spaces, no "1e6", no "0x10"); a value strtoll cannot hold
 * (ERANGE) is out of range, never saturated. TKD_ERR_INVALID_ARG naming the flag and the value:
 * "--threads: 'x' is not an integer" or "--threads: 5000 is out of range; it must be in [1, 4096]".
 * Every tool parses its numeric flags through this one. */
tkd_status tkd_cli_parse_int(const char *flag, const char *v, int64_t lo, int64_t hi, int64_t *out);

/* Writes "usage: <usage>", the shared flags and the schema's key reference (--help output).
 * --resume is listed only when usage offers it (teacher-dump resumes on a plain re-run). */
void tkd_cli_print_help(FILE *out, const char *usage, const tkd_config_schema *schema);

/* The exit status every topkd tool gives for st (the table in README.md): 0 ok; 2 for a usage or
 * config error (TKD_ERR_INVALID_ARG, TKD_ERR_CONFIG), however late it is found; 128 + signo after
 * the signal that interrupted the run (TKD_ERR_INTERRUPTED: 130 for SIGINT, 143 for SIGTERM; signo
 * 0, a stop asked for without a signal, counts as SIGINT); 1 for every other error. signo is what
 * tkd_interrupted() returns. */
int tkd_cli_exit_code(tkd_status st, int signo);

#endif /* TKD_CLI_H */
