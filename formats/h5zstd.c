/* h5zstd.c — see h5zstd.h. */
#include "formats/h5zstd.h"

#include <pthread.h>

/* HDF5 owns the chunk buffer, so a new one must come from the allocator HDF5 frees with. In
 * process that is H5allocate_memory. The loadable plugin is dlopened by whichever HDF5 the host
 * has (h5dump's, or the copy bundled inside h5py): linking it against our libhdf5 would load a
 * second HDF5 into that process, so it links none and uses malloc/free, which is what HDF5's
 * allocator is on the platforms the plugin is built for (Linux, release builds of HDF5). */
#ifdef TKD_H5ZSTD_PLUGIN
#include <stdlib.h>
#define H5allocate_memory(size, clear) malloc(size)
#define H5free_memory(p) free(p)
#define H5resize_memory(p, size) realloc(p, size)
#endif
static size_t h5zstd_replace_buf(void **buf, size_t *buf_size, void *out, size_t out_cap,
                                 size_t out_len)
{
    H5free_memory(*buf);
    *buf = out;
    *buf_size = out_cap;
    return out_len;
}

static int h5zstd_level(int level)
{
    return level < 1 || level > ZSTD_maxCLevel() ? TKD_H5ZSTD_DEFAULT_LEVEL : level;
}

/* ZSTD_compressCCtx ignores (resets) any parameter set on the context: the frame depends only on
 * the input and the level, so it is the same bytes ZSTD_compress makes in the filter below. */
size_t tkd_h5zstd_compress_into(ZSTD_CCtx *cctx, void *dst, size_t cap, const void *src, size_t n,
                                int level)
{
    size_t r = ZSTD_compressCCtx(cctx, dst, cap, src, n, h5zstd_level(level));
    return ZSTD_isError(r) ? 0 : r;
}

static size_t h5zstd_compress(const unsigned cd_values[], size_t cd_nelmts, size_t nbytes,
                              size_t *buf_size, void **buf)
{
    int level = h5zstd_level(cd_nelmts > 0 ? (int)cd_values[0] : TKD_H5ZSTD_DEFAULT_LEVEL);
    size_t cap = ZSTD_compressBound(nbytes);
    void *out = H5allocate_memory(cap, 0);
    if (!out)
        return 0;
    size_t n = ZSTD_compress(out, cap, *buf, nbytes, level);
    if (ZSTD_isError(n)) {
        H5free_memory(out);
        return 0;
    }
    return h5zstd_replace_buf(buf, buf_size, out, cap, n);
}

/* Frames without a content size (written by streaming compressors) are decoded with the streaming
 * API into a buffer that doubles as needed. */
static size_t h5zstd_decompress_stream(size_t nbytes, size_t *buf_size, void **buf)
{
    ZSTD_DStream *ds = ZSTD_createDStream();
    if (!ds)
        return 0;
    size_t cap = nbytes * 4 + 4096, len = 0;
    void *out = H5allocate_memory(cap, 0);
    ZSTD_inBuffer in = {*buf, nbytes, 0};
    size_t ret = ZSTD_initDStream(ds);
    while (out && !ZSTD_isError(ret)) {
        ZSTD_outBuffer o = {out, cap, len};
        ret = ZSTD_decompressStream(ds, &o, &in);
        len = o.pos;
        if (ZSTD_isError(ret) || ret == 0)
            break;
        if (in.pos == in.size && o.pos < o.size) { /* input ended mid-frame: truncated */
            ret = (size_t)-1;
            break;
        }
        if (o.pos == o.size) {
            void *grown = H5resize_memory(out, cap * 2);
            if (!grown) { /* keep `out` so it is freed below, not leaked */
                ret = (size_t)-1;
                break;
            }
            out = grown;
            cap *= 2;
        }
    }
    ZSTD_freeDStream(ds);
    if (!out || ret != 0) {
        H5free_memory(out);
        return 0;
    }
    return h5zstd_replace_buf(buf, buf_size, out, cap, len);
}

static size_t h5zstd_decompress(size_t nbytes, size_t *buf_size, void **buf)
{
    unsigned long long size = ZSTD_getFrameContentSize(*buf, nbytes);
    if (size == ZSTD_CONTENTSIZE_ERROR)
        return 0;
    if (size == ZSTD_CONTENTSIZE_UNKNOWN)
        return h5zstd_decompress_stream(nbytes, buf_size, buf);
    size_t cap = size > 0 ? (size_t)size : 1;
    void *out = H5allocate_memory(cap, 0);
    if (!out)
        return 0;
    size_t n = ZSTD_decompress(out, cap, *buf, nbytes);
    if (ZSTD_isError(n) || n != size) {
        H5free_memory(out);
        return 0;
    }
    return h5zstd_replace_buf(buf, buf_size, out, cap, n);
}

/* The H5Z_func_t: returns the number of valid bytes in *buf, or 0 to signal failure. */
static size_t h5zstd_filter(unsigned int flags, size_t cd_nelmts, const unsigned int cd_values[],
                            size_t nbytes, size_t *buf_size, void **buf)
{
    if (flags & H5Z_FLAG_REVERSE)
        return h5zstd_decompress(nbytes, buf_size, buf);
    return h5zstd_compress(cd_values, cd_nelmts, nbytes, buf_size, buf);
}

const H5Z_class2_t tkd_h5zstd_class = {
    H5Z_CLASS_T_VERS,
    (H5Z_filter_t)TKD_H5ZSTD_FILTER_ID,
    1, /* encoder present */
    1, /* decoder present */
    "zstd (topkd)",
    NULL, /* can_apply */
    NULL, /* set_local */
    h5zstd_filter,
};

/* The plugin build (TKD_H5ZSTD_PLUGIN) carries only the filter: it must not need our status module,
 * which a stock h5dump process does not have. */
#ifndef TKD_H5ZSTD_PLUGIN
static pthread_once_t h5zstd_once = PTHREAD_ONCE_INIT;
static herr_t h5zstd_register_result = -1;

static void h5zstd_register_once(void)
{
    H5Eset_auto2(H5E_DEFAULT, NULL, NULL);
    h5zstd_register_result = H5Zregister(&tkd_h5zstd_class);
}

tkd_status tkd_h5zstd_register(void)
{
    pthread_once(&h5zstd_once, h5zstd_register_once);
    if (h5zstd_register_result < 0)
        return tkd_error_set(TKD_ERR_INTERNAL, "HDF5: could not register the zstd filter (id %d)",
                             TKD_H5ZSTD_FILTER_ID);
    return TKD_OK;
}
#endif /* TKD_H5ZSTD_PLUGIN */
