/* doc_pack.c — see doc_pack.h. */
#include "formats/doc_pack.h"

#include <stdlib.h>
#include <string.h>

const char *const tkd_packing_names[] = {"stream", "documents", NULL};

typedef struct piece {
    int64_t start; /* global token offset */
    int32_t len;   /* tokens, 1..T */
    int32_t cont;  /* 1: the document goes on after it (its last label is the document's next token) */
} piece;

struct tkd_doc_pack {
    const tkd_tokens *ds;
    int T;
    piece *pc;        /* (n_pc) in dataset order */
    int64_t n_pc, cap_pc;
    int64_t *seq0;    /* (n_seq + 1) first piece of each sequence */
    int64_t n_seq, cap_seq;
    int64_t n_docs, n_labels;
    uint8_t *flags;   /* (T + 1) scratch for the flags sidecar's trained bits, when the dataset has one */
};

static tkd_status grow(void **p, int64_t *cap, int64_t need, size_t elem)
{
    if (need <= *cap)
        return TKD_OK;
    int64_t c = *cap ? *cap * 2 : 1024;
    while (c < need)
        c *= 2;
    void *q = realloc(*p, (size_t)c * elem);
    if (!q)
        return tkd_error_set(TKD_ERR_NOMEM, "data.packing: out of memory for %lld document pieces", (long long)need);
    *p = q;
    *cap = c;
    return TKD_OK;
}

/* One document [s, e): its pieces, each closing the current sequence when it does not fit. */
static tkd_status add_doc(tkd_doc_pack *p, int64_t s, int64_t e, int *used)
{
    for (int64_t a = s; a < e; a += p->T) {
        int32_t n = (int32_t)(e - a < p->T ? e - a : p->T);
        if (*used + n > p->T) { /* close the current sequence */
            TKD_TRY(grow((void **)&p->seq0, &p->cap_seq, p->n_seq + 2, sizeof *p->seq0));
            p->seq0[++p->n_seq] = p->n_pc;
            *used = 0;
        }
        TKD_TRY(grow((void **)&p->pc, &p->cap_pc, p->n_pc + 1, sizeof *p->pc));
        p->pc[p->n_pc++] = (piece){a, n, a + n < e};
        *used += n;
        p->n_labels += a + n < e ? n : n - 1;
    }
    p->n_docs++;
    return TKD_OK;
}

/* Every file must record its documents, from its first token on. */
static tkd_status check_files(const tkd_tokens *ds)
{
    int64_t d = 0, nd = tkd_tokens_num_docs(ds);
    for (int f = 0; f < tkd_tokens_num_files(ds); f++) {
        int64_t first, count;
        const char *path = tkd_tokens_file(ds, f, &first, &count);
        if (count == 0)
            continue;
        while (d < nd && tkd_tokens_doc_start(ds, d) < first)
            d++;
        if (d >= nd || tkd_tokens_doc_start(ds, d) != first)
            return tkd_error_hint(tkd_error_set(TKD_ERR_CONFIG, "data.packing: documents: %s records no document "
                                                "boundaries", path),
                                  "make it with teacher-dump tokenize (it writes them beside the tokens) or as a "
                                  "Megatron dataset, or use data.packing: stream");
    }
    return TKD_OK;
}

static tkd_status build(tkd_doc_pack *p)
{
    const tkd_tokens *ds = p->ds;
    TKD_TRY(check_files(ds));
    TKD_TRY(grow((void **)&p->seq0, &p->cap_seq, 1, sizeof *p->seq0));
    p->seq0[0] = 0;
    int64_t nd = tkd_tokens_num_docs(ds);
    int f = 0, nf = tkd_tokens_num_files(ds), used = 0;
    int64_t ffirst = 0, fcount = 0;
    tkd_tokens_file(ds, 0, &ffirst, &fcount);
    for (int64_t d = 0; d < nd; d++) {
        int64_t s = tkd_tokens_doc_start(ds, d);
        while (f + 1 < nf && s >= ffirst + fcount)
            tkd_tokens_file(ds, ++f, &ffirst, &fcount);
        int64_t e = ffirst + fcount, next = d + 1 < nd ? tkd_tokens_doc_start(ds, d + 1) : e;
        e = next < e ? next : e; /* the next document's start, or the end of this one's file */
        if (e > s)
            TKD_TRY(add_doc(p, s, e, &used));
    }
    if (used > 0) {
        TKD_TRY(grow((void **)&p->seq0, &p->cap_seq, p->n_seq + 2, sizeof *p->seq0));
        p->seq0[++p->n_seq] = p->n_pc;
    }
    return TKD_OK;
}

tkd_status tkd_doc_pack_build(const tkd_tokens *ds, int seq_len, tkd_doc_pack **out)
{
    *out = NULL;
    if (seq_len < 1)
        return tkd_error_set(TKD_ERR_INVALID_ARG, "data.packing: sequence length %d < 1", seq_len);
    tkd_doc_pack *p = calloc(1, sizeof *p);
    if (!p)
        return tkd_error_set(TKD_ERR_NOMEM, "data.packing: out of memory");
    p->ds = ds;
    p->T = seq_len;
    p->flags = tkd_tokens_has_flags(ds) ? malloc((size_t)seq_len + 1) : NULL;
    tkd_status st = tkd_tokens_has_flags(ds) && !p->flags ? tkd_error_set(TKD_ERR_NOMEM, "data.packing: out of memory")
                                                          : build(p);
    if (st != TKD_OK) {
        tkd_doc_pack_free(p);
        return st;
    }
    *out = p;
    return TKD_OK;
}

void tkd_doc_pack_free(tkd_doc_pack *p)
{
    if (!p)
        return;
    free(p->pc);
    free(p->seq0);
    free(p->flags);
    free(p);
}

int64_t tkd_doc_pack_count(const tkd_doc_pack *p) { return p->n_seq; }
int64_t tkd_doc_pack_docs(const tkd_doc_pack *p) { return p->n_docs; }
int64_t tkd_doc_pack_labels(const tkd_doc_pack *p) { return p->n_labels; }

tkd_status tkd_doc_pack_read(const tkd_doc_pack *p, int64_t i, int32_t *tokens, int32_t *labels, int32_t *doc,
                             int *n_valid)
{
    if (i < 0 || i >= p->n_seq)
        return tkd_error_set(TKD_ERR_INVALID_ARG, "packed sequence %lld out of range (%lld sequences)", (long long)i,
                             (long long)p->n_seq);
    const int T = p->T;
    int pos = 0, valid = 0;
    for (int64_t c = p->seq0[i]; c < p->seq0[i + 1]; c++) {
        const piece *pc = &p->pc[c];
        int n = pc->len + pc->cont; /* a continuing piece reads its last label too */
        int32_t *dst = tokens + pos; /* n ≤ T + 1 − pos: a continuing piece fills a whole sequence */
        TKD_TRY(tkd_tokens_read(p->ds, pc->start, n, dst));
        if (p->flags)
            TKD_TRY(tkd_tokens_read_flags(p->ds, pc->start, n, p->flags));
        for (int j = 0; j < pc->len; j++) {
            /* a next token in the document, trained by the flags sidecar when there is one */
            int has = (j + 1 < pc->len || pc->cont) && (!p->flags || (p->flags[j + 1] & TKD_TOKENS_FLAG_TRAINED));
            if (labels)
                labels[pos + j] = has ? dst[j + 1] : TKD_TOKENS_IGNORE_LABEL;
            if (doc)
                doc[pos + j] = pos;
            valid += has;
        }
        pos += pc->len;
        if (pos < T || !pc->cont)
            tokens[pos] = TKD_TOKENS_IGNORE_LABEL; /* the next piece overwrites it; else no label */
    }
    for (int j = pos; j < T; j++) { /* padding: one more piece */
        tokens[j] = TKD_TOKENS_IGNORE_LABEL;
        if (labels)
            labels[j] = TKD_TOKENS_IGNORE_LABEL;
        if (doc)
            doc[j] = pos;
    }
    if (pos < T)
        tokens[T] = TKD_TOKENS_IGNORE_LABEL;
    if (n_valid)
        *n_valid = valid;
    return TKD_OK;
}
