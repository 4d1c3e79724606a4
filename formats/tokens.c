/* tokens.c — see tokens.h: the dataset, a list of token files read as one stream (its reads,
 * documents and windows), and loading one llm.c or .npy file. The file formats' headers are
 * tokens_header.c, Megatron datasets tokens_megatron.c. Files are little-endian, like the host
 * (x86-64, aarch64). */
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

#include "formats/tokens_internal.h"

/* ---- reading one file ---------------------------------------------------------------------- */

/* The payload after the header must hold exactly count tokens of the given size. */
tkd_status tkd_tokens_check_payload(const char *path, int64_t count, size_t tsz, uint64_t payload)
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
tkd_status tkd_tokens_check_fit(const tok_file *f, const char *path)
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
tkd_status tkd_tokens_map_path(const char *path, const char *what, void **map, size_t *len)
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

void tkd_tokens_unmap(void *map, size_t len)
{
    if (map)
        munmap(map, len);
}

void tkd_tokens_release_file(tok_file *f)
{
    tkd_tokens_unmap(f->map, f->map_len);
    tkd_tokens_unmap(f->idx_map, f->idx_len);
    tkd_tokens_flags_release(f);
    free(f->path);
}

/* flags_base + ".flags.npy" (malloc'd): the name of the flags sidecar of a token file. */
static tkd_status flags_name(const char *flags_base, char **out)
{
    size_t n = strlen(flags_base);
    if (!(*out = malloc(n + sizeof ".flags.npy")))
        return tkd_error_set(TKD_ERR_NOMEM, "%s: out of memory", flags_base);
    memcpy(*out, flags_base, n);
    memcpy(*out + n, ".flags.npy", sizeof ".flags.npy");
    return TKD_OK;
}

/* Appends f (its tokens mapped and checked) to ds as path, with its flags sidecar
 * flags_base.flags.npy when that exists; on failure f is released. */
tkd_status tkd_tokens_add_file(tkd_tokens *ds, tok_file *f, const char *path, const char *flags_base)
{
    char *fp = NULL;
    tkd_status st = flags_name(flags_base, &fp);
    if (st == TKD_OK)
        st = tkd_tokens_flags_attach(f, path, fp);
    free(fp);
    if (st != TKD_OK) {
        tkd_tokens_release_file(f);
        return st;
    }
    tok_file *files = realloc(ds->files, (size_t)(ds->nfiles + 1) * sizeof *files);
    if (files)
        ds->files = files;
    if (!files || !(f->path = strdup(path))) {
        tkd_tokens_release_file(f);
        return tkd_error_set(TKD_ERR_NOMEM, "%s: out of memory", path);
    }
    f->first = ds->count;
    f->doc0 = ds->ndocs;
    ds->files[ds->nfiles++] = *f;
    ds->count += f->count;
    ds->ndocs += tkd_tokens_file_ndocs(f);
    return TKD_OK;
}

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
    tkd_status st = got == 6 && memcmp(magic, "\x93NUMPY", 6) == 0
                        ? tkd_tokens_npy_header(fp, path, size, &kind, &count)
                        : tkd_tokens_bin_header(fp, path, size, &kind, &count);
    tok_file f = {.kind = kind, .count = count};
    if (st == TKD_OK && tkd_interrupted())
        st = tkd_input_interrupted(path, "token file");
    if (st == TKD_OK)
        st = map_fd(fileno(fp), path, (size_t)size, &f.map, &f.map_len);
    fclose(fp);
    if (st == TKD_OK && count > 0) { /* the header checked that the tokens end the file */
        f.tok = (const uint8_t *)f.map + (size - (uint64_t)count * tkd_tokens_kind_size(kind));
        st = tkd_tokens_check_fit(&f, path);
    }
    if (st != TKD_OK) {
        tkd_tokens_release_file(&f);
        return st;
    }
    return tkd_tokens_add_file(ds, &f, path, path);
}

static tkd_status load_path(tkd_tokens *ds, const char *path)
{
    char *prefix;
    TKD_TRY(tkd_tokens_megatron_prefix(path, &prefix));
    if (!prefix)
        return load_file(ds, path);
    tkd_status st = tkd_tokens_load_megatron(ds, prefix);
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
        if (!tkd_tokens_has_suffix(paths[i], ".idx"))
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
    for (size_t i = 0; i < g.gl_pathc && st == TKD_OK; i++) /* a sidecar is read with its token file */
        if (!skip[i] && !tkd_tokens_has_suffix(g.gl_pathv[i], ".flags.npy"))
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
    ds->ntrained = -1; /* no flags until tkd_tokens_flags_check_list has seen every file */
    tkd_status st = TKD_OK;
    for (int i = 0; i < nspecs && st == TKD_OK; i++)
        st = load_spec(ds, specs[i]);
    if (st == TKD_OK && ds->count == 0)
        st = tkd_error_set(TKD_ERR_FORMAT, "%s%s: the dataset holds no tokens", specs[0], nspecs > 1 ? " ..." : "");
    if (st == TKD_OK)
        st = tkd_tokens_flags_check_list(ds);
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
        tkd_tokens_release_file(&ds->files[i]);
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
int tkd_tokens_file_at(const tkd_tokens *ds, int64_t g) { return last_file_from(ds, g, 0); }

const char *tkd_tokens_locate(const tkd_tokens *ds, int64_t global, int64_t *local)
{
    if (global < 0 || global >= ds->count)
        return NULL;
    const tok_file *f = &ds->files[tkd_tokens_file_at(ds, global)];
    if (local)
        *local = global - f->first;
    return f->path;
}

tkd_status tkd_tokens_read(const tkd_tokens *ds, int64_t first, int64_t n, int32_t *out)
{
    if (first < 0 || n < 0 || first > ds->count - n)
        return tkd_error_set(TKD_ERR_INVALID_ARG, "tokens [%lld, %lld + %lld) are not inside the stream of %lld",
                             (long long)first, (long long)first, (long long)n, (long long)ds->count);
    for (int i = n > 0 ? tkd_tokens_file_at(ds, first) : ds->nfiles; n > 0; i++) {
        const tok_file *f = &ds->files[i];
        int64_t local = first - f->first, m = f->count - local < n ? f->count - local : n;
        if (m <= 0)
            continue;
        convert(f->tok + (size_t)local * tkd_tokens_kind_size(f->kind), f->kind, m, out);
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
    return f->first + tkd_tokens_file_doc_start(f, d - f->doc0);
}

/* The document of f holding token local (f records documents): the last one starting at or before
 * it, which skips the empty documents starting at the same place. */
static int64_t doc_of(const tok_file *f, int64_t local)
{
    int64_t lo = 0, hi = tkd_tokens_file_ndocs(f) - 1;
    while (lo < hi) {
        int64_t mid = lo + (hi - lo + 1) / 2;
        if (tkd_tokens_file_doc_start(f, mid) <= local)
            lo = mid;
        else
            hi = mid - 1;
    }
    return lo;
}

static tkd_status vocab_error(const tok_file *f, int64_t local, int32_t t, int vocab)
{
    char doc[48] = "";
    if (tkd_tokens_file_ndocs(f) > 0 && tkd_tokens_file_doc_start(f, 0) <= local)
        snprintf(doc, sizeof doc, " (document %lld)", (long long)doc_of(f, local));
    return tkd_error_set(TKD_ERR_MISMATCH,
                         "%s: token offset %lld%s: id %d is outside the vocabulary [0, %d): the data was tokenized "
                         "for another model",
                         f->path, (long long)local, doc, t, vocab);
}

/* Passes the tokens of f to fn as int32, TOK_CHUNK at a time (buf (m,) holds the tokens from offset
 * off of f), stopping at fn's first error; an interrupt stops it too, as an error naming the file.
 * The vocabulary check and the checksum both read every token this way. */
enum { TOK_CHUNK = 4096 };
typedef tkd_status (*tok_chunk_fn)(void *ctx, const tok_file *f, int64_t off, const int32_t *buf, int64_t m);

static tkd_status each_chunk(const tok_file *f, tok_chunk_fn fn, void *ctx)
{
    int32_t buf[TOK_CHUNK]; /* int32 in memory is the little-endian stream on the hosts we support */
    size_t tsz = tkd_tokens_kind_size(f->kind);
    for (int64_t off = 0; off < f->count; off += TOK_CHUNK) {
        if ((off & ((1 << 22) - 1)) == 0 && tkd_interrupted())
            return tkd_input_interrupted(f->path, "token file");
        int64_t m = f->count - off < TOK_CHUNK ? f->count - off : TOK_CHUNK;
        convert(f->tok + (size_t)off * tsz, f->kind, m, buf);
        TKD_TRY(fn(ctx, f, off, buf, m));
    }
    return TKD_OK;
}

static tkd_status vocab_chunk(void *ctx, const tok_file *f, int64_t off, const int32_t *buf, int64_t m)
{
    int vocab = *(const int *)ctx;
    for (int64_t j = 0; j < m; j++)
        if (buf[j] < 0 || buf[j] >= vocab)
            return vocab_error(f, off + j, buf[j], vocab);
    return TKD_OK;
}

tkd_status tkd_tokens_check_vocab(const tkd_tokens *ds, int vocab)
{
    for (int i = 0; i < ds->nfiles; i++) {
        const tok_file *f = &ds->files[i];
        if ((f->kind == TOK_U8 && vocab > UINT8_MAX) || (f->kind == TOK_U16 && vocab > UINT16_MAX))
            continue; /* every value the file can hold is inside */
        TKD_TRY(each_chunk(f, vocab_chunk, &vocab));
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
    if (tkd_tokens_has_flags(ds)) /* only the trained targets are labels: label j is token start + j + 1 */
        valid = (int)tkd_tokens_mask_labels(ds, start + 1, valid, labels);
    if (n_valid)
        *n_valid = valid;
    return TKD_OK;
}

static tkd_status sha256_chunk(void *ctx, const tok_file *f, int64_t off, const int32_t *buf, int64_t m)
{
    (void)f, (void)off;
    tkd_sha256_update(ctx, buf, (size_t)m * sizeof *buf);
    return TKD_OK;
}

/* The flags sidecars' bytes after a marker (so no token stream hashes like tokens + flags). */
static tkd_status sha256_flags(const tkd_tokens *ds, tkd_sha256 *c)
{
    static const char marker[] = "topkd flags sidecar";
    tkd_sha256_update(c, marker, sizeof marker);
    uint8_t buf[1 << 16];
    for (int64_t off = 0; off < ds->count; off += (int64_t)sizeof buf) {
        int64_t m = ds->count - off < (int64_t)sizeof buf ? ds->count - off : (int64_t)sizeof buf;
        TKD_TRY(tkd_tokens_read_flags(ds, off, m, buf));
        tkd_sha256_update(c, buf, (size_t)m);
    }
    return TKD_OK;
}

tkd_status tkd_tokens_sha256(const tkd_tokens *ds, char hex[65])
{
    tkd_sha256 c;
    tkd_sha256_init(&c);
    for (int i = 0; i < ds->nfiles; i++)
        TKD_TRY(each_chunk(&ds->files[i], sha256_chunk, &c));
    if (tkd_tokens_has_flags(ds)) /* which targets are trained and where documents start are data too */
        TKD_TRY(sha256_flags(ds, &c));
    uint8_t digest[TKD_SHA256_BYTES];
    tkd_sha256_final(&c, digest);
    tkd_sha256_hex(digest, hex);
    return TKD_OK;
}
