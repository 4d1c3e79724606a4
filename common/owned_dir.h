/* owned_dir.h — directories a tool makes, and what it may therefore remove from them again.
 *
 * A tool removes only what it can prove it wrote. Proof is per entry, never by name alone:
 *  - a file: a regular file (lstat: not a symbolic link, not a directory) whose name is one the tool
 *    uses there and whose content (or a record of the tool's, such as a manifest listing it) shows
 *    that the tool wrote it — each name comes with its proof (tkd_owned_name);
 *  - a directory the tool builds whole and renames into place (a checkpoint, its staging copies): it
 *    carries the tool's marker file ".topkd-built", written when the directory is made and naming
 *    that directory's device and inode (which a rename keeps and a copy does not, so a user's
 *    `cp -r checkpoint checkpoint.tmp-keep` is not taken for one), and holds only regular files of
 *    the names such a directory holds (tkd_built_kind). Nothing is removed recursively: the files
 *    are unlinked one by one, then the empty directory is removed.
 * Any entry that has one of the tool's names but fails its proof is refused, naming it, and then
 * nothing at all is removed.
 *
 * The directory itself carries a marker file of the tool's own (kind->marker, e.g. ".topkd-cache"),
 * written when the directory is taken into use. Emptying a directory (--overwrite) needs the marker
 * and refuses while an entry the tool does not make is present. A directory without the marker is
 * taken into use only when it is empty, or when it was made by a version of topkd from before markers:
 * every entry is one of the kind's and proven, and one of its files (kind->sign_name) begins with the
 * text that version wrote there (kind->sign_text). It gets its marker then. The marker's own
 * temporary file does not count: processes started together on a new directory (one worker per GPU)
 * all take it, whichever writes its marker first.
 *
 * These checks are about ownership, not about concurrency: the caller holds the directory's lock
 * (common/dir_lock.h) before it removes anything.
 */
#ifndef TKD_OWNED_DIR_H
#define TKD_OWNED_DIR_H

#include <stdbool.h>
#include <stddef.h>

#include "common/status.h"

/* ---- directories built whole (checkpoints) ------------------------------------------------------ */

#define TKD_BUILT_MARKER ".topkd-built"

typedef struct tkd_built_kind {
    const char *tool;          /* "student-train": who builds it, for messages */
    const char *what;          /* "checkpoint": what it is, for messages and the marker's text */
    const char *const *files;  /* every file the tool writes in it, temporaries included (fnmatch
                                  patterns, NULL-terminated); the marker is implied */
    const char *old_sign;      /* a file every such directory made before markers holds ("state.json");
                                  where the caller allows it, an unmarked directory holding it and only
                                  regular files of `files` is taken as one an older version built */
} tkd_built_kind;

/* Makes a fresh directory "<final>.tmp-XXXXXX" next to final with the marker in it, for building
 * before tkd_built_dir_rename; its path goes to out (cap bytes). */
tkd_status tkd_built_dir_make_temp(const tkd_built_kind *k, const char *final, char *out, size_t cap);

/* Makes dir (one level; a parent must exist) with the marker, for staging that several processes
 * fill together (each may call it): an existing dir is fine when it carries the marker or holds
 * nothing but files of the kind. TKD_ERR_INVALID_ARG naming dir otherwise. */
tkd_status tkd_built_dir_make(const tkd_built_kind *k, const char *dir);

/* TKD_OK when dir is a directory of kind k: the marker and regular files of k->files only (with
 * old_ok, an unmarked one holding k->old_sign will do). TKD_ERR_INVALID_ARG naming dir and the
 * reason otherwise; TKD_ERR_NOT_FOUND when it is missing. */
tkd_status tkd_built_dir_check(const tkd_built_kind *k, const char *dir, bool old_ok);

/* tkd_built_dir_check, then unlinks its files and removes it. Missing: TKD_OK. Refused: nothing is
 * removed. */
tkd_status tkd_built_dir_remove(const tkd_built_kind *k, const char *dir, bool old_ok);

/* Moves a completed directory tmp (from tkd_built_dir_make_temp or _make) to final: fsyncs tmp's
 * files and tmp; if final exists (proven of kind k; an unmarked one of an older version gets the
 * marker first) it is renamed aside to "<final>.old", then tmp is renamed to final, the parent
 * fsynced, and the old one removed. A crash between the two renames leaves "<final>.old" complete;
 * a stale "<final>.old" (proven, marker required) is removed first. */
tkd_status tkd_built_dir_rename(const tkd_built_kind *k, const char *tmp, const char *final);

/* After a crash inside tkd_built_dir_rename: when final is missing and "<final>.old" is there, the
 * previous version is put back; a "<final>.old" beside final is removed. Each only when proven of
 * kind k (TKD_ERR_INVALID_ARG naming it otherwise). Nothing there: nothing to do. */
tkd_status tkd_built_dir_recover(const tkd_built_kind *k, const char *final);

/* ---- the directories a tool owns ---------------------------------------------------------------- */

/* True when the regular file at path is proven the tool's (ctx: the kind's proof context). */
typedef bool (*tkd_owned_proof)(const char *path, void *ctx);

/* One name the tool uses in its directory, and how an entry of that name is proven its own. */
typedef struct tkd_owned_name {
    const char *pattern;         /* fnmatch pattern; NULL ends the table */
    tkd_owned_proof prove;       /* a regular file: proven when this says so */
    const char *proof;           /* why one fails, for messages: "it does not begin with '# ...'" */
    const tkd_built_kind *built; /* instead of prove: a directory, proven by tkd_built_dir_check */
    bool built_old_ok;           /* ... which may be an unmarked one of an older version */
} tkd_owned_name;

typedef struct tkd_dir_kind {
    const char *tool;             /* "teacher-dump": who makes it, for messages */
    const char *what;             /* "teacher cache": what it is, for messages */
    const char *marker;           /* ".topkd-cache": the ownership marker's file name (implied in names) */
    const tkd_owned_name *names;  /* every other entry the tool makes there, with its proof */
    const char *const *keep;      /* never removed by a clear (the lock files the caller holds); NULL = none */
    const char *sign_name;        /* a file every such directory holds (fnmatch pattern), e.g. "manifest*.yaml", */
    const char *sign_text;        /* and the text it begins with: how an unmarked old directory is known */
    /* Optional: what the proofs of one look through dir need (e.g. the shards its manifests list),
     * made before the look and freed after it. An error stops the look. */
    tkd_status (*proofs_open)(const char *dir, void **ctx);
    void (*proofs_close)(void *ctx);
} tkd_dir_kind;

/* Makes dir (mkdir -p) or checks the one there: it carries the marker, or it is empty or an old
 * directory of this kind (then the marker is written now). Otherwise TKD_ERR_INVALID_ARG naming dir
 * and the first entry the tool does not make (or did not write), or saying that no file proves it an
 * old one. */
tkd_status tkd_owned_dir_claim(const tkd_dir_kind *kind, const char *dir);

/* Which entries a clear removes: true for `name`. */
typedef bool (*tkd_owned_pick)(const char *name, void *arg);

/* --overwrite: checks that dir carries the marker and that every entry is one of the kind's, proven;
 * then removes the entries pick chooses (pick NULL: all of them) except the marker and kind->keep.
 * TKD_ERR_INVALID_ARG naming dir and the first entry that fails, with nothing removed. */
tkd_status tkd_owned_dir_clear(const tkd_dir_kind *kind, const char *dir, tkd_owned_pick pick, void *arg);

/* At start-up, for the holder of the directory's lock: proves every entry that has one of the kind's
 * names (others are left alone), then removes those matching temps (fnmatch patterns, NULL-terminated;
 * NULL = none): the temporaries a dead run left. TKD_ERR_INVALID_ARG naming the first entry that
 * fails, with nothing removed: an entry of the tool's name the tool did not write would otherwise be
 * written over or cleaned up later. */
tkd_status tkd_owned_dir_tidy(const tkd_dir_kind *kind, const char *dir, const char *const *temps);

/* Proof helper: true when the regular file at path begins with text; with cut_ok, also when the whole
 * file is a (possibly empty) beginning of text — a temporary that a crash cut short. */
bool tkd_owned_file_begins(const char *path, const char *text, size_t len, bool cut_ok);

/* Defines the two proofs (tkd_owned_proof) of a file the tool writes whole and that begins with the
 * string literal head: name(), the file, and name_tmp(), its temporary (that beginning, or a cut-short
 * part of it: the writer died). The proof context is not used. */
#define TKD_OWNED_HEAD_PROOFS(name, head)                                                                   \
    static bool name(const char *path, void *ctx)                                                          \
    {                                                                                                      \
        (void)ctx;                                                                                         \
        return tkd_owned_file_begins(path, head, sizeof head - 1, false);                                  \
    }                                                                                                      \
    static bool name##_tmp(const char *path, void *ctx)                                                    \
    {                                                                                                      \
        (void)ctx;                                                                                         \
        return tkd_owned_file_begins(path, head, sizeof head - 1, true);                                   \
    }

#endif /* TKD_OWNED_DIR_H */
