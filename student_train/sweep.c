/* sweep.c — see sweep.h. */
#include "student_train/sweep.h"

#include <inttypes.h>
#include <math.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

#include "common/dir_lock.h"
#include "common/fileio.h"
#include "common/log.h"
#include "common/owned_dir.h"
#include "common/signals.h"
#include "student_train/sweep_plot.h"
#include "student_train/train.h"
#include "student_train/train_config.h"

#define PATH_MAX_ 4096
#define LOCK_NAME ".topkd-sweep-lock"
/* The first line of each file the sweep writes: how a re-run knows it may write over it. */
#define MD_HEAD "<!-- student-train sweep table -->\n"
#define CSV_HEAD "name,status,val_ce,val_ppl,val_kd,top1_agree,tokens_per_s,best_step,steps,error\n"
#define SVG_HEAD "<!-- student-train sweep: validation curves -->\n"

typedef struct sweep_row {
    char name[128];
    bool ok;
    char error[1024];  /* a failed run's message */
    double val_ce, val_ppl, val_kd, top1, tokens_per_s; /* NaN: not measured */
    int64_t best_step, steps;                           /* -1: none */
    double *x, *y;     // (n,) every evaluation's step and val_ce
    int n;
} sweep_row;

void tkd_sweep_name(char *out, size_t cap, const char *path)
{
    const char *base = strrchr(path, '/');
    base = base ? base + 1 : path;
    const char *dot = strrchr(base, '.');
    size_t n = dot && dot > base ? (size_t)(dot - base) : strlen(base);
    snprintf(out, cap, "%.*s", (int)n, base);
    for (char *c = out; *c; c++)
        if (!((*c >= 'a' && *c <= 'z') || (*c >= 'A' && *c <= 'Z') || (*c >= '0' && *c <= '9') || *c == '.' ||
              *c == '_' || *c == '-'))
            *c = '-';
}

/* ---- before anything runs ------------------------------------------------------------------ */

static tkd_status check_names(const tkd_sweep_opts *o, sweep_row *rows)
{
    if (o->nfiles == 0)
        return tkd_error_set(TKD_ERR_INVALID_ARG, "sweep: no ablation file given — list the configs to run, e.g. "
                             "student-train sweep --config base.yaml a.yaml b.yaml");
    for (size_t i = 0; i < o->nfiles; i++) {
        tkd_sweep_name(rows[i].name, sizeof rows[i].name, o->files[i]);
        for (size_t j = 0; j < i; j++)
            if (!strcmp(rows[i].name, rows[j].name))
                return tkd_error_set(TKD_ERR_INVALID_ARG, "sweep: %s and %s would both be run '%s' (a run is named "
                                     "after its file) — rename one", o->files[j], o->files[i], rows[i].name);
    }
    return TKD_OK;
}

/* A file the sweep is about to write over must be one it wrote (its first line). */
static tkd_status check_own(const char *dir, const char *name, const char *head)
{
    char path[PATH_MAX_];
    TKD_TRY(tkd_path_join(path, sizeof path, dir, name));
    if (!tkd_file_exists(path) || tkd_owned_file_begins(path, head, strlen(head), false))
        return TKD_OK;
    return tkd_error_set(TKD_ERR_INVALID_ARG, "%s: not a file of student-train sweep (its first line differs) — "
                         "student-train writes over only what it wrote: move it away, or use another --dir", path);
}

/* tokens/s of a run in a previous sweep.csv (a finished run does not train again). */
static double previous_rate(const char *csv, const char *name)
{
    double r = NAN;
    size_t nlen = strlen(name);
    for (const char *l = csv ? strchr(csv, '\n') : NULL; l && *++l; l = strchr(l, '\n')) {
        if (strncmp(l, name, nlen) != 0 || l[nlen] != ',')
            continue;
        const char *f = l;
        for (int k = 0; k < 6 && f; k++) /* tokens_per_s is the 7th field; the fields before hold no ',' */
            f = strchr(f + 1, ',');
        if (f && f[1] != ',')
            r = strtod(f + 1, NULL);
    }
    return r;
}

/* ---- one ablation --------------------------------------------------------------------------- */

/* The run's config: defaults, the base, the ablation file, the overrides, then its place. */
static tkd_status load_config(const tkd_sweep_opts *o, size_t i, const char *name, tkd_train_config *cfg)
{
    char set[PATH_MAX_ + 16];
    TKD_TRY(tkd_config_load(&tkd_train_schema, cfg, o->base_config, NULL, 0));
    TKD_TRY(tkd_config_apply_file(&tkd_train_schema, cfg, o->files[i]));
    for (size_t k = 0; k < o->nsets; k++)
        TKD_TRY(tkd_config_apply_set(&tkd_train_schema, cfg, o->sets[k]));
    size_t n = (size_t)snprintf(set, sizeof set, "run.dir='");
    for (const char *c = o->dir; *c && n + 3 < sizeof set; c++) { /* a YAML single-quoted scalar: ' as '' */
        if (*c == '\'')
            set[n++] = '\'';
        set[n++] = *c;
    }
    snprintf(set + n, sizeof set - n, "'");
    TKD_TRY(tkd_config_apply_set(&tkd_train_schema, cfg, set));
    snprintf(set, sizeof set, "run.name=%s", name);
    return tkd_config_apply_set(&tkd_train_schema, cfg, set);
}

/* A number of a metrics record (json_num's spelling: "key": 1.5 or null); NaN when absent or null. */
static double record_num(const char *line, size_t n, const char *key)
{
    char pat[64];
    snprintf(pat, sizeof pat, "\"%s\": ", key);
    const char *p = strstr(line, pat);
    if (!p || p >= line + n || !strncmp(p + strlen(pat), "null", 4))
        return NAN;
    return strtod(p + strlen(pat), NULL);
}

/* The table's values from the run's metrics.jsonl: its last evaluation and every val_ce. */
static tkd_status read_metrics(const char *run, sweep_row *r)
{
    char path[PATH_MAX_];
    void *data = NULL;
    size_t len = 0;
    TKD_TRY(tkd_path_join(path, sizeof path, run, "metrics.jsonl"));
    TKD_TRY(tkd_read_file(path, &data, &len));
    int cap = 0;
    for (size_t k = 0; k < len; k++)
        cap += ((char *)data)[k] == '\n';
    r->x = malloc((size_t)(cap + 1) * sizeof *r->x);
    r->y = malloc((size_t)(cap + 1) * sizeof *r->y);
    if (!r->x || !r->y) {
        free(data);
        return tkd_error_set(TKD_ERR_NOMEM, "out of memory reading %s", path);
    }
    for (const char *l = data, *end = l + len; l < end;) {
        const char *nl = memchr(l, '\n', (size_t)(end - l));
        size_t n = nl ? (size_t)(nl - l) : (size_t)(end - l);
        double step = record_num(l, n, "step");
        r->steps = isnan(step) ? r->steps : (int64_t)step;
        const char *ev = strstr(l, "\"type\": \"eval\"");
        if (ev && ev < l + n) {
            r->x[r->n] = step, r->y[r->n++] = record_num(l, n, "val_ce");
            r->val_ce = record_num(l, n, "val_ce"), r->val_ppl = record_num(l, n, "val_ppl");
            r->val_kd = record_num(l, n, "val_kd"), r->top1 = record_num(l, n, "top1_agree");
            double b = record_num(l, n, "best_step");
            r->best_step = isnan(b) ? -1 : (int64_t)b;
        }
        l += n + (nl ? 1 : 0);
    }
    free(data);
    return TKD_OK;
}

/* Runs ablation i (resumed when it has a checkpoint, started over when its directory holds none)
 * into row r. Only an interruption is returned; any other failure is the row's. */
static tkd_status run_one(const tkd_sweep_opts *o, size_t i, const char *old_csv, sweep_row *r)
{
    char run[PATH_MAX_], ckpt[PATH_MAX_];
    tkd_train_config cfg = {0};
    char *yaml = NULL;
    tkd_train_result res;
    memset(&res, 0, sizeof res);
    tkd_status st = tkd_path_join(run, sizeof run, o->dir, r->name);
    if (st == TKD_OK)
        st = tkd_path_join(ckpt, sizeof ckpt, run, "checkpoint");
    if (st == TKD_OK)
        st = load_config(o, i, r->name, &cfg);
    if (st == TKD_OK)
        st = tkd_config_to_text(&tkd_train_schema, &cfg, &yaml);
    bool resume = tkd_file_exists(ckpt);
    if (st == TKD_OK) {
        tkd_log_info("sweep [%zu/%zu] %s: %s", i + 1, o->nfiles, r->name,
                     resume ? "resuming" : tkd_file_exists(run) ? "starting over (no checkpoint)" : "starting");
        tkd_train_opts to = {.cfg = &cfg, .run_name = r->name, .config_yaml = yaml, .resume = resume,
                             .overwrite = !resume && tkd_file_exists(run), .kill_after_steps = o->kill_after_steps};
        st = tkd_train_run(&to, &res);
        if (st == TKD_OK && res.finished_before)
            tkd_log_info("sweep [%zu/%zu] %s: finished at step %" PRId64 " already", i + 1, o->nfiles, r->name,
                         res.steps);
    }
    if (st == TKD_OK)
        st = read_metrics(run, r);
    free(yaml);
    tkd_config_free(&tkd_train_schema, &cfg);
    r->ok = st == TKD_OK;
    if (st == TKD_ERR_INTERRUPTED)
        return st;
    if (!r->ok) {
        snprintf(r->error, sizeof r->error, "%s", tkd_error_msg());
        tkd_log_error("sweep: %s failed: %s", r->name, r->error);
        return TKD_OK;
    }
    r->tokens_per_s = res.finished_before ? previous_rate(old_csv, r->name)
                      : res.seconds > 0   ? (double)res.tokens_run / res.seconds
                                          : NAN;
    return TKD_OK;
}

/* ---- the table -------------------------------------------------------------------------------- */

/* One cell: the value in fmt, or `none` when it was not measured. */
static void cell(char *out, size_t cap, const char *fmt, double v, const char *none)
{
    if (isnan(v))
        snprintf(out, cap, "%s", none);
    else
        snprintf(out, cap, fmt, v);
}

enum { NCOL = 8 };
static const char *const col_names[NCOL] = {"run", "status", "val CE", "ppl", "KD", "top-1", "tokens/s", "best step"};

/* The row's cells as the terminal and Markdown show them. */
static void row_cells(const sweep_row *r, char c[NCOL][160])
{
    snprintf(c[0], 160, "%s", r->name);
    snprintf(c[1], 160, "%s", r->ok ? "ok" : "failed");
    cell(c[2], 160, "%.4f", r->ok ? r->val_ce : NAN, "-");
    cell(c[3], 160, "%.2f", r->ok ? r->val_ppl : NAN, "-");
    cell(c[4], 160, "%.4f", r->ok ? r->val_kd : NAN, "-");
    cell(c[5], 160, "%.4f", r->ok ? r->top1 : NAN, "-");
    cell(c[6], 160, "%.0f", r->ok ? r->tokens_per_s : NAN, "-");
    cell(c[7], 160, "%.0f", r->ok && r->best_step >= 0 ? (double)r->best_step : NAN, "-");
}

static void print_terminal(FILE *out, const sweep_row *rows, size_t n)
{
    int w[NCOL];
    char c[NCOL][160];
    for (int k = 0; k < NCOL; k++)
        w[k] = (int)strlen(col_names[k]);
    for (size_t i = 0; i < n; i++) {
        row_cells(&rows[i], c);
        for (int k = 0; k < NCOL; k++)
            w[k] = (int)strlen(c[k]) > w[k] ? (int)strlen(c[k]) : w[k];
    }
    for (int k = 0; k < NCOL; k++)
        fprintf(out, "%-*s%s", w[k], col_names[k], k + 1 < NCOL ? "  " : "\n");
    for (size_t i = 0; i < n; i++) {
        row_cells(&rows[i], c);
        for (int k = 0; k < NCOL; k++)
            fprintf(out, k < 2 ? "%-*s%s" : "%*s%s", w[k], c[k], k + 1 < NCOL ? "  " : "\n");
    }
    for (size_t i = 0; i < n; i++)
        if (!rows[i].ok)
            fprintf(out, "%s failed: %s\n", rows[i].name, rows[i].error);
}

/* Markdown: the table, then each failure's message (a '|' in it would break the table). */
static void write_md(FILE *f, const sweep_row *rows, size_t n)
{
    char c[NCOL][160];
    fputs(MD_HEAD "\n|", f);
    for (int k = 0; k < NCOL; k++)
        fprintf(f, " %s |", col_names[k]);
    fputs("\n|", f);
    for (int k = 0; k < NCOL; k++)
        fputs(k < 2 ? "---|" : "---:|", f);
    fputc('\n', f);
    for (size_t i = 0; i < n; i++) {
        row_cells(&rows[i], c);
        fputc('|', f);
        for (int k = 0; k < NCOL; k++)
            fprintf(f, " %s |", c[k]);
        fputc('\n', f);
    }
    for (size_t i = 0; i < n; i++)
        if (!rows[i].ok)
            fprintf(f, "\n**%s failed:** `%s`\n", rows[i].name, rows[i].error);
    fputs("\nValidation curves: [sweep.svg](sweep.svg)\n", f);
}

static void csv_num(FILE *f, double v)
{
    if (isnan(v))
        fputc(',', f);
    else
        fprintf(f, ",%.9g", v);
}

/* CSV: full precision, empty where not measured, the error quoted ("" for a quote). */
static void write_csv(FILE *f, const sweep_row *rows, size_t n)
{
    fputs(CSV_HEAD, f);
    for (size_t i = 0; i < n; i++) {
        const sweep_row *r = &rows[i];
        fprintf(f, "%s,%s", r->name, r->ok ? "ok" : "failed");
        double v[6] = {r->val_ce, r->val_ppl, r->val_kd, r->top1, r->tokens_per_s, (double)r->best_step};
        for (int k = 0; k < 6; k++)
            csv_num(f, r->ok && !(k == 5 && r->best_step < 0) ? v[k] : NAN);
        csv_num(f, r->ok ? (double)r->steps : NAN);
        fputs(",", f);
        if (!r->ok) {
            fputc('"', f);
            for (const char *e = r->error; *e; e++)
                fputs(*e == '"' ? "\"\"" : (char[2]){*e, 0}, f);
            fputc('"', f);
        }
        fputc('\n', f);
    }
}

/* Writes <dir>/name atomically from what fill prints. */
static tkd_status write_table_file(const char *dir, const char *name,
                                   void (*fill)(FILE *, const sweep_row *, size_t), const sweep_row *rows,
                                   size_t n)
{
    char path[PATH_MAX_], *text = NULL;
    size_t len = 0;
    TKD_TRY(tkd_path_join(path, sizeof path, dir, name));
    FILE *f = open_memstream(&text, &len);
    if (!f)
        return tkd_error_set(TKD_ERR_NOMEM, "out of memory for %s", path);
    fill(f, rows, n);
    fclose(f);
    tkd_status st = text ? tkd_file_write_atomic(path, text, len) : tkd_error_set(TKD_ERR_NOMEM, "out of memory");
    free(text);
    return st;
}

static tkd_status write_svg(const char *dir, const sweep_row *rows, size_t n)
{
    tkd_plot_series *s = calloc(n ? n : 1, sizeof *s);
    char (*label)[160] = calloc(n ? n : 1, sizeof *label);
    if (!s || !label) {
        free(s);
        free(label);
        return tkd_error_set(TKD_ERR_NOMEM, "out of memory for the plot");
    }
    for (size_t i = 0; i < n; i++) { /* a failed run stays in the legend, said so, without a curve */
        snprintf(label[i], sizeof label[i], "%s%s", rows[i].name, rows[i].ok ? "" : " (failed)");
        s[i] = (tkd_plot_series){.name = label[i], .x = rows[i].x, .y = rows[i].y, .n = rows[i].ok ? rows[i].n : 0};
    }
    char *svg = NULL, path[PATH_MAX_];
    tkd_status st = tkd_plot_svg(SVG_HEAD, "student-train sweep: validation CE", "step", "validation CE (nats/token)",
                                 s, (int)n, &svg);
    free(s);
    free(label);
    if (st == TKD_OK)
        st = tkd_path_join(path, sizeof path, dir, "sweep.svg");
    if (st == TKD_OK)
        st = tkd_file_write_atomic(path, svg, strlen(svg));
    free(svg);
    return st;
}

static tkd_status write_outputs(const char *dir, const sweep_row *rows, size_t n)
{
    TKD_TRY(write_table_file(dir, "sweep.md", write_md, rows, n));
    TKD_TRY(write_table_file(dir, "sweep.csv", write_csv, rows, n));
    return write_svg(dir, rows, n);
}

/* ---- the sweep -------------------------------------------------------------------------------- */

static tkd_status open_sweep_dir(const tkd_sweep_opts *o, tkd_dir_lock **lock, char **old_csv)
{
    char path[PATH_MAX_];
    size_t len;
    TKD_TRY(tkd_mkdir_p(o->dir));
    TKD_TRY(tkd_dir_lock_take(o->dir, LOCK_NAME, "student-train sweep", lock));
    TKD_TRY(check_own(o->dir, "sweep.md", MD_HEAD));
    TKD_TRY(check_own(o->dir, "sweep.csv", CSV_HEAD));
    TKD_TRY(check_own(o->dir, "sweep.svg", SVG_HEAD));
    TKD_TRY(tkd_path_join(path, sizeof path, o->dir, "sweep.csv"));
    *old_csv = NULL;
    void *data = NULL;
    if (tkd_file_exists(path) && tkd_read_file(path, &data, &len) == TKD_OK) {
        char *t = realloc(data, len + 1);
        if (t)
            t[len] = '\0';
        *old_csv = t ? t : NULL;
        if (!t)
            free(data);
    }
    return TKD_OK;
}

tkd_status tkd_sweep_run(const tkd_sweep_opts *o, FILE *out, tkd_sweep_summary *sum)
{
    memset(sum, 0, sizeof *sum);
    sweep_row *rows = calloc(o->nfiles ? o->nfiles : 1, sizeof *rows);
    if (!rows)
        return tkd_error_set(TKD_ERR_NOMEM, "out of memory");
    tkd_dir_lock *lock = NULL;
    char *old_csv = NULL;
    tkd_status st = check_names(o, rows);
    if (st == TKD_OK)
        st = open_sweep_dir(o, &lock, &old_csv);
    size_t done = 0;
    for (; st == TKD_OK && done < o->nfiles; done++) {
        sweep_row *r = &rows[done];
        r->val_ce = r->val_ppl = r->val_kd = r->top1 = r->tokens_per_s = NAN;
        r->best_step = r->steps = -1;
        if (tkd_interrupted()) /* a signal between two runs: the next one does not start */
            st = tkd_error_set(TKD_ERR_INTERRUPTED, "sweep interrupted before %s — run the same command again to "
                               "continue", r->name);
        if (st == TKD_OK)
            st = run_one(o, done, old_csv, r);
        sum->failed += st == TKD_OK && !r->ok;
        if (st == TKD_OK) /* the table so far: a killed sweep keeps the rows (and tokens/s) it made */
            st = write_outputs(o->dir, rows, done + 1);
    }
    done -= st != TKD_OK && done > 0; /* an interrupted run has no row */
    if (lock && done > 0) { /* the files hold these rows already */
        print_terminal(out, rows, done);
        fprintf(out, "table: %s/sweep.md, %s/sweep.csv; curves: %s/sweep.svg\n", o->dir, o->dir, o->dir);
    }
    sum->runs = (int)done;
    for (size_t i = 0; i < o->nfiles; i++)
        free(rows[i].x), free(rows[i].y);
    free(rows);
    free(old_csv);
    tkd_error_saved keep;
    tkd_error_save(&keep, st);
    tkd_dir_lock_release(lock);
    return tkd_error_restore(&keep);
}
