/* h5filters.c — see h5filters.h. */
#include "formats/h5filters.h"

#include <stdlib.h>
#include <string.h>
#include <zstd.h>

#include "formats/h5zstd.h"

/* The transpose for the element sizes our datasets use (2: half logits, 4: ids, floats) reads
 * whole elements; any other size goes byte by byte. Same result either way. */
static void shuffle_2(uint8_t *dst, const uint8_t *src, size_t n)
{
    uint8_t *p0 = dst, *p1 = dst + n;
    for (size_t i = 0; i < n; i++) {
        p0[i] = src[2 * i];
        p1[i] = src[2 * i + 1];
    }
}

static void shuffle_4(uint8_t *dst, const uint8_t *src, size_t n)
{
    uint8_t *p0 = dst, *p1 = dst + n, *p2 = dst + 2 * n, *p3 = dst + 3 * n;
    for (size_t i = 0; i < n; i++) {
        p0[i] = src[4 * i];
        p1[i] = src[4 * i + 1];
        p2[i] = src[4 * i + 2];
        p3[i] = src[4 * i + 3];
    }
}

void tkd_h5_shuffle(void *dst, const void *src, size_t nbytes, size_t elem)
{
    uint8_t *d = dst;
    const uint8_t *s = src;
    size_t n = elem ? nbytes / elem : 0;
    if (elem <= 1 || n <= 1) {
        memcpy(d, s, nbytes);
        return;
    }
    if (elem == 2)
        shuffle_2(d, s, n);
    else if (elem == 4)
        shuffle_4(d, s, n);
    else
        for (size_t j = 0; j < elem; j++)
            for (size_t i = 0; i < n; i++)
                d[j * n + i] = s[i * elem + j];
    memcpy(d + n * elem, s + n * elem, nbytes - n * elem);
}

/* Folds a running sum back towards 16 bits (end-around carry: the value mod 65535 is kept). */
static inline uint32_t fold16(uint32_t x) { return (x & 0xffffu) + (x >> 16); }

uint32_t tkd_h5_fletcher32(const void *data, size_t len)
{
    const uint8_t *p = data;
    uint32_t sum1 = 0, sum2 = 0;
    /* Folded after every 360 words, as HDF5 does, which keeps sum2 below 2^32. Without overflow
     * the result depends only on the true sums (0 stays 0, a nonzero multiple of 65535 ends as
     * 0xffff), provided the last folds below bring both into 16 bits. */
    for (size_t words = len / 2; words > 0;) {
        size_t block = words < 360 ? words : 360;
        words -= block;
        for (size_t i = 0; i < block; i++, p += 2) {
            sum1 += (uint32_t)p[0] << 8 | p[1];
            sum2 += sum1;
        }
        sum1 = fold16(sum1);
        sum2 = fold16(sum2);
    }
    if (len % 2) {
        sum1 += (uint32_t)p[0] << 8;
        sum2 += sum1;
        sum1 = fold16(sum1);
        sum2 = fold16(sum2);
    }
    sum1 = fold16(sum1);
    sum2 = fold16(sum2);
    return sum2 << 16 | sum1;
}

struct tkd_h5_filter_ctx {
    ZSTD_CCtx *zctx;
    uint8_t *shuffled; /* (max_bytes) */
    size_t max_bytes;
};

tkd_status tkd_h5_filter_ctx_create(tkd_h5_filter_ctx **out, size_t max_bytes)
{
    *out = NULL;
    tkd_h5_filter_ctx *c = calloc(1, sizeof *c);
    if (c) {
        c->zctx = ZSTD_createCCtx();
        c->shuffled = malloc(max_bytes ? max_bytes : 1);
        c->max_bytes = max_bytes;
    }
    if (!c || !c->zctx || !c->shuffled) {
        tkd_h5_filter_ctx_free(c);
        return tkd_error_set(TKD_ERR_NOMEM, "out of memory for a chunk filter context (%zu bytes)", max_bytes);
    }
    *out = c;
    return TKD_OK;
}

void tkd_h5_filter_ctx_free(tkd_h5_filter_ctx *c)
{
    if (!c)
        return;
    ZSTD_freeCCtx(c->zctx);
    free(c->shuffled);
    free(c);
}

size_t tkd_h5_filter_bound(size_t nbytes) { return ZSTD_compressBound(nbytes) + 4; }

size_t tkd_h5_filter_chunk(tkd_h5_filter_ctx *c, const void *src, size_t nbytes, size_t elem, int level,
                           void *out, size_t cap)
{
    if (nbytes > c->max_bytes || cap < tkd_h5_filter_bound(nbytes))
        return 0;
    tkd_h5_shuffle(c->shuffled, src, nbytes, elem);
    /* the same capacity HDF5's filter gives zstd (h5zstd.c), so nothing can depend on it */
    size_t z = tkd_h5zstd_compress_into(c->zctx, out, ZSTD_compressBound(nbytes), c->shuffled, nbytes, level);
    if (z == 0)
        return 0;
    uint32_t sum = tkd_h5_fletcher32(out, z);
    uint8_t *tail = (uint8_t *)out + z;
    for (int i = 0; i < 4; i++)
        tail[i] = (uint8_t)(sum >> (8 * i));
    return z + 4;
}
