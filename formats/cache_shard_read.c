/* cache_shard_read.c — the shard reader of cache_shard.h: opens a shard, checks its attributes and
 * datasets against the format, and reads batches of sequences (widening 16-bit logits to float).
 */
#include "formats/cache_shard.h"

#include <stdlib.h>
#include <string.h>

#include "common/fileio.h"
#include "common/half.h"
#include "formats/cache_shard_internal.h"
#include "formats/h5zstd.h"

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
    tkd_shard_h5_quiet(); /* may run on a thread that made no other call here: HDF5 must not print there either */
    for (int d = 0; d < DS_COUNT; d++)
        if (s->ds[d] >= 0)
            H5Dclose(s->ds[d]);
    if (s->logits_mtype >= 0)
        H5Tclose(s->logits_mtype);
    if (s->file >= 0)
        H5Fclose(s->file);
    tkd_shard_h5_forget();
    free(s->path);
    free(s);
}

const tkd_shard_info *tkd_shard_get_info(const tkd_shard *s) { return &s->info; }

/* One attribute read: tkd_shard_attr_read's result (1 read, 0 missing, < 0 HDF5 failure). */
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
            return tkd_shard_h5_fail(TKD_ERR_FORMAT, "%s: root attribute '%s' unreadable", s->path, got[i].name);
    }
    return TKD_OK;
}

/* Reads the root attributes; missing ones are a format error naming the attribute. */
/* An optional root attribute that may only say `value`: *flag 1 when present, 0 when absent. */
static tkd_status read_flag_attr(tkd_shard *s, const char *name, const char *value, int32_t *flag)
{
    *flag = 0;
    if (H5Aexists(s->file, name) <= 0) {
        tkd_shard_h5_forget();
        return TKD_OK;
    }
    char v[32];
    if (tkd_shard_attr_read_str(s->file, name, v, sizeof v) < 0 || strcmp(v, value) != 0)
        return tkd_shard_h5_fail(TKD_ERR_FORMAT, "%s: root attribute '%s' is not \"%s\"", s->path, name, value);
    *flag = 1;
    return TKD_OK;
}

/* The optional root attributes packing ("documents": formats/doc_pack.h; absent: windows) and
 * positions ("trained": /labels, untrained positions' data zeros; absent: every position). */
static tkd_status read_packing(tkd_shard *s, tkd_cache_identity *id)
{
    TKD_TRY(read_flag_attr(s, "packing", "documents", &id->packed));
    return read_flag_attr(s, "positions", "trained", &id->trained_only);
}

static tkd_status shard_read_attrs(tkd_shard *s)
{
    char fmt[64] = "", dtype[32] = "";
    tkd_shard_info *in = &s->info;
    tkd_cache_identity *id = &in->id;
    int64_t vocab = 0, k = 0, seq_len = 0, S = 0, version = 0;
    attr_got got[] = {
        {"format", tkd_shard_attr_read_str(s->file, "format", fmt, sizeof fmt)},
        {"version", tkd_shard_attr_read(s->file, "version", H5T_NATIVE_INT64, &version)},
    };
    TKD_TRY(attrs_check(s, got, sizeof got / sizeof got[0], "not a topkd cache shard"));
    if (strcmp(fmt, TKD_CACHE_FORMAT_NAME) != 0)
        return tkd_error_set(TKD_ERR_FORMAT, "%s: format is '%s', expected '%s'", s->path, fmt,
                             TKD_CACHE_FORMAT_NAME);
    if (version < TKD_CACHE_FORMAT_VERSION || version > TKD_CACHE_FORMAT_VERSION_LAYOUTS)
        return tkd_error_set(TKD_ERR_UNSUPPORTED,
                             "%s: cache format version %lld, this build reads versions %d and %d — use a matching topkd or re-create the cache",
                             s->path, (long long)version, TKD_CACHE_FORMAT_VERSION, TKD_CACHE_FORMAT_VERSION_LAYOUTS);
    in->version = (int32_t)version;
    attr_got rest[] = {
        {"vocab_size", tkd_shard_attr_read(s->file, "vocab_size", H5T_NATIVE_INT64, &vocab)},
        {"k", tkd_shard_attr_read(s->file, "k", H5T_NATIVE_INT64, &k)},
        {"seq_len", tkd_shard_attr_read(s->file, "seq_len", H5T_NATIVE_INT64, &seq_len)},
        {"temperature", tkd_shard_attr_read(s->file, "temperature", H5T_NATIVE_FLOAT, &id->temperature)},
        {"teacher_sha256",
         tkd_shard_attr_read_str(s->file, "teacher_sha256", id->teacher_sha256, TKD_CACHE_SHA256_HEX)},
        {"dataset_sha256",
         tkd_shard_attr_read_str(s->file, "dataset_sha256", id->dataset_sha256, TKD_CACHE_SHA256_HEX)},
        {"logits_dtype", tkd_shard_attr_read_str(s->file, "logits_dtype", dtype, sizeof dtype)},
        {"first_seq", tkd_shard_attr_read(s->file, "first_seq", H5T_NATIVE_INT64, &in->first_seq)},
        {"num_seq", tkd_shard_attr_read(s->file, "num_seq", H5T_NATIVE_INT64, &in->num_seq)},
    };
    TKD_TRY(attrs_check(s, rest, sizeof rest / sizeof rest[0], "not a complete topkd cache shard"));
    /* tail_samples came with the tail draws: a shard without it has no /tail group (S = 0) */
    if (tkd_shard_attr_read(s->file, "tail_samples", H5T_NATIVE_INT64, &S) < 0)
        return tkd_shard_h5_fail(TKD_ERR_FORMAT, "%s: root attribute 'tail_samples' unreadable", s->path);
    if (k > INT32_MAX || seq_len > INT32_MAX || S > INT32_MAX || k < 0 || seq_len < 0 || S < 0)
        return tkd_error_set(TKD_ERR_FORMAT, "%s: k %lld / seq_len %lld / tail_samples %lld out of range",
                             s->path, (long long)k, (long long)seq_len, (long long)S);
    id->vocab_size = vocab;
    id->k = (int32_t)k;
    id->seq_len = (int32_t)seq_len;
    id->tail_samples = (int32_t)S;
    TKD_TRY(read_packing(s, id));
    if (version != tkd_cache_format_version(id))
        return tkd_error_set(TKD_ERR_FORMAT, "%s: format version %lld does not match its attributes (packing, "
                             "positions: version %d)", s->path, (long long)version, tkd_cache_format_version(id));
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
        int dt = tkd_shard_logits_dtype_of(ft);
        if (dt != (int)s->info.id.logits_dtype)
            return tkd_error_set(TKD_ERR_FORMAT, "%s: %s has an HDF5 type that is not the %s the attributes announce",
                                 s->path, tkd_shard_ds_names[d], tkd_cache_dtype_name(s->info.id.logits_dtype));
        s->logits_mtype = H5Tcopy(ft);
        return TKD_OK;
    }
    hid_t want = tkd_shard_file_type_of(d, s->info.id.logits_dtype);
    htri_t eq = H5Tequal(ft, want);
    H5Tclose(want);
    if (eq <= 0)
        return tkd_error_set(TKD_ERR_FORMAT, "%s: %s has the wrong element type (see docs/cache-format.md)",
                             s->path, tkd_shard_ds_names[d]);
    return TKD_OK;
}

/* Opens dataset d and checks its type and shape [num_seq, row...]. */
static tkd_status shard_open_dataset(tkd_shard *s, int d, size_t cache_bytes)
{
    const char *group = d == DS_INDICES || d == DS_LOGITS ? "/topk" : d == DS_TAIL ? "/tail" : NULL;
    if ((group && H5Lexists(s->file, group, H5P_DEFAULT) <= 0) ||
        H5Lexists(s->file, tkd_shard_ds_names[d], H5P_DEFAULT) <= 0) {
        tkd_shard_h5_forget();
        return tkd_error_set(TKD_ERR_NOT_FOUND, "%s: dataset %s missing — the shard is incomplete or not a topkd cache",
                             s->path, tkd_shard_ds_names[d]);
    }
    tkd_shard_ds_shape sh = tkd_shard_shape_of(d, &s->info.id);
    size_t one_chunk = (size_t)s->info.chunk_seqs * tkd_shard_row_elems(&sh) * 4;
    hid_t dapl = H5Pcreate(H5P_DATASET_ACCESS);
    if (dapl >= 0)
        H5Pset_chunk_cache(dapl, 521, cache_bytes ? cache_bytes : one_chunk + 4096, 1.0);
    s->ds[d] = H5Dopen2(s->file, tkd_shard_ds_names[d], dapl);
    H5Pclose(dapl);
    if (s->ds[d] < 0)
        return tkd_shard_h5_fail(TKD_ERR_FORMAT, "%s: cannot open dataset %s", s->path, tkd_shard_ds_names[d]);
    hid_t ft = H5Dget_type(s->ds[d]);
    hid_t sp = H5Dget_space(s->ds[d]);
    hsize_t dims[4] = {0, 0, 0, 0};
    int rank = sp >= 0 ? H5Sget_simple_extent_ndims(sp) : -1;
    if (rank == sh.rank)
        H5Sget_simple_extent_dims(sp, dims, NULL);
    H5Sclose(sp);
    tkd_status st = ft < 0 ? tkd_shard_h5_fail(TKD_ERR_FORMAT, "%s: %s has no type", s->path, tkd_shard_ds_names[d])
                           : shard_check_dataset_type(s, d, ft);
    H5Tclose(ft);
    TKD_TRY(st);
    if (rank != sh.rank || dims[0] != (hsize_t)s->info.num_seq || dims[1] != sh.row[0] ||
        (sh.rank == 3 && dims[2] != sh.row[1]))
        return tkd_error_set(TKD_ERR_FORMAT,
                             "%s: %s has shape [%llu, %llu, %llu] (rank %d), expected [%lld, %llu, %llu] (rank %d) from the attributes",
                             s->path, tkd_shard_ds_names[d], (unsigned long long)dims[0],
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
    tkd_shard_h5_forget();
    return (int64_t)chunk[0];
}

bool tkd_shard_has_cache_format(const char *path)
{
    tkd_shard_h5_quiet();
    if (tkd_input_check(path, "cache shard") != TKD_OK) /* HDF5 would block on a FIFO */
        return false;
    hid_t f = H5Fopen(path, H5F_ACC_RDONLY, H5P_DEFAULT);
    char fmt[64] = "";
    bool ours =
        f >= 0 && tkd_shard_attr_read_str(f, "format", fmt, sizeof fmt) == 1 && !strcmp(fmt, TKD_CACHE_FORMAT_NAME);
    if (f >= 0)
        H5Fclose(f);
    tkd_shard_h5_forget();
    return ours;
}

tkd_status tkd_shard_open(tkd_shard **out, const char *path, size_t cache_bytes)
{
    *out = NULL;
    TKD_TRY(tkd_h5zstd_register());
    tkd_shard_h5_quiet();
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
        st = tkd_shard_h5_fail_open(TKD_ERR_FORMAT, path, "not a readable HDF5 file (truncated or not a shard)");
    if (st == TKD_OK)
        st = shard_read_attrs(s);
    if (st == TKD_OK)
        s->info.chunk_seqs = shard_chunk_seqs(s->file);
    for (int d = 0; st == TKD_OK && d < DS_COUNT; d++)
        if ((d != DS_TAIL || s->info.id.tail_samples > 0) && (d != DS_DOC_START || s->info.id.packed) &&
            (d != DS_LABELS || s->info.id.trained_only))
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
    tkd_shard_ds_shape sh = tkd_shard_shape_of(d, &s->info.id);
    hsize_t start[3] = {(hsize_t)first, 0, 0};
    hsize_t n[3] = {(hsize_t)count, sh.row[0], sh.rank == 3 ? cols : sh.row[1]};
    return tkd_shard_slab_io(s->ds[d], mtype, sh.rank, start, n, buf, NULL);
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
    tkd_shard_h5_quiet();
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
                            b->tail_indices ? b->tail_indices + sl * T * (size_t)b->tail_samples : NULL,
                            b->doc_start ? b->doc_start + sl * T : NULL, b->labels ? b->labels + sl * T : NULL};
    for (int d = 0; d < DS_COUNT; d++) {
        if (!bufs[d] || s->ds[d] < 0)
            continue;
        hid_t mt = d == DS_LOGITS && raw16 ? s->logits_mtype : tkd_shard_mem_type_of(d);
        if (shard_get(s, d, first, count, d == DS_TAIL ? (hsize_t)b->tail_samples : kp, mt, bufs[d]) < 0)
            return tkd_shard_h5_fail(TKD_ERR_IO, "%s: reading %s, sequences %lld..%lld of the shard "
                                     "(cache %lld..%lld) failed",
                                     s->path, tkd_shard_ds_names[d], (long long)first, (long long)(first + count - 1),
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
