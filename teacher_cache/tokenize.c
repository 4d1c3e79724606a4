/* tokenize.c — see tokenize.h. The main thread reads records into a batch (up to 16 MB of text or
 * 4096 records; a longer record is a batch of its own, read in place), OpenMP threads each with
 * their own tokenizer context turn the batch into ids (and parse JSON Lines on the way), then the
 * main thread writes the ids in order. Every output file is staged under a temporary name; all of
 * them get their final names only once the whole run has succeeded. */
#include "teacher_cache/tokenize.h"

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
#include "formats/chat.h"
#include "formats/tokenizer.h"
#include "formats/tokens.h"
#include "teacher_cache/tokenize_internal.h"

#define BATCH_BYTES (16u << 20)
#define BATCH_RECORDS 4096
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
    "  --chat                 JSON Lines conversations ({\"messages\": [...]} or {\"prompt\", \"completion\"}),\n"
    "                         rendered with the tokenizer's chat template; writes OUT.bin.flags.npy beside\n"
    "                         each token file: which tokens are trained (the assistant's) and where each\n"
    "                         conversation starts (docs/data-formats.md)\n"
    "  --chat-template FILE   --chat: this Jinja template instead of the tokenizer's\n"
    "  --chat-kwargs JSON     --chat: a JSON object added to the template's variables, e.g.\n"
    "                         '{\"enable_thinking\": false}'\n"
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
    else if (strcmp(name, "--chat-template") == 0)
        o->chat_template = v;
    else if (strcmp(name, "--chat-kwargs") == 0)
        o->chat_kwargs = v;
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
    else if (strcmp(a, "--chat") == 0)
        o->chat = true;
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

/* What the output's format can hold: llm.c's header counts a file's tokens in an int32, so one .bin
 * file (a shard, or the whole output) holds at most INT32_MAX tokens; a .npy has no such limit. */
static tkd_status check_limits(const tkd_tokenize_opts *o)
{
    if (o->shard_tokens < 0)
        return tkd_error_set(TKD_ERR_INVALID_ARG, "tokenize: --shard-tokens %lld is negative (0: one file)",
                             (long long)o->shard_tokens);
    if (!tkd_tokenize_is_npy(o) && o->shard_tokens > INT32_MAX) {
        tkd_error_set(TKD_ERR_INVALID_ARG, "tokenize: --shard-tokens %lld is more than one llm.c .bin file holds "
                      "(%d tokens: its header counts them in an int32)", (long long)o->shard_tokens, INT32_MAX);
        return tkd_error_hint(TKD_ERR_INVALID_ARG, "give at most %d, or an --output named .npy", INT32_MAX);
    }
    if (!o->chat && (o->chat_template || o->chat_kwargs))
        return tkd_error_set(TKD_ERR_INVALID_ARG, "tokenize: --%s needs --chat",
                             o->chat_template ? "chat-template" : "chat-kwargs");
    if (o->chat && (o->eos || o->kind == TKD_TEXT_PLAIN || o->separator)) {
        tkd_error_set(TKD_ERR_INVALID_ARG, "tokenize: --chat does not take %s",
                      o->eos ? "--eos: the chat template ends each conversation itself"
                             : "text input: its records are JSON Lines conversations");
        return tkd_error_hint(TKD_ERR_INVALID_ARG, "leave out --eos, --format text and --doc-separator");
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
    tkd_chat_flags flags[BATCH_RECORDS]; /* --chat: each record's flags, as long as its ids */
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
    tkd_chat *chat;          /* --chat: the template, else NULL */
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
            tkd_text_opts to = {.kind = s->chat ? TKD_TEXT_JSONL : s->o->kind, .separator = s->o->separator};
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

/* One record -> prefix + ids + suffix (+ EOS), on the calling thread's context; --chat: the
 * conversation's ids and flags (formats/chat.h). */
static tkd_status encode_record(const run_state *s, tkd_tokenizer_ctx *ctx, const record *r, const char *text,
                                tkd_token_ids *out, tkd_chat_flags *flags)
{
    if (s->chat) {
        tkd_status st = tkd_chat_encode(s->chat, ctx, s->o->inputs[r->file], r->line, text, r->len, out, flags);
        return st == TKD_OK ? check_vocab(s, r, out) : st;
    }
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
        b->st[i] = encode_record(s, s->ctx[omp_get_thread_num()], &b->rec[i], rec_text(b, i), &b->ids[i],
                                 &b->flags[i]);
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
        st = tkd_tokout_put(&s->out, b->ids[i].ids, s->chat ? b->flags[i].v : NULL, b->ids[i].n);
        sum->docs++;
        sum->tokens += (int64_t)b->ids[i].n;
        for (size_t k = 0; s->chat && k < b->flags[i].n; k++)
            sum->trained += b->flags[i].v[k] & TKD_TOKENS_FLAG_TRAINED;
        if (b->flags[i].cap > BATCH_BYTES / 4)
            tkd_chat_flags_free(&b->flags[i]);
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

/* The output's directory and the name of its lock file, ".<output's name>.topkd-lock". */
static void lock_name(const run_state *s, char *dir, size_t cap, char *name, size_t name_cap)
{
    const char *base;
    tkd_tokenize_split_path(s->o->output, dir, cap, &base);
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
        TKD_TRY(tkd_tokout_add_read(&s->out, s->o->inputs[i], "input"));
        s->bytes_total += size;
    }
    TKD_TRY(tkd_tokenizer_load(s->o->tokenizer, &s->tok));
    char dir[4096];
    const char *base;
    tkd_tokenize_split_path(tkd_tokenizer_path(s->tok), dir, sizeof dir, &base);
    snprintf(tok_config, cap, "%s/tokenizer_config.json", dir);
    TKD_TRY(tkd_tokout_add_read(&s->out, tkd_tokenizer_path(s->tok), "tokenizer file"));
    TKD_TRY(tkd_tokout_add_read(&s->out, tok_config, "tokenizer file"));
    if (s->o->chat_template)
        TKD_TRY(tkd_tokout_add_read(&s->out, s->o->chat_template, "chat template"));
    TKD_TRY(tkd_tokout_check_outputs(&s->out));
    if (s->o->chat) { /* the template ends each conversation: no EOS between documents */
        s->eos = -1;
        tkd_chat_opts co = {s->o->chat_template, s->o->chat_kwargs, s->o->chat_now > 0 ? s->o->chat_now : -1};
        TKD_TRY(tkd_chat_open(s->tok, &co, &s->chat));
    } else {
        TKD_TRY(resolve_eos(s));
    }
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
        TKD_TRY(tkd_tokout_open_file(&s->out));
    if (s->out.open)
        TKD_TRY(tkd_tokout_finish_file(&s->out));
    TKD_TRY(tkd_tokout_publish(&s->out));
    sum->seconds = tkd_progress_now() - t0;
    return TKD_OK;
}

static void teardown(run_state *s, batch *b, bool failed)
{
    tkd_tokout_free(&s->out);
    if (failed)
        unmake_output_dir(s);
    tkd_dir_lock_release(s->lock);
    tkd_text_reader_close(s->reader);
    for (int i = 0; s->ctx && i < s->threads; i++)
        tkd_tokenizer_ctx_free(s->ctx[i]);
    free(s->ctx);
    tkd_chat_free(s->chat);
    tkd_tokenizer_free(s->tok);
    if (b) {
        for (int i = 0; i < BATCH_RECORDS; i++) {
            tkd_token_ids_free(&b->ids[i]);
            tkd_chat_flags_free(&b->flags[i]);
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
        sum->nprefix = s.chat ? 0 : tkd_tokenizer_prefix(s.tok, &ids); /* --chat: the template's own tokens */
        sum->nsuffix = s.chat ? 0 : tkd_tokenizer_suffix(s.tok, &ids);
        if (s.chat)
            snprintf(sum->chat_source, sizeof sum->chat_source, "%s (trained: %s)", tkd_chat_source(s.chat),
                     tkd_chat_rule(s.chat));
        tkd_tokenize_shard_path(o, 0, sum->first, sizeof sum->first);
        if (o->shard_tokens > 0 && tkd_tokenize_shard_path(o, s.out.shard, sum->stale, sizeof sum->stale) == TKD_OK &&
            !tkd_file_exists(sum->stale))
            sum->stale[0] = '\0';
    }
    tkd_error_saved saved;
    tkd_error_save(&saved, st);
    teardown(&s, b, st != TKD_OK);
    return tkd_error_restore(&saved);
}
