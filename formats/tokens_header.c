/* tokens_header.c — the headers of the one-file token formats (tokens_internal.h): llm.c's .bin
 * (a 1024-byte int32 header) and numpy's .npy (a Python dict literal), each giving the kind and the
 * count of the tokens that end the file. Files are little-endian, like the host.
 */
#include "formats/tokens_internal.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>

#define BIN_HEADER_INTS 256
#define LLMC_EVAL_MAGIC 20240522 /* llm.c's multiple-choice eval files (HellaSwag, MMLU) */
#define NPY_MAX_HEADER (1u << 20) /* numpy writes < 1 KB; anything huge is corrupt */

tkd_status tkd_tokens_bin_header(FILE *fp, const char *path, uint64_t size, tok_kind *kind, int64_t *count)
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
                             "%s: bad magic %d (expected %d or %d): not an llm.c token file, a .npy array or the "
                             ".bin of a Megatron dataset with its .idx beside it",
                             path, h[0], TKD_TOKENS_MAGIC_U16, TKD_TOKENS_MAGIC_U32);
    }
    if (h[1] != want_version && h[1] != former_version)
        return tkd_error_set(TKD_ERR_FORMAT, "%s: llm.c header version %d does not go with magic %d (expected %d%s)",
                             path, h[1], h[0], want_version, former_version > 0 ? ", or topkd's former 2" : "");
    if (h[2] < 0)
        return tkd_error_set(TKD_ERR_FORMAT, "%s: negative token count %d in the header", path, h[2]);
    *count = h[2];
    return tkd_tokens_check_payload(path, *count, tkd_tokens_kind_size(*kind), size - BIN_HEADER_INTS * 4);
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

/* One dtype a reader takes: its descr as numpy writes it, and the kind it reads as. */
typedef struct npy_descr {
    const char *descr;
    tok_kind kind;
} npy_descr;

static const npy_descr NPY_TOKENS[] = {{"<i4", TOK_I32}, {"<u2", TOK_U16}, {"<u4", TOK_U32}, {"<i8", TOK_I64}};
static const npy_descr NPY_FLAGS[] = {{"|u1", TOK_U8}, {"<u1", TOK_U8}}; /* numpy writes '|u1' for uint8 */

/* The 'descr' value p among ok[0, nok); what names them in the message. */
static tkd_status npy_dtype(const char *path, const char *p, const npy_descr *ok, size_t nok, const char *what,
                            tok_kind *kind)
{
    if (!p)
        return tkd_error_set(TKD_ERR_FORMAT, "%s: npy header has no 'descr' entry", path);
    char d[16] = "";
    if (*p == '\'' || *p == '"') {
        const char *e = strchr(p + 1, *p);
        if (e && e - p - 1 < (ptrdiff_t)sizeof d)
            memcpy(d, p + 1, (size_t)(e - p - 1));
    }
    for (size_t i = 0; i < nok; i++)
        if (strcmp(d, ok[i].descr) == 0) {
            *kind = ok[i].kind;
            return TKD_OK;
        }
    return tkd_error_set(TKD_ERR_UNSUPPORTED, "%s: npy dtype '%s' is not supported for %s", path,
                         *d ? d : "(structured or unreadable)", what);
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

/* p: the 'shape' value, a tuple whose end npy_value_end has checked, of 1 to max_nd dimensions. */
static tkd_status npy_shape(const char *path, const char *p, int max_nd, int64_t *count)
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
    if (nd < 1 || nd > max_nd)
        return tkd_error_set(TKD_ERR_UNSUPPORTED, "%s: npy array has %d dimensions; %s", path, nd,
                             max_nd == 1 ? "a flags sidecar is 1-D" : "tokens must be 1-D or 2-D");
    *count = n;
    return TKD_OK;
}

/* What an .npy header must say for one kind of array: its dtypes and its dimensions. */
typedef struct npy_want {
    const npy_descr *ok;
    size_t nok;
    const char *what; /* "tokens (int32 <i4, ...)" */
    int max_nd;
} npy_want;

static const npy_want WANT_TOKENS = {NPY_TOKENS, 4, "tokens (int32 <i4, uint16 <u2, uint32 <u4, int64 <i8)", 2};
static const npy_want WANT_FLAGS = {NPY_FLAGS, 2, "a flags sidecar (uint8 |u1)", 1};

/* The dict text h of an .npy header: the kind and count it describes. */
static tkd_status npy_parse_header(const char *path, const char *h, const npy_want *w, tok_kind *kind,
                                   int64_t *count)
{
    npy_dict d;
    TKD_TRY(npy_parse_dict(path, h, &d));
    TKD_TRY(npy_dtype(path, d.descr, w->ok, w->nok, w->what, kind));
    TKD_TRY(npy_fortran(path, d.fortran_order));
    return npy_shape(path, d.shape, w->max_nd, count);
}

/* Reads and checks the header of the .npy file fp (size bytes): *start is where its data begins,
 * which holds exactly *count elements. */
static tkd_status npy_header(FILE *fp, const char *path, uint64_t size, const npy_want *w, tok_kind *kind,
                             int64_t *count, uint64_t *start)
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
    *start = 8 + lensz + hl;
    if (*start > size || hl > NPY_MAX_HEADER)
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
    tkd_status st = npy_parse_header(path, h, w, kind, count);
    free(h);
    TKD_TRY(st);
    return tkd_tokens_check_payload(path, *count, tkd_tokens_kind_size(*kind), size - *start);
}

tkd_status tkd_tokens_npy_header(FILE *fp, const char *path, uint64_t size, tok_kind *kind, int64_t *count)
{
    uint64_t start;
    return npy_header(fp, path, size, &WANT_TOKENS, kind, count, &start);
}

tkd_status tkd_tokens_npy_flags_header(FILE *fp, const char *path, uint64_t size, int64_t *count, uint64_t *start)
{
    tok_kind kind;
    return npy_header(fp, path, size, &WANT_FLAGS, &kind, count, start);
}
