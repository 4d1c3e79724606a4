/* cache_shard.c — see cache_shard.h: the dtypes and identity of a cache, batches, and the shard writer.
 * The reader is cache_shard_read.c; the HDF5 helpers both use are cache_shard_h5.c. */
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
#include "formats/cache_shard_internal.h"

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

float tkd_cache_dtype_exact_below(tkd_cache_dtype dt, double tol)
{
    if (dt == TKD_CACHE_DTYPE_FLOAT32)
        return INFINITY;
    if (!(tol > 0.0))
        return 0.0f;
    int e;
    frexp(tol, &e); /* tol = f · 2^e, f in [0.5, 1): floor(log2 tol) = e − 1 */
    const int mant = dt == TKD_CACHE_DTYPE_HALF ? 10 : 7;
    return (float)fmin(ldexp(1.0, mant + 2 + e - 1), (double)tkd_cache_dtype_max(dt));
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
    if ((id->packed != 0 && id->packed != 1) || (id->trained_only != 0 && id->trained_only != 1))
        return tkd_error_set(TKD_ERR_FORMAT, "%s: packed %d / trained_only %d is neither 0 nor 1", what, id->packed,
                             id->trained_only);
    if (id->tail_samples < 0 || id->tail_samples > 65535)
        return tkd_error_set(TKD_ERR_FORMAT, "%s: tail_samples %d out of range [0, 65535]", what,
                             id->tail_samples);
    if (!is_hex_digest(id->teacher_sha256) || !is_hex_digest(id->dataset_sha256))
        return tkd_error_set(TKD_ERR_FORMAT,
                             "%s: teacher_sha256 and dataset_sha256 must be 64 lowercase hex digits",
                             what);
    return TKD_OK;
}

int tkd_cache_format_version(const tkd_cache_identity *id)
{
    return id->packed || id->trained_only ? TKD_CACHE_FORMAT_VERSION_LAYOUTS : TKD_CACHE_FORMAT_VERSION;
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
    TKD_CMP_INT(packed)
    TKD_CMP_INT(trained_only)
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

/* One optional (capacity, seq_len) int32 buffer of a batch. */
static tkd_status alloc_positions(const tkd_cache_batch *b, int32_t **buf, const char *what)
{
    free(*buf);
    *buf = malloc((size_t)b->capacity * (size_t)b->seq_len * sizeof **buf);
    return *buf ? TKD_OK
                : tkd_error_set(TKD_ERR_NOMEM, "out of memory for the %s of %lld sequences", what,
                                (long long)b->capacity);
}

tkd_status tkd_cache_batch_alloc_doc_start(tkd_cache_batch *b)
{
    return alloc_positions(b, &b->doc_start, "document starts");
}

tkd_status tkd_cache_batch_alloc_labels(tkd_cache_batch *b)
{
    return alloc_positions(b, &b->labels, "labels");
}

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
    free(b->doc_start);
    free(b->labels);
    free(b->tail_indices);
    free(b->cache_seq);
    memset(b, 0, sizeof *b);
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
    tkd_shard_ds_shape s = tkd_shard_shape_of(d, &w->id);
    hsize_t dims[3] = {0, s.row[0], s.row[1]};
    hsize_t maxdims[3] = {H5S_UNLIMITED, s.row[0], s.row[1]};
    hsize_t chunk[3] = {(hsize_t)w->chunk_seqs, s.row[0], s.row[1]};
    unsigned cd = (unsigned)level;
    hid_t sp = H5Screate_simple(s.rank, dims, maxdims);
    hid_t dcpl = H5Pcreate(H5P_DATASET_CREATE);
    hid_t dapl = H5Pcreate(H5P_DATASET_ACCESS);
    hid_t ft = tkd_shard_file_type_of(d, w->id.logits_dtype);
    size_t chunk_bytes = (size_t)w->chunk_seqs * tkd_shard_row_elems(&s) * 8;
    hid_t ds = -1;
    /* Filter order is the order of these calls: shuffle, zstd (mandatory), fletcher32. A chunk
     * cache of two chunks keeps a partly filled chunk in memory between appends. No modification
     * time: a shard's bytes depend on its data only (tkd_shard_writer_open). */
    if (sp >= 0 && dcpl >= 0 && dapl >= 0 && ft >= 0 && H5Pset_obj_track_times(dcpl, 0) >= 0 &&
        H5Pset_chunk(dcpl, s.rank, chunk) >= 0 && H5Pset_shuffle(dcpl) >= 0 &&
        H5Pset_filter(dcpl, TKD_H5ZSTD_FILTER_ID, H5Z_FLAG_MANDATORY, 1, &cd) >= 0 &&
        H5Pset_fletcher32(dcpl) >= 0 && H5Pset_chunk_cache(dapl, 521, 2 * chunk_bytes + (1u << 20), 1.0) >= 0)
        ds = H5Dcreate2(w->file, tkd_shard_ds_names[d], ft, sp, H5P_DEFAULT, dcpl, dapl);
    H5Tclose(ft);
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
        tkd_shard_h5_forget();
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
    tkd_shard_h5_forget();
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

/* A shard's bytes are a function of its data and settings alone, so that two dumps of the same
 * data give the same files and the manifests' sha256 can be compared across runs and machines.
 * HDF5 would record each object's modification time (track times): it is off for the root group
 * here, for the groups (writer_create_groups) and for every dataset (writer_create_dataset). The
 * rest of the file (addresses, free space, superblock) follows from the order of our calls. */
static hid_t writer_create_file(const char *path)
{
    hid_t fcpl = H5Pcreate(H5P_FILE_CREATE);
    hid_t fapl = H5Pcreate(H5P_FILE_ACCESS);
    hid_t f = -1;
    if (fcpl >= 0 && fapl >= 0 && H5Pset_obj_track_times(fcpl, 0) >= 0 &&
        H5Pset_fclose_degree(fapl, H5F_CLOSE_STRONG) >= 0)
        f = H5Fcreate(path, H5F_ACC_TRUNC, fcpl, fapl);
    H5Pclose(fapl);
    H5Pclose(fcpl);
    return f;
}

/* /topk, and /tail when the shard has tail draws: made here, without modification times (an
 * intermediate group HDF5 made on its own would take the default, times tracked). */
static herr_t writer_create_groups(tkd_shard_writer *w)
{
    hid_t gcpl = H5Pcreate(H5P_GROUP_CREATE);
    herr_t r = gcpl >= 0 && H5Pset_obj_track_times(gcpl, 0) >= 0 ? 0 : -1;
    for (int i = 0; i < 2 && r >= 0; i++) {
        if (i == 1 && w->id.tail_samples == 0)
            break;
        hid_t g = H5Gcreate2(w->file, i == 0 ? "/topk" : "/tail", H5P_DEFAULT, gcpl, H5P_DEFAULT);
        r = g < 0 ? -1 : H5Gclose(g);
    }
    H5Pclose(gcpl);
    return r;
}

/* The parallel filter for the datasets this shard has, one chunk of chunk_seqs sequences each. */
static tkd_status writer_start_chunks(tkd_shard_writer *w, int level)
{
    tkd_shard_chunk_stream streams[DS_COUNT];
    for (int d = 0; d < DS_COUNT; d++) {
        tkd_shard_ds_shape s = tkd_shard_shape_of(d, &w->id);
        size_t elem = tkd_shard_file_elem_size(d, w->id.logits_dtype);
        streams[d] = (tkd_shard_chunk_stream){w->ds[d] < 0 ? 0 : tkd_shard_row_elems(&s) * elem, elem};
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
    tkd_shard_h5_quiet();
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
    w->file = writer_create_file(w->tmp_path);
    if (w->file < 0) {
        tkd_status st = tkd_shard_h5_fail_open(TKD_ERR_IO, w->tmp_path, "cannot create shard");
        writer_free(w);
        return st;
    }
    if (writer_create_groups(w) < 0) {
        tkd_status st = tkd_shard_h5_fail(TKD_ERR_IO, "%s: cannot create the groups /topk and /tail", w->tmp_path);
        tkd_shard_writer_abort(w);
        return st;
    }
    int level = o.zstd_level ? o.zstd_level : TKD_H5ZSTD_DEFAULT_LEVEL;
    for (int d = 0; d < DS_COUNT; d++) {
        if ((d == DS_TAIL && id->tail_samples == 0) || (d == DS_DOC_START && !id->packed) ||
            (d == DS_LABELS && !id->trained_only))
            continue;
        w->ds[d] = writer_create_dataset(w, d, level);
        if (w->ds[d] < 0) {
            tkd_status st =
                tkd_shard_h5_fail(TKD_ERR_IO, "%s: cannot create dataset %s", w->tmp_path, tkd_shard_ds_names[d]);
            tkd_shard_writer_abort(w);
            return st;
        }
    }
    if (tkd_shard_write_root_attrs(w->file, id, first_seq, o.tail_seed) < 0) {
        tkd_status st = tkd_shard_h5_fail(TKD_ERR_IO, "%s: cannot write root attributes", w->tmp_path);
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
static herr_t writer_put(tkd_shard_writer *w, int d, int64_t n, hid_t mtype, const void *buf)
{
    tkd_shard_ds_shape s = tkd_shard_shape_of(d, &w->id);
    hsize_t dims[3] = {(hsize_t)(w->num_seq + n), s.row[0], s.row[1]};
    hsize_t start[3] = {(hsize_t)w->num_seq, 0, 0};
    hsize_t count[3] = {(hsize_t)n, s.row[0], s.row[1]};
    if (H5Dset_extent(w->ds[d], dims) < 0)
        return -1;
    return tkd_shard_slab_io(w->ds[d], mtype, s.rank, start, count, NULL, buf);
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
            return tkd_shard_h5_fail(TKD_ERR_IO, "%s: writing %s, the chunk from sequence %lld, failed", w->tmp_path,
                                     tkd_shard_ds_names[ch[i].stream], (long long)(w->first_seq + ch[i].first_row));
    }
    return TKD_OK;
}

/* The parallel path of an append: every dataset grows by n sequences, the chunks they complete are
 * filtered on the writer's threads and written; a partial chunk waits for the next append. */
static tkd_status writer_put_chunks(tkd_shard_writer *w, int64_t n, const void *const *bufs)
{
    for (int d = 0; d < DS_COUNT; d++) {
        tkd_shard_ds_shape s = tkd_shard_shape_of(d, &w->id);
        hsize_t dims[3] = {(hsize_t)(w->num_seq + n), s.row[0], s.row[1]};
        if (w->ds[d] >= 0 && H5Dset_extent(w->ds[d], dims) < 0)
            return tkd_shard_h5_fail(TKD_ERR_IO, "%s: extending %s to %lld sequences failed", w->tmp_path,
                                     tkd_shard_ds_names[d], (long long)(w->num_seq + n));
    }
    tkd_status st = tkd_shard_chunks_add(w->chunks, n, bufs);
    if (st != TKD_OK)
        return tkd_error_prefix(st, "%s", w->tmp_path);
    return writer_write_chunks(w);
}

tkd_status tkd_shard_writer_append(tkd_shard_writer *w, const tkd_cache_batch *b)
{
    tkd_shard_h5_quiet();
    if (b->num_seq < 0 || b->seq_len != w->id.seq_len || b->k != w->id.k ||
        b->tail_samples != w->id.tail_samples || (w->id.tail_samples > 0 && !b->tail_indices) ||
        (w->id.packed && !b->doc_start) || (w->id.trained_only && !b->labels) ||
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
                                  b->tail_indices, b->doc_start, b->labels};
    if (w->chunks) {
        TKD_TRY(writer_put_chunks(w, b->num_seq, bufs));
        w->num_seq += b->num_seq;
        return TKD_OK;
    }
    for (int d = 0; d < DS_COUNT; d++) {
        if (w->ds[d] < 0)
            continue;
        hid_t mt = tkd_shard_mem_type_of(d), owned = -1;
        if (d == DS_LOGITS && w->id.logits_dtype != TKD_CACHE_DTYPE_FLOAT32)
            mt = owned = tkd_shard_logits_file_type(w->id.logits_dtype);
        herr_t r = writer_put(w, d, b->num_seq, mt, bufs[d]);
        if (owned >= 0)
            H5Tclose(owned);
        if (r < 0)
            return tkd_shard_h5_fail(TKD_ERR_IO, "%s: writing %s for sequences %lld..%lld failed", w->tmp_path,
                                     tkd_shard_ds_names[d], (long long)(w->first_seq + w->num_seq),
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
    tkd_shard_h5_quiet(); /* as in tkd_shard_close */
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
        tkd_shard_h5_forget();
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
    if (tkd_shard_attr_write_i64(w->file, "num_seq", w->num_seq) < 0)
        return tkd_shard_h5_fail(TKD_ERR_IO, "%s: writing the shard failed", w->tmp_path);
    TKD_TRY(writer_reserve_flush_room(w));
    if (H5Fflush(w->file, H5F_SCOPE_LOCAL) < 0)
        return tkd_shard_h5_fail(TKD_ERR_IO, "%s: writing the shard failed", w->tmp_path);
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
        return tkd_shard_h5_fail(TKD_ERR_IO, "%s: closing the shard failed", w->tmp_path);
    return TKD_OK;
}

tkd_status tkd_shard_writer_finish(tkd_shard_writer *w, tkd_cache_shard_entry *entry)
{
    tkd_shard_h5_quiet();
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

