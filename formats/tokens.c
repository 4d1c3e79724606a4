/* tokens.c — see tokens.h. Files are little-endian, like the host (x86-64, aarch64). */
#include "formats/tokens.h"

#include "common/fileio.h"
#include "common/sha256.h"
#include "common/signals.h"

#include <errno.h>
#include <glob.h>
#include <limits.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#define BIN_HEADER_INTS 256
#define NPY_MAX_HEADER (1u << 20) /* numpy writes < 1 KB; anything huge is corrupt */

typedef struct tok_file {
    char *path;
    int64_t first; /* global offset of its first token */
    int64_t count;
} tok_file;

struct tkd_tokens {
    int32_t *data; // (count,)
    int64_t count, cap;
    tok_file *files;
    int nfiles;
};

/* How the tokens of one file are stored. */
typedef enum tok_kind { TOK_I32, TOK_U16, TOK_U32, TOK_I64 } tok_kind;

static size_t kind_size(tok_kind k) { return k == TOK_U16 ? 2 : k == TOK_I64 ? 8 : 4; }

/* ---- reading one file ---------------------------------------------------------------------- */

static tkd_status grow(tkd_tokens *ds, int64_t extra, const char *path)
{
    if (ds->count + extra <= ds->cap)
        return TKD_OK;
    int64_t cap = ds->cap ? ds->cap : 4096;
    while (cap < ds->count + extra)
        cap *= 2;
    if ((uint64_t)cap > SIZE_MAX / sizeof(int32_t))
        return tkd_error_set(TKD_ERR_NOMEM, "%s: %lld tokens do not fit in memory", path, (long long)cap);
    int32_t *p = realloc(ds->data, (size_t)cap * sizeof *p);
    if (!p)
        return tkd_error_set(TKD_ERR_NOMEM, "%s: out of memory loading %lld tokens", path,
                             (long long)(ds->count + extra));
    ds->data = p;
    ds->cap = cap;
    return TKD_OK;
}

/* The payload after the header must hold exactly count tokens of the given size. */
static tkd_status check_payload(const char *path, int64_t count, size_t tsz, uint64_t payload)
{
    uint64_t want = (uint64_t)count * tsz;
    if (payload < want)
        return tkd_error_set(TKD_ERR_FORMAT,
                             "%s: truncated: the header promises %lld tokens (%llu bytes) but %llu bytes follow it",
                             path, (long long)count, (unsigned long long)want, (unsigned long long)payload);
    if (payload > want)
        return tkd_error_set(TKD_ERR_FORMAT,
                             "%s: token count mismatch: the header says %lld tokens (%llu bytes) but %llu bytes "
                             "follow it",
                             path, (long long)count, (unsigned long long)want, (unsigned long long)payload);
    return TKD_OK;
}

/* Reads count tokens of kind k from fp into ds (already grown), converting to int32. */
static tkd_status read_tokens(tkd_tokens *ds, FILE *fp, const char *path, tok_kind k, int64_t count)
{
    enum { CHUNK = 1 << 14 };
    if (count == 0)
        return TKD_OK; /* ds->data may still be NULL: no pointer arithmetic on it (found by fuzz_tokens) */
    size_t tsz = kind_size(k);
    uint8_t *buf = malloc(CHUNK * 8); /* one buffer per file, reused for every chunk */
    if (!buf)
        return tkd_error_set(TKD_ERR_NOMEM, "%s: out of memory", path);
    int32_t *dst = ds->data + ds->count;
    tkd_status st = TKD_OK;
    for (int64_t done = 0; done < count && st == TKD_OK;) {
        size_t m = count - done < CHUNK ? (size_t)(count - done) : CHUNK, got = 0;
        /* a large file takes a while: Ctrl-C ends the read between chunks */
        if (tkd_interrupted()) {
            st = tkd_input_interrupted(path, "token file");
            break;
        }
        st = tkd_fread_input(fp, buf, m * tsz, &got, path);
        if (st == TKD_OK && got != m * tsz)
            st = tkd_error_set(TKD_ERR_IO, "%s: read failed at token offset %lld (file shrank while reading?)", path,
                               (long long)done);
        if (st != TKD_OK)
            break;
        for (size_t j = 0; j < m && st == TKD_OK; j++) {
            int64_t v;
            if (k == TOK_U16) {
                uint16_t u;
                memcpy(&u, buf + 2 * j, 2);
                v = u;
            } else if (k == TOK_U32) {
                uint32_t u;
                memcpy(&u, buf + 4 * j, 4);
                v = u;
            } else if (k == TOK_I32) {
                int32_t u;
                memcpy(&u, buf + 4 * j, 4);
                v = u;
            } else {
                memcpy(&v, buf + 8 * j, 8);
            }
            if (v > INT32_MAX || v < INT32_MIN)
                st = tkd_error_set(TKD_ERR_FORMAT, "%s: token %lld at token offset %lld does not fit in int32",
                                   path, (long long)v, (long long)(done + (int64_t)j));
            dst[done + (int64_t)j] = (int32_t)v;
        }
        done += (int64_t)m;
    }
    free(buf);
    return st;
}

static tkd_status bin_header(FILE *fp, const char *path, uint64_t size, tok_kind *kind, int64_t *count)
{
    if (size < BIN_HEADER_INTS * 4)
        return tkd_error_set(TKD_ERR_FORMAT,
                             "%s: %llu bytes, shorter than the 1024-byte llm.c token header: truncated or not a "
                             "token file",
                             path, (unsigned long long)size);
    int32_t h[BIN_HEADER_INTS];
    if (fread(h, 4, BIN_HEADER_INTS, fp) != BIN_HEADER_INTS)
        return tkd_error_set(TKD_ERR_IO, "%s: cannot read the header", path);
    int want_version;
    if (h[0] == TKD_TOKENS_MAGIC_U16) {
        *kind = TOK_U16;
        want_version = 1;
    } else if (h[0] == TKD_TOKENS_MAGIC_U32) {
        *kind = TOK_U32;
        want_version = 2;
    } else {
        return tkd_error_set(TKD_ERR_FORMAT,
                             "%s: bad magic %d (expected %d or %d): not an llm.c token file or a .npy array",
                             path, h[0], TKD_TOKENS_MAGIC_U16, TKD_TOKENS_MAGIC_U32);
    }
    if (h[1] != want_version)
        return tkd_error_set(TKD_ERR_FORMAT, "%s: llm.c header version %d does not go with magic %d (expected %d)",
                             path, h[1], h[0], want_version);
    if (h[2] < 0)
        return tkd_error_set(TKD_ERR_FORMAT, "%s: negative token count %d in the header", path, h[2]);
    *count = h[2];
    return check_payload(path, *count, kind_size(*kind), size - BIN_HEADER_INTS * 4);
}

/* The header dict of an .npy file ("{'descr': '<i4', 'fortran_order': False, 'shape': (10,), }"),
 * read as the Python literal it is: each entry points at its value's text inside the header, NULL
 * when absent. A key given twice or one numpy does not write is refused, so no value is silently
 * ignored. */
typedef struct npy_dict {
    const char *descr, *fortran_order, *shape;
} npy_dict;

static const char *skip_space(const char *p)
{
    while (*p == ' ' || *p == '\t' || *p == '\n' || *p == '\r')
        p++;
    return p;
}

/* Just past the Python literal at p: a quoted string, a bracketed tuple or list (nested, quotes
 * skipped) or a bare word or number; NULL when it does not end. */
static const char *npy_value_end(const char *p)
{
    if (*p == '\'' || *p == '"') {
        const char *e = strchr(p + 1, *p);
        return e ? e + 1 : NULL;
    }
    if (*p == '(' || *p == '[') {
        for (int depth = 0; *p; p++) {
            if (*p == '\'' || *p == '"') {
                if (!(p = strchr(p + 1, *p)))
                    return NULL;
            } else if (*p == '(' || *p == '[') {
                depth++;
            } else if ((*p == ')' || *p == ']') && --depth == 0) {
                return p + 1;
            }
        }
        return NULL;
    }
    const char *s = p;
    while (*p && !strchr(",:{}()[]'\" \t\r\n", *p))
        p++;
    return p > s ? p : NULL;
}

static tkd_status npy_bad_dict(const char *path, const char *h, const char *p, const char *what)
{
    return tkd_error_set(TKD_ERR_FORMAT, "%s: npy header is not a Python dict: %s at header byte %ld", path, what,
                         (long)(p - h));
}

/* Stores the value of key (kl bytes at key) in its slot of d. */
static tkd_status npy_put(const char *path, npy_dict *d, const char *key, size_t kl, const char *value)
{
    static const char *const names[] = {"descr", "fortran_order", "shape"};
    const char **slots[] = {&d->descr, &d->fortran_order, &d->shape};
    for (int i = 0; i < 3; i++) {
        if (strlen(names[i]) != kl || strncmp(names[i], key, kl) != 0)
            continue;
        if (*slots[i])
            return tkd_error_set(TKD_ERR_FORMAT, "%s: npy header has the key '%s' twice", path, names[i]);
        *slots[i] = value;
        return TKD_OK;
    }
    return tkd_error_set(TKD_ERR_FORMAT, "%s: npy header has the key '%.*s'; numpy writes only descr, "
                         "fortran_order and shape", path, (int)(kl < 40 ? kl : 40), key);
}

static tkd_status npy_parse_dict(const char *path, const char *h, npy_dict *d)
{
    memset(d, 0, sizeof *d);
    const char *p = skip_space(h);
    if (*p != '{')
        return npy_bad_dict(path, h, p, "no opening '{'");
    for (p = skip_space(p + 1); *p != '}'; p = skip_space(p)) {
        const char *ke = *p == '\'' || *p == '"' ? strchr(p + 1, *p) : NULL;
        if (!ke)
            return npy_bad_dict(path, h, p, "expected a quoted key");
        const char *key = p + 1, *colon = skip_space(ke + 1);
        if (*colon != ':')
            return npy_bad_dict(path, h, colon, "expected ':' after a key");
        p = skip_space(colon + 1);
        const char *ve = npy_value_end(p);
        if (!ve)
            return npy_bad_dict(path, h, p, "a value that does not end");
        TKD_TRY(npy_put(path, d, key, (size_t)(ke - key), p));
        p = skip_space(ve);
        if (*p == ',')
            p++;
        else if (*p != '}')
            return npy_bad_dict(path, h, p, "expected ',' or '}' after a value");
    }
    p = skip_space(p + 1);
    return *p ? npy_bad_dict(path, h, p, "text after the closing '}'") : TKD_OK;
}

static tkd_status npy_dtype(const char *path, const char *p, tok_kind *kind)
{
    if (!p)
        return tkd_error_set(TKD_ERR_FORMAT, "%s: npy header has no 'descr' entry", path);
    char d[16] = "";
    if (*p == '\'' || *p == '"') {
        const char *e = strchr(p + 1, *p);
        if (e && e - p - 1 < (ptrdiff_t)sizeof d)
            memcpy(d, p + 1, (size_t)(e - p - 1));
    }
    static const struct { const char *descr; tok_kind kind; } ok[] = {
        {"<i4", TOK_I32}, {"<u2", TOK_U16}, {"<u4", TOK_U32}, {"<i8", TOK_I64},
    };
    for (size_t i = 0; i < sizeof ok / sizeof ok[0]; i++)
        if (strcmp(d, ok[i].descr) == 0) {
            *kind = ok[i].kind;
            return TKD_OK;
        }
    return tkd_error_set(TKD_ERR_UNSUPPORTED,
                         "%s: npy dtype '%s' is not supported for tokens (int32 <i4, uint16 <u2, uint32 <u4, "
                         "int64 <i8)",
                         path, *d ? d : "(structured or unreadable)");
}

static tkd_status npy_fortran(const char *path, const char *p)
{
    if (!p)
        return tkd_error_set(TKD_ERR_FORMAT, "%s: npy header has no 'fortran_order' entry", path);
    if (strncmp(p, "False", 5) == 0 && npy_value_end(p) == p + 5)
        return TKD_OK;
    if (strncmp(p, "True", 4) == 0 && npy_value_end(p) == p + 4)
        return tkd_error_set(TKD_ERR_UNSUPPORTED,
                             "%s: npy array is in Fortran order; save it C-contiguous (np.ascontiguousarray)", path);
    return tkd_error_set(TKD_ERR_FORMAT, "%s: npy 'fortran_order' is neither True nor False", path);
}

/* p: the 'shape' value, a tuple whose end npy_value_end has checked. */
static tkd_status npy_shape(const char *path, const char *p, int64_t *count)
{
    if (!p || *p != '(')
        return tkd_error_set(TKD_ERR_FORMAT, "%s: npy header has no 'shape' tuple", path);
    p++;
    int nd = 0;
    int64_t n = 1;
    for (;;) {
        while (*p == ' ' || *p == ',')
            p++;
        if (*p == ')')
            break;
        char *e;
        errno = 0;
        long long v = strtoll(p, &e, 10);
        if (e == p || v < 0 || errno)
            return tkd_error_set(TKD_ERR_FORMAT, "%s: npy 'shape' is not a tuple of non-negative integers", path);
        if (v && n > INT64_MAX / 8 / v)
            return tkd_error_set(TKD_ERR_FORMAT, "%s: npy shape is absurdly large", path);
        n *= v;
        nd++;
        p = e;
    }
    if (nd < 1 || nd > 2)
        return tkd_error_set(TKD_ERR_UNSUPPORTED, "%s: npy array has %d dimensions; tokens must be 1-D or 2-D",
                             path, nd);
    *count = n;
    return TKD_OK;
}

/* The dict text h of an .npy header: the token kind and count it describes. */
static tkd_status npy_parse_header(const char *path, const char *h, tok_kind *kind, int64_t *count)
{
    npy_dict d;
    TKD_TRY(npy_parse_dict(path, h, &d));
    TKD_TRY(npy_dtype(path, d.descr, kind));
    TKD_TRY(npy_fortran(path, d.fortran_order));
    return npy_shape(path, d.shape, count);
}

static tkd_status npy_header(FILE *fp, const char *path, uint64_t size, tok_kind *kind, int64_t *count)
{
    uint8_t pre[12];
    size_t got = fread(pre, 1, sizeof pre, fp);
    if (got < 10)
        return tkd_error_set(TKD_ERR_FORMAT, "%s: npy header runs past the end of the file", path);
    int major = pre[6];
    if (major < 1 || major > 3)
        return tkd_error_set(TKD_ERR_UNSUPPORTED, "%s: npy format version %d is not supported (1, 2 or 3)", path,
                             major);
    size_t lensz = major == 1 ? 2 : 4;
    if (got < 8 + lensz)
        return tkd_error_set(TKD_ERR_FORMAT, "%s: npy header runs past the end of the file", path);
    uint64_t hl = pre[8] | (uint64_t)pre[9] << 8;
    if (lensz == 4)
        hl |= (uint64_t)pre[10] << 16 | (uint64_t)pre[11] << 24;
    uint64_t start = 8 + lensz + hl;
    if (start > size || hl > NPY_MAX_HEADER)
        return tkd_error_set(TKD_ERR_FORMAT, "%s: npy header runs past the end of the file (%llu header bytes)",
                             path, (unsigned long long)hl);
    char *h = malloc(hl + 1);
    if (!h)
        return tkd_error_set(TKD_ERR_NOMEM, "%s: out of memory", path);
    if (fseek(fp, (long)(8 + lensz), SEEK_SET) != 0 || fread(h, 1, hl, fp) != hl) {
        free(h);
        return tkd_error_set(TKD_ERR_IO, "%s: cannot read the npy header", path);
    }
    h[hl] = '\0';
    tkd_status st = npy_parse_header(path, h, kind, count);
    free(h);
    TKD_TRY(st);
    return check_payload(path, *count, kind_size(*kind), size - start);
}

/* Appends one file's tokens to ds; it is recorded in ds->files only when whole. */
static tkd_status load_file(tkd_tokens *ds, const char *path)
{
    FILE *fp;
    TKD_TRY(tkd_fopen_input(path, "token file", &fp));
    struct stat sb;
    if (fstat(fileno(fp), &sb) != 0) {
        tkd_status st = tkd_error_set(TKD_ERR_IO, "%s: fstat failed: %s", path, strerror(errno));
        fclose(fp);
        return st;
    }
    uint64_t size = (uint64_t)sb.st_size;
    uint8_t magic[6] = {0};
    size_t got = fread(magic, 1, 6, fp);
    rewind(fp);
    tok_kind kind = TOK_I32; /* set by the header parsers; initialised for the compiler */
    int64_t count = 0;
    tkd_status st = got == 6 && memcmp(magic, "\x93NUMPY", 6) == 0 ? npy_header(fp, path, size, &kind, &count)
                                                                   : bin_header(fp, path, size, &kind, &count);
    if (st == TKD_OK)
        st = grow(ds, count, path);
    if (st == TKD_OK)
        st = read_tokens(ds, fp, path, kind, count);
    fclose(fp);
    TKD_TRY(st);
    tok_file *f = realloc(ds->files, (size_t)(ds->nfiles + 1) * sizeof *f);
    if (!f)
        return tkd_error_set(TKD_ERR_NOMEM, "%s: out of memory", path);
    ds->files = f;
    if (!(f[ds->nfiles].path = strdup(path)))
        return tkd_error_set(TKD_ERR_NOMEM, "%s: out of memory", path);
    f[ds->nfiles].first = ds->count;
    f[ds->nfiles].count = count;
    ds->nfiles++;
    ds->count += count;
    return TKD_OK;
}

/* A spec with glob characters expands (sorted); a plain path is taken as it is. */
static tkd_status load_spec(tkd_tokens *ds, const char *spec)
{
    if (!strpbrk(spec, "*?["))
        return load_file(ds, spec);
    glob_t g;
    int rc = glob(spec, GLOB_ERR, NULL, &g);
    if (rc == GLOB_NOMATCH) {
        globfree(&g);
        return tkd_error_set(TKD_ERR_NOT_FOUND, "%s: the glob matches no files", spec);
    }
    if (rc != 0) {
        globfree(&g);
        return tkd_error_set(TKD_ERR_IO, "%s: glob failed (%s)", spec, rc == GLOB_NOSPACE ? "out of memory" : "read error");
    }
    tkd_status st = TKD_OK;
    for (size_t i = 0; i < g.gl_pathc && st == TKD_OK; i++)
        st = load_file(ds, g.gl_pathv[i]);
    globfree(&g);
    return st;
}

tkd_status tkd_tokens_open_list(const char *const *specs, int nspecs, tkd_tokens **out)
{
    *out = NULL;
    if (nspecs < 1)
        return tkd_error_set(TKD_ERR_INVALID_ARG, "token dataset: no files given");
    tkd_tokens *ds = calloc(1, sizeof *ds);
    if (!ds)
        return tkd_error_set(TKD_ERR_NOMEM, "token dataset: out of memory");
    tkd_status st = TKD_OK;
    for (int i = 0; i < nspecs && st == TKD_OK; i++)
        st = load_spec(ds, specs[i]);
    if (st == TKD_OK && ds->count == 0)
        st = tkd_error_set(TKD_ERR_FORMAT, "%s%s: the dataset holds no tokens", specs[0], nspecs > 1 ? " ..." : "");
    if (st != TKD_OK) {
        tkd_tokens_free(ds);
        return st;
    }
    *out = ds;
    return TKD_OK;
}

tkd_status tkd_tokens_open(const char *spec, tkd_tokens **out) { return tkd_tokens_open_list(&spec, 1, out); }

void tkd_tokens_free(tkd_tokens *ds)
{
    if (!ds)
        return;
    for (int i = 0; i < ds->nfiles; i++)
        free(ds->files[i].path);
    free(ds->files);
    free(ds->data);
    free(ds);
}

int64_t tkd_tokens_count(const tkd_tokens *ds) { return ds->count; }
const int32_t *tkd_tokens_data(const tkd_tokens *ds) { return ds->data; }
int tkd_tokens_num_files(const tkd_tokens *ds) { return ds->nfiles; }

const char *tkd_tokens_file(const tkd_tokens *ds, int i, int64_t *first, int64_t *count)
{
    if (i < 0 || i >= ds->nfiles)
        return NULL;
    if (first)
        *first = ds->files[i].first;
    if (count)
        *count = ds->files[i].count;
    return ds->files[i].path;
}

const char *tkd_tokens_locate(const tkd_tokens *ds, int64_t global, int64_t *local)
{
    if (global < 0 || global >= ds->count)
        return NULL;
    int lo = 0, hi = ds->nfiles - 1; /* last file whose first <= global (empty files skipped by count) */
    while (lo < hi) {
        int mid = (lo + hi + 1) / 2;
        if (ds->files[mid].first <= global)
            lo = mid;
        else
            hi = mid - 1;
    }
    if (local)
        *local = global - ds->files[lo].first;
    return ds->files[lo].path;
}

tkd_status tkd_tokens_check_vocab(const tkd_tokens *ds, int vocab)
{
    for (int64_t i = 0; i < ds->count; i++) {
        int32_t t = ds->data[i];
        if (t < 0 || t >= vocab) {
            int64_t local = 0;
            const char *file = tkd_tokens_locate(ds, i, &local);
            return tkd_error_set(TKD_ERR_MISMATCH,
                                 "%s: token offset %lld: id %d is outside the vocabulary [0, %d): the data was "
                                 "tokenized for another model",
                                 file, (long long)local, t, vocab);
        }
    }
    return TKD_OK;
}

/* ---- windows -------------------------------------------------------------------------------- */

int64_t tkd_tokens_num_windows(const tkd_tokens *ds, int seq_len, int stride, int pad_tail)
{
    if (seq_len < 1 || stride < 1)
        return 0;
    int64_t n = ds->count, w = (int64_t)seq_len + 1;
    if (!pad_tail)
        return n >= w ? (n - w) / stride + 1 : 0;
    if (n < 2) /* not even one label */
        return 0;
    /* enough windows to cover every label, but none that would hold no label at all (stride > w) */
    int64_t cover = n <= w ? 1 : (n - w + stride - 1) / stride + 1;
    int64_t some_label = (n - 2) / stride + 1;
    return cover < some_label ? cover : some_label;
}

tkd_status tkd_tokens_window(const tkd_tokens *ds, int seq_len, int stride, int pad_tail, int64_t i,
                             int32_t *tokens, int32_t *labels, int *n_valid)
{
    int64_t nw = tkd_tokens_num_windows(ds, seq_len, stride, pad_tail);
    if (seq_len < 1 || stride < 1 || i < 0 || i >= nw)
        return tkd_error_set(TKD_ERR_INVALID_ARG,
                             "token window %lld out of range (%lld windows of seq_len %d, stride %d)", (long long)i,
                             (long long)nw, seq_len, stride);
    int64_t start = i * stride;
    int valid = 0;
    for (int j = 0; j <= seq_len; j++) {
        int64_t p = start + j;
        tokens[j] = p < ds->count ? ds->data[p] : 0;
    }
    for (int j = 0; j < seq_len; j++) {
        int real = start + j + 1 < ds->count;
        valid += real;
        if (labels)
            labels[j] = real ? tokens[j + 1] : TKD_TOKENS_IGNORE_LABEL;
    }
    if (n_valid)
        *n_valid = valid;
    return TKD_OK;
}

void tkd_tokens_sha256(const tkd_tokens *ds, char hex[65])
{
    uint8_t digest[TKD_SHA256_BYTES];
    /* the in-memory int32 array is the little-endian stream on the hosts we support */
    tkd_sha256_buffer(ds->data, (size_t)ds->count * sizeof *ds->data, digest);
    tkd_sha256_hex(digest, hex);
}
