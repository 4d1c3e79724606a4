/* dir_lock.h — one writer per directory: a lock file inside it, held with flock(2) while the writer
 * runs.
 *
 * The kernel drops an flock when the last descriptor of its open file goes away, however the
 * process ends (SIGKILL included), so a lock is never stale and nothing needs cleaning up after a
 * crash. The lock file itself is never removed: a second writer could otherwise lock a fresh file
 * of the same name while the first still holds the old one. The holder writes its pid into the
 * file, so a refused writer can say who is in the way.
 *
 * Cooperating writers (the workers of one split teacher-dump, each writing its own files into one
 * directory) take the directory's lock shared, plus an exclusive lock of their own "<name>.<part>":
 * they run side by side, a second writer of the same part is refused, and so is an exclusive writer
 * while any of them runs.
 *
 * The lock files are opened O_CLOEXEC; a child made with fork (without exec) shares the lock.
 */
#ifndef TKD_DIR_LOCK_H
#define TKD_DIR_LOCK_H

#include <stdbool.h>

#include "common/status.h"

typedef struct tkd_dir_lock tkd_dir_lock;

/* Takes the exclusive lock <dir>/<name> (creating the file) without waiting. On success *out owns
 * it until tkd_dir_lock_release. When another process (or another handle in this one) holds it,
 * TKD_ERR_BUSY with "<dir>: another <tool> (pid N) is writing there — ...", naming every holder. */
tkd_status tkd_dir_lock_take(const char *dir, const char *name, const char *tool, tkd_dir_lock **out);

/* Takes <dir>/<name> shared and <dir>/<name>.<part> exclusively (part: [A-Za-z0-9_-], e.g.
 * "worker-1"), both without waiting; TKD_ERR_BUSY naming the holder when an exclusive writer holds
 * <name> or another writer holds the same part. */
tkd_status tkd_dir_lock_take_part(const char *dir, const char *name, const char *part, const char *tool,
                                  tkd_dir_lock **out);

/* True when the regular file at path holds what a lock file holds: nothing, or a pid and a newline
 * (the proof that lets a tool count it among its own files, common/owned_dir.h; ctx is unused). */
bool tkd_dir_lock_file_proof(const char *path, void *ctx);

/* Releases the lock(s) and frees l (NULL is a no-op). The files stay. */
void tkd_dir_lock_release(tkd_dir_lock *l);

#endif /* TKD_DIR_LOCK_H */
