/* safetensors.h — read and write safetensors files and HF checkpoint directories.
 *
 * Reading memory-maps each file and validates the header completely before any tensor is touched:
 * header length sane, JSON well-formed, dtype known, offsets inside the data region, no overlap,
 * dtype size x shape == byte length. Each violation is TKD_ERR_FORMAT naming the file and tensor.
 * A directory holds model.safetensors, or model-0000x-of-0000y.safetensors shards listed in
 * model.safetensors.index.json.
 */
#ifndef TKD_SAFETENSORS_H
#define TKD_SAFETENSORS_H

#include <stddef.h>
#include <stdint.h>

#include "common/half.h"
#include "common/status.h"

typedef enum tkd_dtype {
    TKD_DTYPE_F32 = 0,
    TKD_DTYPE_F16 = 1,
    TKD_DTYPE_BF16 = 2,
    TKD_DTYPE_I32 = 3,
    TKD_DTYPE_I64 = 4,
    TKD_DTYPE_U8 = 5,
} tkd_dtype;

#define TKD_ST_MAX_DIMS 8

typedef struct tkd_st_tensor {
    char *name;
    tkd_dtype dtype;
    int ndim;
    int64_t shape[TKD_ST_MAX_DIMS];
    const void *data;   /* points into the mapping; valid while the tkd_st_dir is open */
    size_t nbytes;
    const char *file;   /* the file it lives in (for messages) */
} tkd_st_tensor;

typedef struct tkd_st_dir tkd_st_dir; /* opaque: all mapped files of one checkpoint directory */

/* Element size in bytes (4, 2, 2, 4, 8, 1) and the safetensors spelling ("F32", "BF16", ...). */
size_t tkd_dtype_size(tkd_dtype dt);
const char *tkd_dtype_name(tkd_dtype dt);

/* Writes a shape as "[a, b, c]" into buf (cap bytes, cut short when it does not fit); returns buf. */
const char *tkd_st_shape_str(char *buf, size_t cap, int ndim, const int64_t *shape);

/* Opens <dir>/model.safetensors, or the shards named by <dir>/model.safetensors.index.json, or
 * <dir> itself when it is a .safetensors file. On success *out is owned by the caller
 * (tkd_st_close). */
tkd_status tkd_st_open(const char *dir, tkd_st_dir **out);
void tkd_st_close(tkd_st_dir *d); /* NULL is a no-op */

/* Validates and indexes one safetensors image already in memory (label names it in messages).
 * The buffer is borrowed: it must outlive *out. Used by the fuzz harness and by tests. */
tkd_status tkd_st_open_memory(const char *label, const void *buf, size_t size, tkd_st_dir **out);

/* Finds a tensor by name; NULL when absent; count/at walk all of them by index. The returned
 * tensors are borrowed from d: valid until tkd_st_close(d). */
const tkd_st_tensor *tkd_st_find(const tkd_st_dir *d, const char *name);
int tkd_st_count(const tkd_st_dir *d);
const tkd_st_tensor *tkd_st_at(const tkd_st_dir *d, int i);

/* Converts a tensor to fp32 into dst (capacity n floats, must equal the element count), checking
 * that its shape equals expect_shape[0..ndim) (error names tensor, expected and found shapes). */
tkd_status tkd_st_read_f32(const tkd_st_dir *d, const char *name, int ndim, const int64_t *expect_shape,
                           float *dst, size_t n);

/* TKD_ERR_MISMATCH naming the tensor, its shape and the expected one unless t's shape is
 * expect_shape[0..ndim). */
tkd_status tkd_st_check_shape(const tkd_st_tensor *t, int ndim, const int64_t *expect_shape);

/* Elements [first, first + n) of tensor t (a float type) converted to fp32 into dst (n floats):
 * a slice of a larger tensor, e.g. one expert of a stacked (E, ...) tensor. TKD_ERR_INVALID_ARG
 * when the range runs past the tensor, TKD_ERR_UNSUPPORTED for a non-float dtype. */
tkd_status tkd_st_slice_f32(const tkd_st_tensor *t, size_t first, size_t n, float *dst);

/* Writer: collects (name, shape, fp32 data) and writes one file in F32 or BF16, atomically
 * (temp file + fsync + rename). On success init gives *out to the caller, who releases it with
 * tkd_st_writer_free (finish does not). add copies name and shape but borrows data: those
 * pointers must stay valid until tkd_st_writer_finish. */
typedef struct tkd_st_writer tkd_st_writer;
tkd_status tkd_st_writer_init(tkd_st_writer **out, tkd_dtype dtype);
tkd_status tkd_st_writer_add(tkd_st_writer *w, const char *name, int ndim, const int64_t *shape,
                             const float *data);
tkd_status tkd_st_writer_finish(tkd_st_writer *w, const char *path);
void tkd_st_writer_free(tkd_st_writer *w);

#endif /* TKD_SAFETENSORS_H */
