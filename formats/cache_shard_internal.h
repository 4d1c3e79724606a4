/* cache_shard_internal.h — what the shard writer (cache_shard.c), the shard reader
 * (cache_shard_read.c) and their HDF5 helpers (cache_shard_h5.c) share: the datasets of a shard,
 * their types and shapes, HDF5 errors as one-line tkd_status, attributes. Only those files include it.
 */
#ifndef TKD_CACHE_SHARD_INTERNAL_H
#define TKD_CACHE_SHARD_INTERNAL_H

#include <hdf5.h>
#include <stddef.h>
#include <stdint.h>

#include "formats/cache_shard.h"

/* The datasets of a shard, in a fixed order used by both writer and reader. */
enum {
    DS_TOKENS,
    DS_INDICES,
    DS_LOGITS,
    DS_LSE,
    DS_SEQ_INDEX,
    DS_TAIL,
    DS_DOC_START, /* packed caches only */
    DS_LABELS,    /* trained_only caches only */
    DS_COUNT,
};
extern const char *const tkd_shard_ds_names[DS_COUNT];

/* HDF5 errors -> one-line tkd_status (cache_shard_h5.c says how). */
void tkd_shard_h5_quiet(void);
void tkd_shard_h5_forget(void);
tkd_status tkd_shard_h5_fail(tkd_status st, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
tkd_status tkd_shard_h5_fail_open(tkd_status st, const char *path, const char *what);

/* HDF5 types and shapes of the datasets. */
hid_t tkd_shard_logits_file_type(tkd_cache_dtype dt);
int tkd_shard_logits_dtype_of(hid_t t);
typedef struct tkd_shard_ds_shape {
    int rank;
    hsize_t row[2]; /* dims after the sequence axis */
} tkd_shard_ds_shape;
tkd_shard_ds_shape tkd_shard_shape_of(int d, const tkd_cache_identity *id);
hid_t tkd_shard_file_type_of(int d, tkd_cache_dtype dt);
size_t tkd_shard_file_elem_size(int d, tkd_cache_dtype dt);
hid_t tkd_shard_mem_type_of(int d);
size_t tkd_shard_row_elems(const tkd_shard_ds_shape *s);
herr_t tkd_shard_slab_io(hid_t ds, hid_t mtype, int rank, const hsize_t *start, const hsize_t *count, void *rbuf,
                         const void *wbuf);

/* Attributes. */
herr_t tkd_shard_attr_write_i64(hid_t loc, const char *name, int64_t v);
int tkd_shard_attr_read(hid_t loc, const char *name, hid_t mtype, void *v);
int tkd_shard_attr_read_str(hid_t loc, const char *name, char *buf, size_t cap);
herr_t tkd_shard_write_root_attrs(hid_t f, const tkd_cache_identity *id, int64_t first_seq, uint64_t tail_seed);

#endif
