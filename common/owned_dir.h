/* owned_dir.h — directories a tool makes, and may therefore empty again.
 *
 * A tool deletes only what it can prove it wrote. Each directory it makes carries a marker file of
 * the tool's own (kind->marker, e.g. ".topkd-cache"), written when the directory is taken into use,
 * and the tool names every entry it ever creates there (kind->names, fnmatch patterns). Emptying a
 * directory (--overwrite) needs the marker and removes nothing at all while an entry the tool does
 * not make is present: the refusal names the directory and that entry.
 *
 * A directory without the marker is taken into use only when it is empty, or when it was made by a
 * version of topkd from before markers: it holds nothing but the kind's names, and one of its files
 * (kind->sign_name) begins with the text that version wrote there (kind->sign_text). It gets its
 * marker then. Anything else — a user's folder, another tool's output — is refused. The marker's own
 * temporary file does not count: processes started together on a new directory (one worker per GPU)
 * all take it, whichever writes its marker first.
 *
 * These checks are about ownership, not about concurrency: the caller holds the directory's lock
 * (common/dir_lock.h) before it removes anything.
 */
#ifndef TKD_OWNED_DIR_H
#define TKD_OWNED_DIR_H

#include "common/status.h"

typedef struct tkd_dir_kind {
    const char *tool;         /* "teacher-dump": who makes it, for messages */
    const char *what;         /* "teacher cache": what it is, for messages */
    const char *marker;       /* ".topkd-cache": the ownership marker's file name */
    const char *const *names; /* every entry the tool makes there (fnmatch patterns, NULL-terminated);
                                 must match the marker and its temporary files too */
    const char *sign_name;    /* a file every such directory holds (fnmatch pattern), e.g. "manifest*.yaml", */
    const char *sign_text;    /* and the text it begins with: how an unmarked old directory is known */
} tkd_dir_kind;

/* Makes dir (mkdir -p) or checks the one there: it carries the marker, or it is empty or an old
 * directory of this kind (then the marker is written now). Otherwise TKD_ERR_INVALID_ARG naming dir
 * and the first entry the tool does not make, or saying that no file proves it an old one. */
tkd_status tkd_owned_dir_claim(const tkd_dir_kind *kind, const char *dir);

/* Checks dir before the caller removes entries of it: the marker is there and every entry matches
 * the kind's names. TKD_ERR_INVALID_ARG naming dir (and the unexpected entry) otherwise. */
tkd_status tkd_owned_dir_check(const tkd_dir_kind *kind, const char *dir);

/* --overwrite: tkd_owned_dir_check, then removes every entry except the marker and those matching
 * keep (fnmatch patterns, NULL-terminated; NULL = none), such as the lock file the caller holds.
 * Nothing is removed when the check fails. */
tkd_status tkd_owned_dir_clear(const tkd_dir_kind *kind, const char *dir, const char *const *keep);

/* Removes the entries of dir (files or whole trees) whose names match patterns (NULL-terminated):
 * the temporary files a dead run left. Only for the holder of the directory's lock. */
tkd_status tkd_owned_dir_remove(const char *dir, const char *const *patterns);

#endif /* TKD_OWNED_DIR_H */
