/* cache_shard_h5.c — the HDF5 helpers of the shard writer and reader (cache_shard_internal.h):
 * HDF5's error stack turned into one-line tkd_status, the file and memory types and shapes of the
 * datasets, block transfers, and the root attributes.
 */
#include "formats/cache_shard_internal.h"

#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/status.h"

const char *const tkd_shard_ds_names[DS_COUNT] = {
    "/tokens", "/topk/indices", "/topk/logits", "/lse", "/seq_index", "/tail/indices", "/doc_start", "/labels",
};

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
void tkd_shard_h5_quiet(void)
{
    H5Eset_auto2(H5E_DEFAULT, h5_record, NULL);
    h5_have_first = 0;
    errno = 0; /* h5_record reads it: no stale ENOSPC from an earlier call */
}

/* Drops a failure we chose to ignore, so it is not reported by a later tkd_shard_h5_fail. */
void tkd_shard_h5_forget(void)
{
    h5_have_first = 0;
    H5Eclear2(H5E_DEFAULT);
}

/* Turns the first recorded HDF5 failure into a tkd_status: `st` unless a filter reported corrupt
 * data (TKD_ERR_CHECKSUM) or the disk is full (TKD_ERR_NOSPACE). The message is the caller's text
 * followed by HDF5's innermost description. */
tkd_status tkd_shard_h5_fail(tkd_status st, const char *fmt, ...)
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
tkd_status tkd_shard_h5_fail_open(tkd_status st, const char *path, const char *what)
{
    h5err_walk w = {{0}, 0, 0, 0};
    if (h5_have_first)
        w = h5_first;
    else
        H5Ewalk2(H5E_DEFAULT, H5E_WALK_DOWNWARD, h5err_visit, &w);
    if (!w.locked)
        return tkd_shard_h5_fail(st, "%s: %s", path, what);
    tkd_shard_h5_forget();
    return tkd_error_set(TKD_ERR_IO, "%s: locked: another program has this file open (HDF5 file lock) — close it "
                         "there (h5py, HDFView, another teacher-dump or student-train) and re-run; on a file system "
                         "without working locks, set HDF5_USE_FILE_LOCKING=FALSE", path);
}

/* ---- HDF5 types ----------------------------------------------------------------------------- */

/* The file type of /topk/logits: IEEE half or bfloat16 built from a float32 copy, or float32. */
hid_t tkd_shard_logits_file_type(tkd_cache_dtype dt)
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
int tkd_shard_logits_dtype_of(hid_t t)
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
tkd_shard_ds_shape tkd_shard_shape_of(int d, const tkd_cache_identity *id)
{
    tkd_shard_ds_shape s = {1, {0, 0}};
    hsize_t t = (hsize_t)id->seq_len;
    switch (d) {
    case DS_TOKENS: s = (tkd_shard_ds_shape){2, {t + 1, 0}}; break;
    case DS_INDICES:
    case DS_LOGITS: s = (tkd_shard_ds_shape){3, {t, (hsize_t)id->k}}; break;
    case DS_LSE: s = (tkd_shard_ds_shape){2, {t, 0}}; break;
    case DS_SEQ_INDEX: break;
    case DS_TAIL: s = (tkd_shard_ds_shape){3, {t, (hsize_t)id->tail_samples}}; break;
    case DS_DOC_START:
    case DS_LABELS: s = (tkd_shard_ds_shape){2, {t, 0}}; break;
    }
    return s;
}

hid_t tkd_shard_file_type_of(int d, tkd_cache_dtype dt)
{
    switch (d) {
    case DS_TOKENS:
    case DS_DOC_START:
    case DS_LABELS: return H5Tcopy(H5T_STD_I32LE);
    case DS_INDICES:
    case DS_TAIL: return H5Tcopy(H5T_STD_U32LE);
    case DS_LOGITS: return tkd_shard_logits_file_type(dt);
    case DS_LSE: return H5Tcopy(H5T_IEEE_F32LE);
    default: return H5Tcopy(H5T_STD_I64LE);
    }
}

/* Bytes per element of dataset d in the file (what shuffle transposes by). */
size_t tkd_shard_file_elem_size(int d, tkd_cache_dtype dt)
{
    return d == DS_LOGITS ? tkd_cache_dtype_size(dt) : d == DS_SEQ_INDEX ? 8 : 4;
}

hid_t tkd_shard_mem_type_of(int d)
{
    switch (d) {
    case DS_TOKENS:
    case DS_DOC_START:
    case DS_LABELS: return H5T_NATIVE_INT32;
    case DS_INDICES:
    case DS_TAIL: return H5T_NATIVE_UINT32;
    case DS_LOGITS:
    case DS_LSE: return H5T_NATIVE_FLOAT;
    default: return H5T_NATIVE_INT64;
    }
}

size_t tkd_shard_row_elems(const tkd_shard_ds_shape *s)
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


/* Transfers the block [start, start + count) of dataset ds through a memory space of that shape:
 * writes wbuf when it is not NULL, else reads into rbuf. The writer and the reader share it so the
 * dataspace handling (and its cleanup on every path) lives in one place. */
herr_t tkd_shard_slab_io(hid_t ds, hid_t mtype, int rank, const hsize_t *start, const hsize_t *count, void *rbuf,
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
    return r;
}

herr_t tkd_shard_attr_write_i64(hid_t loc, const char *name, int64_t v)
{
    return attr_write(loc, name, H5T_STD_I64LE, H5T_NATIVE_INT64, &v);
}

static herr_t attr_write_i32(hid_t loc, const char *name, int32_t v)
{
    return attr_write(loc, name, H5T_STD_I32LE, H5T_NATIVE_INT32, &v);
}

/* Reads a scalar numeric attribute converted to mtype. 1 = ok, 0 = missing, -1 = HDF5 error. */
int tkd_shard_attr_read(hid_t loc, const char *name, hid_t mtype, void *v)
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
int tkd_shard_attr_read_str(hid_t loc, const char *name, char *buf, size_t cap)
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

herr_t tkd_shard_write_root_attrs(hid_t f, const tkd_cache_identity *id, int64_t first_seq,
                                  uint64_t tail_seed)
{
    herr_t r = 0;
    r |= attr_write_str(f, "format", TKD_CACHE_FORMAT_NAME);
    r |= attr_write_i32(f, "version", tkd_cache_format_version(id));
    r |= tkd_shard_attr_write_i64(f, "vocab_size", id->vocab_size);
    r |= attr_write_i32(f, "k", id->k);
    r |= attr_write_i32(f, "seq_len", id->seq_len);
    r |= attr_write(f, "temperature", H5T_IEEE_F32LE, H5T_NATIVE_FLOAT, &id->temperature);
    r |= attr_write_str(f, "teacher_sha256", id->teacher_sha256);
    r |= attr_write_str(f, "dataset_sha256", id->dataset_sha256);
    r |= attr_write_str(f, "logits_dtype", tkd_cache_dtype_name(id->logits_dtype));
    r |= attr_write_i32(f, "tail_samples", id->tail_samples);
    r |= tkd_shard_attr_write_i64(f, "first_seq", first_seq);
    if (id->tail_samples > 0)
        r |= attr_write(f, "tail_seed", H5T_STD_U64LE, H5T_NATIVE_UINT64, &tail_seed);
    if (id->packed) /* absent: windows of the stream (every cache before packing existed) */
        r |= attr_write_str(f, "packing", "documents");
    if (id->trained_only) /* absent: every position holds its teacher data */
        r |= attr_write_str(f, "positions", "trained");
    return r < 0 ? -1 : 0;
}

