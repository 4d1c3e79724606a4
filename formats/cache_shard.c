/* cache_shard.c — see cache_shard.h. */
#define _GNU_SOURCE /* memfd_create: where a discarded shard's last writes go (writer_discard_io) */
#include "formats/cache_shard.h"

#include <errno.h>
#include <fcntl.h>
#include <float.h>
#include <hdf5.h>
#include <math.h>
#include <omp.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include "common/half.h"
#include "common/fileio.h"
#include "common/sha256.h"
#include "formats/h5zstd.h"
#include "formats/shard_chunks.h"

/* The datasets of a shard, in a fixed order used by both writer and reader. */
enum {
    DS_TOKENS,
    DS_INDICES,
    DS_LOGITS,
    DS_LSE,
    DS_SEQ_INDEX,
    DS_TAIL,
    DS_COUNT,
};
static const char *const ds_names[DS_COUNT] = {
    "/tokens", "/topk/indices", "/topk/logits", "/lse", "/seq_index", "/tail/indices",
};

/* ---- dtypes and identity ------------------------------------------------------------------ */

const char *tkd_cache_dtype_name(tkd_cache_dtype dt)
{
    switch (dt) {
    case TKD_CACHE_DTYPE_HALF: return "half";
    case TKD_CACHE_DTYPE_BFLOAT16: return "bfloat16";
    case TKD_CACHE_DTYPE_FLOAT32: return "float32";
    }
    return "?";
}

tkd_status tkd_cache_dtype_parse(const char *name, tkd_cache_dtype *out)
{
    static const struct { const char *name; tkd_cache_dtype dt; } names[] = {
        {"half", TKD_CACHE_DTYPE_HALF},         {"float16", TKD_CACHE_DTYPE_HALF},
        {"f16", TKD_CACHE_DTYPE_HALF},          {"fp16", TKD_CACHE_DTYPE_HALF},
        {"bfloat16", TKD_CACHE_DTYPE_BFLOAT16}, {"bf16", TKD_CACHE_DTYPE_BFLOAT16},
        {"float32", TKD_CACHE_DTYPE_FLOAT32},   {"f32", TKD_CACHE_DTYPE_FLOAT32},
        {"fp32", TKD_CACHE_DTYPE_FLOAT32},
    };
    for (size_t i = 0; name && i < sizeof names / sizeof names[0]; i++) {
        if (strcmp(name, names[i].name) == 0) {
            *out = names[i].dt;
            return TKD_OK;
        }
    }
    return tkd_error_set(TKD_ERR_CONFIG, "unknown logits dtype '%s' (allowed: half, bfloat16, float32)",
                         name ? name : "(null)");
}

size_t tkd_cache_dtype_size(tkd_cache_dtype dt) { return dt == TKD_CACHE_DTYPE_FLOAT32 ? 4 : 2; }

float tkd_cache_dtype_max(tkd_cache_dtype dt)
{
    switch (dt) {
    case TKD_CACHE_DTYPE_HALF: return 65504.0f;          /* 0x7bff */
    case TKD_CACHE_DTYPE_BFLOAT16: return 0x1.fep127f;  /* 0x7f7f */
    case TKD_CACHE_DTYPE_FLOAT32: break;
    }
    return FLT_MAX;
}

float tkd_cache_dtype_round(tkd_cache_dtype dt, float x)
{
    switch (dt) {
    case TKD_CACHE_DTYPE_HALF: return tkd_f16_to_f32(tkd_f32_to_f16(x));
    case TKD_CACHE_DTYPE_BFLOAT16: return tkd_bf16_to_f32(tkd_f32_to_bf16(x));
    case TKD_CACHE_DTYPE_FLOAT32: break;
    }
    return x;
}

static int is_hex_digest(const char *s)
{
    if (strlen(s) != 64)
        return 0;
    for (int i = 0; i < 64; i++)
        if (!((s[i] >= '0' && s[i] <= '9') || (s[i] >= 'a' && s[i] <= 'f')))
            return 0;
    return 1;
}

tkd_status tkd_cache_identity_check(const tkd_cache_identity *id, const char *what)
{
    if (id->vocab_size < 1 || id->vocab_size > (int64_t)UINT32_MAX)
        return tkd_error_set(TKD_ERR_FORMAT, "%s: vocab_size %lld out of range [1, 2^32)", what,
                             (long long)id->vocab_size);
    if (id->k < 1 || id->k > 65535 || id->k > id->vocab_size)
        return tkd_error_set(TKD_ERR_FORMAT, "%s: k %d out of range [1, min(65535, vocab_size)]",
                             what, id->k);
    if (id->seq_len < 1)
        return tkd_error_set(TKD_ERR_FORMAT, "%s: seq_len %d must be >= 1", what, id->seq_len);
    if (!(id->temperature > 0.0f) || !isfinite(id->temperature))
        return tkd_error_set(TKD_ERR_FORMAT, "%s: temperature %g must be finite and > 0", what,
                             (double)id->temperature);
    if ((unsigned)id->logits_dtype > TKD_CACHE_DTYPE_FLOAT32)
        return tkd_error_set(TKD_ERR_FORMAT, "%s: unknown logits dtype %d", what, (int)id->logits_dtype);
    if (id->tail_samples < 0 || id->tail_samples > 65535)
        return tkd_error_set(TKD_ERR_FORMAT, "%s: tail_samples %d out of range [0, 65535]", what,
                             id->tail_samples);
    if (!is_hex_digest(id->teacher_sha256) || !is_hex_digest(id->dataset_sha256))
        return tkd_error_set(TKD_ERR_FORMAT,
                             "%s: teacher_sha256 and dataset_sha256 must be 64 lowercase hex digits",
                             what);
    return TKD_OK;
}

tkd_status tkd_cache_identity_compare(const tkd_cache_identity *a, const char *a_name,
                                      const tkd_cache_identity *b, const char *b_name)
{
#define TKD_CMP_INT(field)                                                                       \
    if (a->field != b->field)                                                                    \
        return tkd_error_set(TKD_ERR_MISMATCH, "%s vs %s: " #field " differs (%lld vs %lld)",    \
                             a_name, b_name, (long long)a->field, (long long)b->field);
    TKD_CMP_INT(vocab_size)
    TKD_CMP_INT(k)
    TKD_CMP_INT(seq_len)
    TKD_CMP_INT(tail_samples)
#undef TKD_CMP_INT
    if (a->temperature != b->temperature)
        return tkd_error_set(TKD_ERR_MISMATCH, "%s vs %s: temperature differs (%.9g vs %.9g)",
                             a_name, b_name, (double)a->temperature, (double)b->temperature);
    if (a->logits_dtype != b->logits_dtype)
        return tkd_error_set(TKD_ERR_MISMATCH, "%s vs %s: logits_dtype differs (%s vs %s)", a_name,
                             b_name, tkd_cache_dtype_name(a->logits_dtype),
                             tkd_cache_dtype_name(b->logits_dtype));
    if (strcmp(a->teacher_sha256, b->teacher_sha256) != 0)
        return tkd_error_set(TKD_ERR_MISMATCH, "%s vs %s: teacher_sha256 differs (%.12s... vs %.12s...)",
                             a_name, b_name, a->teacher_sha256, b->teacher_sha256);
    if (strcmp(a->dataset_sha256, b->dataset_sha256) != 0)
        return tkd_error_set(TKD_ERR_MISMATCH, "%s vs %s: dataset_sha256 differs (%.12s... vs %.12s...)",
                             a_name, b_name, a->dataset_sha256, b->dataset_sha256);
    return TKD_OK;
}

double tkd_cache_raw_bytes_per_token(const tkd_cache_identity *id)
{
    return (double)(4 + tkd_cache_dtype_size(id->logits_dtype)) * id->k + 4.0 + 4.0 * id->tail_samples;
}

double tkd_cache_bytes_per_token(uint64_t file_bytes, int64_t num_seq, int32_t seq_len)
{
    if (num_seq <= 0 || seq_len <= 0)
        return 0.0;
    return (double)file_bytes / ((double)num_seq * (double)seq_len);
}

/* ---- batches -------------------------------------------------------------------------------- */

tkd_status tkd_cache_batch_alloc(tkd_cache_batch *b, int64_t capacity, int32_t seq_len, int32_t k,
                                 int32_t tail_samples)
{
    memset(b, 0, sizeof *b);
    if (capacity < 1 || seq_len < 1 || k < 1 || tail_samples < 0)
        return tkd_error_set(TKD_ERR_INVALID_ARG,
                             "cache batch: capacity %lld, seq_len %d, k %d, S %d must be positive",
                             (long long)capacity, seq_len, k, tail_samples);
    size_t n = (size_t)capacity, t = (size_t)seq_len;
    b->capacity = capacity;
    b->seq_len = seq_len;
    b->k = k;
    b->tail_samples = tail_samples;
    b->tokens = malloc(n * (t + 1) * sizeof *b->tokens);
    b->topk_indices = malloc(n * t * (size_t)k * sizeof *b->topk_indices);
    b->topk_logits = malloc(n * t * (size_t)k * sizeof *b->topk_logits);
    b->lse = malloc(n * t * sizeof *b->lse);
    b->seq_index = malloc(n * sizeof *b->seq_index);
    b->cache_seq = malloc(n * sizeof *b->cache_seq);
    if (tail_samples > 0)
        b->tail_indices = malloc(n * t * (size_t)tail_samples * sizeof *b->tail_indices);
    if (!b->tokens || !b->topk_indices || !b->topk_logits || !b->lse || !b->seq_index ||
        !b->cache_seq || (tail_samples > 0 && !b->tail_indices)) {
        tkd_cache_batch_free(b);
        return tkd_error_set(TKD_ERR_NOMEM, "cache batch: out of memory for %lld sequences of %d x %d",
                             (long long)capacity, seq_len, k);
    }
    return TKD_OK;
}

void tkd_cache_batch_free(tkd_cache_batch *b)
{
    if (!b)
        return;
    free(b->tokens);
    free(b->topk_indices);
    free(b->topk_logits);
    free(b->lse);
    free(b->seq_index);
    free(b->tail_indices);
    free(b->cache_seq);
    memset(b, 0, sizeof *b);
}

/* ---- HDF5 errors -> one-line tkd_status ----------------------------------------------------- */

typedef struct h5err_walk {
    char desc[256];   /* most specific description (where the error was detected) */
    int checksum;     /* a filter (fletcher32 / zstd) reported corrupt data */
    int nospace;      /* a write failed with ENOSPC / EDQUOT (HDF5 reports it as a generic write error) */
    int locked;       /* HDF5's flock of the file failed: another process has it open */
} h5err_walk;

static herr_t h5err_visit(unsigned n, const H5E_error2_t *e, void *data)
{
    h5err_walk *w = data;
    const char *d = e->desc ? e->desc : "";
    (void)n; /* the walk goes from the API call down: the last entry is the most specific */
    if (d[0])
        snprintf(w->desc, sizeof w->desc, "%s", d);
    if (e->maj_num == H5E_PLINE || strstr(d, "Fletcher32") || strstr(d, "filter returned failure"))
        w->checksum = 1;
    if (strstr(d, "No space left"))
        w->nospace = 1;
    if (strstr(d, "unable to lock file"))
        w->locked = 1;
    return 0;
}

/* The first HDF5 failure since the last entry point, recorded by h5_record while the library's
 * error stack is still intact (a later successful call, e.g. closing a dataspace during cleanup,
 * clears that stack). Per thread, like HDF5's own stacks. */
static _Thread_local h5err_walk h5_first;
static _Thread_local int h5_have_first;

static herr_t h5_record(hid_t estack, void *data)
{
    (void)data;
    if (!h5_have_first) {
        int err = errno; /* still the failed write's errno: HDF5 reports from right after it */
        memset(&h5_first, 0, sizeof h5_first);
        H5Ewalk2(estack, H5E_WALK_DOWNWARD, h5err_visit, &h5_first);
        if (err == ENOSPC || err == EDQUOT)
            h5_first.nospace = 1;
        h5_have_first = 1;
    }
    return 0;
}

/* HDF5's automatic error handler is per thread in a thread-safe build, so every entry point (which
 * may run on a loader thread) installs ours: it records instead of printing. Cheap. */
static void h5_quiet(void)
{
    H5Eset_auto2(H5E_DEFAULT, h5_record, NULL);
    h5_have_first = 0;
    errno = 0; /* h5_record reads it: no stale ENOSPC from an earlier call */
}

/* Drops a failure we chose to ignore, so it is not reported by a later h5_fail. */
static void h5_forget(void)
{
    h5_have_first = 0;
    H5Eclear2(H5E_DEFAULT);
}

/* Turns the first recorded HDF5 failure into a tkd_status: `st` unless a filter reported corrupt
 * data (TKD_ERR_CHECKSUM) or the disk is full (TKD_ERR_NOSPACE). The message is the caller's text
 * followed by HDF5's innermost description. */
static tkd_status h5_fail(tkd_status st, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static tkd_status h5_fail(tkd_status st, const char *fmt, ...)
{
    h5err_walk w = {{0}, 0, 0, 0};
    if (h5_have_first)
        w = h5_first;
    else
        H5Ewalk2(H5E_DEFAULT, H5E_WALK_DOWNWARD, h5err_visit, &w);
    h5_have_first = 0;
    H5Eclear2(H5E_DEFAULT);
    char msg[TKD_ERROR_MSG_MAX];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    if (w.checksum)
        st = TKD_ERR_CHECKSUM;
    else if (w.nospace)
        st = TKD_ERR_NOSPACE;
    if (st == TKD_ERR_NOSPACE) /* HDF5's text (time, buffer address, sizes) adds nothing here */
        return tkd_error_set(st, "%s: disk full (No space left on device) — free disk space and re-run", msg);
    /* HDF5 descriptions may hold newlines (a ctime() stamp); messages are one line */
    for (char *c = w.desc; *c; c++)
        if (*c == '\n' || *c == '\r' || *c == '\t')
            *c = ' ';
    const char *hint = st == TKD_ERR_CHECKSUM ? " — the shard is corrupt; " TKD_CACHE_REPAIR_HINT : "";
    return tkd_error_set(st, "%s (HDF5: %s)%s", msg, w.desc[0] ? w.desc : "unknown error", hint);
}

/* A failed H5Fopen / H5Fcreate of path. HDF5 locks every file it opens (flock: shared to read,
 * exclusive to write), so a file that another program has open for writing (h5py, HDFView, another
 * topkd process), or is reading while we create it, fails with HDF5's "unable to lock file, errno =
 * 11", which says neither what happened nor what to do: that case gets a message of its own. */
static tkd_status h5_fail_open(tkd_status st, const char *path, const char *what)
{
    h5err_walk w = {{0}, 0, 0, 0};
    if (h5_have_first)
        w = h5_first;
    else
        H5Ewalk2(H5E_DEFAULT, H5E_WALK_DOWNWARD, h5err_visit, &w);
    if (!w.locked)
        return h5_fail(st, "%s: %s", path, what);
    h5_forget();
    return tkd_error_set(TKD_ERR_IO, "%s: locked: another program has this file open (HDF5 file lock) — close it "
                         "there (h5py, HDFView, another teacher-dump or student-train) and re-run; on a file system "
                         "without working locks, set HDF5_USE_FILE_LOCKING=FALSE", path);
}

/* ---- HDF5 types ----------------------------------------------------------------------------- */

/* The file type of /topk/logits: IEEE half or bfloat16 built from a float32 copy, or float32. */
static hid_t logits_file_type(tkd_cache_dtype dt)
{
    hid_t t = H5Tcopy(H5T_IEEE_F32LE);
    if (t < 0 || dt == TKD_CACHE_DTYPE_FLOAT32)
        return t;
    int half = dt == TKD_CACHE_DTYPE_HALF;
    /* sign bit 15; exponent at 10 (5 bits) or 7 (8 bits); mantissa at 0, 10 or 7 bits */
    if (H5Tset_fields(t, 15, half ? 10 : 7, half ? 5 : 8, 0, half ? 10 : 7) < 0 ||
        H5Tset_size(t, 2) < 0 || H5Tset_precision(t, 16) < 0 ||
        H5Tset_ebias(t, half ? 15 : 127) < 0) {
        H5Tclose(t);
        return -1;
    }
    return t;
}

/* Which of our three dtypes an HDF5 float type is; -1 if none. */
static int logits_dtype_of(hid_t t)
{
    if (H5Tget_class(t) != H5T_FLOAT || H5Tget_order(t) != H5T_ORDER_LE)
        return -1;
    size_t size = H5Tget_size(t), spos, epos, esize, mpos, msize;
    if (H5Tget_fields(t, &spos, &epos, &esize, &mpos, &msize) < 0)
        return -1;
    if (size == 4 && esize == 8 && msize == 23)
        return TKD_CACHE_DTYPE_FLOAT32;
    if (size == 2 && spos == 15 && epos == 10 && esize == 5 && mpos == 0 && msize == 10 &&
        H5Tget_ebias(t) == 15)
        return TKD_CACHE_DTYPE_HALF;
    if (size == 2 && spos == 15 && epos == 7 && esize == 8 && mpos == 0 && msize == 7 &&
        H5Tget_ebias(t) == 127)
        return TKD_CACHE_DTYPE_BFLOAT16;
    return -1;
}

/* File type, native memory type, rank and per-sequence dims of dataset d. */
typedef struct ds_shape {
    int rank;
    hsize_t row[2]; /* dims after the sequence axis */
} ds_shape;

static ds_shape shape_of(int d, const tkd_cache_identity *id)
{
    ds_shape s = {1, {0, 0}};
    hsize_t t = (hsize_t)id->seq_len;
    switch (d) {
    case DS_TOKENS: s = (ds_shape){2, {t + 1, 0}}; break;
    case DS_INDICES:
    case DS_LOGITS: s = (ds_shape){3, {t, (hsize_t)id->k}}; break;
    case DS_LSE: s = (ds_shape){2, {t, 0}}; break;
    case DS_SEQ_INDEX: break;
    case DS_TAIL: s = (ds_shape){3, {t, (hsize_t)id->tail_samples}}; break;
    }
    return s;
}

static hid_t file_type_of(int d, tkd_cache_dtype dt)
{
    switch (d) {
    case DS_TOKENS: return H5Tcopy(H5T_STD_I32LE);
    case DS_INDICES:
    case DS_TAIL: return H5Tcopy(H5T_STD_U32LE);
    case DS_LOGITS: return logits_file_type(dt);
    case DS_LSE: return H5Tcopy(H5T_IEEE_F32LE);
    default: return H5Tcopy(H5T_STD_I64LE);
    }
}

/* Bytes per element of dataset d in the file (what shuffle transposes by). */
static size_t file_elem_size(int d, tkd_cache_dtype dt)
{
    return d == DS_LOGITS ? tkd_cache_dtype_size(dt) : d == DS_SEQ_INDEX ? 8 : 4;
}

static hid_t mem_type_of(int d)
{
    switch (d) {
    case DS_TOKENS: return H5T_NATIVE_INT32;
    case DS_INDICES:
    case DS_TAIL: return H5T_NATIVE_UINT32;
    case DS_LOGITS:
    case DS_LSE: return H5T_NATIVE_FLOAT;
    default: return H5T_NATIVE_INT64;
    }
}

static size_t row_elems(const ds_shape *s)
{
    size_t n = 1;
    for (int i = 0; i + 1 < s->rank; i++)
        n *= (size_t)s->row[i];
    return n;
}

int64_t tkd_shard_default_chunk_seqs(const tkd_cache_identity *id)
{
    /* About 1 MiB for the widest dataset: big enough for zstd to find redundancy, small enough that
     * random access decompresses little, and a few sequences at real sizes (T=1024, k=100: 2). */
    int32_t width = id->k > id->tail_samples ? id->k : id->tail_samples;
    size_t per_seq = (size_t)id->seq_len * (size_t)width * 4;
    int64_t c = (int64_t)((1u << 20) / (per_seq ? per_seq : 1));
    return c < 1 ? 1 : c > 64 ? 64 : c;
}

/* ---- attributes ----------------------------------------------------------------------------- */

static herr_t attr_write(hid_t loc, const char *name, hid_t ftype, hid_t mtype, const void *v)
{
    hid_t sp = H5Screate(H5S_SCALAR);
    hid_t a = sp < 0 ? -1 : H5Acreate2(loc, name, ftype, sp, H5P_DEFAULT, H5P_DEFAULT);
    herr_t r = a < 0 ? -1 : H5Awrite(a, mtype, v);
    if (a >= 0)
        H5Aclose(a);
    if (sp >= 0)
        H5Sclose(sp);
    return r;
}

static herr_t attr_write_str(hid_t loc, const char *name, const char *v)
{
    hid_t t = H5Tcopy(H5T_C_S1);
    if (t < 0 || H5Tset_size(t, strlen(v) + 1) < 0 || H5Tset_strpad(t, H5T_STR_NULLTERM) < 0) {
        H5Tclose(t);
        return -1;
    }
    herr_t r = attr_write(loc, name, t, t, v);
    H5Tclose(t);
    return r;
}

static herr_t attr_write_i64(hid_t loc, const char *name, int64_t v)
{
    return attr_write(loc, name, H5T_STD_I64LE, H5T_NATIVE_INT64, &v);
}

static herr_t attr_write_i32(hid_t loc, const char *name, int32_t v)
{
    return attr_write(loc, name, H5T_STD_I32LE, H5T_NATIVE_INT32, &v);
}

/* Reads a scalar numeric attribute converted to mtype. 1 = ok, 0 = missing, -1 = HDF5 error. */
static int attr_read(hid_t loc, const char *name, hid_t mtype, void *v)
{
    htri_t ex = H5Aexists(loc, name);
    if (ex <= 0)
        return ex < 0 ? -1 : 0;
    hid_t a = H5Aopen(loc, name, H5P_DEFAULT);
    hid_t sp = a < 0 ? -1 : H5Aget_space(a);
    int ok = sp >= 0 && H5Sget_simple_extent_npoints(sp) == 1 && H5Aread(a, mtype, v) >= 0;
    if (sp >= 0)
        H5Sclose(sp);
    if (a >= 0)
        H5Aclose(a);
    return ok ? 1 : -1;
}

/* Reads a fixed-length string attribute into buf (NUL-terminated, truncated to cap). */
static int attr_read_str(hid_t loc, const char *name, char *buf, size_t cap)
{
    htri_t ex = H5Aexists(loc, name);
    if (ex <= 0)
        return ex < 0 ? -1 : 0;
    hid_t a = H5Aopen(loc, name, H5P_DEFAULT);
    hid_t ft = a < 0 ? -1 : H5Aget_type(a);
    int ok = -1;
    if (ft >= 0 && H5Tget_class(ft) == H5T_STRING && !H5Tis_variable_str(ft)) {
        size_t n = H5Tget_size(ft);
        char *tmp = calloc(n + 1, 1);
        hid_t mt = H5Tcopy(ft);
        if (tmp && mt >= 0 && H5Aread(a, mt, tmp) >= 0) {
            snprintf(buf, cap, "%s", tmp);
            ok = 1;
        }
        if (mt >= 0)
            H5Tclose(mt);
        free(tmp);
    }
    if (ft >= 0)
        H5Tclose(ft);
    if (a >= 0)
        H5Aclose(a);
    return ok;
}

static herr_t write_root_attrs(hid_t f, const tkd_cache_identity *id, int64_t first_seq,
                               uint64_t tail_seed)
{
    herr_t r = 0;
    r |= attr_write_str(f, "format", TKD_CACHE_FORMAT_NAME);
    r |= attr_write_i32(f, "version", TKD_CACHE_FORMAT_VERSION);
    r |= attr_write_i64(f, "vocab_size", id->vocab_size);
    r |= attr_write_i32(f, "k", id->k);
    r |= attr_write_i32(f, "seq_len", id->seq_len);
    r |= attr_write(f, "temperature", H5T_IEEE_F32LE, H5T_NATIVE_FLOAT, &id->temperature);
    r |= attr_write_str(f, "teacher_sha256", id->teacher_sha256);
    r |= attr_write_str(f, "dataset_sha256", id->dataset_sha256);
    r |= attr_write_str(f, "logits_dtype", tkd_cache_dtype_name(id->logits_dtype));
    r |= attr_write_i32(f, "tail_samples", id->tail_samples);
    r |= attr_write_i64(f, "first_seq", first_seq);
    if (id->tail_samples > 0)
        r |= attr_write(f, "tail_seed", H5T_STD_U64LE, H5T_NATIVE_UINT64, &tail_seed);
    return r < 0 ? -1 : 0;
}

/* ---- writer --------------------------------------------------------------------------------- */

struct tkd_shard_writer {
    char *path;     /* final name */
    char *tmp_path; /* "<path>.tmp" while writing */
    tkd_cache_identity id;
    int64_t first_seq, num_seq, chunk_seqs;
    hid_t file;
    hid_t ds[DS_COUNT];
    uint16_t *scratch; /* logits converted to 16 bits; grows to the largest batch */
    size_t scratch_cap;
    int threads;              /* filtering threads (tkd_shard_writer_threads) */
    tkd_shard_chunks *chunks; /* the parallel filter; NULL on the H5Dwrite path */
};

static hid_t writer_create_dataset(tkd_shard_writer *w, int d, int level)
{
    ds_shape s = shape_of(d, &w->id);
    hsize_t dims[3] = {0, s.row[0], s.row[1]};
    hsize_t maxdims[3] = {H5S_UNLIMITED, s.row[0], s.row[1]};
    hsize_t chunk[3] = {(hsize_t)w->chunk_seqs, s.row[0], s.row[1]};
    unsigned cd = (unsigned)level;
    hid_t sp = H5Screate_simple(s.rank, dims, maxdims);
    hid_t dcpl = H5Pcreate(H5P_DATASET_CREATE);
    hid_t dapl = H5Pcreate(H5P_DATASET_ACCESS);
    hid_t lcpl = H5Pcreate(H5P_LINK_CREATE);
    hid_t ft = file_type_of(d, w->id.logits_dtype);
    size_t chunk_bytes = (size_t)w->chunk_seqs * row_elems(&s) * 8;
    hid_t ds = -1;
    /* Filter order is the order of these calls: shuffle, zstd (mandatory), fletcher32. A chunk
     * cache of two chunks keeps a partly filled chunk in memory between appends. */
    if (sp >= 0 && dcpl >= 0 && dapl >= 0 && lcpl >= 0 && ft >= 0 &&
        H5Pset_chunk(dcpl, s.rank, chunk) >= 0 && H5Pset_shuffle(dcpl) >= 0 &&
        H5Pset_filter(dcpl, TKD_H5ZSTD_FILTER_ID, H5Z_FLAG_MANDATORY, 1, &cd) >= 0 &&
        H5Pset_fletcher32(dcpl) >= 0 && H5Pset_create_intermediate_group(lcpl, 1) >= 0 &&
        H5Pset_chunk_cache(dapl, 521, 2 * chunk_bytes + (1u << 20), 1.0) >= 0)
        ds = H5Dcreate2(w->file, ds_names[d], ft, sp, lcpl, dcpl, dapl);
    H5Tclose(ft);
    H5Pclose(lcpl);
    H5Pclose(dapl);
    H5Pclose(dcpl);
    H5Sclose(sp);
    return ds;
}

/* The file is being thrown away: its descriptor is pointed at an anonymous in-memory file, so the
 * writes HDF5 still makes while closing cannot fail on a full disk. That matters because HDF5 1.10
 * frees a file whose close failed but keeps its ID, and then crashes (or spins) at exit. */
static void writer_discard_io(tkd_shard_writer *w)
{
    void *handle = NULL;
    if (w->file < 0 || H5Fget_vfd_handle(w->file, H5P_DEFAULT, &handle) < 0 || !handle) {
        h5_forget();
        return;
    }
    int mfd = memfd_create("topkd-discarded-shard", MFD_CLOEXEC);
    if (mfd >= 0) {
        dup2(mfd, *(int *)handle);
        close(mfd);
    }
}

static void writer_free(tkd_shard_writer *w)
{
    for (int d = 0; d < DS_COUNT; d++)
        if (w->ds[d] >= 0)
            H5Dclose(w->ds[d]);
    if (w->file >= 0)
        H5Fclose(w->file);
    h5_forget();
    tkd_shard_chunks_free(w->chunks);
    free(w->scratch);
    free(w->path);
    free(w->tmp_path);
    free(w);
}

/* H5Fcreate writes the superblock at once, and a create that fails on a full disk leaves HDF5 1.10
 * unable to shut down (it spins at exit); so a directory with less than this free is refused before
 * HDF5 sees it. Later writes are cached and meet a full disk at flush time, which is handled. */
#define SHARD_MIN_FREE_BYTES (16u << 10)

static tkd_status check_room(const char *tmp_path)
{
    char dir[4096];
    const char *slash = strrchr(tmp_path, '/');
    snprintf(dir, sizeof dir, "%.*s", slash ? (int)(slash - tmp_path) + 1 : 1, slash ? tmp_path : ".");
    struct statvfs sv;
    if (statvfs(dir, &sv) != 0) /* the create will report whatever is wrong with the directory */
        return TKD_OK;
    unsigned long long avail = (unsigned long long)sv.f_bavail * (unsigned long long)sv.f_frsize;
    if (avail < SHARD_MIN_FREE_BYTES)
        return tkd_error_set(TKD_ERR_NOSPACE, "%s: disk full (%llu bytes free) — free disk space and re-run",
                             tmp_path, avail);
    return TKD_OK;
}

int tkd_shard_writer_threads(int requested)
{
    if (requested > 0)
        return requested;
    int cores = omp_get_num_procs(); /* the CPUs of this process's affinity mask */
    int n = cores - 1 < 8 ? cores - 1 : 8;
    return n < 1 ? 1 : n;
}

/* The parallel filter for the datasets this shard has, one chunk of chunk_seqs sequences each. */
static tkd_status writer_start_chunks(tkd_shard_writer *w, int level)
{
    tkd_shard_chunk_stream streams[DS_COUNT];
    for (int d = 0; d < DS_COUNT; d++) {
        ds_shape s = shape_of(d, &w->id);
        size_t elem = file_elem_size(d, w->id.logits_dtype);
        streams[d] = (tkd_shard_chunk_stream){w->ds[d] < 0 ? 0 : row_elems(&s) * elem, elem};
    }
    tkd_status st = tkd_shard_chunks_create(&w->chunks, streams, DS_COUNT, w->chunk_seqs, level, w->threads);
    return st == TKD_OK ? st : tkd_error_prefix(st, "%s", w->tmp_path);
}

tkd_status tkd_shard_writer_open(tkd_shard_writer **out, const char *path,
                                 const tkd_cache_identity *id, int64_t first_seq,
                                 const tkd_shard_writer_opts *opts)
{
    *out = NULL;
    TKD_TRY(tkd_h5zstd_register());
    h5_quiet();
    TKD_TRY(tkd_cache_identity_check(id, path));
    tkd_shard_writer_opts o = opts ? *opts : (tkd_shard_writer_opts){0, 0, 0, 0, 0};
    if (o.zstd_level < 0 || o.zstd_level > 22 || o.chunk_seqs < 0 || first_seq < 0 || o.threads < 0 ||
        o.threads > TKD_SHARD_WRITER_MAX_THREADS)
        return tkd_error_set(TKD_ERR_INVALID_ARG,
                             "%s: zstd level %d (1..22), chunk_seqs %lld, first_seq %lld, threads %d (0..%d)",
                             path, o.zstd_level, (long long)o.chunk_seqs, (long long)first_seq, o.threads,
                             TKD_SHARD_WRITER_MAX_THREADS);
    tkd_shard_writer *w = calloc(1, sizeof *w);
    if (!w)
        return tkd_error_set(TKD_ERR_NOMEM, "%s: out of memory", path);
    w->file = -1;
    for (int d = 0; d < DS_COUNT; d++)
        w->ds[d] = -1;
    w->id = *id;
    w->first_seq = first_seq;
    w->chunk_seqs = o.chunk_seqs ? o.chunk_seqs : tkd_shard_default_chunk_seqs(id);
    w->threads = tkd_shard_writer_threads(o.threads);
    w->path = strdup(path);
    w->tmp_path = malloc(strlen(path) + 5);
    if (!w->path || !w->tmp_path) {
        writer_free(w);
        return tkd_error_set(TKD_ERR_NOMEM, "%s: out of memory", path);
    }
    sprintf(w->tmp_path, "%s.tmp", path);
    tkd_status room = check_room(w->tmp_path);
    if (room != TKD_OK) {
        writer_free(w);
        return room;
    }
    hid_t fapl = H5Pcreate(H5P_FILE_ACCESS);
    if (fapl >= 0)
        H5Pset_fclose_degree(fapl, H5F_CLOSE_STRONG);
    w->file = H5Fcreate(w->tmp_path, H5F_ACC_TRUNC, H5P_DEFAULT, fapl);
    H5Pclose(fapl);
    if (w->file < 0) {
        tkd_status st = h5_fail_open(TKD_ERR_IO, w->tmp_path, "cannot create shard");
        writer_free(w);
        return st;
    }
    int level = o.zstd_level ? o.zstd_level : TKD_H5ZSTD_DEFAULT_LEVEL;
    for (int d = 0; d < DS_COUNT; d++) {
        if (d == DS_TAIL && id->tail_samples == 0)
            continue;
        w->ds[d] = writer_create_dataset(w, d, level);
        if (w->ds[d] < 0) {
            tkd_status st = h5_fail(TKD_ERR_IO, "%s: cannot create dataset %s", w->tmp_path, ds_names[d]);
            tkd_shard_writer_abort(w);
            return st;
        }
    }
    if (write_root_attrs(w->file, id, first_seq, o.tail_seed) < 0) {
        tkd_status st = h5_fail(TKD_ERR_IO, "%s: cannot write root attributes", w->tmp_path);
        tkd_shard_writer_abort(w);
        return st;
    }
    /* the chunks we filter are little-endian file bytes taken straight from native buffers */
    int native_le = __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__;
    tkd_status st = o.h5dwrite || !native_le ? TKD_OK : writer_start_chunks(w, level);
    if (st != TKD_OK) {
        tkd_shard_writer_abort(w);
        return st;
    }
    *out = w;
    return TKD_OK;
}

/* Transfers the block [start, start + count) of dataset ds through a memory space of that shape:
 * writes wbuf when it is not NULL, else reads into rbuf. The writer and the reader share it so the
 * dataspace handling (and its cleanup on every path) lives in one place. */
static herr_t slab_io(hid_t ds, hid_t mtype, int rank, const hsize_t *start, const hsize_t *count, void *rbuf,
                      const void *wbuf)
{
    hid_t fs = H5Dget_space(ds);
    hid_t ms = H5Screate_simple(rank, count, NULL);
    herr_t r = -1;
    if (fs >= 0 && ms >= 0 && H5Sselect_hyperslab(fs, H5S_SELECT_SET, start, NULL, count, NULL) >= 0)
        r = wbuf ? H5Dwrite(ds, mtype, ms, fs, H5P_DEFAULT, wbuf) : H5Dread(ds, mtype, ms, fs, H5P_DEFAULT, rbuf);
    if (ms >= 0)
        H5Sclose(ms);
    if (fs >= 0)
        H5Sclose(fs);
    return r;
}

/* Extends dataset d by n sequences and writes buf (n whole rows, already in file layout). */
static herr_t writer_put(tkd_shard_writer *w, int d, int64_t n, hid_t mtype, const void *buf)
{
    ds_shape s = shape_of(d, &w->id);
    hsize_t dims[3] = {(hsize_t)(w->num_seq + n), s.row[0], s.row[1]};
    hsize_t start[3] = {(hsize_t)w->num_seq, 0, 0};
    hsize_t count[3] = {(hsize_t)n, s.row[0], s.row[1]};
    if (H5Dset_extent(w->ds[d], dims) < 0)
        return -1;
    return slab_io(w->ds[d], mtype, s.rank, start, count, NULL, buf);
}

/* Converts logits to the file dtype. Returns the buffer to write and its memory type (the file's
 * own type for 16-bit dtypes, so HDF5 copies bytes without its slow soft conversion). */
static tkd_status writer_logits(tkd_shard_writer *w, const tkd_cache_batch *b, const void **buf)
{
    size_t n = (size_t)b->num_seq * (size_t)b->seq_len * (size_t)b->k;
    if (w->id.logits_dtype == TKD_CACHE_DTYPE_FLOAT32) {
        *buf = b->topk_logits;
        return TKD_OK;
    }
    if (n > w->scratch_cap) {
        uint16_t *p = realloc(w->scratch, n * sizeof *p);
        if (!p)
            return tkd_error_set(TKD_ERR_NOMEM, "%s: out of memory converting logits", w->path);
        w->scratch = p;
        w->scratch_cap = n;
    }
    int half = w->id.logits_dtype == TKD_CACHE_DTYPE_HALF;
#pragma omp parallel for schedule(static) num_threads(w->threads) if (w->threads > 1 && n >= (1u << 16))
    for (size_t i = 0; i < n; i++)
        w->scratch[i] = half ? tkd_f32_to_f16(b->topk_logits[i]) : tkd_f32_to_bf16(b->topk_logits[i]);
    *buf = w->scratch;
    return TKD_OK;
}

/* Writes the chunks the parallel filter finished, as they are (filter mask 0: all filters applied). */
static tkd_status writer_write_chunks(tkd_shard_writer *w)
{
    const tkd_shard_chunk *ch;
    size_t n = tkd_shard_chunks_ready(w->chunks, &ch);
    for (size_t i = 0; i < n; i++) {
        hsize_t offset[3] = {(hsize_t)ch[i].first_row, 0, 0};
        if (H5Dwrite_chunk(w->ds[ch[i].stream], H5P_DEFAULT, 0, offset, ch[i].size, ch[i].data) < 0)
            return h5_fail(TKD_ERR_IO, "%s: writing %s, the chunk from sequence %lld, failed", w->tmp_path,
                           ds_names[ch[i].stream], (long long)(w->first_seq + ch[i].first_row));
    }
    return TKD_OK;
}

/* The parallel path of an append: every dataset grows by n sequences, the chunks they complete are
 * filtered on the writer's threads and written; a partial chunk waits for the next append. */
static tkd_status writer_put_chunks(tkd_shard_writer *w, int64_t n, const void *const *bufs)
{
    for (int d = 0; d < DS_COUNT; d++) {
        ds_shape s = shape_of(d, &w->id);
        hsize_t dims[3] = {(hsize_t)(w->num_seq + n), s.row[0], s.row[1]};
        if (w->ds[d] >= 0 && H5Dset_extent(w->ds[d], dims) < 0)
            return h5_fail(TKD_ERR_IO, "%s: extending %s to %lld sequences failed", w->tmp_path, ds_names[d],
                           (long long)(w->num_seq + n));
    }
    tkd_status st = tkd_shard_chunks_add(w->chunks, n, bufs);
    if (st != TKD_OK)
        return tkd_error_prefix(st, "%s", w->tmp_path);
    return writer_write_chunks(w);
}

tkd_status tkd_shard_writer_append(tkd_shard_writer *w, const tkd_cache_batch *b)
{
    h5_quiet();
    if (b->num_seq < 0 || b->seq_len != w->id.seq_len || b->k != w->id.k ||
        b->tail_samples != w->id.tail_samples || (w->id.tail_samples > 0 && !b->tail_indices) ||
        !b->tokens || !b->topk_indices || !b->topk_logits || !b->lse || !b->seq_index)
        return tkd_error_set(TKD_ERR_INVALID_ARG,
                             "%s: batch shape (T %d, k %d, S %d) does not match the shard (T %d, k %d, S %d) or a buffer is NULL",
                             w->path, b->seq_len, b->k, b->tail_samples, w->id.seq_len, w->id.k,
                             w->id.tail_samples);
    if (b->num_seq == 0)
        return TKD_OK;
    const void *logits = NULL;
    TKD_TRY(writer_logits(w, b, &logits));
    const void *bufs[DS_COUNT] = {b->tokens, b->topk_indices, logits, b->lse, b->seq_index,
                                  b->tail_indices};
    if (w->chunks) {
        TKD_TRY(writer_put_chunks(w, b->num_seq, bufs));
        w->num_seq += b->num_seq;
        return TKD_OK;
    }
    for (int d = 0; d < DS_COUNT; d++) {
        if (w->ds[d] < 0)
            continue;
        hid_t mt = mem_type_of(d), owned = -1;
        if (d == DS_LOGITS && w->id.logits_dtype != TKD_CACHE_DTYPE_FLOAT32)
            mt = owned = logits_file_type(w->id.logits_dtype);
        herr_t r = writer_put(w, d, b->num_seq, mt, bufs[d]);
        if (owned >= 0)
            H5Tclose(owned);
        if (r < 0)
            return h5_fail(TKD_ERR_IO, "%s: writing %s for sequences %lld..%lld failed", w->tmp_path,
                           ds_names[d], (long long)(w->first_seq + w->num_seq),
                           (long long)(w->first_seq + w->num_seq + b->num_seq - 1));
    }
    w->num_seq += b->num_seq;
    return TKD_OK;
}

int64_t tkd_shard_writer_num_seq(const tkd_shard_writer *w) { return w->num_seq; }

void tkd_shard_writer_abort(tkd_shard_writer *w)
{
    if (!w)
        return;
    h5_quiet(); /* as in tkd_shard_close */
    char *tmp = w->tmp_path;
    w->tmp_path = NULL;
    writer_discard_io(w);
    writer_free(w);
    if (tmp)
        unlink(tmp);
    free(tmp);
}

/* Reserves the disk blocks the final H5Fflush writes to, so that a full disk is met here and not
 * in the flush's metadata phase: HDF5 1.10.8 cannot close a file whose metadata flush failed (its
 * close stops at "slist already enabled?", frees the file but keeps its ID, and the process crashes
 * at exit). That phase is where a full disk strikes when the raw chunks are already written, as on
 * the parallel path. All that the flush writes lies below the end of allocation (EOA; it does not
 * grow while flushing), so [0, EOA) is reserved, holes included, without changing the file size (the
 * flush may give back a few KB of EOA: those stay reserved past the end of the file). Best effort: a
 * filesystem that cannot reserve leaves it to the flush to report. */
static tkd_status writer_reserve_flush_room(tkd_shard_writer *w)
{
    hsize_t eoa = 0;
    void *handle = NULL;
    if (H5Fget_filesize(w->file, &eoa) < 0 || H5Fget_vfd_handle(w->file, H5P_DEFAULT, &handle) < 0 || !handle) {
        h5_forget();
        return TKD_OK;
    }
    if (eoa == 0 || fallocate(*(int *)handle, FALLOC_FL_KEEP_SIZE, 0, (off_t)eoa) == 0)
        return TKD_OK;
    if (errno == ENOSPC || errno == EDQUOT)
        return tkd_error_set(TKD_ERR_NOSPACE,
                             "%s: writing the shard failed: disk full (No space left on device) — free disk space and re-run",
                             w->tmp_path);
    return TKD_OK;
}

/* Closes the HDF5 file after recording num_seq. Everything is flushed first with the file still
 * open: a flush that fails (disk full) leaves it to tkd_shard_writer_abort, which can close it
 * safely; a failed H5Fclose could not be undone. */
static tkd_status writer_close_file(tkd_shard_writer *w)
{
    if (w->chunks) { /* the last chunk, padded with zeros as HDF5 fills an edge chunk */
        tkd_status st = tkd_shard_chunks_flush(w->chunks);
        TKD_TRY(st == TKD_OK ? writer_write_chunks(w) : tkd_error_prefix(st, "%s", w->tmp_path));
    }
    if (attr_write_i64(w->file, "num_seq", w->num_seq) < 0)
        return h5_fail(TKD_ERR_IO, "%s: writing the shard failed", w->tmp_path);
    TKD_TRY(writer_reserve_flush_room(w));
    if (H5Fflush(w->file, H5F_SCOPE_LOCAL) < 0)
        return h5_fail(TKD_ERR_IO, "%s: writing the shard failed", w->tmp_path);
    herr_t r = 0;
    for (int d = 0; d < DS_COUNT; d++) {
        if (w->ds[d] >= 0 && H5Dclose(w->ds[d]) < 0)
            r = -1;
        w->ds[d] = -1;
    }
    if (H5Fclose(w->file) < 0)
        r = -1;
    w->file = -1;
    if (r < 0)
        return h5_fail(TKD_ERR_IO, "%s: closing the shard failed", w->tmp_path);
    return TKD_OK;
}

tkd_status tkd_shard_writer_finish(tkd_shard_writer *w, tkd_cache_shard_entry *entry)
{
    h5_quiet();
    tkd_status st = writer_close_file(w);
    if (st == TKD_OK)
        st = tkd_fsync_file(w->tmp_path);
    tkd_cache_shard_entry e;
    memset(&e, 0, sizeof e);
    if (st == TKD_OK)
        st = tkd_file_size(w->tmp_path, &e.bytes);
    if (st == TKD_OK)
        st = tkd_sha256_file_hex(w->tmp_path, e.sha256);
    if (st == TKD_OK)
        st = tkd_rename_durable(w->tmp_path, w->path);
    if (st != TKD_OK) {
        tkd_shard_writer_abort(w);
        return st;
    }
    const char *base = strrchr(w->path, '/');
    snprintf(e.file, sizeof e.file, "%s", base ? base + 1 : w->path);
    e.first_seq = w->first_seq;
    e.num_seq = w->num_seq;
    if (entry)
        *entry = e;
    writer_free(w);
    return TKD_OK;
}

/* ---- reader --------------------------------------------------------------------------------- */

struct tkd_shard {
    char *path;
    hid_t file;
    hid_t ds[DS_COUNT];
    hid_t logits_mtype; /* memory type for raw logits reads (the file's own type) */
    tkd_shard_info info;
};

void tkd_shard_close(tkd_shard *s)
{
    if (!s)
        return;
    h5_quiet(); /* may run on a thread that made no other call here: HDF5 must not print there either */
    for (int d = 0; d < DS_COUNT; d++)
        if (s->ds[d] >= 0)
            H5Dclose(s->ds[d]);
    if (s->logits_mtype >= 0)
        H5Tclose(s->logits_mtype);
    if (s->file >= 0)
        H5Fclose(s->file);
    h5_forget();
    free(s->path);
    free(s);
}

const tkd_shard_info *tkd_shard_get_info(const tkd_shard *s) { return &s->info; }

/* One attribute read: attr_read's result (1 read, 0 missing, < 0 HDF5 failure). */
typedef struct attr_got {
    const char *name;
    int r;
} attr_got;

/* The first attribute of got[0..n) that is missing or unreadable, as a format error. */
static tkd_status attrs_check(const tkd_shard *s, const attr_got *got, size_t n, const char *missing_hint)
{
    for (size_t i = 0; i < n; i++) {
        if (got[i].r == 0)
            return tkd_error_set(TKD_ERR_FORMAT, "%s: root attribute '%s' missing — %s", s->path, got[i].name,
                                 missing_hint);
        if (got[i].r < 0)
            return h5_fail(TKD_ERR_FORMAT, "%s: root attribute '%s' unreadable", s->path, got[i].name);
    }
    return TKD_OK;
}

/* Reads the root attributes; missing ones are a format error naming the attribute. */
static tkd_status shard_read_attrs(tkd_shard *s)
{
    char fmt[64] = "", dtype[32] = "";
    tkd_shard_info *in = &s->info;
    tkd_cache_identity *id = &in->id;
    int64_t vocab = 0, k = 0, seq_len = 0, S = 0, version = 0;
    attr_got got[] = {
        {"format", attr_read_str(s->file, "format", fmt, sizeof fmt)},
        {"version", attr_read(s->file, "version", H5T_NATIVE_INT64, &version)},
    };
    TKD_TRY(attrs_check(s, got, sizeof got / sizeof got[0], "not a topkd cache shard"));
    if (strcmp(fmt, TKD_CACHE_FORMAT_NAME) != 0)
        return tkd_error_set(TKD_ERR_FORMAT, "%s: format is '%s', expected '%s'", s->path, fmt,
                             TKD_CACHE_FORMAT_NAME);
    if (version != TKD_CACHE_FORMAT_VERSION)
        return tkd_error_set(TKD_ERR_UNSUPPORTED,
                             "%s: cache format version %lld, this build reads version %d — use a matching topkd or re-create the cache",
                             s->path, (long long)version, TKD_CACHE_FORMAT_VERSION);
    in->version = (int32_t)version;
    attr_got rest[] = {
        {"vocab_size", attr_read(s->file, "vocab_size", H5T_NATIVE_INT64, &vocab)},
        {"k", attr_read(s->file, "k", H5T_NATIVE_INT64, &k)},
        {"seq_len", attr_read(s->file, "seq_len", H5T_NATIVE_INT64, &seq_len)},
        {"temperature", attr_read(s->file, "temperature", H5T_NATIVE_FLOAT, &id->temperature)},
        {"teacher_sha256", attr_read_str(s->file, "teacher_sha256", id->teacher_sha256, TKD_CACHE_SHA256_HEX)},
        {"dataset_sha256", attr_read_str(s->file, "dataset_sha256", id->dataset_sha256, TKD_CACHE_SHA256_HEX)},
        {"logits_dtype", attr_read_str(s->file, "logits_dtype", dtype, sizeof dtype)},
        {"first_seq", attr_read(s->file, "first_seq", H5T_NATIVE_INT64, &in->first_seq)},
        {"num_seq", attr_read(s->file, "num_seq", H5T_NATIVE_INT64, &in->num_seq)},
    };
    TKD_TRY(attrs_check(s, rest, sizeof rest / sizeof rest[0], "not a complete topkd cache shard"));
    /* tail_samples came with the tail draws: a shard without it has no /tail group (S = 0) */
    if (attr_read(s->file, "tail_samples", H5T_NATIVE_INT64, &S) < 0)
        return h5_fail(TKD_ERR_FORMAT, "%s: root attribute 'tail_samples' unreadable", s->path);
    if (k > INT32_MAX || seq_len > INT32_MAX || S > INT32_MAX || k < 0 || seq_len < 0 || S < 0)
        return tkd_error_set(TKD_ERR_FORMAT, "%s: k %lld / seq_len %lld / tail_samples %lld out of range",
                             s->path, (long long)k, (long long)seq_len, (long long)S);
    id->vocab_size = vocab;
    id->k = (int32_t)k;
    id->seq_len = (int32_t)seq_len;
    id->tail_samples = (int32_t)S;
    if (tkd_cache_dtype_parse(dtype, &id->logits_dtype) != TKD_OK)
        return tkd_error_set(TKD_ERR_FORMAT, "%s: root attribute logits_dtype '%s' is not half, bfloat16 or float32",
                             s->path, dtype);
    TKD_TRY(tkd_cache_identity_check(id, s->path));
    /* sequence numbers first_seq .. first_seq + num_seq must be representable (found by fuzz_shard) */
    if (in->first_seq < 0 || in->num_seq < 0 || in->num_seq > INT64_MAX - in->first_seq)
        return tkd_error_set(TKD_ERR_FORMAT, "%s: first_seq %lld / num_seq %lld negative or past 2^63", s->path,
                             (long long)in->first_seq, (long long)in->num_seq);
    return TKD_OK;
}

static tkd_status shard_check_dataset_type(tkd_shard *s, int d, hid_t ft)
{
    if (d == DS_LOGITS) {
        int dt = logits_dtype_of(ft);
        if (dt != (int)s->info.id.logits_dtype)
            return tkd_error_set(TKD_ERR_FORMAT, "%s: %s has an HDF5 type that is not the %s the attributes announce",
                                 s->path, ds_names[d], tkd_cache_dtype_name(s->info.id.logits_dtype));
        s->logits_mtype = H5Tcopy(ft);
        return TKD_OK;
    }
    hid_t want = file_type_of(d, s->info.id.logits_dtype);
    htri_t eq = H5Tequal(ft, want);
    H5Tclose(want);
    if (eq <= 0)
        return tkd_error_set(TKD_ERR_FORMAT, "%s: %s has the wrong element type (see docs/cache-format.md)",
                             s->path, ds_names[d]);
    return TKD_OK;
}

/* Opens dataset d and checks its type and shape [num_seq, row...]. */
static tkd_status shard_open_dataset(tkd_shard *s, int d, size_t cache_bytes)
{
    const char *group = d == DS_INDICES || d == DS_LOGITS ? "/topk" : d == DS_TAIL ? "/tail" : NULL;
    if ((group && H5Lexists(s->file, group, H5P_DEFAULT) <= 0) ||
        H5Lexists(s->file, ds_names[d], H5P_DEFAULT) <= 0) {
        h5_forget();
        return tkd_error_set(TKD_ERR_NOT_FOUND, "%s: dataset %s missing — the shard is incomplete or not a topkd cache",
                             s->path, ds_names[d]);
    }
    ds_shape sh = shape_of(d, &s->info.id);
    size_t one_chunk = (size_t)s->info.chunk_seqs * row_elems(&sh) * 4;
    hid_t dapl = H5Pcreate(H5P_DATASET_ACCESS);
    if (dapl >= 0)
        H5Pset_chunk_cache(dapl, 521, cache_bytes ? cache_bytes : one_chunk + 4096, 1.0);
    s->ds[d] = H5Dopen2(s->file, ds_names[d], dapl);
    H5Pclose(dapl);
    if (s->ds[d] < 0)
        return h5_fail(TKD_ERR_FORMAT, "%s: cannot open dataset %s", s->path, ds_names[d]);
    hid_t ft = H5Dget_type(s->ds[d]);
    hid_t sp = H5Dget_space(s->ds[d]);
    hsize_t dims[4] = {0, 0, 0, 0};
    int rank = sp >= 0 ? H5Sget_simple_extent_ndims(sp) : -1;
    if (rank == sh.rank)
        H5Sget_simple_extent_dims(sp, dims, NULL);
    H5Sclose(sp);
    tkd_status st = ft < 0 ? h5_fail(TKD_ERR_FORMAT, "%s: %s has no type", s->path, ds_names[d])
                           : shard_check_dataset_type(s, d, ft);
    H5Tclose(ft);
    TKD_TRY(st);
    if (rank != sh.rank || dims[0] != (hsize_t)s->info.num_seq || dims[1] != sh.row[0] ||
        (sh.rank == 3 && dims[2] != sh.row[1]))
        return tkd_error_set(TKD_ERR_FORMAT,
                             "%s: %s has shape [%llu, %llu, %llu] (rank %d), expected [%lld, %llu, %llu] (rank %d) from the attributes",
                             s->path, ds_names[d], (unsigned long long)dims[0],
                             (unsigned long long)dims[1], (unsigned long long)dims[2], rank,
                             (long long)s->info.num_seq, (unsigned long long)sh.row[0],
                             (unsigned long long)sh.row[1], sh.rank);
    return TKD_OK;
}

/* Sequences per chunk of /topk/indices (1 for a contiguous layout). */
static int64_t shard_chunk_seqs(hid_t file)
{
    hid_t ds = H5Dopen2(file, "/topk/indices", H5P_DEFAULT);
    hid_t dcpl = ds < 0 ? -1 : H5Dget_create_plist(ds);
    hsize_t chunk[3] = {1, 1, 1};
    if (dcpl >= 0 && H5Pget_layout(dcpl) == H5D_CHUNKED)
        H5Pget_chunk(dcpl, 3, chunk);
    if (dcpl >= 0)
        H5Pclose(dcpl);
    if (ds >= 0)
        H5Dclose(ds);
    h5_forget();
    return (int64_t)chunk[0];
}

bool tkd_shard_has_cache_format(const char *path)
{
    h5_quiet();
    if (tkd_input_check(path, "cache shard") != TKD_OK) /* HDF5 would block on a FIFO */
        return false;
    hid_t f = H5Fopen(path, H5F_ACC_RDONLY, H5P_DEFAULT);
    char fmt[64] = "";
    bool ours = f >= 0 && attr_read_str(f, "format", fmt, sizeof fmt) == 1 && !strcmp(fmt, TKD_CACHE_FORMAT_NAME);
    if (f >= 0)
        H5Fclose(f);
    h5_forget();
    return ours;
}

tkd_status tkd_shard_open(tkd_shard **out, const char *path, size_t cache_bytes)
{
    *out = NULL;
    TKD_TRY(tkd_h5zstd_register());
    h5_quiet();
    /* HDF5 opens the file itself: refuse a FIFO or a device before it can block on one */
    TKD_TRY(tkd_input_check(path, "cache shard"));
    tkd_shard *s = calloc(1, sizeof *s);
    if (!s || !(s->path = strdup(path))) {
        free(s);
        return tkd_error_set(TKD_ERR_NOMEM, "%s: out of memory", path);
    }
    s->logits_mtype = -1;
    for (int d = 0; d < DS_COUNT; d++)
        s->ds[d] = -1;
    hid_t fapl = H5Pcreate(H5P_FILE_ACCESS);
    if (fapl >= 0)
        H5Pset_fclose_degree(fapl, H5F_CLOSE_STRONG);
    s->file = H5Fopen(path, H5F_ACC_RDONLY, fapl);
    H5Pclose(fapl);
    tkd_status st = TKD_OK;
    if (s->file < 0)
        st = h5_fail_open(TKD_ERR_FORMAT, path, "not a readable HDF5 file (truncated or not a shard)");
    if (st == TKD_OK)
        st = shard_read_attrs(s);
    if (st == TKD_OK)
        s->info.chunk_seqs = shard_chunk_seqs(s->file);
    for (int d = 0; st == TKD_OK && d < DS_COUNT; d++)
        if (d != DS_TAIL || s->info.id.tail_samples > 0)
            st = shard_open_dataset(s, d, cache_bytes);
    if (st != TKD_OK) {
        tkd_shard_close(s);
        return st;
    }
    *out = s;
    return TKD_OK;
}

/* Reads [first, first+count) x (the first `cols` columns) of dataset d into buf. */
static herr_t shard_get(tkd_shard *s, int d, int64_t first, int64_t count, hsize_t cols, hid_t mtype,
                        void *buf)
{
    ds_shape sh = shape_of(d, &s->info.id);
    hsize_t start[3] = {(hsize_t)first, 0, 0};
    hsize_t n[3] = {(hsize_t)count, sh.row[0], sh.rank == 3 ? cols : sh.row[1]};
    return slab_io(s->ds[d], mtype, sh.rank, start, n, buf, NULL);
}

/* Widens n 16-bit logits stored at the start of buf into floats in place, from the back, so each
 * source value is read before the float written over it. */
static void widen_logits_inplace(float *buf, size_t n, tkd_cache_dtype dt)
{
    const uint16_t *src = (const uint16_t *)(void *)buf;
    for (size_t i = n; i-- > 0;) {
        uint16_t v = src[i];
        buf[i] = dt == TKD_CACHE_DTYPE_HALF ? tkd_f16_to_f32(v) : tkd_bf16_to_f32(v);
    }
}

tkd_status tkd_shard_read(tkd_shard *s, int64_t first, int64_t count, tkd_cache_batch *b,
                          int64_t slot)
{
    h5_quiet();
    const tkd_cache_identity *id = &s->info.id;
    if (first < 0 || count < 1 || first + count > s->info.num_seq || slot < 0 ||
        slot + count > b->capacity || b->seq_len != id->seq_len || b->k < 1 || b->k > id->k ||
        (b->tail_samples != 0 && b->tail_samples != id->tail_samples))
        return tkd_error_set(TKD_ERR_INVALID_ARG,
                             "%s: read of sequences %lld+%lld (of %lld) into slot %lld of %lld with T %d, k' %d, S %d does not fit the shard (T %d, k %d, S %d)",
                             s->path, (long long)first, (long long)count, (long long)s->info.num_seq,
                             (long long)slot, (long long)b->capacity, b->seq_len, b->k,
                             b->tail_samples, id->seq_len, id->k, id->tail_samples);
    size_t T = (size_t)id->seq_len, kp = (size_t)b->k, sl = (size_t)slot;
    float *logits = b->topk_logits + sl * T * kp;
    int raw16 = id->logits_dtype != TKD_CACHE_DTYPE_FLOAT32;
    void *bufs[DS_COUNT] = {b->tokens + sl * (T + 1), b->topk_indices + sl * T * kp, logits,
                            b->lse + sl * T, b->seq_index + sl,
                            b->tail_indices ? b->tail_indices + sl * T * (size_t)b->tail_samples : NULL};
    for (int d = 0; d < DS_COUNT; d++) {
        if (!bufs[d] || s->ds[d] < 0)
            continue;
        hid_t mt = d == DS_LOGITS && raw16 ? s->logits_mtype : mem_type_of(d);
        if (shard_get(s, d, first, count, d == DS_TAIL ? (hsize_t)b->tail_samples : kp, mt, bufs[d]) < 0)
            return h5_fail(TKD_ERR_IO, "%s: reading %s, sequences %lld..%lld of the shard (cache %lld..%lld) failed",
                           s->path, ds_names[d], (long long)first, (long long)(first + count - 1),
                           (long long)(s->info.first_seq + first),
                           (long long)(s->info.first_seq + first + count - 1));
    }
    if (raw16)
        widen_logits_inplace(logits, (size_t)count * T * kp, id->logits_dtype);
    if (b->cache_seq)
        for (int64_t i = 0; i < count; i++)
            b->cache_seq[slot + i] = s->info.first_seq + first + i;
    return TKD_OK;
}
