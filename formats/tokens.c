/* tokens.c — see tokens.h. Files are little-endian, like the host (x86-64, aarch64). */
#include "formats/tokens.h"

#include "common/fileio.h"
#include "common/sha256.h"
#include "common/signals.h"

#include <errno.h>
#include <fcntl.h>
#include <glob.h>
#include <limits.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#define BIN_HEADER_INTS 256
#define LLMC_EVAL_MAGIC 20240522 /* llm.c's multiple-choice eval files (HellaSwag, MMLU) */
#define NPY_MAX_HEADER (1u << 20) /* numpy writes < 1 KB; anything huge is corrupt */
#define MM_MAGIC "MMIDIDX\0\0"   /* 9 bytes */
#define MM_HEADER_BYTES 34        /* magic 9, version 8, dtype code 1, sequence_count 8, document_count 8 */

/* How the tokens of one file are stored. */
typedef enum tok_kind { TOK_I32, TOK_U16, TOK_U32, TOK_I64, TOK_U8, TOK_I8, TOK_I16 } tok_kind;

static size_t kind_size(tok_kind k)
{
    static const size_t bytes[] = {[TOK_I32] = 4, [TOK_U16] = 2, [TOK_U32] = 4, [TOK_I64] = 8,
                                   [TOK_U8] = 1,  [TOK_I8] = 1,  [TOK_I16] = 2};
    return bytes[k];
}

typedef struct tok_file {
    char *path;            /* the token file; a Megatron dataset's .bin */
    int64_t first;         /* global offset of its first token */
    int64_t count;
    tok_kind kind;
    const uint8_t *tok;    /* its first token, inside map; NULL when it holds none */
    void *map, *idx_map;   /* our read-only mappings of the file and of a Megatron index, or NULL */
    size_t map_len, idx_len;
    tkd_megatron_index mm; /* a Megatron dataset's index (mm.doc_idx == NULL for other files) */
    int64_t doc0;          /* global number of its first recorded document */
} tok_file;

struct tkd_tokens {
    int64_t count, ndocs;
    tok_file *files;
    int nfiles;
    int32_t *flat; /* tkd_tokens_data's copy, made on first use */
};

/* ---- reading one file ---------------------------------------------------------------------- */

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

/* Converts n tokens of kind k at src to int32 (uint32 / int64 values are known to fit). */
static void convert(const uint8_t *src, tok_kind k, int64_t n, int32_t *dst /* (n) */)
{
#define TOK_CONVERT(T)                                            \
    for (int64_t j = 0; j < n; j++) {                             \
        T v_;                                                     \
        memcpy(&v_, src + (size_t)j * sizeof v_, sizeof v_);      \
        dst[j] = (int32_t)v_;                                     \
    }                                                             \
    break
    switch (k) {
    case TOK_I32: memcpy(dst, src, (size_t)n * sizeof *dst); break;
    case TOK_U16: TOK_CONVERT(uint16_t);
    case TOK_U32: TOK_CONVERT(uint32_t);
    case TOK_I64: TOK_CONVERT(int64_t);
    case TOK_U8: TOK_CONVERT(uint8_t);
    case TOK_I8: TOK_CONVERT(int8_t);
    case TOK_I16: TOK_CONVERT(int16_t);
    }
#undef TOK_CONVERT
}

/* Only uint32 and int64 tokens can fall outside int32: the stream is int32 everywhere after this. */
static tkd_status check_fit(const tok_file *f, const char *path)
{
    if (f->kind != TOK_U32 && f->kind != TOK_I64)
        return TKD_OK;
    for (int64_t j = 0; j < f->count; j++) {
        if ((j & ((1 << 22) - 1)) == 0 && tkd_interrupted()) /* a few ms per check on large files */
            return tkd_input_interrupted(path, "token file");
        int64_t v;
        if (f->kind == TOK_U32) {
            uint32_t u;
            memcpy(&u, f->tok + 4 * (size_t)j, 4);
            v = u;
        } else {
            memcpy(&v, f->tok + 8 * (size_t)j, 8);
        }
        if (v > INT32_MAX || v < INT32_MIN)
            return tkd_error_set(TKD_ERR_FORMAT, "%s: token %lld at token offset %lld does not fit in int32", path,
                                 (long long)v, (long long)j);
    }
    return TKD_OK;
}

/* Maps the first size bytes of fd read-only (*map = NULL for an empty file). */
static tkd_status map_fd(int fd, const char *path, size_t size, void **map, size_t *len)
{
    *map = NULL;
    *len = size;
    if (size == 0) /* mmap of 0 bytes fails; there is nothing to read */
        return TKD_OK;
    void *p = mmap(NULL, size, PROT_READ, MAP_PRIVATE, fd, 0);
    if (p == MAP_FAILED)
        return tkd_error_set(TKD_ERR_IO, "%s: mmap failed: %s", path, strerror(errno));
    *map = p;
    return TKD_OK;
}

/* Maps the regular file path; what says what it is in the message when it cannot be opened. */
static tkd_status map_path(const char *path, const char *what, void **map, size_t *len)
{
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return tkd_error_set(errno == ENOENT ? TKD_ERR_NOT_FOUND : TKD_ERR_IO, "%s: cannot open %s: %s", path, what,
                             strerror(errno));
    struct stat sb;
    tkd_status st = fstat(fd, &sb) == 0 && S_ISREG(sb.st_mode)
                        ? map_fd(fd, path, (size_t)sb.st_size, map, len)
                        : tkd_error_set(TKD_ERR_IO, "%s: not a regular file", path);
    close(fd); /* the mapping keeps the file alive */
    return st;
}

static void release_file(tok_file *f)
{
    if (f->map)
        munmap(f->map, f->map_len);
    if (f->idx_map)
        munmap(f->idx_map, f->idx_len);
    free(f->path);
}

/* Appends f (its tokens mapped and checked) to ds as path; on failure f is released. */
static tkd_status add_file(tkd_tokens *ds, tok_file *f, const char *path)
{
    tok_file *files = realloc(ds->files, (size_t)(ds->nfiles + 1) * sizeof *files);
    if (files)
        ds->files = files;
    if (!files || !(f->path = strdup(path))) {
        release_file(f);
        return tkd_error_set(TKD_ERR_NOMEM, "%s: out of memory", path);
    }
    f->first = ds->count;
    f->doc0 = ds->ndocs;
    ds->files[ds->nfiles++] = *f;
    ds->count += f->count;
    ds->ndocs += f->mm.doc_idx ? f->mm.num_documents : 0;
    return TKD_OK;
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

/* Appends one llm.c or .npy file to ds, mapped; it is recorded in ds->files only when whole. */
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
    tok_file f = {.kind = kind, .count = count};
    if (st == TKD_OK && tkd_interrupted())
        st = tkd_input_interrupted(path, "token file");
    if (st == TKD_OK)
        st = map_fd(fileno(fp), path, (size_t)size, &f.map, &f.map_len);
    fclose(fp);
    if (st == TKD_OK && count > 0) { /* the header checked that the tokens end the file */
        f.tok = (const uint8_t *)f.map + (size - (uint64_t)count * kind_size(kind));
        st = check_fit(&f, path);
    }
    if (st != TKD_OK) {
        release_file(&f);
        return st;
    }
    return add_file(ds, &f, path);
}

/* ---- Megatron-LM indexed datasets ---------------------------------------------------------- */

static uint64_t rd_u64(const uint8_t *p) { uint64_t v; memcpy(&v, p, 8); return v; }
static int64_t rd_i64(const uint8_t *p, int64_t i) { int64_t v; memcpy(&v, p + 8 * (size_t)i, 8); return v; }
static int32_t rd_i32(const uint8_t *p, int64_t i) { int32_t v; memcpy(&v, p + 4 * (size_t)i, 4); return v; }

/* Megatron's DType codes (megatron/core/datasets/indexed_dataset.py); kind < 0: not an integer. */
static const struct mm_dtype {
    int code;
    const char *name;
    int kind;
} mm_dtypes[] = {
    {1, "uint8", TOK_U8},  {2, "int8", TOK_I8},     {3, "int16", TOK_I16},  {4, "int32", TOK_I32},
    {5, "int64", TOK_I64}, {6, "float64", -1},      {7, "float32", -1},     {8, "uint16", TOK_U16},
};

static tkd_status mm_dtype(const char *ip, int code, tok_kind *kind)
{
    for (size_t i = 0; i < sizeof mm_dtypes / sizeof mm_dtypes[0]; i++) {
        if (mm_dtypes[i].code != code)
            continue;
        if (mm_dtypes[i].kind < 0)
            return tkd_error_set(TKD_ERR_UNSUPPORTED, "%s: dtype code %d (%s) is not an integer type: tokens must be "
                                 "stored as integers", ip, code, mm_dtypes[i].name);
        *kind = (tok_kind)mm_dtypes[i].kind;
        return TKD_OK;
    }
    return tkd_error_set(TKD_ERR_FORMAT, "%s: dtype code %d is not one Megatron defines (1 to 8)", ip, code);
}

/* Magic, version, dtype, and counts that match the index's length exactly; fills the views. */
static tkd_status mm_header(const char *ip, const uint8_t *b, size_t size, tkd_megatron_index *mi)
{
    if (size < MM_HEADER_BYTES)
        return tkd_error_set(TKD_ERR_FORMAT, "%s: %zu bytes, shorter than the %d-byte MMIDIDX header: truncated or "
                             "not a Megatron-LM index", ip, size, MM_HEADER_BYTES);
    if (memcmp(b, MM_MAGIC, 9) != 0)
        return tkd_error_set(TKD_ERR_FORMAT, "%s: bad magic (expected \"MMIDIDX\\x00\\x00\"): not a Megatron-LM "
                             "index", ip);
    uint64_t version = rd_u64(b + 9), nseq = rd_u64(b + 18), ndoc = rd_u64(b + 26);
    if (version != 1)
        return tkd_error_set(TKD_ERR_FORMAT, "%s: index version %llu is not supported (expected 1)", ip,
                             (unsigned long long)version);
    tok_kind kind = TOK_I32; /* set by mm_dtype; initialised for the compiler */
    TKD_TRY(mm_dtype(ip, b[17], &kind));
    uint64_t body = size - MM_HEADER_BYTES; /* sizes (int32), pointers (int64), document_indices (int64) */
    if (nseq >= (1ull << 59) || ndoc >= (1ull << 59))
        return tkd_error_set(TKD_ERR_FORMAT, "%s: sequence_count %llu and document_count %llu are too large for any "
                             "index: corrupt", ip, (unsigned long long)nseq, (unsigned long long)ndoc);
    if (12 * nseq + 8 * ndoc > body) /* < 2^63 after the check above */
        return tkd_error_set(TKD_ERR_FORMAT, "%s: sequence_count %llu and document_count %llu make a %llu-byte "
                             "index, but the file holds %zu bytes: truncated", ip, (unsigned long long)nseq,
                             (unsigned long long)ndoc, (unsigned long long)(MM_HEADER_BYTES + 12 * nseq + 8 * ndoc),
                             size);
    uint64_t extra = body - 12 * nseq - 8 * ndoc;
    if (extra && extra == nseq)
        return tkd_error_set(TKD_ERR_UNSUPPORTED, "%s: a multimodal index (a mode byte per sequence after the "
                             "document indices) is not supported", ip);
    if (extra)
        return tkd_error_set(TKD_ERR_FORMAT, "%s: %llu bytes follow the document indices that sequence_count %llu "
                             "and document_count %llu do not describe", ip, (unsigned long long)extra,
                             (unsigned long long)nseq, (unsigned long long)ndoc);
    if (ndoc == 0)
        return tkd_error_set(TKD_ERR_FORMAT, "%s: document_count is 0, but document_indices always holds at least "
                             "its leading 0", ip);
    *mi = (tkd_megatron_index){.dtype_code = b[17], .token_bytes = (int)kind_size(kind),
                               .num_sequences = (int64_t)nseq, .num_documents = (int64_t)ndoc - 1,
                               .sizes = b + MM_HEADER_BYTES, .pointers = b + MM_HEADER_BYTES + 4 * nseq,
                               .doc_idx = b + MM_HEADER_BYTES + 12 * nseq};
    return TKD_OK;
}

/* document_indices: 0, never decreasing, ending at sequence_count. */
static tkd_status mm_doc_idx(const char *ip, const tkd_megatron_index *mi)
{
    int64_t prev = rd_i64(mi->doc_idx, 0), last = mi->num_documents;
    if (prev != 0)
        return tkd_error_set(TKD_ERR_FORMAT, "%s: document_indices[0] = %lld (expected 0)", ip, (long long)prev);
    for (int64_t d = 1; d <= last; d++) {
        int64_t v = rd_i64(mi->doc_idx, d);
        if (v < prev)
            return tkd_error_set(TKD_ERR_FORMAT, "%s: document_indices[%lld] = %lld is below document_indices[%lld] "
                                 "= %lld: they must not decrease", ip, (long long)d, (long long)v, (long long)(d - 1),
                                 (long long)prev);
        prev = v;
    }
    if (prev != mi->num_sequences)
        return tkd_error_set(TKD_ERR_FORMAT, "%s: document_indices ends at %lld, but sequence_count is %lld", ip,
                             (long long)prev, (long long)mi->num_sequences);
    return TKD_OK;
}

/* sizes >= 0 adding up to the .bin's length; pointers inside it, one sequence after another. */
static tkd_status mm_sequences(const char *ip, const char *bp, uint64_t bin, tkd_megatron_index *mi)
{
    uint64_t tsz = (uint64_t)mi->token_bytes, total = 0;
    for (int64_t s = 0; s < mi->num_sequences; s++) {
        int32_t n = rd_i32(mi->sizes, s);
        if (n < 0)
            return tkd_error_set(TKD_ERR_FORMAT, "%s: sizes[%lld] = %d is negative", ip, (long long)s, n);
        total += (uint64_t)n; /* < 2^31 per sequence and < 2^60 sequences: no overflow */
    }
    if (total > (uint64_t)INT64_MAX / 8)
        return tkd_error_set(TKD_ERR_FORMAT, "%s: sizes add up to %llu tokens, more than any file holds", ip,
                             (unsigned long long)total);
    if (bin != TKD_MEGATRON_BIN_UNKNOWN && total * tsz != bin)
        return tkd_error_set(TKD_ERR_FORMAT, "%s: %llu bytes, but the sizes in %s add up to %llu tokens of %llu "
                             "bytes (%llu bytes)", bp, (unsigned long long)bin, ip, (unsigned long long)total,
                             (unsigned long long)tsz, (unsigned long long)(total * tsz));
    uint64_t at = 0; /* where sequence s starts when the sequences lie back to back */
    for (int64_t s = 0; s < mi->num_sequences; s++) {
        int64_t p = rd_i64(mi->pointers, s);
        uint64_t len = (uint64_t)rd_i32(mi->sizes, s) * tsz;
        if (bin != TKD_MEGATRON_BIN_UNKNOWN && (p < 0 || (uint64_t)p > bin || len > bin - (uint64_t)p))
            return tkd_error_set(TKD_ERR_FORMAT, "%s: pointers[%lld] = %lld puts sequence %lld (%llu bytes) outside "
                                 "%s (%llu bytes)", ip, (long long)s, (long long)p, (long long)s,
                                 (unsigned long long)len, bp, (unsigned long long)bin);
        if (p < 0 || (uint64_t)p != at)
            return tkd_error_set(TKD_ERR_FORMAT, "%s: pointers[%lld] = %lld, but the sequences before it end at byte "
                                 "%llu (Megatron's builder stores sequences back to back)", ip, (long long)s,
                                 (long long)p, (unsigned long long)at);
        at += len;
    }
    mi->num_tokens = (int64_t)total;
    mi->data_bytes = total * tsz;
    return TKD_OK;
}

tkd_status tkd_tokens_parse_megatron_index(const char *idx_name, const void *idx, size_t size, const char *bin_name,
                                           uint64_t bin_bytes, tkd_megatron_index *out)
{
    tkd_megatron_index mi;
    TKD_TRY(mm_header(idx_name, idx, size, &mi));
    TKD_TRY(mm_doc_idx(idx_name, &mi));
    TKD_TRY(mm_sequences(idx_name, bin_name, bin_bytes, &mi));
    *out = mi;
    return TKD_OK;
}

/* Token offset (in its file) where document d of a checked index starts; d = num_documents: the end. */
static int64_t mm_doc_start(const tkd_megatron_index *mi, int64_t d)
{
    int64_t s = rd_i64(mi->doc_idx, d);
    return s == mi->num_sequences ? mi->num_tokens : rd_i64(mi->pointers, s) / mi->token_bytes;
}

/* Appends the Megatron dataset PREFIX.idx + PREFIX.bin to ds. */
static tkd_status load_megatron(tkd_tokens *ds, const char *prefix)
{
    size_t n = strlen(prefix);
    char *ip = malloc(2 * n + 10), *bp = ip + n + 5;
    if (!ip)
        return tkd_error_set(TKD_ERR_NOMEM, "%s: out of memory", prefix);
    snprintf(ip, n + 5, "%s.idx", prefix);
    snprintf(bp, n + 5, "%s.bin", prefix);
    char what[4200];
    snprintf(what, sizeof what, "the data file of Megatron index %s", ip);
    tok_file f = {0};
    tkd_status st = map_path(ip, "Megatron index", &f.idx_map, &f.idx_len);
    if (st == TKD_OK)
        st = map_path(bp, what, &f.map, &f.map_len);
    if (st == TKD_OK)
        st = tkd_tokens_parse_megatron_index(ip, f.idx_map, f.idx_len, bp, f.map_len, &f.mm);
    if (st == TKD_OK) {
        mm_dtype(ip, f.mm.dtype_code, &f.kind); /* checked by the parse */
        f.count = f.mm.num_tokens;
        f.tok = f.map;
        st = check_fit(&f, bp);
    }
    if (st == TKD_OK)
        st = add_file(ds, &f, bp);
    else
        release_file(&f);
    free(ip);
    return st;
}

static int has_suffix(const char *s, const char *suffix)
{
    size_t n = strlen(s), m = strlen(suffix);
    return n >= m && strcmp(s + n - m, suffix) == 0;
}

static int starts_with_mm_magic(const char *path)
{
    char b[9];
    FILE *fp = fopen(path, "rb");
    int yes = fp && fread(b, 1, 9, fp) == 9 && memcmp(b, MM_MAGIC, 9) == 0;
    if (fp)
        fclose(fp);
    return yes;
}

/* The Megatron dataset path names, as its prefix in *prefix (malloc'd), or NULL: PREFIX.idx always
 * names one; PREFIX.bin when a PREFIX.idx beginning with the MMIDIDX magic lies beside it; PREFIX
 * when no such file exists but PREFIX.idx does (Megatron's own way of naming a dataset). */
static tkd_status megatron_prefix(const char *path, char **prefix)
{
    *prefix = NULL;
    int is_idx = has_suffix(path, ".idx"), is_bin = has_suffix(path, ".bin");
    size_t keep = strlen(path) - (is_idx || is_bin ? 4 : 0);
    char *p = malloc(keep + 5);
    if (!p)
        return tkd_error_set(TKD_ERR_NOMEM, "%s: out of memory", path);
    memcpy(p, path, keep);
    memcpy(p + keep, ".idx", 5);
    struct stat sb;
    if (is_idx || (is_bin && starts_with_mm_magic(p)) ||
        (!is_bin && stat(path, &sb) != 0 && errno == ENOENT && stat(p, &sb) == 0)) {
        p[keep] = '\0';
        *prefix = p;
    } else {
        free(p);
    }
    return TKD_OK;
}

static tkd_status load_path(tkd_tokens *ds, const char *path)
{
    char *prefix;
    TKD_TRY(megatron_prefix(path, &prefix));
    if (!prefix)
        return load_file(ds, path);
    tkd_status st = load_megatron(ds, prefix);
    free(prefix);
    return st;
}

static int cmp_str(const void *a, const void *b) { return strcmp(*(char *const *)a, *(char *const *)b); }

/* Marks skip[i] for each PREFIX.idx among n paths whose PREFIX.bin is among them too: a glob that
 * matches both files of a Megatron dataset takes it once, where its .bin sorts. */
static tkd_status mark_idx_with_bin(char *const *paths, size_t n, char *skip)
{
    char **sorted = malloc(n * sizeof *sorted);
    if (!sorted)
        return tkd_error_set(TKD_ERR_NOMEM, "token dataset: out of memory");
    memcpy(sorted, paths, n * sizeof *sorted);
    qsort(sorted, n, sizeof *sorted, cmp_str); /* glob's order follows the locale; bsearch needs strcmp's */
    tkd_status st = TKD_OK;
    for (size_t i = 0; i < n && st == TKD_OK; i++) {
        if (!has_suffix(paths[i], ".idx"))
            continue;
        char *bin = strdup(paths[i]);
        if (!bin) {
            st = tkd_error_set(TKD_ERR_NOMEM, "%s: out of memory", paths[i]);
            break;
        }
        memcpy(bin + strlen(bin) - 4, ".bin", 4);
        skip[i] = bsearch(&bin, sorted, n, sizeof *sorted, cmp_str) != NULL;
        free(bin);
    }
    free(sorted);
    return st;
}

/* A spec with glob characters expands (sorted); a plain path is taken as it is. */
static tkd_status load_spec(tkd_tokens *ds, const char *spec)
{
    if (!strpbrk(spec, "*?["))
        return load_path(ds, spec);
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
    char *skip = calloc(g.gl_pathc, 1);
    tkd_status st = skip ? mark_idx_with_bin(g.gl_pathv, g.gl_pathc, skip)
                         : tkd_error_set(TKD_ERR_NOMEM, "%s: out of memory", spec);
    for (size_t i = 0; i < g.gl_pathc && st == TKD_OK; i++)
        if (!skip[i])
            st = load_path(ds, g.gl_pathv[i]);
    free(skip);
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
        release_file(&ds->files[i]);
    free(ds->files);
    free(ds->flat);
    free(ds);
}

int64_t tkd_tokens_count(const tkd_tokens *ds) { return ds->count; }
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

/* The last file whose first token (by_doc: first document) is <= v. A file holding none shares
 * that number with the file after it, so the search passes over it to the file holding v. */
static int last_file_from(const tkd_tokens *ds, int64_t v, int by_doc)
{
    int lo = 0, hi = ds->nfiles - 1;
    while (lo < hi) {
        int mid = (lo + hi + 1) / 2;
        if ((by_doc ? ds->files[mid].doc0 : ds->files[mid].first) <= v)
            lo = mid;
        else
            hi = mid - 1;
    }
    return lo;
}

/* The file holding global offset g in [0, count). */
static int file_at(const tkd_tokens *ds, int64_t g) { return last_file_from(ds, g, 0); }

const char *tkd_tokens_locate(const tkd_tokens *ds, int64_t global, int64_t *local)
{
    if (global < 0 || global >= ds->count)
        return NULL;
    const tok_file *f = &ds->files[file_at(ds, global)];
    if (local)
        *local = global - f->first;
    return f->path;
}

tkd_status tkd_tokens_read(const tkd_tokens *ds, int64_t first, int64_t n, int32_t *out)
{
    if (first < 0 || n < 0 || first > ds->count - n)
        return tkd_error_set(TKD_ERR_INVALID_ARG, "tokens [%lld, %lld + %lld) are not inside the stream of %lld",
                             (long long)first, (long long)first, (long long)n, (long long)ds->count);
    for (int i = n > 0 ? file_at(ds, first) : ds->nfiles; n > 0; i++) {
        const tok_file *f = &ds->files[i];
        int64_t local = first - f->first, m = f->count - local < n ? f->count - local : n;
        if (m <= 0)
            continue;
        convert(f->tok + (size_t)local * kind_size(f->kind), f->kind, m, out);
        out += m;
        first += m;
        n -= m;
    }
    return TKD_OK;
}

const int32_t *tkd_tokens_data(const tkd_tokens *ds)
{
    tkd_tokens *cache = (tkd_tokens *)ds; /* the copy is a cache: no dataset is ever defined const */
    if (!cache->flat && (uint64_t)ds->count <= SIZE_MAX / sizeof(int32_t)) {
        cache->flat = malloc((size_t)ds->count * sizeof(int32_t));
        if (cache->flat)
            tkd_tokens_read(ds, 0, ds->count, cache->flat);
    }
    return cache->flat;
}

int64_t tkd_tokens_num_docs(const tkd_tokens *ds) { return ds->ndocs; }

int64_t tkd_tokens_doc_start(const tkd_tokens *ds, int64_t d)
{
    if (d < 0 || d >= ds->ndocs)
        return -1;
    const tok_file *f = &ds->files[last_file_from(ds, d, 1)];
    return f->first + mm_doc_start(&f->mm, d - f->doc0);
}

/* The document of f holding token local (f records documents): the last one starting at or before
 * it, which skips the empty documents starting at the same place. */
static int64_t doc_of(const tok_file *f, int64_t local)
{
    int64_t lo = 0, hi = f->mm.num_documents - 1;
    while (lo < hi) {
        int64_t mid = lo + (hi - lo + 1) / 2;
        if (mm_doc_start(&f->mm, mid) <= local)
            lo = mid;
        else
            hi = mid - 1;
    }
    return lo;
}

static tkd_status vocab_error(const tok_file *f, int64_t local, int32_t t, int vocab)
{
    char doc[48] = "";
    if (f->mm.doc_idx && f->mm.num_documents > 0)
        snprintf(doc, sizeof doc, " (document %lld)", (long long)doc_of(f, local));
    return tkd_error_set(TKD_ERR_MISMATCH,
                         "%s: token offset %lld%s: id %d is outside the vocabulary [0, %d): the data was tokenized "
                         "for another model",
                         f->path, (long long)local, doc, t, vocab);
}

tkd_status tkd_tokens_check_vocab(const tkd_tokens *ds, int vocab)
{
    enum { CHUNK = 4096 };
    int32_t buf[CHUNK];
    for (int i = 0; i < ds->nfiles; i++) {
        const tok_file *f = &ds->files[i];
        if ((f->kind == TOK_U8 && vocab > UINT8_MAX) || (f->kind == TOK_U16 && vocab > UINT16_MAX))
            continue; /* every value the file can hold is inside */
        size_t tsz = kind_size(f->kind);
        for (int64_t off = 0; off < f->count; off += CHUNK) {
            if ((off & ((1 << 22) - 1)) == 0 && tkd_interrupted())
                return tkd_input_interrupted(f->path, "token file");
            int64_t m = f->count - off < CHUNK ? f->count - off : CHUNK;
            convert(f->tok + (size_t)off * tsz, f->kind, m, buf);
            for (int64_t j = 0; j < m; j++)
                if (buf[j] < 0 || buf[j] >= vocab)
                    return vocab_error(f, off + j, buf[j], vocab);
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
    int64_t start = i * stride, real = ds->count - start < seq_len + 1 ? ds->count - start : seq_len + 1;
    TKD_TRY(tkd_tokens_read(ds, start, real, tokens));
    for (int64_t j = real; j <= seq_len; j++)
        tokens[j] = 0;
    int valid = 0;
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

tkd_status tkd_tokens_sha256(const tkd_tokens *ds, char hex[65])
{
    enum { CHUNK = 4096 };
    int32_t buf[CHUNK]; /* int32 in memory is the little-endian stream on the hosts we support */
    tkd_sha256 c;
    tkd_sha256_init(&c);
    for (int i = 0; i < ds->nfiles; i++) {
        const tok_file *f = &ds->files[i];
        size_t tsz = kind_size(f->kind);
        for (int64_t off = 0; off < f->count; off += CHUNK) {
            if ((off & ((1 << 22) - 1)) == 0 && tkd_interrupted())
                return tkd_input_interrupted(f->path, "token file");
            int64_t m = f->count - off < CHUNK ? f->count - off : CHUNK;
            convert(f->tok + (size_t)off * tsz, f->kind, m, buf);
            tkd_sha256_update(&c, buf, (size_t)m * sizeof *buf);
        }
    }
    uint8_t digest[TKD_SHA256_BYTES];
    tkd_sha256_final(&c, digest);
    tkd_sha256_hex(digest, hex);
    return TKD_OK;
}
