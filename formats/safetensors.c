/* safetensors.c — see safetensors.h.
 *
 * Layout of one file: u64 little-endian header length N, N bytes of JSON
 * {name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}, then the data
 * region; offsets are relative to the start of the data region. The host is assumed little-endian
 * (x86-64, aarch64), like the files.
 */
#include "formats/safetensors.h"

#include "common/fileio.h"
#include "formats/json_check.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

/* A header above this is refused: real checkpoints stay far below (a few hundred KB), and the
 * bound keeps a corrupt length from making us allocate gigabytes. */
#define ST_MAX_HEADER (100u * 1000u * 1000u)

typedef struct st_file {
    char *path;
    const uint8_t *base; /* whole file image */
    size_t size;
    int mapped;          /* 1: base is our mmap, unmapped on close */
} st_file;

struct tkd_st_dir {
    char *where;           /* directory or file given to open (for messages) */
    st_file *files;
    int nfiles;
    tkd_st_tensor *tensors; /* sorted by name once open succeeds */
    int ntensors;
    int cap;
};

size_t tkd_dtype_size(tkd_dtype dt)
{
    switch (dt) {
    case TKD_DTYPE_F32: return 4;
    case TKD_DTYPE_F16: return 2;
    case TKD_DTYPE_BF16: return 2;
    case TKD_DTYPE_I32: return 4;
    case TKD_DTYPE_I64: return 8;
    case TKD_DTYPE_U8: return 1;
    }
    return 0;
}

const char *tkd_dtype_name(tkd_dtype dt)
{
    switch (dt) {
    case TKD_DTYPE_F32: return "F32";
    case TKD_DTYPE_F16: return "F16";
    case TKD_DTYPE_BF16: return "BF16";
    case TKD_DTYPE_I32: return "I32";
    case TKD_DTYPE_I64: return "I64";
    case TKD_DTYPE_U8: return "U8";
    }
    return "?";
}

static int dtype_parse(const char *s, tkd_dtype *out)
{
    static const tkd_dtype all[] = {TKD_DTYPE_F32, TKD_DTYPE_F16, TKD_DTYPE_BF16,
                                    TKD_DTYPE_I32, TKD_DTYPE_I64, TKD_DTYPE_U8};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++)
        if (strcmp(s, tkd_dtype_name(all[i])) == 0) {
            *out = all[i];
            return 1;
        }
    return 0;
}

const char *tkd_st_shape_str(char *buf, size_t cap, int ndim, const int64_t *shape)
{
    size_t n = (size_t)snprintf(buf, cap, "[");
    for (int i = 0; i < ndim && n < cap; i++)
        n += (size_t)snprintf(buf + n, cap - n, "%s%lld", i ? ", " : "", (long long)shape[i]);
    if (n < cap)
        snprintf(buf + n, cap - n, "]");
    return buf;
}

/* ---- header parsing ----------------------------------------------------------------------- */

/* A JSON number that is a non-negative integer exactly representable in a double. */
static int json_uint(const cJSON *j, int64_t *out)
{
    if (!cJSON_IsNumber(j))
        return 0;
    double v = j->valuedouble;
    if (!(v >= 0.0) || v > 9007199254740992.0 || floor(v) != v)
        return 0;
    *out = (int64_t)v;
    return 1;
}

/* arr (n elements of elem bytes in use, room for *cap) with room for one more: arr itself, or a copy
 * twice as large (first when empty), *cap updated; NULL when out of memory, arr then untouched. */
static void *room_for_one(void *arr, int n, int *cap, size_t elem, int first)
{
    if (n < *cap)
        return arr;
    int c = *cap ? *cap * 2 : first;
    void *p = realloc(arr, (size_t)c * elem);
    if (p)
        *cap = c;
    return p;
}

static tkd_status push_tensor(tkd_st_dir *d, tkd_st_tensor *t)
{
    tkd_st_tensor *p = room_for_one(d->tensors, d->ntensors, &d->cap, sizeof *p, 64);
    if (!p)
        return tkd_error_set(TKD_ERR_NOMEM, "safetensors: out of memory indexing tensors");
    d->tensors = p;
    d->tensors[d->ntensors++] = *t;
    return TKD_OK;
}

/* Parses one tensor entry of file f into t (t->name already set). */
static tkd_status parse_entry(const st_file *f, const cJSON *e, const uint8_t *data, uint64_t data_size,
                              tkd_st_tensor *t)
{
    const char *path = f->path, *name = t->name;
    if (!cJSON_IsObject(e))
        return tkd_error_set(TKD_ERR_FORMAT, "%s: tensor '%s': header entry is not a JSON object", path, name);
    const cJSON *jd = cJSON_GetObjectItemCaseSensitive(e, "dtype");
    const cJSON *js = cJSON_GetObjectItemCaseSensitive(e, "shape");
    const cJSON *jo = cJSON_GetObjectItemCaseSensitive(e, "data_offsets");
    if (!cJSON_IsString(jd))
        return tkd_error_set(TKD_ERR_FORMAT, "%s: tensor '%s': missing or non-string \"dtype\"", path, name);
    if (!dtype_parse(jd->valuestring, &t->dtype))
        return tkd_error_set(TKD_ERR_FORMAT,
                             "%s: tensor '%s': dtype %.32s is not supported (supported: F32, F16, BF16, I32, "
                             "I64, U8); convert the checkpoint",
                             path, name, jd->valuestring);
    if (!cJSON_IsArray(js))
        return tkd_error_set(TKD_ERR_FORMAT, "%s: tensor '%s': missing or non-array \"shape\"", path, name);
    int nd = cJSON_GetArraySize(js);
    if (nd > TKD_ST_MAX_DIMS)
        return tkd_error_set(TKD_ERR_FORMAT, "%s: tensor '%s': shape has %d dimensions (at most %d)", path, name,
                             nd, TKD_ST_MAX_DIMS);
    t->ndim = nd;
    uint64_t count = 1;
    int overflow = 0;
    const cJSON *it;
    int i = 0;
    cJSON_ArrayForEach(it, js) {
        int64_t v;
        if (!json_uint(it, &v))
            return tkd_error_set(TKD_ERR_FORMAT, "%s: tensor '%s': shape[%d] is not a non-negative integer", path,
                                 name, i);
        t->shape[i++] = v;
        if (v != 0 && count > UINT64_MAX / (uint64_t)v)
            overflow = 1;
        else
            count *= (uint64_t)v;
    }
    if (!cJSON_IsArray(jo) || cJSON_GetArraySize(jo) != 2)
        return tkd_error_set(TKD_ERR_FORMAT, "%s: tensor '%s': \"data_offsets\" must be an array [begin, end]",
                             path, name);
    int64_t b, en;
    if (!json_uint(cJSON_GetArrayItem(jo, 0), &b) || !json_uint(cJSON_GetArrayItem(jo, 1), &en))
        return tkd_error_set(TKD_ERR_FORMAT, "%s: tensor '%s': data_offsets are not non-negative integers", path,
                             name);
    if (b > en)
        return tkd_error_set(TKD_ERR_FORMAT, "%s: tensor '%s': data_offsets [%lld, %lld] have begin > end", path,
                             name, (long long)b, (long long)en);
    if ((uint64_t)en > data_size)
        return tkd_error_set(TKD_ERR_FORMAT,
                             "%s: tensor '%s': data_offsets [%lld, %lld] end past the data region (%llu bytes): "
                             "the file is truncated or its header is wrong",
                             path, name, (long long)b, (long long)en, (unsigned long long)data_size);
    uint64_t esz = tkd_dtype_size(t->dtype);
    if (overflow || count > UINT64_MAX / esz || count * esz != (uint64_t)(en - b)) {
        char sb[160];
        return tkd_error_set(TKD_ERR_FORMAT,
                             "%s: tensor '%s': %s x shape %s needs %s%llu bytes but data_offsets [%lld, %lld] "
                             "span %lld",
                             path, name, jd->valuestring, tkd_st_shape_str(sb, sizeof sb, nd, t->shape),
                             overflow ? "more than " : "",
                             overflow ? (unsigned long long)UINT64_MAX : (unsigned long long)(count * esz),
                             (long long)b, (long long)en, (long long)(en - b));
    }
    t->data = data + b;
    t->nbytes = (size_t)(en - b);
    t->file = f->path;
    return TKD_OK;
}

static int cmp_offset(const void *a, const void *b)
{
    const tkd_st_tensor *x = a, *y = b;
    if (x->data != y->data)
        return (const uint8_t *)x->data < (const uint8_t *)y->data ? -1 : 1;
    return x->nbytes < y->nbytes ? -1 : x->nbytes > y->nbytes;
}

static int cmp_name(const void *a, const void *b)
{
    return strcmp(((const tkd_st_tensor *)a)->name, ((const tkd_st_tensor *)b)->name);
}

/* Tensors [first, first+n) of one file: sorted by offset, neighbours must not share bytes.
 * Empty tensors own no bytes, so they cannot overlap anything. */
static tkd_status check_overlap(const st_file *f, tkd_st_tensor *t, int n, const uint8_t *data)
{
    qsort(t, (size_t)n, sizeof *t, cmp_offset);
    const tkd_st_tensor *prev = NULL;
    for (int i = 0; i < n; i++) {
        if (t[i].nbytes == 0)
            continue;
        if (prev && (const uint8_t *)prev->data + prev->nbytes > (const uint8_t *)t[i].data)
            return tkd_error_set(TKD_ERR_FORMAT,
                                 "%s: tensors '%s' (bytes %td..%td) and '%s' (bytes %td..%td) overlap in the data "
                                 "region",
                                 f->path, prev->name, (const uint8_t *)prev->data - data,
                                 (const uint8_t *)prev->data - data + (ptrdiff_t)prev->nbytes, t[i].name,
                                 (const uint8_t *)t[i].data - data,
                                 (const uint8_t *)t[i].data - data + (ptrdiff_t)t[i].nbytes);
        prev = &t[i];
    }
    return TKD_OK;
}

/* Validates the file image f and appends its tensors to d. */
static tkd_status parse_file(tkd_st_dir *d, const st_file *f)
{
    const char *path = f->path;
    if (f->size < 8)
        return tkd_error_set(TKD_ERR_FORMAT,
                             "%s: file is %zu bytes, shorter than the 8-byte header length: truncated or not a "
                             "safetensors file",
                             path, f->size);
    uint64_t n = 0;
    for (int i = 7; i >= 0; i--)
        n = (n << 8) | f->base[i];
    if (n < 2)
        return tkd_error_set(TKD_ERR_FORMAT, "%s: header length %llu is too small (a JSON object needs >= 2)",
                             path, (unsigned long long)n);
    if (n > ST_MAX_HEADER)
        return tkd_error_set(TKD_ERR_FORMAT,
                             "%s: header length %llu is larger than the 100 MB limit: not a safetensors file or "
                             "corrupt",
                             path, (unsigned long long)n);
    if (n > f->size - 8)
        return tkd_error_set(TKD_ERR_FORMAT,
                             "%s: header length %llu exceeds the file (%zu bytes): the file is truncated", path,
                             (unsigned long long)n, f->size);
    /* cJSON wants a terminated string; the mapping has none. */
    char *text = malloc((size_t)n + 1);
    if (!text)
        return tkd_error_set(TKD_ERR_NOMEM, "%s: out of memory for a %llu-byte header", path,
                             (unsigned long long)n);
    memcpy(text, f->base + 8, (size_t)n);
    text[n] = '\0';
    const char *end = NULL;
    cJSON *root = cJSON_ParseWithLengthOpts(text, (size_t)n, &end, 0);
    if (!root) {
        long at = end ? (long)(end - text) : -1;
        free(text);
        return tkd_error_set(TKD_ERR_FORMAT, "%s: header is not valid JSON (error near header byte %ld)", path,
                             at);
    }
    tkd_status st = tkd_json_unique_keys(root, text, (size_t)n, path);
    free(text);
    if (st != TKD_OK)
        goto out;
    if (!cJSON_IsObject(root)) {
        st = tkd_error_set(TKD_ERR_FORMAT, "%s: header is JSON but not an object", path);
        goto out;
    }
    const uint8_t *data = f->base + 8 + n;
    uint64_t data_size = f->size - 8 - n;
    int first = d->ntensors;
    const cJSON *e;
    cJSON_ArrayForEach(e, root) {
        if (!e->string) {
            st = tkd_error_set(TKD_ERR_FORMAT, "%s: header entry without a name", path);
            goto out;
        }
        if (strcmp(e->string, "__metadata__") == 0) {
            if (!cJSON_IsObject(e)) {
                st = tkd_error_set(TKD_ERR_FORMAT, "%s: \"__metadata__\" is not a JSON object", path);
                goto out;
            }
            continue;
        }
        tkd_st_tensor t = {0};
        t.name = strdup(e->string);
        if (!t.name) {
            st = tkd_error_set(TKD_ERR_NOMEM, "%s: out of memory", path);
            goto out;
        }
        st = parse_entry(f, e, data, data_size, &t);
        if (st == TKD_OK)
            st = push_tensor(d, &t);
        if (st != TKD_OK) {
            free(t.name);
            goto out;
        }
    }
    /* a header of __metadata__ alone adds no tensor (and d->tensors may still be NULL) */
    if (d->ntensors > first)
        st = check_overlap(f, d->tensors + first, d->ntensors - first, data);
out:
    cJSON_Delete(root);
    return st;
}

/* ---- opening files and directories ---------------------------------------------------------- */

/* Records a file image in d (taking over the mapping when mapped), without parsing it. */
static tkd_status record_file(tkd_st_dir *d, const char *path, const void *buf, size_t size, int mapped)
{
    st_file *p = realloc(d->files, (size_t)(d->nfiles + 1) * sizeof *p);
    if (!p)
        return tkd_error_set(TKD_ERR_NOMEM, "%s: out of memory", path);
    d->files = p;
    st_file *f = &d->files[d->nfiles];
    if (!(f->path = strdup(path)))
        return tkd_error_set(TKD_ERR_NOMEM, "%s: out of memory", path);
    f->base = buf;
    f->size = size;
    f->mapped = mapped;
    d->nfiles++;
    return TKD_OK;
}

static tkd_status map_file(tkd_st_dir *d, const char *path)
{
    int fd;
    TKD_TRY(tkd_open_input(path, "safetensors file", &fd));
    struct stat sb;
    if (fstat(fd, &sb) != 0) {
        tkd_status st = tkd_error_set(TKD_ERR_IO, "%s: fstat failed: %s", path, strerror(errno));
        close(fd);
        return st;
    }
    size_t size = (size_t)sb.st_size;
    void *base = NULL;
    if (size > 0) { /* mmap of 0 bytes fails; parse_file reports the short file */
        base = mmap(NULL, size, PROT_READ, MAP_PRIVATE, fd, 0);
        if (base == MAP_FAILED) {
            int e = errno;
            close(fd);
            return tkd_error_set(TKD_ERR_IO, "%s: mmap failed: %s", path, strerror(e));
        }
    }
    close(fd); /* the mapping keeps the file alive */
    tkd_status st = record_file(d, path, base, size, base != NULL);
    if (st != TKD_OK) {
        if (base)
            munmap(base, size);
        return st;
    }
    return parse_file(d, &d->files[d->nfiles - 1]);
}

static tkd_st_dir *dir_new(const char *where)
{
    tkd_st_dir *d = calloc(1, sizeof *d);
    if (d && !(d->where = strdup(where))) {
        free(d);
        d = NULL;
    }
    return d;
}

/* Sorts by name and refuses a name that occurs twice (in one file or across shards). */
static tkd_status index_names(tkd_st_dir *d)
{
    if (d->ntensors > 1) /* qsort must not see the NULL list of a file without tensors */
        qsort(d->tensors, (size_t)d->ntensors, sizeof *d->tensors, cmp_name);
    for (int i = 1; i < d->ntensors; i++)
        if (strcmp(d->tensors[i - 1].name, d->tensors[i].name) == 0 &&
            d->tensors[i - 1].file == d->tensors[i].file)
            return tkd_error_set(TKD_ERR_FORMAT, "%s: tensor '%s' is defined twice in the header", d->tensors[i].file,
                                 d->tensors[i].name);
        else if (strcmp(d->tensors[i - 1].name, d->tensors[i].name) == 0)
            return tkd_error_set(TKD_ERR_FORMAT, "%s: tensor '%s' is defined twice (in %s and %s)", d->where,
                                 d->tensors[i].name, d->tensors[i - 1].file, d->tensors[i].file);
    return TKD_OK;
}

static int file_exists(const char *p)
{
    struct stat sb;
    return stat(p, &sb) == 0 && S_ISREG(sb.st_mode);
}

/* Shard names come from the index file: keep them inside the directory. */
static int shard_name_ok(const char *s)
{
    return *s && !strchr(s, '/') && strcmp(s, ".") != 0 && strcmp(s, "..") != 0;
}

/* Opens every shard the index names (once each), then checks each mapping. */
static tkd_status open_sharded(tkd_st_dir *d, const char *dir, const char *index_path)
{
    char *text = NULL;
    size_t len = 0;
    TKD_TRY(tkd_read_input(index_path, "safetensors index", (void **)&text, &len));
    const char *end = NULL;
    cJSON *root = cJSON_ParseWithOpts(text, &end, 0);
    if (!root) {
        long at = end ? (long)(end - text) : -1;
        free(text);
        return tkd_error_set(TKD_ERR_FORMAT, "%s: not valid JSON (error near byte %ld)", index_path, at);
    }
    tkd_status st = tkd_json_unique_keys(root, text, len, index_path);
    free(text);
    if (st != TKD_OK)
        goto out;
    const cJSON *wm = cJSON_GetObjectItemCaseSensitive(root, "weight_map");
    if (!cJSON_IsObject(wm)) {
        st = tkd_error_set(TKD_ERR_FORMAT, "%s: no \"weight_map\" object", index_path);
        goto out;
    }
    const cJSON *e;
    cJSON_ArrayForEach(e, wm) {
        if (!cJSON_IsString(e) || !shard_name_ok(e->valuestring)) {
            st = tkd_error_set(TKD_ERR_FORMAT, "%s: weight_map[\"%s\"] is not a shard file name in this directory",
                               index_path, e->string ? e->string : "");
            goto out;
        }
        int seen = 0;
        for (const cJSON *p = wm->child; p != e && !seen; p = p->next)
            seen = strcmp(p->valuestring, e->valuestring) == 0;
        if (seen)
            continue;
        char *sp;
        if ((st = tkd_path_join_alloc(&sp, dir, e->valuestring)) != TKD_OK)
            goto out;
        if (!file_exists(sp))
            st = tkd_error_set(TKD_ERR_NOT_FOUND, "%s: shard %s (weight_map[\"%s\"]) does not exist", index_path,
                               sp, e->string);
        else
            st = map_file(d, sp);
        free(sp);
        if (st != TKD_OK)
            goto out;
    }
    if ((st = index_names(d)) != TKD_OK)
        goto out;
    cJSON_ArrayForEach(e, wm) {
        const tkd_st_tensor *t = tkd_st_find(d, e->string);
        const char *base = t ? strrchr(t->file, '/') : NULL;
        base = base ? base + 1 : (t ? t->file : "");
        if (!t || strcmp(base, e->valuestring) != 0) {
            if (t)
                st = tkd_error_set(TKD_ERR_FORMAT, "%s: weight_map puts tensor '%s' in %s, but it is in %s",
                                   index_path, e->string, e->valuestring, t->file);
            else
                st = tkd_error_set(TKD_ERR_FORMAT, "%s: weight_map puts tensor '%s' in %s, but that shard lacks it",
                                   index_path, e->string, e->valuestring);
            goto out;
        }
    }
out:
    cJSON_Delete(root);
    return st;
}

tkd_status tkd_st_open(const char *path, tkd_st_dir **out)
{
    *out = NULL;
    struct stat sb;
    if (stat(path, &sb) != 0)
        return tkd_error_set(TKD_ERR_NOT_FOUND, "%s: cannot open checkpoint: %s", path, strerror(errno));
    tkd_st_dir *d = dir_new(path);
    if (!d)
        return tkd_error_set(TKD_ERR_NOMEM, "%s: out of memory", path);
    tkd_status st = TKD_OK;
    if (!S_ISDIR(sb.st_mode)) {
        st = map_file(d, path);
        if (st == TKD_OK)
            st = index_names(d);
    } else {
        char *single = NULL, *index = NULL;
        st = tkd_path_join_alloc(&single, path, "model.safetensors");
        if (st == TKD_OK)
            st = tkd_path_join_alloc(&index, path, "model.safetensors.index.json");
        if (st != TKD_OK)
            ; /* out of memory */
        else if (file_exists(single) && (st = map_file(d, single)) == TKD_OK) /* transformers' order */
            st = index_names(d);
        else if (file_exists(single))
            ; /* st holds map_file's error */
        else if (file_exists(index))
            st = open_sharded(d, path, index);
        else
            st = tkd_error_set(TKD_ERR_NOT_FOUND,
                               "%s: neither model.safetensors nor model.safetensors.index.json is there: not a "
                               "Hugging Face checkpoint directory",
                               path);
        free(single);
        free(index);
    }
    if (st != TKD_OK) {
        tkd_st_close(d);
        return st;
    }
    *out = d;
    return TKD_OK;
}

tkd_status tkd_st_open_memory(const char *label, const void *buf, size_t size, tkd_st_dir **out)
{
    *out = NULL;
    tkd_st_dir *d = dir_new(label);
    if (!d)
        return tkd_error_set(TKD_ERR_NOMEM, "%s: out of memory", label);
    tkd_status st = record_file(d, label, buf, size, 0);
    if (st == TKD_OK)
        st = parse_file(d, &d->files[0]);
    if (st == TKD_OK)
        st = index_names(d);
    if (st != TKD_OK) {
        tkd_st_close(d);
        return st;
    }
    *out = d;
    return TKD_OK;
}

void tkd_st_close(tkd_st_dir *d)
{
    if (!d)
        return;
    for (int i = 0; i < d->ntensors; i++)
        free(d->tensors[i].name);
    for (int i = 0; i < d->nfiles; i++) {
        if (d->files[i].mapped)
            munmap((void *)d->files[i].base, d->files[i].size);
        free(d->files[i].path);
    }
    free(d->tensors);
    free(d->files);
    free(d->where);
    free(d);
}

const tkd_st_tensor *tkd_st_find(const tkd_st_dir *d, const char *name)
{
    tkd_st_tensor key = {.name = (char *)name};
    return bsearch(&key, d->tensors, (size_t)d->ntensors, sizeof key, cmp_name);
}

int tkd_st_count(const tkd_st_dir *d) { return d->ntensors; }

const tkd_st_tensor *tkd_st_at(const tkd_st_dir *d, int i)
{
    return i >= 0 && i < d->ntensors ? &d->tensors[i] : NULL;
}

/* ---- reading as fp32 ------------------------------------------------------------------------ */

tkd_status tkd_st_check_shape(const tkd_st_tensor *t, int ndim, const int64_t *expect_shape)
{
    int same = t->ndim == ndim;
    for (int i = 0; same && i < ndim; i++)
        same = t->shape[i] == expect_shape[i];
    if (same)
        return TKD_OK;
    char a[200], b[200];
    return tkd_error_set(TKD_ERR_MISMATCH,
                         "%s: tensor '%s' has shape %s, expected %s: the checkpoint does not match its config.json",
                         t->file, t->name, tkd_st_shape_str(a, sizeof a, t->ndim, t->shape),
                         tkd_st_shape_str(b, sizeof b, ndim, expect_shape));
}

tkd_status tkd_st_read_f32(const tkd_st_dir *d, const char *name, int ndim, const int64_t *expect_shape,
                           float *dst, size_t n)
{
    const tkd_st_tensor *t = tkd_st_find(d, name);
    if (!t)
        return tkd_error_set(TKD_ERR_NOT_FOUND, "%s: tensor '%s' is missing from the checkpoint", d->where, name);
    TKD_TRY(tkd_st_check_shape(t, ndim, expect_shape));
    size_t count = t->nbytes / tkd_dtype_size(t->dtype);
    if (count != n)
        return tkd_error_set(TKD_ERR_INVALID_ARG, "%s: tensor '%s' has %zu elements, destination holds %zu",
                             t->file, name, count, n);
    return tkd_st_slice_f32(t, 0, n, dst);
}

tkd_status tkd_st_slice_f32(const tkd_st_tensor *t, size_t first, size_t n, float *dst)
{
    size_t count = t->nbytes / tkd_dtype_size(t->dtype);
    if (first > count || n > count - first)
        return tkd_error_set(TKD_ERR_INVALID_ARG, "%s: tensor '%s' has %zu elements, asked for [%zu, %zu)", t->file,
                             t->name, count, first, first + n);
    const char *name = t->name;
    const uint8_t *src = (const uint8_t *)t->data + first * tkd_dtype_size(t->dtype); /* may be unaligned */
    switch (t->dtype) {
    case TKD_DTYPE_F32:
        memcpy(dst, src, n * 4);
        return TKD_OK;
    case TKD_DTYPE_F16:
    case TKD_DTYPE_BF16: {
        int bf = t->dtype == TKD_DTYPE_BF16;
        for (size_t i = 0; i < n; i++) {
            uint16_t h;
            memcpy(&h, src + 2 * i, 2);
            dst[i] = bf ? tkd_bf16_to_f32(h) : tkd_f16_to_f32(h);
        }
        return TKD_OK;
    }
    default:
        return tkd_error_set(TKD_ERR_UNSUPPORTED, "%s: tensor '%s' is %s, not a float tensor", t->file, name,
                             tkd_dtype_name(t->dtype));
    }
}

/* ---- writer --------------------------------------------------------------------------------- */

typedef struct st_wentry {
    char *name;
    int ndim;
    int64_t shape[TKD_ST_MAX_DIMS];
    size_t count;
    const float *data;
} st_wentry;

struct tkd_st_writer {
    tkd_dtype dtype;
    st_wentry *e;
    int n, cap;
};

tkd_status tkd_st_writer_init(tkd_st_writer **out, tkd_dtype dtype)
{
    *out = NULL;
    if (dtype != TKD_DTYPE_F32 && dtype != TKD_DTYPE_BF16)
        return tkd_error_set(TKD_ERR_INVALID_ARG, "safetensors writer: dtype %s not supported (F32 or BF16)",
                             tkd_dtype_name(dtype));
    tkd_st_writer *w = calloc(1, sizeof *w);
    if (!w)
        return tkd_error_set(TKD_ERR_NOMEM, "safetensors writer: out of memory");
    w->dtype = dtype;
    *out = w;
    return TKD_OK;
}

tkd_status tkd_st_writer_add(tkd_st_writer *w, const char *name, int ndim, const int64_t *shape, const float *data)
{
    if (ndim < 0 || ndim > TKD_ST_MAX_DIMS || !name || !*name || strcmp(name, "__metadata__") == 0)
        return tkd_error_set(TKD_ERR_INVALID_ARG, "safetensors writer: bad tensor '%s' (ndim %d)",
                             name ? name : "(null)", ndim);
    for (int i = 0; i < w->n; i++)
        if (strcmp(w->e[i].name, name) == 0)
            return tkd_error_set(TKD_ERR_INVALID_ARG, "safetensors writer: tensor '%s' added twice", name);
    size_t count = 1;
    for (int i = 0; i < ndim; i++) {
        if (shape[i] < 0)
            return tkd_error_set(TKD_ERR_INVALID_ARG, "safetensors writer: tensor '%s' has a negative dim", name);
        count *= (size_t)shape[i];
    }
    st_wentry *p = room_for_one(w->e, w->n, &w->cap, sizeof *p, 32);
    if (!p)
        return tkd_error_set(TKD_ERR_NOMEM, "safetensors writer: out of memory");
    w->e = p;
    st_wentry *e = &w->e[w->n];
    if (!(e->name = strdup(name)))
        return tkd_error_set(TKD_ERR_NOMEM, "safetensors writer: out of memory");
    e->ndim = ndim;
    if (ndim > 0)
        memcpy(e->shape, shape, (size_t)ndim * sizeof *shape);
    e->count = count;
    e->data = data;
    w->n++;
    return TKD_OK;
}

/* A growable string for the header. */
typedef struct sbuf {
    char *p;
    size_t n, cap;
    int oom;
} sbuf;

static void sb_put(sbuf *s, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void sb_put(sbuf *s, const char *fmt, ...)
{
    if (s->oom)
        return;
    for (;;) {
        va_list ap;
        va_start(ap, fmt);
        int k = vsnprintf(s->p + s->n, s->cap - s->n, fmt, ap);
        va_end(ap);
        if (k >= 0 && (size_t)k < s->cap - s->n) {
            s->n += (size_t)k;
            return;
        }
        size_t cap = s->cap * 2 + (size_t)(k > 0 ? k : 0);
        char *p = realloc(s->p, cap);
        if (!p) {
            s->oom = 1;
            return;
        }
        s->p = p;
        s->cap = cap;
    }
}

/* JSON string with escapes; tensor names are ASCII in practice, but stay valid for anything. */
static void sb_json_str(sbuf *s, const char *str)
{
    sb_put(s, "\"");
    for (const unsigned char *c = (const unsigned char *)str; *c; c++) {
        if (*c == '"' || *c == '\\')
            sb_put(s, "\\%c", *c);
        else if (*c < 0x20)
            sb_put(s, "\\u%04x", *c);
        else
            sb_put(s, "%c", *c);
    }
    sb_put(s, "\"");
}

/* Builds the header, padded with spaces so the data region starts 8-byte aligned. */
static tkd_status build_header(const tkd_st_writer *w, sbuf *s)
{
    size_t esz = tkd_dtype_size(w->dtype);
    uint64_t off = 0;
    s->cap = 256;
    if (!(s->p = malloc(s->cap)))
        return tkd_error_set(TKD_ERR_NOMEM, "safetensors writer: out of memory");
    /* transformers refuses a safetensors file without "format": "pt" in its metadata */
    sb_put(s, "{\"__metadata__\":{\"format\":\"pt\"}");
    for (int i = 0; i < w->n; i++) {
        const st_wentry *e = &w->e[i];
        sb_put(s, ",");
        sb_json_str(s, e->name);
        sb_put(s, ":{\"dtype\":\"%s\",\"shape\":[", tkd_dtype_name(w->dtype));
        for (int k = 0; k < e->ndim; k++)
            sb_put(s, "%s%lld", k ? "," : "", (long long)e->shape[k]);
        uint64_t end = off + e->count * esz;
        sb_put(s, "],\"data_offsets\":[%llu,%llu]}", (unsigned long long)off, (unsigned long long)end);
        off = end;
    }
    sb_put(s, "}");
    while (!s->oom && s->n % 8 != 0)
        sb_put(s, " ");
    if (s->oom)
        return tkd_error_set(TKD_ERR_NOMEM, "safetensors writer: out of memory");
    return TKD_OK;
}

/* fwrite that names the file; errno tells a full disk apart. */
static tkd_status write_all(FILE *fp, const void *buf, size_t n, const char *path)
{
    if (n && fwrite(buf, 1, n, fp) != n)
        return tkd_error_set(errno == ENOSPC ? TKD_ERR_NOSPACE : TKD_ERR_IO, "%s: write failed: %s%s", path,
                             strerror(errno), errno == ENOSPC ? " (disk full: free space and retry)" : "");
    return TKD_OK;
}

static tkd_status write_tensor_data(const tkd_st_writer *w, FILE *fp, const char *path)
{
    if (w->dtype == TKD_DTYPE_F32) {
        for (int i = 0; i < w->n; i++)
            TKD_TRY(write_all(fp, w->e[i].data, w->e[i].count * 4, path));
        return TKD_OK;
    }
    enum { CHUNK = 1 << 15 };
    uint16_t *buf = malloc(CHUNK * sizeof *buf); /* one conversion buffer for the whole file */
    if (!buf)
        return tkd_error_set(TKD_ERR_NOMEM, "safetensors writer: out of memory");
    tkd_status st = TKD_OK;
    for (int i = 0; i < w->n && st == TKD_OK; i++)
        for (size_t j = 0; j < w->e[i].count && st == TKD_OK; j += CHUNK) {
            size_t m = w->e[i].count - j < CHUNK ? w->e[i].count - j : CHUNK;
            for (size_t k = 0; k < m; k++)
                buf[k] = tkd_f32_to_bf16(w->e[i].data[j + k]);
            st = write_all(fp, buf, m * 2, path);
        }
    free(buf);
    return st;
}

tkd_status tkd_st_writer_finish(tkd_st_writer *w, const char *path)
{
    sbuf hdr = {0};
    tkd_status st = build_header(w, &hdr);
    tkd_atomic_file af;
    if (st == TKD_OK)
        st = tkd_atomic_file_open(&af, path);
    if (st != TKD_OK) {
        free(hdr.p);
        return st;
    }
    uint8_t len8[8];
    for (int i = 0; i < 8; i++)
        len8[i] = (uint8_t)((uint64_t)hdr.n >> (8 * i));
    st = write_all(af.fp, len8, 8, path);
    if (st == TKD_OK)
        st = write_all(af.fp, hdr.p, hdr.n, path);
    if (st == TKD_OK)
        st = write_tensor_data(w, af.fp, path);
    free(hdr.p);
    if (st != TKD_OK) {
        tkd_atomic_file_abort(&af); /* never leave a half-written file behind */
        return st;
    }
    return tkd_atomic_file_commit(&af);
}

void tkd_st_writer_free(tkd_st_writer *w)
{
    if (!w)
        return;
    for (int i = 0; i < w->n; i++)
        free(w->e[i].name);
    free(w->e);
    free(w);
}
