/* tokens.c — see tokens.h. Files are little-endian, like the host (x86-64, aarch64). */
#include "formats/tokens.h"

#include "common/sha256.h"

#include <errno.h>
#include <glob.h>
#include <limits.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#define BIN_HEADER_INTS 256
#define LLMC_EVAL_MAGIC 20240522 /* llm.c's multiple-choice eval files (HellaSwag, MMLU) */
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
    size_t tsz = kind_size(k);
    uint8_t *buf = malloc(CHUNK * 8); /* one buffer per file, reused for every chunk */
    if (!buf)
        return tkd_error_set(TKD_ERR_NOMEM, "%s: out of memory", path);
    int32_t *dst = ds->data + ds->count;
    tkd_status st = TKD_OK;
    for (int64_t done = 0; done < count && st == TKD_OK;) {
        size_t m = count - done < CHUNK ? (size_t)(count - done) : CHUNK;
        if (fread(buf, tsz, m, fp) != m) {
            st = tkd_error_set(TKD_ERR_IO, "%s: read failed at token offset %lld%s", path, (long long)done,
                               ferror(fp) ? "" : " (file shrank while reading?)");
            break;
        }
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
    int want_version, former_version = -1;
    if (h[0] == TKD_TOKENS_MAGIC_U16) {
        *kind = TOK_U16;
        want_version = TKD_TOKENS_VERSION_U16;
    } else if (h[0] == TKD_TOKENS_MAGIC_U32) {
        *kind = TOK_U32;
        want_version = TKD_TOKENS_VERSION_U32;
        former_version = TKD_TOKENS_VERSION_U32_TOPKD;
    } else if (h[0] == LLMC_EVAL_MAGIC) {
        return tkd_error_set(TKD_ERR_FORMAT,
                             "%s: magic %d marks an llm.c eval file (multiple-choice examples such as HellaSwag), "
                             "not a token file",
                             path, h[0]);
    } else {
        return tkd_error_set(TKD_ERR_FORMAT,
                             "%s: bad magic %d (expected %d or %d): not an llm.c token file or a .npy array",
                             path, h[0], TKD_TOKENS_MAGIC_U16, TKD_TOKENS_MAGIC_U32);
    }
    if (h[1] != want_version && h[1] != former_version)
        return tkd_error_set(TKD_ERR_FORMAT, "%s: llm.c header version %d does not go with magic %d (expected %d%s)",
                             path, h[1], h[0], want_version, former_version > 0 ? ", or topkd's former 2" : "");
    if (h[2] < 0)
        return tkd_error_set(TKD_ERR_FORMAT, "%s: negative token count %d in the header", path, h[2]);
    *count = h[2];
    return check_payload(path, *count, kind_size(*kind), size - BIN_HEADER_INTS * 4);
}

/* Points just past `'key':` (or "key":) in the npy header dict; NULL when the key is absent. */
static const char *npy_key(const char *h, const char *key)
{
    char pat[40];
    for (int q = 0; q < 2; q++) {
        snprintf(pat, sizeof pat, "%c%s%c", q ? '"' : '\'', key, q ? '"' : '\'');
        const char *p = strstr(h, pat);
        if (p) {
            p += strlen(pat);
            while (*p == ' ')
                p++;
            return *p == ':' ? p + 1 : NULL;
        }
    }
    return NULL;
}

static tkd_status npy_dtype(const char *path, const char *h, tok_kind *kind)
{
    const char *p = npy_key(h, "descr");
    if (!p)
        return tkd_error_set(TKD_ERR_FORMAT, "%s: npy header has no 'descr' entry", path);
    while (*p == ' ')
        p++;
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

static tkd_status npy_shape(const char *path, const char *h, int64_t *count)
{
    const char *p = npy_key(h, "shape");
    while (p && *p == ' ')
        p++;
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
    tkd_status st = npy_dtype(path, h, kind);
    const char *fo = st == TKD_OK ? npy_key(h, "fortran_order") : NULL;
    while (fo && *fo == ' ')
        fo++;
    if (st == TKD_OK && !fo)
        st = tkd_error_set(TKD_ERR_FORMAT, "%s: npy header has no 'fortran_order' entry", path);
    else if (st == TKD_OK && strncmp(fo, "False", 5) != 0)
        st = tkd_error_set(TKD_ERR_UNSUPPORTED,
                           "%s: npy array is in Fortran order; save it C-contiguous (np.ascontiguousarray)", path);
    if (st == TKD_OK)
        st = npy_shape(path, h, count);
    free(h);
    TKD_TRY(st);
    return check_payload(path, *count, kind_size(*kind), size - start);
}

/* Appends one file's tokens to ds; it is recorded in ds->files only when whole. */
static tkd_status load_file(tkd_tokens *ds, const char *path)
{
    FILE *fp = fopen(path, "rb");
    if (!fp)
        return tkd_error_set(errno == ENOENT ? TKD_ERR_NOT_FOUND : TKD_ERR_IO, "%s: cannot open token file: %s",
                             path, strerror(errno));
    struct stat sb;
    if (fstat(fileno(fp), &sb) != 0 || !S_ISREG(sb.st_mode)) {
        fclose(fp);
        return tkd_error_set(TKD_ERR_IO, "%s: not a regular file", path);
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
