/* cache_fsutil.c — see cache_fsutil.h. SHA-256 follows FIPS 180-4. */
#include "formats/cache_fsutil.h"

#include <errno.h>
#include <fcntl.h>
#include <libgen.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* ---- sha256 --------------------------------------------------------------------------------- */

typedef struct sha256_ctx {
    uint32_t h[8];
    uint64_t len;       /* bytes hashed */
    uint8_t block[64];
    size_t fill;
} sha256_ctx;

static const uint32_t sha256_k[64] = {
    0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4, 0xab1c5ed5,
    0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe, 0x9bdc06a7, 0xc19bf174,
    0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f, 0x4a7484aa, 0x5cb0a9dc, 0x76f988da,
    0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7, 0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967,
    0x27b70a85, 0x2e1b2138, 0x4d2c6dfc, 0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85,
    0xa2bfe8a1, 0xa81a664b, 0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070,
    0x19a4c116, 0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
    0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7, 0xc67178f2,
};

static uint32_t ror32(uint32_t x, int n) { return (x >> n) | (x << (32 - n)); }

static void sha256_block(sha256_ctx *c, const uint8_t *p)
{
    uint32_t w[64];
    for (int i = 0; i < 16; i++)
        w[i] = (uint32_t)p[4 * i] << 24 | (uint32_t)p[4 * i + 1] << 16 | (uint32_t)p[4 * i + 2] << 8 |
               p[4 * i + 3];
    for (int i = 16; i < 64; i++) {
        uint32_t s0 = ror32(w[i - 15], 7) ^ ror32(w[i - 15], 18) ^ (w[i - 15] >> 3);
        uint32_t s1 = ror32(w[i - 2], 17) ^ ror32(w[i - 2], 19) ^ (w[i - 2] >> 10);
        w[i] = w[i - 16] + s0 + w[i - 7] + s1;
    }
    uint32_t a = c->h[0], b = c->h[1], cc = c->h[2], d = c->h[3];
    uint32_t e = c->h[4], f = c->h[5], g = c->h[6], h = c->h[7];
    for (int i = 0; i < 64; i++) {
        uint32_t t1 = h + (ror32(e, 6) ^ ror32(e, 11) ^ ror32(e, 25)) + ((e & f) ^ (~e & g)) +
                      sha256_k[i] + w[i];
        uint32_t t2 = (ror32(a, 2) ^ ror32(a, 13) ^ ror32(a, 22)) + ((a & b) ^ (a & cc) ^ (b & cc));
        h = g; g = f; f = e; e = d + t1;
        d = cc; cc = b; b = a; a = t1 + t2;
    }
    c->h[0] += a; c->h[1] += b; c->h[2] += cc; c->h[3] += d;
    c->h[4] += e; c->h[5] += f; c->h[6] += g; c->h[7] += h;
}

static void sha256_init(sha256_ctx *c)
{
    static const uint32_t h0[8] = {0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a,
                                   0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19};
    memcpy(c->h, h0, sizeof h0);
    c->len = 0;
    c->fill = 0;
}

static void sha256_update(sha256_ctx *c, const void *data, size_t n)
{
    const uint8_t *p = data;
    c->len += n;
    while (n > 0) {
        if (c->fill == 0 && n >= 64) {
            sha256_block(c, p);
            p += 64;
            n -= 64;
            continue;
        }
        size_t take = 64 - c->fill < n ? 64 - c->fill : n;
        memcpy(c->block + c->fill, p, take);
        c->fill += take;
        p += take;
        n -= take;
        if (c->fill == 64) {
            sha256_block(c, c->block);
            c->fill = 0;
        }
    }
}

static void sha256_final_hex(sha256_ctx *c, char hex[65])
{
    uint64_t bits = c->len * 8;
    uint8_t pad[72] = {0x80};
    size_t padlen = (c->fill < 56 ? 56 : 120) - c->fill;
    for (int i = 0; i < 8; i++)
        pad[padlen + i] = (uint8_t)(bits >> (56 - 8 * i));
    sha256_update(c, pad, padlen + 8);
    for (int i = 0; i < 8; i++)
        snprintf(hex + 8 * i, 9, "%08x", c->h[i]);
}

void tkd_cache_sha256_hex(const void *data, size_t len, char hex[65])
{
    sha256_ctx c;
    sha256_init(&c);
    sha256_update(&c, data, len);
    sha256_final_hex(&c, hex);
}

tkd_status tkd_cache_file_digest(const char *path, char hex[65], uint64_t *bytes)
{
    FILE *f = fopen(path, "rb");
    if (!f)
        return tkd_error_set(errno == ENOENT ? TKD_ERR_NOT_FOUND : TKD_ERR_IO, "%s: %s", path,
                             strerror(errno));
    enum { BUF = 1 << 16 };
    uint8_t *buf = malloc(BUF);
    if (!buf) {
        fclose(f);
        return tkd_error_set(TKD_ERR_NOMEM, "%s: out of memory hashing", path);
    }
    sha256_ctx c;
    sha256_init(&c);
    size_t n;
    while ((n = fread(buf, 1, BUF, f)) > 0)
        sha256_update(&c, buf, n);
    int err = ferror(f);
    free(buf);
    fclose(f);
    if (err)
        return tkd_error_set(TKD_ERR_IO, "%s: read error while hashing", path);
    if (bytes)
        *bytes = c.len;
    sha256_final_hex(&c, hex);
    return TKD_OK;
}

/* ---- durable writes --------------------------------------------------------------------------- */

static tkd_status errno_status(int e)
{
    return e == ENOSPC || e == EDQUOT ? TKD_ERR_NOSPACE : e == ENOENT ? TKD_ERR_NOT_FOUND : TKD_ERR_IO;
}

tkd_status tkd_cache_fsync_path(const char *path)
{
    int fd = open(path, O_RDONLY);
    if (fd < 0)
        return tkd_error_set(errno_status(errno), "%s: open for fsync: %s", path, strerror(errno));
    int r = fsync(fd);
    int e = errno;
    close(fd);
    if (r != 0)
        return tkd_error_set(errno_status(e), "%s: fsync: %s", path, strerror(e));
    return TKD_OK;
}

static tkd_status fsync_parent_dir(const char *path)
{
    char *copy = strdup(path);
    if (!copy)
        return tkd_error_set(TKD_ERR_NOMEM, "%s: out of memory", path);
    const char *dir = dirname(copy);
    int fd = open(dir, O_RDONLY | O_DIRECTORY);
    tkd_status st = TKD_OK;
    if (fd < 0 || fsync(fd) != 0)
        st = tkd_error_set(TKD_ERR_IO, "%s: fsync of the directory: %s", dir, strerror(errno));
    if (fd >= 0)
        close(fd);
    free(copy);
    return st;
}

tkd_status tkd_cache_rename_durable(const char *from, const char *to)
{
    if (rename(from, to) != 0)
        return tkd_error_set(errno_status(errno), "rename %s -> %s: %s", from, to, strerror(errno));
    return fsync_parent_dir(to);
}

tkd_status tkd_cache_write_atomic(const char *path, const void *data, size_t len)
{
    size_t cap = strlen(path) + 32;
    char *tmp = malloc(cap);
    if (!tmp)
        return tkd_error_set(TKD_ERR_NOMEM, "%s: out of memory", path);
    snprintf(tmp, cap, "%s.tmp.%ld", path, (long)getpid());
    int fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    tkd_status st = TKD_OK;
    if (fd < 0) {
        st = tkd_error_set(errno_status(errno), "%s: create: %s", tmp, strerror(errno));
        free(tmp);
        return st;
    }
    const char *p = data;
    size_t left = len;
    while (left > 0 && st == TKD_OK) {
        ssize_t n = write(fd, p, left);
        if (n < 0 && errno == EINTR)
            continue;
        if (n <= 0)
            st = tkd_error_set(errno_status(n < 0 ? errno : ENOSPC), "%s: write: %s", tmp,
                               strerror(n < 0 ? errno : ENOSPC));
        else {
            p += n;
            left -= (size_t)n;
        }
    }
    if (st == TKD_OK && fsync(fd) != 0)
        st = tkd_error_set(errno_status(errno), "%s: fsync: %s", tmp, strerror(errno));
    if (close(fd) != 0 && st == TKD_OK)
        st = tkd_error_set(errno_status(errno), "%s: close: %s", tmp, strerror(errno));
    if (st == TKD_OK)
        st = tkd_cache_rename_durable(tmp, path);
    if (st != TKD_OK)
        unlink(tmp);
    free(tmp);
    return st;
}
