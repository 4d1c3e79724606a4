/* tokens_flags.c — the per-token flags sidecar of a token file (tokens.h, docs/data-formats.md):
 * F.flags.npy beside F (PREFIX.flags.npy beside a Megatron dataset), a NumPy 1-D uint8 array of one
 * byte per token of F. Bit 0: the token is a trained target (the label of the position before it);
 * bit 1: the token starts a document. It is mapped like the tokens, checked once when the dataset
 * opens (length, reserved bits), and its document starts replace the file's own.
 */
#include "formats/tokens_internal.h"

#include <errno.h>
#include <stdbool.h>
#include <stdlib.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>

#include "common/fileio.h"
#include "common/signals.h"

/* Bits 2-7 are kept for later meanings: a file that sets them was written by a newer writer. */
#define FLAGS_KNOWN (TKD_TOKENS_FLAG_TRAINED | TKD_TOKENS_FLAG_DOC_START)

/* One pass over the mapped flags: each byte's bits checked, trained tokens counted, document starts
 * collected (f->flag_docs, grown by doubling). */
static tkd_status flags_scan(tok_file *f)
{
    int64_t cap = 0;
    for (int64_t j = 0; j < f->count; j++) {
        if ((j & ((1 << 22) - 1)) == 0 && tkd_interrupted())
            return tkd_input_interrupted(f->flags_path, "flags sidecar");
        uint8_t v = f->flags[j];
        if (v & ~FLAGS_KNOWN)
            return tkd_error_set(TKD_ERR_FORMAT, "%s: byte %lld is 0x%02x: bits 2-7 are reserved (only 1 = trained "
                                 "and 2 = document start are defined)", f->flags_path, (long long)j, v);
        f->ntrained += v & TKD_TOKENS_FLAG_TRAINED;
        if (!(v & TKD_TOKENS_FLAG_DOC_START))
            continue;
        if (f->nflag_docs == cap) {
            cap = cap ? 2 * cap : 64;
            int64_t *p = realloc(f->flag_docs, (size_t)cap * sizeof *p);
            if (!p)
                return tkd_error_set(TKD_ERR_NOMEM, "%s: out of memory for its document starts", f->flags_path);
            f->flag_docs = p;
        }
        f->flag_docs[f->nflag_docs++] = j;
    }
    return TKD_OK;
}

/* Its header, against the token file's count: one flag per token. */
static tkd_status flags_header(tok_file *f, const char *tok_path, uint64_t *start)
{
    FILE *fp;
    TKD_TRY(tkd_fopen_input(f->flags_path, "flags sidecar", &fp));
    int64_t n = 0;
    tkd_status st = tkd_tokens_npy_flags_header(fp, f->flags_path, f->flags_len, &n, start);
    fclose(fp);
    TKD_TRY(st);
    if (n != f->count) {
        tkd_error_set(TKD_ERR_MISMATCH, "%s: %lld flags, but its token file %s holds %lld tokens", f->flags_path,
                      (long long)n, tok_path, (long long)f->count);
        return tkd_error_hint(TKD_ERR_MISMATCH, "a flags sidecar holds one byte per token: write it again with the "
                              "token file");
    }
    return TKD_OK;
}

tkd_status tkd_tokens_flags_attach(tok_file *f, const char *tok_path, const char *flags_path)
{
    struct stat sb;
    if (stat(flags_path, &sb) != 0 && errno == ENOENT)
        return TKD_OK; /* no sidecar: a plain token file */
    if (!(f->flags_path = strdup(flags_path)))
        return tkd_error_set(TKD_ERR_NOMEM, "%s: out of memory", flags_path);
    TKD_TRY(tkd_tokens_map_path(flags_path, "flags sidecar", &f->flags_map, &f->flags_len));
    uint64_t start = 0;
    TKD_TRY(flags_header(f, tok_path, &start));
    f->flags = (const uint8_t *)f->flags_map + start;
    return flags_scan(f);
}

void tkd_tokens_flags_release(tok_file *f)
{
    tkd_tokens_unmap(f->flags_map, f->flags_len);
    free(f->flags_path);
    free(f->flag_docs);
}

int64_t tkd_tokens_file_ndocs(const tok_file *f)
{
    if (f->flags_path)
        return f->nflag_docs;
    return f->mm.doc_idx ? f->mm.num_documents : 0;
}

int64_t tkd_tokens_file_doc_start(const tok_file *f, int64_t d)
{
    return f->flags_path ? f->flag_docs[d] : tkd_tokens_mm_doc_start(&f->mm, d);
}

/* The list's files all have flags, or none does: a trained-target mask over part of the stream
 * would train the rest on every position without saying so. */
tkd_status tkd_tokens_flags_check_list(tkd_tokens *ds)
{
    int with = -1, without = -1;
    ds->ntrained = 0;
    for (int i = 0; i < ds->nfiles; i++) {
        if (ds->files[i].flags_path) {
            with = with < 0 ? i : with;
            ds->ntrained += ds->files[i].ntrained;
        } else {
            without = without < 0 ? i : without;
        }
    }
    if (with < 0) {
        ds->ntrained = -1;
        return TKD_OK;
    }
    if (without < 0)
        return TKD_OK;
    const tok_file *w = &ds->files[with], *o = &ds->files[without];
    tkd_error_set(TKD_ERR_MISMATCH, "%s has no flags sidecar, but %s has one (%s): a list of token files has flags "
                  "for every file or for none", o->path, w->path, w->flags_path);
    return tkd_error_hint(TKD_ERR_MISMATCH, "tokenize %s again with its flags, or leave the flags out", o->path);
}

bool tkd_tokens_has_flags(const tkd_tokens *ds) { return ds->ntrained >= 0; }
int64_t tkd_tokens_num_trained(const tkd_tokens *ds) { return ds->ntrained; }

size_t tkd_tokens_trained_summary(const tkd_tokens *ds, char *buf, size_t cap)
{
    if (!tkd_tokens_has_flags(ds) || cap == 0)
        return 0;
    int64_t n = tkd_tokens_count(ds), t = ds->ntrained;
    int w = snprintf(buf, cap, "flags: %lld of %lld tokens are trained targets (%.1f %%), %lld documents",
                     (long long)t, (long long)n, n > 0 ? 100.0 * (double)t / (double)n : 0.0,
                     (long long)tkd_tokens_num_docs(ds));
    return w < 0 ? 0 : (size_t)w < cap ? (size_t)w : cap - 1;
}

/* Calls fn(ctx, flags, at, m) for each run of flags inside one file covering [first, first + n). */
static void each_flag_run(const tkd_tokens *ds, int64_t first, int64_t n,
                          void (*fn)(void *ctx, const uint8_t *flags, int64_t at, int64_t m), void *ctx)
{
    int64_t at = 0;
    for (int i = n > 0 ? tkd_tokens_file_at(ds, first) : ds->nfiles; n > 0; i++) {
        const tok_file *f = &ds->files[i];
        int64_t local = first - f->first, m = f->count - local < n ? f->count - local : n;
        if (m <= 0)
            continue;
        fn(ctx, f->flags + local, at, m);
        at += m;
        first += m;
        n -= m;
    }
}

static void copy_run(void *ctx, const uint8_t *flags, int64_t at, int64_t m)
{
    memcpy((uint8_t *)ctx + at, flags, (size_t)m);
}

tkd_status tkd_tokens_read_flags(const tkd_tokens *ds, int64_t first, int64_t n, uint8_t *out)
{
    if (!tkd_tokens_has_flags(ds))
        return tkd_error_set(TKD_ERR_INVALID_ARG, "%s: the token files have no flags sidecar",
                             ds->files[0].path);
    if (first < 0 || n < 0 || first > ds->count - n)
        return tkd_error_set(TKD_ERR_INVALID_ARG, "flags [%lld, %lld + %lld) are not inside the stream of %lld",
                             (long long)first, (long long)first, (long long)n, (long long)ds->count);
    each_flag_run(ds, first, n, copy_run, out);
    return TKD_OK;
}

/* A window's labels: mask the untrained ones (labels may be NULL) and count the trained ones. */
typedef struct mask_ctx {
    int32_t *labels;
    int64_t trained;
} mask_ctx;

static void mask_run(void *ctx, const uint8_t *flags, int64_t at, int64_t m)
{
    mask_ctx *c = ctx;
    for (int64_t j = 0; j < m; j++) {
        int trained = flags[j] & TKD_TOKENS_FLAG_TRAINED;
        c->trained += trained;
        if (!trained && c->labels)
            c->labels[at + j] = TKD_TOKENS_IGNORE_LABEL;
    }
}

int64_t tkd_tokens_mask_labels(const tkd_tokens *ds, int64_t first, int64_t n, int32_t *labels)
{
    mask_ctx c = {labels, 0};
    each_flag_run(ds, first, n, mask_run, &c);
    return c.trained;
}
