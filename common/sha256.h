/* sha256.h — SHA-256 (FIPS 180-4) of buffers, streams and files, for file identity: the cache
 * manifest records the sha256 of the teacher weights and the dataset so a mismatched cache is
 * caught before training on it. */
#ifndef TKD_SHA256_H
#define TKD_SHA256_H

#include <stddef.h>
#include <stdint.h>

#include "common/status.h"

#define TKD_SHA256_BYTES 32
#define TKD_SHA256_HEX_LEN 65 /* 64 hex digits + NUL */

typedef struct tkd_sha256 {
    uint32_t h[8];
    uint64_t nbytes;       /* total bytes fed so far */
    uint8_t block[64];     /* pending partial block */
    size_t fill;           /* bytes in block */
} tkd_sha256;

void tkd_sha256_init(tkd_sha256 *c);
void tkd_sha256_update(tkd_sha256 *c, const void *data, size_t len);
/* Writes the digest; c must be re-initialised before reuse. */
void tkd_sha256_final(tkd_sha256 *c, uint8_t out[TKD_SHA256_BYTES]);

/* One-shot digest of a buffer. */
void tkd_sha256_buffer(const void *data, size_t len, uint8_t out[TKD_SHA256_BYTES]);

/* Lower-case hex of a digest into hex (65 bytes with the NUL). */
void tkd_sha256_hex(const uint8_t digest[TKD_SHA256_BYTES], char hex[TKD_SHA256_HEX_LEN]);

/* Digest of a whole file, read in 1 MiB blocks. TKD_ERR_NOT_FOUND / TKD_ERR_IO name the path. */
tkd_status tkd_sha256_file(const char *path, uint8_t out[TKD_SHA256_BYTES]);

/* Same, as hex. */
tkd_status tkd_sha256_file_hex(const char *path, char hex[TKD_SHA256_HEX_LEN]);

#endif /* TKD_SHA256_H */
