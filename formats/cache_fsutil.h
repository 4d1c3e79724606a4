/* cache_fsutil.h — durable file operations for the teacher cache: fsync, rename-then-fsync-dir,
 * atomic whole-file writes, and the sha256 digest that identifies a shard in the manifest.
 *
 * The cache promises that a crash never leaves a shard or manifest under its final name that is
 * incomplete; these helpers are the only way cache files reach their final names.
 */
#ifndef TKD_CACHE_FSUTIL_H
#define TKD_CACHE_FSUTIL_H

#include <stddef.h>
#include <stdint.h>

#include "common/status.h"

/* fsyncs an existing file by path. */
tkd_status tkd_cache_fsync_path(const char *path);

/* rename(from, to), then fsyncs the directory holding `to` so the new name survives a crash. */
tkd_status tkd_cache_rename_durable(const char *from, const char *to);

/* Writes len bytes to path atomically: "<path>.tmp.<pid>" in the same directory, fsync, rename,
 * fsync the directory. ENOSPC becomes TKD_ERR_NOSPACE. The temp file is removed on failure. */
tkd_status tkd_cache_write_atomic(const char *path, const void *data, size_t len);

/* sha256 of a whole file as 64 lowercase hex digits (hex has room for 65 chars) and its size
 * (bytes may be NULL). */
tkd_status tkd_cache_file_digest(const char *path, char hex[65], uint64_t *bytes);

/* sha256 of a memory buffer as lowercase hex. */
void tkd_cache_sha256_hex(const void *data, size_t len, char hex[65]);

#endif /* TKD_CACHE_FSUTIL_H */
