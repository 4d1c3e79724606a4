/* tokenize.c — see tokenize.h. The main thread reads records into a batch (up to 16 MB of text or
 * 4096 records), OpenMP threads each with their own tokenizer context turn the batch into ids (and
 * parse JSON Lines on the way), then the main thread writes the ids in order. */
#include "teacher_cache/tokenize.h"

#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/fileio.h"
#include "common/progress.h"
#include "common/signals.h"
#include "formats/tokenizer.h"

#define BATCH_BYTES (16u << 20)
#define BATCH_RECORDS 4096
#define LLMC_MAGIC_U32 20240801
#define LLMC_HEADER_INTS 256

const char tkd_tokenize_usage[] =
    "teacher-dump tokenize --tokenizer PATH --output OUT.bin [options] FILE...\n"
    "Tokenizes text files or JSON Lines with the teacher's Hugging Face tokenizer into an llm.c token file\n"
    "(uint32 tokens, header 20240801 v7) that data.paths reads (docs/teacher-dump.md, \"Tokenizing text\").\n"
    "  --tokenizer PATH       tokenizer.json, or the checkpoint directory holding it (and tokenizer_config.json)\n"
    "  --output OUT.bin       the token file; with --shard-tokens, OUT_000000.bin, OUT_000001.bin, ...;\n"
    "                         a name ending in .npy writes a NumPy uint32 array instead\n"
    "  --format auto|text|jsonl  auto (default): .jsonl/.ndjson are JSON Lines, other files text\n"
    "  --field NAME           JSON Lines: the field holding the text (default: text)\n"
    "  --doc-separator STR    text: documents are separated by STR (\\n, \\t, \\r, \\\\ understood); default:\n"
    "                         one document per file\n"
    "  --eos TOKEN|none       the token written after each document (default: the tokenizer's eos_token)\n"
    "  --shard-tokens N       at most N tokens per output file (default: one file)\n"
    "  --threads N            tokenizing threads (default: OMP_NUM_THREADS, else all CPUs)\n"
    "  --overwrite            replace an existing output file\n"
    "  -v / -q                more / less output";

/* ---- arguments ---------------------------------------------------------------------------------- */

void tkd_tokenize_opts_free(tkd_tokenize_opts *o)
{
    free(o->inputs);
    free(o->separator);
    o->inputs = NULL;
    o->separator = NULL;
}

static tkd_status parse_int(const char *flag, const char *v, int64_t lo, int64_t *out)
{
    char *end;
    long long x = v ? strtoll(v, &end, 10) : 0;
    if (!v || !*v || *end || x < lo)
        return tkd_error_set(TKD_ERR_INVALID_ARG, "tokenize: %s needs an integer >= %lld (got '%s') — see --help", flag,
                             (long long)lo, v ? v : "");
    *out = x;
    return TKD_OK;
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
        TKD_TRY(parse_int(name, v, 1, &x));
        o->shard_tokens = x;
    } else if (strcmp(name, "--threads") == 0) {
        TKD_TRY(parse_int(name, v, 1, &x));
        o->threads = (int)(x < 4096 ? x : 4096);
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
    return TKD_OK;
}

/* ---- output: llm.c .bin files, maybe sharded ------------------------------------------------------ */

typedef struct out_writer {
    const tkd_tokenize_opts *o;
    tkd_atomic_file af;
    bool open;
    int shard;          /* files opened so far */
    int64_t in_file;    /* tokens in the open file */
    char path[4096];    /* the open file */
} out_writer;

static bool is_npy(const tkd_tokenize_opts *o)
{
    size_t n = strlen(o->output);
    return n > 4 && strcmp(o->output + n - 4, ".npy") == 0;
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

/* llm.c: 256 int32 {magic, version, count, 0...}. NumPy (an output named .npy): format 1.0, a
 * 1-D '<u4' array, the header padded to NPY_HEADER bytes so that the count fits when it is known. */
#define NPY_HEADER 128
static tkd_status write_header(out_writer *w, int64_t ntok)
{
    size_t ok;
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
    if (ok != 1)
        return tkd_error_set(TKD_ERR_IO, "%s: write failed", w->path);
    return TKD_OK;
}

static tkd_status open_file(out_writer *w)
{
    TKD_TRY(shard_path(w->o, w->shard, w->path, sizeof w->path));
    if (!w->o->overwrite && tkd_file_exists(w->path)) {
        tkd_error_set(TKD_ERR_INVALID_ARG, "tokenize: %s exists", w->path);
        return tkd_error_hint(TKD_ERR_INVALID_ARG, "pass --overwrite to replace it, or choose another --output");
    }
    TKD_TRY(tkd_atomic_file_open(&w->af, w->path));
    w->open = true;
    w->shard++;
    w->in_file = 0;
    return write_header(w, 0);
}

/* The header gets the count, then the file its final name. */
static tkd_status close_file(out_writer *w)
{
    w->open = false;
    if (fflush(w->af.fp) != 0 || fseek(w->af.fp, 0, SEEK_SET) != 0) {
        tkd_atomic_file_abort(&w->af);
        return tkd_error_set(TKD_ERR_IO, "%s: write failed", w->path);
    }
    tkd_status st = write_header(w, w->in_file);
    if (st != TKD_OK) {
        tkd_atomic_file_abort(&w->af);
        return st;
    }
    return tkd_atomic_file_commit(&w->af);
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
        if (fwrite(ids, sizeof *ids, take, w->af.fp) != take)
            return tkd_error_set(TKD_ERR_IO, "%s: write failed", w->path);
        w->in_file += (int64_t)take, ids += take, n -= take;
        if (w->o->shard_tokens > 0 && w->in_file == w->o->shard_tokens)
            TKD_TRY(close_file(w));
    }
    return TKD_OK;
}

/* ---- batches -------------------------------------------------------------------------------------- */

typedef struct record {
    size_t off, len; /* in the batch's text */
    int64_t line;
    int file;
    bool jsonl;      /* a JSON Lines record: the text is one of its fields */
} record;

typedef struct batch {
    char *text;
    size_t used, cap;
    record rec[BATCH_RECORDS];
    tkd_token_ids ids[BATCH_RECORDS];
    tkd_status st[BATCH_RECORDS];
    char *msg[BATCH_RECORDS]; /* a failed record's message (strdup) */
    int n;
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
} run_state;

static tkd_status batch_add(batch *b, const char *rec, size_t len, int64_t line, int file, bool jsonl)
{
    if (b->used + len > b->cap) {
        size_t cap = b->cap ? b->cap : BATCH_BYTES;
        while (cap < b->used + len)
            cap *= 2;
        char *p = realloc(b->text, cap);
        if (!p)
            return tkd_error_set(TKD_ERR_NOMEM, "out of memory for a batch of %zu bytes", cap);
        b->text = p, b->cap = cap;
    }
    memcpy(b->text + b->used, rec, len);
    b->rec[b->n++] = (record){b->used, len, line, file, jsonl};
    b->used += len;
    return TKD_OK;
}

/* Fills b from the inputs; *more is false once every input is read. */
static tkd_status batch_fill(run_state *s, batch *b, bool *more)
{
    b->n = 0, b->used = 0;
    *more = true;
    while (b->n < BATCH_RECORDS && b->used < BATCH_BYTES) {
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
        TKD_TRY(batch_add(b, rec, len, line, s->file, tkd_text_reader_kind(s->reader) == TKD_TEXT_JSONL));
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
    return st;
}

static void batch_encode(run_state *s, batch *b)
{
#pragma omp parallel for num_threads(s->threads) schedule(dynamic, 1)
    for (int i = 0; i < b->n; i++) {
        b->st[i] = encode_record(s, s->ctx[omp_get_thread_num()], &b->rec[i], b->text + b->rec[i].off, &b->ids[i]);
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
    }
    return st;
}

/* ---- the run ------------------------------------------------------------------------------------- */

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

static tkd_status setup(run_state *s)
{
    for (int i = 0; i < s->o->ninputs; i++) {
        uint64_t size;
        TKD_TRY(tkd_file_size(s->o->inputs[i], &size));
        s->bytes_total += size;
    }
    TKD_TRY(tkd_tokenizer_load(s->o->tokenizer, &s->tok));
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
            return tkd_error_set(TKD_ERR_INTERRUPTED, "tokenize: stopped by a signal after %lld documents; %d whole "
                                 "file(s) kept, the one in progress removed — re-run the command to start again",
                                 (long long)sum->docs, s->out.shard - (s->out.open ? 1 : 0));
    }
    if (!s->out.open && s->out.shard == 0) /* no documents: still a (valid, empty) token file */
        TKD_TRY(open_file(&s->out));
    if (s->out.open)
        TKD_TRY(close_file(&s->out));
    sum->seconds = tkd_progress_now() - t0;
    return TKD_OK;
}

static void teardown(run_state *s, batch *b)
{
    if (s->out.open)
        tkd_atomic_file_abort(&s->out.af);
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
    batch *b = calloc(1, sizeof *b);
    tkd_status st = b ? setup(&s) : tkd_error_set(TKD_ERR_NOMEM, "out of memory");
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
    teardown(&s, b);
    return tkd_error_restore(&saved);
}
