/* fileio.h — file helpers that never leave a half-written file where a later run would trust it.
 *
 * Outputs (manifests, configs, checkpoints) reach their final name only by rename after an fsync:
 * a crash leaves either the old complete file or the new complete one. A disk-full error is
 * TKD_ERR_NOSPACE with "disk full" in the message; on any failure the temporary is removed.
 */
#ifndef TKD_FILEIO_H
#define TKD_FILEIO_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "common/status.h"

/* Writes data[0..len) to path atomically: a temp file "<path>.tmp-XXXXXX" in the same directory,
 * fsync, rename over path, fsync the directory. Mode 0644. */
tkd_status tkd_file_write_atomic(const char *path, const void *data, size_t len);

/* The same for output produced piece by piece (e.g. YAML written with fprintf): open gives a
 * FILE* on the temp file; commit flushes, fsyncs, renames and fsyncs the directory; abort removes
 * the temp. Exactly one of commit/abort must follow a successful open; both release the struct. */
typedef struct tkd_atomic_file {
    FILE *fp;          /* write here */
    char *path;        /* final name (owned) */
    char *tmp;         /* temp name (owned) */
} tkd_atomic_file;

tkd_status tkd_atomic_file_open(tkd_atomic_file *af, const char *path);
tkd_status tkd_atomic_file_commit(tkd_atomic_file *af);
void tkd_atomic_file_abort(tkd_atomic_file *af);

/* mkdir -p with mode 0755; existing directories are fine, an existing non-directory is an error. */
tkd_status tkd_mkdir_p(const char *path);

/* tkd_mkdir_p that says what it made: made (cap bytes) gets the shallowest directory this call
 * created ("" when every one was there already; the folders below it up to path are this call's
 * too), so that a run that fails can remove exactly those (tkd_rmdir_made) and never a folder the
 * user had. made is "" after an error too, unless the call made something before failing. */
tkd_status tkd_mkdir_p_made(const char *path, char *made, size_t cap);

/* Undoes tkd_mkdir_p_made(path, made): removes path, then each parent up to and including made,
 * with rmdir, so a folder that holds anything stays (and those above it). Nothing when made is "". */
void tkd_rmdir_made(const char *path, const char *made);

/* 1 when every entry of dir matches one of the fnmatch patterns (NULL-terminated): a directory
 * that holds nothing but a tool's own marker and lock files. 0 when dir cannot be read. */
int tkd_dir_holds_only(const char *dir, const char *const *patterns);

/* out = a "/" b (no doubled slash; b absolute -> b). TKD_ERR_INVALID_ARG when it does not fit
 * cap bytes with the NUL. */
tkd_status tkd_path_join(char *out, size_t cap, const char *a, const char *b);

/* The same into a malloc'd string the caller frees (*out = NULL on failure). */
tkd_status tkd_path_join_alloc(char **out, const char *a, const char *b);

/* True when path exists (any type). */
bool tkd_file_exists(const char *path);

/* Size in bytes of a regular file. TKD_ERR_NOT_FOUND when missing. */
tkd_status tkd_file_size(const char *path, uint64_t *size);

/* ---- opening inputs ----------------------------------------------------------------------------
 * Every file a tool reads (configs, token files, manifests, checkpoints, shards) is opened through
 * these, so that a path naming a FIFO, a device or a directory is refused before anything blocks on
 * it, and a SIGINT/SIGTERM seen while reading (tkd_interrupted(), or a read that returned EINTR)
 * ends the read with TKD_ERR_INTERRUPTED. `what` names the file's role in messages ("token
 * file", "config file"). */

/* TKD_OK when path is a regular file (symbolic links followed); TKD_ERR_NOT_FOUND when missing;
 * TKD_ERR_IO naming what it is (a FIFO, a directory, ...) otherwise. For files a library opens
 * itself (HDF5). */
tkd_status tkd_input_check(const char *path, const char *what);

/* tkd_input_check, then open for reading (O_CLOEXEC). The open itself cannot block: it is made
 * with O_NONBLOCK and the descriptor checked again, so a file swapped for a FIFO in between is
 * refused too. On success *fd is the caller's to close (blocking mode restored). */
tkd_status tkd_open_input(const char *path, const char *what, int *fd);

/* The same as a FILE* ("rb") the caller fcloses. */
tkd_status tkd_fopen_input(const char *path, const char *what, FILE **fp);

/* fread of n bytes into buf; *got says how many came (fewer only at the end of the file). An
 * interrupt before or during the read is TKD_ERR_INTERRUPTED, a read error TKD_ERR_IO; both name
 * path. */
tkd_status tkd_fread_input(FILE *fp, void *buf, size_t n, size_t *got, const char *path);

/* Sets TKD_ERR_INTERRUPTED "<path>: interrupted by SIGINT while reading the <what>" (the signal
 * tkd_interrupted() saw) and returns it: for readers that poll between the chunks of a long read. */
tkd_status tkd_input_interrupted(const char *path, const char *what);

/* Reads a whole input file into a malloc'd buffer the caller frees; *data gets one extra NUL
 * byte after the contents (so text can be used as a C string), *size excludes it. */
tkd_status tkd_read_input(const char *path, const char *what, void **data, size_t *size);

/* tkd_read_input of a "file". */
tkd_status tkd_read_file(const char *path, void **data, size_t *size);

/* Fsyncs the directory itself (so entries created or renamed in it survive a crash). */
tkd_status tkd_fsync_dir(const char *dir);

/* Fsyncs an existing file by path (e.g. one a library such as HDF5 wrote and closed). */
tkd_status tkd_fsync_file(const char *path);

/* rename(from, to), then fsyncs the directory holding `to` so the new name survives a crash. For
 * files written and fsynced by other means (tkd_file_write_atomic does all of this itself). */
tkd_status tkd_rename_durable(const char *from, const char *to);

/* *within = true when inner is outer or lies below it, compared by device and inode along inner's
 * real path, so symlinks and other spellings of one directory are seen through. A tail of inner
 * that does not exist yet is taken to lie where its deepest existing ancestor is. A missing outer
 * contains nothing. */
tkd_status tkd_path_within(const char *inner, const char *outer, bool *within);

/* rm -rf path (no error when missing). For tests and for a tree the caller made itself this run:
 * what a tool removes from its directories goes through common/owned_dir.h, which proves it first. */
tkd_status tkd_remove_tree(const char *path);

#endif /* TKD_FILEIO_H */
