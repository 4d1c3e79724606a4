/* tokenize.c — see tokenize.h. The main thread reads records into a batch (up to 16 MB of text or
 * 4096 records; a longer record is a batch of its own, read in place), OpenMP threads each with
 * their own tokenizer context turn the batch into ids (and parse JSON Lines on the way), then the
 * main thread writes the ids in order. Every output file is staged under a temporary name; all of
 * them get their final names only once the whole run has succeeded. */
#include "teacher_cache/tokenize.h"

#include <dirent.h>
#include <errno.h>
#include <math.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/cli.h"
#include "common/dir_lock.h"
#include "common/fileio.h"
#include "common/progress.h"
#include "common/signals.h"
#include "formats/tokenizer.h"

#define BATCH_BYTES (16u << 20)
#define BATCH_RECORDS 4096
#define LLMC_MAGIC_U32 20240801
#define LLMC_HEADER_INTS 256
#define MAX_THREADS 4096

const char tkd_tokenize_usage[] =
    "teacher-dump tokenize --tokenizer PATH --output OUT.bin [options] FILE...\n"
    "Tokenizes text files or JSON Lines with the teacher's Hugging Face tokenizer into an llm.c token file\n"
    "(uint32 tokens, header 20240801 v7) that data.paths reads (docs/teacher-dump.md, \"Tokenizing text\").\n"
    "  --tokenizer PATH       tokenizer.json, or the checkpoint directory holding it (and tokenizer_config.json)\n"
    "  --output OUT.bin       the token file (its folder is made when missing); with --shard-tokens,\n"
    "                         OUT_000000.bin, OUT_000001.bin, ...;\n"
    "                         a name ending in .npy writes a NumPy uint32 array instead\n"
    "  --format auto|text|jsonl  auto (default): .jsonl/.ndjson are JSON Lines, other files text\n"
    "  --field NAME           JSON Lines: the field holding the text (default: text)\n"
    "  --doc-separator STR    text: documents are separated by STR (\\n, \\t, \\r, \\\\ understood); default:\n"
    "                         one document per file\n"
    "  --eos TOKEN|none       the token written after each document (default: the tokenizer's eos_token)\n"
    "  --shard-tokens N       at most N tokens per output file (default: one file; a .bin file holds at\n"
    "                         most 2147483647, llm.c's int32 count)\n"
    "  --threads N            tokenizing threads, 1 to 4096 (default: OMP_NUM_THREADS, else all CPUs)\n"
    "  --overwrite            replace an existing output (at the end: until the whole run has succeeded,\n"
    "                         the files are temporaries and an earlier output stays as it was)\n"
    "  -v / -q                more / less output";

/* ---- arguments ---------------------------------------------------------------------------------- */

void tkd_tokenize_opts_free(tkd_tokenize_opts *o)
{
    free(o->inputs);
    free(o->separator);
    o->inputs = NULL;
    o->separator = NULL;
}

/* Through the tools' one numeric parser (common/cli.h): junk and overflow are refused, never saturated. */
static tkd_status parse_int(const char *flag, const char *v, int64_t lo, int64_t hi, int64_t *out)
{
    tkd_status st = tkd_cli_parse_int(flag, v, lo, hi, out);
    return st == TKD_OK ? st : tkd_error_hint(tkd_error_prefix(st, "tokenize"), "see --help");
}

/* One "--flag value" / "--flag=value"; returns TKD_ERR_NOT_FOUND for a flag it does not know. */
static tkd_status parse_flag(tkd_tokenize_opts *o, const char *name, const char *v)
{
    int64_t x = 0;
    if (!v)
        return tkd_error_set(TKD_ERR_INVALID_ARG, "tokenize: %s needs a value — see --help", name);
    if (strcmp(name, "--tokenizer") == 0)
        o->tokenizer = v;
    else if (strcmp(name, "--output") == 0 || strcmp(name, "-o") == 0)
        o->output = v;
    else if (strcmp(name, "--field") == 0)
        o->field = v;
    else if (strcmp(name, "--eos") == 0)
        o->eos = v;
    else if (strcmp(name, "--doc-separator") == 0) {
        free(o->separator);
        o->separator = NULL;
        TKD_TRY(tkd_text_unescape(v, "tokenize: --doc-separator", TKD_ERR_INVALID_ARG, &o->separator));
    } else if (strcmp(name, "--format") == 0) {
        if (strcmp(v, "auto") && strcmp(v, "text") && strcmp(v, "jsonl"))
            return tkd_error_set(TKD_ERR_INVALID_ARG, "tokenize: --format is auto, text or jsonl (got '%s')", v);
        o->kind = v[0] == 'a' ? TKD_TEXT_AUTO : v[0] == 't' ? TKD_TEXT_PLAIN : TKD_TEXT_JSONL;
    } else if (strcmp(name, "--shard-tokens") == 0) {
        TKD_TRY(parse_int(name, v, 1, INT64_MAX, &x));
        o->shard_tokens = x;
    } else if (strcmp(name, "--threads") == 0) {
        TKD_TRY(parse_int(name, v, 1, MAX_THREADS, &x));
        o->threads = (int)x;
    } else {
        return TKD_ERR_NOT_FOUND;
    }
    return TKD_OK;
}

static tkd_status parse_short(const char *arg, bool *help, int *verbosity)
{
    for (const char *c = arg + 1; *c; c++) {
        if (*c == 'h')
            *help = true;
        else if (*c == 'v' || *c == 'q')
            *verbosity += *c == 'v' ? 1 : -1;
        else
            return tkd_error_set(TKD_ERR_INVALID_ARG, "tokenize: unknown option '%s' — see --help", arg);
    }
    return TKD_OK;
}

static tkd_status parse_one(tkd_tokenize_opts *o, int argc, char **argv, int *i, bool *help, int *verbosity)
{
    const char *a = argv[*i];
    if (strcmp(a, "--help") == 0)
        *help = true;
    else if (strcmp(a, "--overwrite") == 0)
        o->overwrite = true;
    else if (a[0] == '-' && a[1] != '-' && a[1] && strcmp(a, "-o") != 0)
        return parse_short(a, help, verbosity);
    else if (a[0] == '-' && a[1]) {
        char name[64];
        const char *eq = strchr(a, '=');
        size_t n = eq ? (size_t)(eq - a) : strlen(a);
        snprintf(name, sizeof name, "%.*s", (int)(n < 63 ? n : 63), a);
        const char *v = eq ? eq + 1 : *i + 1 < argc ? argv[++*i] : NULL;
        tkd_status st = parse_flag(o, name, v);
        if (st == TKD_ERR_NOT_FOUND)
            return tkd_error_set(TKD_ERR_INVALID_ARG, "tokenize: unknown option '%s' — see --help", name);
        return st;
    } else {
        o->inputs[o->ninputs++] = a;
    }
    return TKD_OK;
}

static bool is_npy(const tkd_tokenize_opts *o)
{
    size_t n = strlen(o->output);
    return n > 4 && strcmp(o->output + n - 4, ".npy") == 0;
}

/* What the output's format can hold: llm.c's header counts a file's tokens in an int32, so one .bin
 * file (a shard, or the whole output) holds at most INT32_MAX tokens; a .npy has no such limit. */
static tkd_status check_limits(const tkd_tokenize_opts *o)
{
    if (o->shard_tokens < 0)
        return tkd_error_set(TKD_ERR_INVALID_ARG, "tokenize: --shard-tokens %lld is negative (0: one file)",
                             (long long)o->shard_tokens);
    if (!is_npy(o) && o->shard_tokens > INT32_MAX) {
        tkd_error_set(TKD_ERR_INVALID_ARG, "tokenize: --shard-tokens %lld is more than one llm.c .bin file holds "
                      "(%d tokens: its header counts them in an int32)", (long long)o->shard_tokens, INT32_MAX);
        return tkd_error_hint(TKD_ERR_INVALID_ARG, "give at most %d, or an --output named .npy", INT32_MAX);
    }
    if (o->threads < 0 || o->threads > MAX_THREADS)
        return tkd_error_set(TKD_ERR_INVALID_ARG, "tokenize: %d threads is out of range; it must be in [1, %d]",
                             o->threads, MAX_THREADS);
    return TKD_OK;
}

tkd_status tkd_tokenize_parse_args(int argc, char **argv, tkd_tokenize_opts *o, bool *help, int *verbosity)
{
    memset(o, 0, sizeof *o);
    o->field = "text";
    *help = false;
    *verbosity = 0;
    o->inputs = calloc((size_t)argc + 1, sizeof *o->inputs);
    if (!o->inputs)
        return tkd_error_set(TKD_ERR_NOMEM, "out of memory");
    for (int i = 1; i < argc; i++)
        TKD_TRY(parse_one(o, argc, argv, &i, help, verbosity));
    if (*help)
        return TKD_OK;
    if (!o->tokenizer || !o->output)
        return tkd_error_set(TKD_ERR_INVALID_ARG, "tokenize: --tokenizer and --output are required — see --help");
    if (o->ninputs == 0)
        return tkd_error_set(TKD_ERR_INVALID_ARG, "tokenize: no input files — name the text or .jsonl files to tokenize");
    return check_limits(o);
}

/* ---- output: llm.c .bin files, maybe sharded ------------------------------------------------------ */

/* A file this run reads (an input, the tokenizer's files): no output may be the same file. */
typedef struct file_id {
    dev_t dev;
    ino_t ino;
    const char *path;
    const char *role; /* "input", "tokenizer file" */
} file_id;

/* A finished output file under its temporary name, renamed to its final name by out_publish. */
typedef struct staged {
    char *tmp, *path;
} staged;

typedef struct out_writer {
    const tkd_tokenize_opts *o;
    tkd_atomic_file af;
    bool open;
    int shard;          /* files opened so far */
    int64_t in_file;    /* tokens in the open file */
    char path[4096];    /* the open file */
    staged *done;       // (ndone,) finished, not yet renamed; tmp NULL once renamed
    int ndone, cap_done;
    file_id *reads;     // (nreads,) the files this run reads
    int nreads;
} out_writer;

/* The directory of path ("." when none) into dir; *base = its last component. */
static void split_path(const char *path, char *dir, size_t cap, const char **base)
{
    const char *slash = strrchr(path, '/');
    *base = slash ? slash + 1 : path;
    if (!slash)
        snprintf(dir, cap, ".");
    else
        snprintf(dir, cap, "%.*s", slash == path ? 1 : (int)(slash - path), path);
}

/* OUT.bin (or OUT.npy) itself, or OUT_%06d.bin for shard i (the extension kept). */
static tkd_status shard_path(const tkd_tokenize_opts *o, int i, char *out, size_t cap)
{
    size_t n = strlen(o->output);
    const char *ext = is_npy(o) ? ".npy" : ".bin";
    if (n > 4 && strcmp(o->output + n - 4, ext) == 0)
        n -= 4;
    int w = o->shard_tokens > 0 ? snprintf(out, cap, "%.*s_%06d%s", (int)n, o->output, i, ext)
                                : snprintf(out, cap, "%s", o->output);
    if (w < 0 || (size_t)w >= cap)
        return tkd_error_set(TKD_ERR_INVALID_ARG, "tokenize: --output '%s' is too long", o->output);
    return TKD_OK;
}

/* Refuses path when it is (stat: symlinks followed, hard links seen) one of the files being read. */
static tkd_status check_not_read(const out_writer *w, const char *path)
{
    struct stat sb;
    if (stat(path, &sb) != 0)
        return TKD_OK;
    for (int i = 0; i < w->nreads; i++)
        if (w->reads[i].dev == sb.st_dev && w->reads[i].ino == sb.st_ino) {
            tkd_error_set(TKD_ERR_INVALID_ARG, "tokenize: the output %s is the %s %s (the same file)", path,
                          w->reads[i].role, w->reads[i].path);
            return tkd_error_hint(TKD_ERR_INVALID_ARG, "choose another --output; writing it would replace a file "
                                  "this run reads");
        }
    return TKD_OK;
}

/* An output file that is already there: one of the inputs never; else only with --overwrite. */
static tkd_status check_existing(const out_writer *w, const char *path)
{
    TKD_TRY(check_not_read(w, path));
    if (!w->o->overwrite) {
        tkd_error_set(TKD_ERR_INVALID_ARG, "tokenize: %s exists", path);
        return tkd_error_hint(TKD_ERR_INVALID_ARG, "pass --overwrite to replace it, or choose another --output");
    }
    return TKD_OK;
}

/* Is name ("train_000012.bin") "<stem><6 or more digits><ext>", a shard name of this output? */
static bool is_shard_name(const char *name, const char *stem, size_t stem_len, const char *ext)
{
    size_t n = strlen(name), e = strlen(ext);
    if (n < stem_len + 6 + e || strncmp(name, stem, stem_len) != 0 || strcmp(name + n - e, ext) != 0)
        return false;
    return strspn(name + stem_len, "0123456789") == n - stem_len - e;
}

/* Before anything is written: each output name already there (the one file, or every shard name
 * OUT_<digits>.ext in its directory, whatever the count) is checked by check_existing, so an input
 * that is an old shard is refused up front and a run without --overwrite stops at once. */
static tkd_status check_outputs(const out_writer *w)
{
    char first[4096], dir[4096], path[8192];
    const char *base;
    TKD_TRY(shard_path(w->o, 0, first, sizeof first));
    if (w->o->shard_tokens == 0)
        return tkd_file_exists(first) ? check_existing(w, first) : TKD_OK;
    split_path(first, dir, sizeof dir, &base);
    size_t stem_len = strlen(base) - strlen("000000.bin"); /* base is "<stem>000000.bin" (or .npy) */
    DIR *d = opendir(dir);
    if (!d)
        return TKD_OK; /* no directory yet: the temporary file's creation names the problem */
    tkd_status st = TKD_OK;
    for (struct dirent *e; st == TKD_OK && (e = readdir(d)) != NULL;)
        if (is_shard_name(e->d_name, base, stem_len, base + strlen(base) - 4)) {
            snprintf(path, sizeof path, "%s/%s", dir, e->d_name);
            st = check_existing(w, strchr(first, '/') ? path : e->d_name);
        }
    closedir(d);
    return st;
}

/* llm.c: 256 int32 {magic, version, count, 0...}. NumPy (an output named .npy): format 1.0, a
 * 1-D '<u4' array, the header padded to NPY_HEADER bytes so that the count fits when it is known. */
#define NPY_HEADER 128

/* A failed write, flush, fsync or close of the open file: errno's reason in the message (ENOSPC /
 * EDQUOT: TKD_ERR_NOSPACE, "disk full"). */
static tkd_status write_failed(const out_writer *w, const char *what, int err)
{
    if (err == 0)
        err = EIO;
    if (err == ENOSPC || err == EDQUOT) {
        tkd_error_set(TKD_ERR_NOSPACE, "%s: disk full while %s (%s)", w->path, what, strerror(err));
        return tkd_error_hint(TKD_ERR_NOSPACE, "free space and re-run");
    }
    return tkd_error_set(TKD_ERR_IO, "%s: %s failed: %s", w->path, what, strerror(err));
}

static tkd_status write_header(out_writer *w, int64_t ntok)
{
    size_t ok;
    errno = 0;
    if (is_npy(w->o)) {
        char h[NPY_HEADER + 1];
        int n = snprintf(h + 10, sizeof h - 10, "{'descr': '<u4', 'fortran_order': False, 'shape': (%lld,), }",
                         (long long)ntok);
        memcpy(h, "\x93NUMPY\x01\x00", 8);
        h[8] = (char)(NPY_HEADER - 10), h[9] = 0;
        memset(h + 10 + n, ' ', (size_t)(NPY_HEADER - 10 - n));
        h[NPY_HEADER - 1] = '\n';
        ok = fwrite(h, NPY_HEADER, 1, w->af.fp);
    } else {
        int32_t h[LLMC_HEADER_INTS] = {LLMC_MAGIC_U32, TKD_TOKENIZE_VERSION, (int32_t)ntok};
        ok = fwrite(h, sizeof h, 1, w->af.fp);
    }
    return ok == 1 ? TKD_OK : write_failed(w, "writing the header", errno);
}

static tkd_status open_file(out_writer *w)
{
    TKD_TRY(shard_path(w->o, w->shard, w->path, sizeof w->path));
    if (tkd_file_exists(w->path)) /* checked up front too; this sees a name made since */
        TKD_TRY(check_existing(w, w->path));
    TKD_TRY(tkd_atomic_file_open(&w->af, w->path));
    w->open = true;
    w->shard++;
    w->in_file = 0;
    return write_header(w, 0);
}

/* The header gets the count, then the file is flushed, fsynced and closed under its temporary name
 * and joins w->done; out_publish renames it. */
static tkd_status finish_file(out_writer *w)
{
    w->open = false;
    tkd_status st = TKD_OK;
    errno = 0;
    if (fflush(w->af.fp) != 0 || fseek(w->af.fp, 0, SEEK_SET) != 0)
        st = write_failed(w, "writing", errno);
    if (st == TKD_OK)
        st = write_header(w, w->in_file);
    errno = 0;
    if (st == TKD_OK && (fflush(w->af.fp) != 0 || ferror(w->af.fp)))
        st = write_failed(w, "writing", errno);
    if (st == TKD_OK && fsync(fileno(w->af.fp)) != 0)
        st = write_failed(w, "fsync", errno);
    if (st == TKD_OK && w->ndone == w->cap_done) {
        int cap = w->cap_done ? 2 * w->cap_done : 16;
        staged *p = realloc(w->done, (size_t)cap * sizeof *p);
        if (!p)
            st = tkd_error_set(TKD_ERR_NOMEM, "out of memory");
        else
            w->done = p, w->cap_done = cap;
    }
    if (st != TKD_OK) {
        tkd_atomic_file_abort(&w->af);
        return st;
    }
    int rc = fclose(w->af.fp), err = errno;
    w->done[w->ndone++] = (staged){w->af.tmp, w->af.path}; /* taken over: tkd_atomic_file holds nothing now */
    w->af = (tkd_atomic_file){0};
    return rc == 0 ? TKD_OK : write_failed(w, "closing", err);
}

/* The end of a successful run: every staged file gets its final name, in order, then the
 * directory is fsynced. Until here an interrupted run left no output name behind. */
static tkd_status out_publish(out_writer *w)
{
    char dir[4096];
    const char *base;
    for (int i = 0; i < w->ndone; i++) {
        if (rename(w->done[i].tmp, w->done[i].path) != 0)
            return tkd_error_set(TKD_ERR_IO, "%s: renaming the finished file %s to it failed: %s", w->done[i].path,
                                 w->done[i].tmp, strerror(errno));
        free(w->done[i].tmp);
        w->done[i].tmp = NULL;
    }
    if (w->ndone == 0)
        return TKD_OK;
    split_path(w->done[0].path, dir, sizeof dir, &base);
    return tkd_fsync_dir(dir);
}

/* Removes what an unsuccessful run staged (the open file and the finished ones not renamed). */
static void out_free(out_writer *w)
{
    if (w->open)
        tkd_atomic_file_abort(&w->af);
    for (int i = 0; i < w->ndone; i++) {
        if (w->done[i].tmp)
            unlink(w->done[i].tmp);
        free(w->done[i].tmp);
        free(w->done[i].path);
    }
    free(w->done);
    free(w->reads);
}

/* llm.c's header holds the count as int32, so one llm.c file holds at most INT32_MAX tokens. */
static tkd_status writer_put(out_writer *w, const uint32_t *ids, size_t n)
{
    int64_t limit = is_npy(w->o) ? INT64_MAX : INT32_MAX;
    while (n > 0) {
        if (!w->open)
            TKD_TRY(open_file(w));
        int64_t room = w->o->shard_tokens > 0 ? w->o->shard_tokens - w->in_file : limit - w->in_file;
        if (room == 0 && w->o->shard_tokens == 0) {
            tkd_error_set(TKD_ERR_INVALID_ARG, "tokenize: %s would hold more than %d tokens (llm.c's limit)", w->path,
                          INT32_MAX);
            return tkd_error_hint(TKD_ERR_INVALID_ARG, "split the output with --shard-tokens");
        }
        size_t take = (size_t)room < n ? (size_t)room : n;
        errno = 0;
        if (fwrite(ids, sizeof *ids, take, w->af.fp) != take)
            return write_failed(w, "writing", errno);
        w->in_file += (int64_t)take, ids += take, n -= take;
        if (w->o->shard_tokens > 0 && w->in_file == w->o->shard_tokens)
            TKD_TRY(finish_file(w));
    }
    return TKD_OK;
}

/* ---- batches -------------------------------------------------------------------------------------- */

typedef struct record {
    size_t off, len; /* in the batch's text (a big batch's record: in b->big) */
    int64_t line;
    int file;
    bool jsonl;      /* a JSON Lines record: the text is one of its fields */
} record;

typedef struct batch {
    char *text;               // (BATCH_BYTES,) allocated once
    const char *big;          /* a record longer than BATCH_BYTES, alone in the batch: read in place */
    size_t used;
    record rec[BATCH_RECORDS];
    tkd_token_ids ids[BATCH_RECORDS];
    tkd_status st[BATCH_RECORDS];
    char *msg[BATCH_RECORDS]; /* a failed record's message (strdup) */
    int n;
    const char *pending;      /* a record read that did not fit: the next batch's first. It points */
    record pending_rec;       /*   into the reader's buffer, valid until the reader's next call */
} batch;

typedef struct run_state {
    const tkd_tokenize_opts *o;
    tkd_tokenizer *tok;
    tkd_tokenizer_ctx **ctx; // (threads,)
    int threads;
    int64_t eos;             /* appended after a document, -1 for none */
    tkd_text_reader *reader;
    int file;                /* the input being read */
    uint64_t bytes_before;   /* sizes of the inputs finished */
    uint64_t bytes_total;
    out_writer out;
    tkd_dir_lock *lock;      /* the output's lock (.<output name>.topkd-lock beside it) */
    char made[4096];         /* the shallowest folder of the output's path this run made; "" for none */
} run_state;

static const char *rec_text(const batch *b, int i)
{
    return b->big ? b->big : b->text + b->rec[i].off;
}

/* Puts one record in b: copied when it fits the batch's text; a record longer than a whole batch
 * is read in place as a batch of its own (no copy: memory for it is the reader's buffer only);
 * otherwise it waits in b->pending and the batch is full. Returns true when b is full. */
static bool batch_take(batch *b, const char *text, record r)
{
    if (b->used + r.len <= BATCH_BYTES) {
        memcpy(b->text + b->used, text, r.len);
        r.off = b->used;
        b->used += r.len;
        b->rec[b->n++] = r;
        return b->used == BATCH_BYTES;
    }
    if (b->n == 0) {
        b->big = text;
        b->rec[b->n++] = r;
    } else {
        b->pending = text;
        b->pending_rec = r;
    }
    return true;
}

/* Fills b from the inputs (the pending record first); *more is false once every input is read. */
static tkd_status batch_fill(run_state *s, batch *b, bool *more)
{
    b->n = 0, b->used = 0, b->big = NULL;
    *more = true;
    if (b->pending) {
        const char *text = b->pending;
        b->pending = NULL;
        if (batch_take(b, text, b->pending_rec))
            return TKD_OK;
    }
    while (b->n < BATCH_RECORDS) {
        if (!s->reader) {
            if (s->file == s->o->ninputs) {
                *more = false;
                return TKD_OK;
            }
            tkd_text_opts to = {.kind = s->o->kind, .separator = s->o->separator};
            TKD_TRY(tkd_text_reader_open(s->o->inputs[s->file], &to, &s->reader));
        }
        const char *rec;
        size_t len;
        int64_t line;
        bool eof;
        TKD_TRY(tkd_text_reader_next(s->reader, &rec, &len, &line, &eof));
        if (eof) {
            s->bytes_before += tkd_text_reader_offset(s->reader);
            tkd_text_reader_close(s->reader);
            s->reader = NULL;
            s->file++;
            continue;
        }
        bool jsonl = tkd_text_reader_kind(s->reader) == TKD_TEXT_JSONL;
        if (batch_take(b, rec, (record){0, len, line, s->file, jsonl}))
            return TKD_OK;
    }
    return TKD_OK;
}

/* A record's ids against o->vocab_limit: the place named is the text's, not the token file's (with
 * teacher-dump's data.tokenizer that file is a temporary one the user never sees). */
static tkd_status check_vocab(const run_state *s, const record *r, const tkd_token_ids *ids)
{
    const int64_t v = s->o->vocab_limit;
    for (size_t i = 0; v > 0 && i < ids->n; i++)
        if (ids->ids[i] >= (uint64_t)v) {
            tkd_error_set(TKD_ERR_MISMATCH, "%s:%lld: the tokenizer %s gives id %u (token %zu of the document), "
                          "beyond the teacher's vocabulary of %lld", s->o->inputs[r->file], (long long)r->line,
                          tkd_tokenizer_path(s->tok), ids->ids[i], i, (long long)v);
            return tkd_error_hint(TKD_ERR_MISMATCH, "use the teacher's own tokenizer");
        }
    return TKD_OK;
}

/* One record -> prefix + ids + suffix (+ EOS), on the calling thread's context. */
static tkd_status encode_record(const run_state *s, tkd_tokenizer_ctx *ctx, const record *r, const char *text,
                                tkd_token_ids *out)
{
    const uint32_t *pre, *suf;
    int npre = tkd_tokenizer_prefix(s->tok, &pre), nsuf = tkd_tokenizer_suffix(s->tok, &suf);
    char *field = NULL;
    size_t len = r->len;
    out->n = 0;
    tkd_status st = TKD_OK;
    if (r->jsonl)
        st = tkd_text_jsonl_field(s->o->inputs[r->file], r->line, text, r->len, s->o->field, &field, &len);
    if (st == TKD_OK)
        st = tkd_token_ids_push(out, pre, (size_t)npre);
    if (st == TKD_OK)
        st = tkd_tokenizer_encode(ctx, field ? field : text, len, out);
    if (st == TKD_OK)
        st = tkd_token_ids_push(out, suf, (size_t)nsuf);
    uint32_t eos = (uint32_t)s->eos;
    if (st == TKD_OK && s->eos >= 0 && !(nsuf > 0 && suf[nsuf - 1] == eos))
        st = tkd_token_ids_push(out, &eos, 1);
    free(field);
    return st == TKD_OK ? check_vocab(s, r, out) : st;
}

static void batch_encode(run_state *s, batch *b)
{
#pragma omp parallel for num_threads(s->threads) schedule(dynamic, 1)
    for (int i = 0; i < b->n; i++) {
        b->st[i] = encode_record(s, s->ctx[omp_get_thread_num()], &b->rec[i], rec_text(b, i), &b->ids[i]);
        b->msg[i] = b->st[i] != TKD_OK ? strdup(tkd_error_msg()) : NULL;
    }
}

/* Writes the batch's ids in order; the first failed record's message becomes this thread's. */
static tkd_status batch_write(run_state *s, batch *b, tkd_tokenize_summary *sum)
{
    tkd_status st = TKD_OK;
    for (int i = 0; i < b->n; i++) {
        if (st == TKD_OK && b->st[i] != TKD_OK) {
            tkd_error_copy(b->st[i], b->msg[i] ? b->msg[i] : "out of memory");
            st = b->st[i];
        }
        free(b->msg[i]);
        b->msg[i] = NULL;
        if (st != TKD_OK)
            continue;
        st = writer_put(&s->out, b->ids[i].ids, b->ids[i].n);
        sum->docs++;
        sum->tokens += (int64_t)b->ids[i].n;
        if (b->ids[i].cap > BATCH_BYTES / 4) /* a long document's ids are not kept for the rest of the run */
            tkd_token_ids_free(&b->ids[i]);
    }
    return st;
}

/* ---- the run ------------------------------------------------------------------------------------- */

static const char *plural(int64_t n, const char *one, const char *many)
{
    return n == 1 ? one : many;
}

size_t tkd_tokenize_format_totals(char *buf, size_t cap, const tkd_tokenize_summary *s)
{
    char dur[32], size[32], tok_rate[32], byte_rate[32];
    bool timed = s->seconds > 0;
    tkd_progress_format_duration(dur, sizeof dur, s->seconds);
    tkd_progress_format_bytes(size, sizeof size, (double)s->bytes);
    tkd_progress_format_rate(tok_rate, sizeof tok_rate, timed ? (double)s->tokens / s->seconds : NAN);
    tkd_progress_format_bytes(byte_rate, sizeof byte_rate, timed ? (double)s->bytes / s->seconds : NAN);
    int n = snprintf(buf, cap, "done in %s: %d %s, %s of text, %lld %s, %lld %s (%s tok/s, %s/s)", dur, s->files,
                     plural(s->files, "file", "files"), size, (long long)s->docs,
                     plural(s->docs, "document", "documents"), (long long)s->tokens,
                     plural(s->tokens, "token", "tokens"), tok_rate, byte_rate);
    return n < 0 ? 0 : (size_t)n < cap ? (size_t)n : cap ? cap - 1 : 0;
}

static tkd_status resolve_eos(run_state *s)
{
    const char *e = s->o->eos;
    if (e && strcmp(e, "none") == 0) {
        s->eos = -1;
        return TKD_OK;
    }
    s->eos = e ? tkd_tokenizer_token_id(s->tok, e) : tkd_tokenizer_eos_id(s->tok);
    if (s->eos >= 0)
        return TKD_OK;
    if (e)
        tkd_error_set(TKD_ERR_INVALID_ARG, "tokenize: --eos '%s' is not a token of %s", e, tkd_tokenizer_path(s->tok));
    else
        tkd_error_set(TKD_ERR_INVALID_ARG, "tokenize: %s names no eos_token (tokenizer_config.json)",
                      tkd_tokenizer_path(s->tok));
    return tkd_error_hint(TKD_ERR_INVALID_ARG, "pass --eos TOKEN (e.g. --eos '<|endoftext|>'), or --eos none");
}

/* Remembers path (device and inode, symlinks followed) as a file this run reads; missing is fine. */
static tkd_status add_read(out_writer *w, const char *path, const char *role)
{
    struct stat sb;
    if (stat(path, &sb) != 0)
        return TKD_OK;
    file_id *p = realloc(w->reads, (size_t)(w->nreads + 1) * sizeof *p);
    if (!p)
        return tkd_error_set(TKD_ERR_NOMEM, "out of memory");
    w->reads = p;
    w->reads[w->nreads++] = (file_id){sb.st_dev, sb.st_ino, path, role};
    return TKD_OK;
}

/* The output's directory and the name of its lock file, ".<output's name>.topkd-lock". */
static void lock_name(const run_state *s, char *dir, size_t cap, char *name, size_t name_cap)
{
    const char *base;
    split_path(s->o->output, dir, cap, &base);
    snprintf(name, name_cap, ".%s.topkd-lock", base);
}

/* One writer per output: the lock file in the output's directory (common/dir_lock.h), taken before
 * anything is checked or written, so a second run into the same output stops at once naming the
 * first one's pid. The directory is made when missing, as teacher-dump makes output.dir (mkdir -p);
 * a run that fails removes the folders it made (unmake_output_dir) and never one the user had. */
static tkd_status lock_output(run_state *s)
{
    char dir[4096], name[4096];
    lock_name(s, dir, sizeof dir, name, sizeof name);
    tkd_status st = tkd_mkdir_p_made(dir, s->made, sizeof s->made);
    if (st == TKD_OK)
        st = tkd_dir_lock_take(dir, name, "teacher-dump tokenize", &s->lock);
    return st == TKD_OK ? st : tkd_error_prefix(st, "tokenize: --output %s", s->o->output);
}

/* A failed run: the folders it made go again, with the lock file in them (this run's, made there by
 * it), each by rmdir, so one that holds anything else stays. Called with the lock still held. */
static void unmake_output_dir(const run_state *s)
{
    char dir[4096], name[4096], path[8200];
    if (!s->made[0])
        return;
    lock_name(s, dir, sizeof dir, name, sizeof name);
    snprintf(path, sizeof path, "%s/%s", dir, name);
    if (s->lock)
        unlink(path);
    tkd_rmdir_made(dir, s->made);
}

static tkd_status setup(run_state *s, char *tok_config, size_t cap)
{
    TKD_TRY(check_limits(s->o));
    if (!s->o->no_lock)
        TKD_TRY(lock_output(s));
    for (int i = 0; i < s->o->ninputs; i++) {
        uint64_t size;
        TKD_TRY(tkd_file_size(s->o->inputs[i], &size));
        TKD_TRY(add_read(&s->out, s->o->inputs[i], "input"));
        s->bytes_total += size;
    }
    TKD_TRY(tkd_tokenizer_load(s->o->tokenizer, &s->tok));
    char dir[4096];
    const char *base;
    split_path(tkd_tokenizer_path(s->tok), dir, sizeof dir, &base);
    snprintf(tok_config, cap, "%s/tokenizer_config.json", dir);
    TKD_TRY(add_read(&s->out, tkd_tokenizer_path(s->tok), "tokenizer file"));
    TKD_TRY(add_read(&s->out, tok_config, "tokenizer file"));
    TKD_TRY(check_outputs(&s->out));
    TKD_TRY(resolve_eos(s));
    s->threads = s->o->threads > 0 ? s->o->threads : omp_get_max_threads();
    s->ctx = calloc((size_t)s->threads, sizeof *s->ctx);
    if (!s->ctx)
        return tkd_error_set(TKD_ERR_NOMEM, "out of memory");
    for (int i = 0; i < s->threads; i++)
        TKD_TRY(tkd_tokenizer_ctx_create(s->tok, &s->ctx[i]));
    return TKD_OK;
}

static void report(const run_state *s, const tkd_tokenize_summary *sum, double t0)
{
    if (!s->o->progress)
        return;
    tkd_tokenize_progress p = {
        .bytes_done = s->bytes_before + (s->reader ? tkd_text_reader_offset(s->reader) : 0),
        .bytes_total = s->bytes_total,
        .docs = sum->docs,
        .tokens = sum->tokens,
        .elapsed_s = tkd_progress_now() - t0,
    };
    s->o->progress(&p, s->o->progress_user);
}

static tkd_status run_batches(run_state *s, batch *b, tkd_tokenize_summary *sum)
{
    double t0 = tkd_progress_now();
    for (bool more = true; more;) {
        TKD_TRY(batch_fill(s, b, &more));
        batch_encode(s, b);
        TKD_TRY(batch_write(s, b, sum));
        report(s, sum, t0);
        if (tkd_interrupted())
            return tkd_error_set(TKD_ERR_INTERRUPTED, "tokenize: stopped by a signal after %lld documents; nothing "
                                 "written (the %d file(s) made so far were temporaries, now removed; an existing "
                                 "output is untouched) — re-run the command to start again",
                                 (long long)sum->docs, s->out.shard);
    }
    if (!s->out.open && s->out.shard == 0) /* no documents: still a (valid, empty) token file */
        TKD_TRY(open_file(&s->out));
    if (s->out.open)
        TKD_TRY(finish_file(&s->out));
    TKD_TRY(out_publish(&s->out));
    sum->seconds = tkd_progress_now() - t0;
    return TKD_OK;
}

static void teardown(run_state *s, batch *b, bool failed)
{
    out_free(&s->out);
    if (failed)
        unmake_output_dir(s);
    tkd_dir_lock_release(s->lock);
    tkd_text_reader_close(s->reader);
    for (int i = 0; s->ctx && i < s->threads; i++)
        tkd_tokenizer_ctx_free(s->ctx[i]);
    free(s->ctx);
    tkd_tokenizer_free(s->tok);
    if (b) {
        for (int i = 0; i < BATCH_RECORDS; i++) {
            tkd_token_ids_free(&b->ids[i]);
            free(b->msg[i]);
        }
        free(b->text);
        free(b);
    }
}

tkd_status tkd_tokenize_run(const tkd_tokenize_opts *o, tkd_tokenize_summary *sum)
{
    memset(sum, 0, sizeof *sum);
    run_state s = {.o = o, .out = {.o = o}};
    char tok_config[4200]; /* a name add_read keeps */
    batch *b = calloc(1, sizeof *b);
    char *text = malloc(BATCH_BYTES);
    if (b)
        b->text = text;
    else
        free(text);
    tkd_status st = b && text ? setup(&s, tok_config, sizeof tok_config) : tkd_error_set(TKD_ERR_NOMEM, "out of memory");
    if (st == TKD_OK)
        st = run_batches(&s, b, sum);
    if (st == TKD_OK) {
        sum->bytes = s.bytes_total;
        sum->files = s.out.shard;
        sum->eos_id = s.eos;
        const uint32_t *ids;
        sum->nprefix = tkd_tokenizer_prefix(s.tok, &ids);
        sum->nsuffix = tkd_tokenizer_suffix(s.tok, &ids);
        shard_path(o, 0, sum->first, sizeof sum->first);
        if (o->shard_tokens > 0 && shard_path(o, s.out.shard, sum->stale, sizeof sum->stale) == TKD_OK &&
            !tkd_file_exists(sum->stale))
            sum->stale[0] = '\0';
    }
    tkd_error_saved saved;
    tkd_error_save(&saved, st);
    teardown(&s, b, st != TKD_OK);
    return tkd_error_restore(&saved);
}
