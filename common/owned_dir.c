/* owned_dir.c — see owned_dir.h. */
#include "common/owned_dir.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <fnmatch.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/fileio.h"

#define OWNED_PATH_MAX 4096
#define OWNED_WHY_MAX 400

static bool matches(const char *name, const char *const *patterns)
{
    for (; patterns && *patterns; patterns++)
        if (fnmatch(*patterns, name, 0) == 0)
            return true;
    return false;
}

static bool is_dot(const char *name)
{
    return !strcmp(name, ".") || !strcmp(name, "..");
}

/* tkd_file_write_atomic's temporary of `file` ("<file>.tmp-XXXXXX"). */
static bool is_temp_of(const char *file, const char *name)
{
    size_t n = strlen(file);
    return strncmp(name, file, n) == 0 && strncmp(name + n, ".tmp-", 5) == 0;
}

bool tkd_owned_file_begins(const char *path, const char *text, size_t len, bool cut_ok)
{
    char head[512];
    if (len > sizeof head)
        return false;
    /* O_NOFOLLOW | O_NONBLOCK: a link or a FIFO swapped in since the caller's lstat proves nothing */
    int fd = open(path, O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK);
    if (fd < 0)
        return false;
    struct stat sb;
    size_t got = 0;
    bool reg = fstat(fd, &sb) == 0 && S_ISREG(sb.st_mode);
    while (reg && got < len) {
        ssize_t r = read(fd, head + got, len - got);
        if (r <= 0)
            break;
        got += (size_t)r;
    }
    close(fd);
    if (!reg || memcmp(head, text, got) != 0)
        return false;
    return got == len || (cut_ok && (off_t)got == sb.st_size);
}

/* ---- directories built whole -------------------------------------------------------------------- */

/* The marker's text: "A checkpoint built by topkd's student-train.", what it allows, and the
 * directory it was written into (device and inode, which a rename keeps): a copy of the directory
 * (cp -r checkpoint checkpoint.tmp-keep) carries a marker that names another directory, and so is not
 * taken for one the tool built. */
static int built_marker_text(const tkd_built_kind *k, const struct stat *dir, char *out, size_t cap, bool head_only)
{
    if (head_only)
        return snprintf(out, cap, "A %s built by topkd's %s.", k->what, k->tool);
    return snprintf(out, cap,
                    "A %s built by topkd's %s. With this file here, %s may remove this directory and the files\n"
                    "of a %s in it; it removes nothing else.\ndirectory: %llu:%llu\n", k->what, k->tool, k->tool,
                    k->what, (unsigned long long)dir->st_dev, (unsigned long long)dir->st_ino);
}

/* What the marker (or its temporary) at path says of the directory dir. */
typedef enum built_mark_state {
    MARK_OURS,  /* written into this very directory (a temporary: any beginning of that text) */
    MARK_COPY,  /* written by the tool into another directory: this one is a copy (or was restored) */
    MARK_OTHER, /* not the tool's text */
} built_mark_state;

static built_mark_state built_marker_state(const tkd_built_kind *k, const struct stat *dir, const char *path,
                                           bool temp)
{
    char text[512];
    int n = built_marker_text(k, dir, text, sizeof text, false);
    if (n > 0 && tkd_owned_file_begins(path, text, (size_t)n, temp))
        return MARK_OURS;
    n = built_marker_text(k, dir, text, sizeof text, true);
    return n > 0 && tkd_owned_file_begins(path, text, (size_t)n, temp) ? MARK_COPY : MARK_OTHER;
}

static tkd_status built_mark(const tkd_built_kind *k, const char *dir)
{
    char path[OWNED_PATH_MAX], text[512];
    struct stat sb;
    TKD_TRY(tkd_path_join(path, sizeof path, dir, TKD_BUILT_MARKER));
    if (lstat(dir, &sb) != 0)
        return tkd_error_set(TKD_ERR_IO, "%s: %s", dir, strerror(errno));
    int n = built_marker_text(k, &sb, text, sizeof text, false);
    return tkd_file_write_atomic(path, text, (size_t)n);
}

/* What a look into a built directory found. */
typedef struct built_scan {
    bool marked, signed_, only_files; /* marker; k->old_sign; nothing but the marker and k->files */
    bool copied;                      /* a marker of the tool's naming another directory */
    char why[256];                    /* the first entry that is not the kind's; "" when none */
} built_scan;

static tkd_status built_look(const tkd_built_kind *k, const char *dir, built_scan *s)
{
    memset(s, 0, sizeof *s);
    struct stat dsb;
    if (lstat(dir, &dsb) != 0)
        return tkd_error_set(errno == ENOENT ? TKD_ERR_NOT_FOUND : TKD_ERR_IO, "%s: %s", dir, strerror(errno));
    DIR *d = opendir(dir);
    if (!d)
        return tkd_error_set(errno == ENOENT ? TKD_ERR_NOT_FOUND : TKD_ERR_IO, "%s: cannot list the directory: %s",
                             dir, strerror(errno));
    struct dirent *e;
    while ((e = readdir(d)) != NULL && !s->why[0]) {
        char path[OWNED_PATH_MAX];
        struct stat sb;
        if (is_dot(e->d_name) || tkd_path_join(path, sizeof path, dir, e->d_name) != TKD_OK)
            continue;
        bool marker = !strcmp(e->d_name, TKD_BUILT_MARKER), temp = is_temp_of(TKD_BUILT_MARKER, e->d_name);
        if (lstat(path, &sb) != 0)
            continue; /* gone since readdir */
        if (!S_ISREG(sb.st_mode))
            snprintf(s->why, sizeof s->why, "holds '%.200s', which is not a regular file", e->d_name);
        else if (marker || temp) {
            built_mark_state m = built_marker_state(k, &dsb, path, temp);
            if (m == MARK_OTHER)
                snprintf(s->why, sizeof s->why, "holds a %.200s that %s did not write", e->d_name, k->tool);
            s->marked |= marker && m == MARK_OURS;
            s->copied |= marker && m == MARK_COPY;
        } else if (!matches(e->d_name, k->files))
            snprintf(s->why, sizeof s->why, "holds '%.200s', which a %s never holds", e->d_name, k->what);
        else if (k->old_sign && !strcmp(e->d_name, k->old_sign))
            s->signed_ = true;
    }
    closedir(d);
    s->only_files = !s->why[0];
    return TKD_OK;
}

/* Checks dir as tkd_built_dir_check; *marked says whether it carries the marker. On refusal
 * TKD_ERR_INVALID_ARG with the reason (without the path) in why. */
static tkd_status built_why(const tkd_built_kind *k, const char *dir, bool old_ok, bool *marked, char *why,
                            size_t cap)
{
    struct stat sb;
    if (lstat(dir, &sb) != 0)
        return tkd_error_set(errno == ENOENT ? TKD_ERR_NOT_FOUND : TKD_ERR_IO, "%s: %s", dir, strerror(errno));
    if (!S_ISDIR(sb.st_mode)) {
        snprintf(why, cap, "not a directory");
        return TKD_ERR_INVALID_ARG;
    }
    built_scan s;
    TKD_TRY(built_look(k, dir, &s));
    if (s.why[0])
        snprintf(why, cap, "%s", s.why);
    else if (!s.marked && !(old_ok && k->old_sign && s.signed_) && s.copied)
        snprintf(why, cap, "its %s was written into another directory: this one is a copy", TKD_BUILT_MARKER);
    else if (!s.marked && !(old_ok && k->old_sign && s.signed_))
        snprintf(why, cap, "no %s file in it", TKD_BUILT_MARKER);
    else {
        *marked = s.marked;
        return TKD_OK;
    }
    return TKD_ERR_INVALID_ARG;
}

static tkd_status built_check(const tkd_built_kind *k, const char *dir, bool old_ok, bool *marked)
{
    char why[OWNED_WHY_MAX];
    tkd_status st = built_why(k, dir, old_ok, marked, why, sizeof why);
    return st == TKD_ERR_INVALID_ARG ? tkd_error_set(st, "%s: %s, so it is not a %s %s built — move it away", dir, why,
                                                     k->what, k->tool)
                                     : st;
}

tkd_status tkd_built_dir_check(const tkd_built_kind *k, const char *dir, bool old_ok)
{
    bool marked;
    return built_check(k, dir, old_ok, &marked);
}

tkd_status tkd_built_dir_remove(const tkd_built_kind *k, const char *dir, bool old_ok)
{
    bool marked;
    tkd_status st = built_check(k, dir, old_ok, &marked);
    if (st == TKD_ERR_NOT_FOUND)
        return TKD_OK;
    TKD_TRY(st);
    DIR *d = opendir(dir);
    if (!d)
        return tkd_error_set(TKD_ERR_IO, "%s: cannot list the directory: %s", dir, strerror(errno));
    struct dirent *e;
    while (st == TKD_OK && (e = readdir(d)) != NULL) {
        char path[OWNED_PATH_MAX];
        if (is_dot(e->d_name))
            continue;
        st = tkd_path_join(path, sizeof path, dir, e->d_name);
        /* unlink never removes a directory: one that appeared since the check stays, and rmdir fails */
        if (st == TKD_OK && unlink(path) != 0 && errno != ENOENT)
            st = tkd_error_set(TKD_ERR_IO, "%s: cannot remove it: %s", path, strerror(errno));
    }
    closedir(d);
    if (st == TKD_OK && rmdir(dir) != 0 && errno != ENOENT)
        st = tkd_error_set(TKD_ERR_IO, "%s: cannot remove the directory: %s", dir, strerror(errno));
    return st;
}

tkd_status tkd_built_dir_make_temp(const tkd_built_kind *k, const char *final, char *out, size_t cap)
{
    int n = snprintf(out, cap, "%s.tmp-XXXXXX", final);
    if (n < 0 || (size_t)n >= cap)
        return tkd_error_set(TKD_ERR_INVALID_ARG, "%s: path too long for a temporary directory", final);
    if (!mkdtemp(out))
        return tkd_error_set(errno == ENOSPC ? TKD_ERR_NOSPACE : TKD_ERR_IO,
                             "%s: creating a temporary directory next to it failed: %s", final, strerror(errno));
    tkd_status st = built_mark(k, out);
    if (st != TKD_OK)
        rmdir(out); /* empty: mkdtemp made it just now, and the marker's temporary is gone */
    return st;
}

tkd_status tkd_built_dir_make(const tkd_built_kind *k, const char *dir)
{
    if (mkdir(dir, 0755) == 0)
        return built_mark(k, dir);
    if (errno != EEXIST)
        return tkd_error_set(errno == ENOSPC ? TKD_ERR_NOSPACE : TKD_ERR_IO, "%s: mkdir failed: %s", dir,
                             strerror(errno));
    struct stat sb;
    built_scan s;
    if (lstat(dir, &sb) != 0 || !S_ISDIR(sb.st_mode))
        return tkd_error_set(TKD_ERR_INVALID_ARG, "%s: exists and is not a directory, where %s builds a %s", dir,
                             k->tool, k->what);
    TKD_TRY(built_look(k, dir, &s));
    if (!s.only_files)
        return tkd_error_set(TKD_ERR_INVALID_ARG, "%s: %s, so it is not a %s %s built — move it away", dir, s.why,
                             k->what, k->tool);
    /* another process of the same job made it a moment ago (its marker may still be on the way) */
    return s.marked ? TKD_OK : built_mark(k, dir);
}

/* fsync of every regular file directly inside dir, then of dir: a directory must be on disk before
 * it gets its final name. */
static tkd_status fsync_files(const char *dir)
{
    DIR *d = opendir(dir);
    if (!d)
        return tkd_error_set(TKD_ERR_IO, "%s: opendir failed: %s", dir, strerror(errno));
    struct dirent *e;
    tkd_status st = TKD_OK;
    while (st == TKD_OK && (e = readdir(d)) != NULL) {
        char child[OWNED_PATH_MAX];
        struct stat sb;
        if (is_dot(e->d_name))
            continue;
        st = tkd_path_join(child, sizeof child, dir, e->d_name);
        if (st == TKD_OK && lstat(child, &sb) == 0 && S_ISREG(sb.st_mode))
            st = tkd_fsync_file(child);
    }
    closedir(d);
    return st == TKD_OK ? tkd_fsync_dir(dir) : st;
}

static tkd_status old_path(const char *final, char *out, size_t cap)
{
    int n = snprintf(out, cap, "%s.old", final);
    return n > 0 && (size_t)n < cap ? TKD_OK : tkd_error_set(TKD_ERR_INVALID_ARG, "%s: path too long", final);
}

/* The parent directory of path, fsynced: a rename in it survives a crash. */
static tkd_status fsync_parent(const char *path)
{
    char dir[OWNED_PATH_MAX];
    const char *slash = strrchr(path, '/');
    snprintf(dir, sizeof dir, "%.*s", slash ? (slash == path ? 1 : (int)(slash - path)) : 1, slash ? path : ".");
    return tkd_fsync_dir(dir);
}

tkd_status tkd_built_dir_rename(const tkd_built_kind *k, const char *tmp, const char *final)
{
    char old[OWNED_PATH_MAX];
    bool marked = true;
    TKD_TRY(fsync_files(tmp));
    TKD_TRY(old_path(final, old, sizeof old));
    TKD_TRY(tkd_built_dir_remove(k, old, false)); /* left by an earlier crash */
    bool had_final = tkd_file_exists(final);
    if (had_final)
        TKD_TRY(built_check(k, final, true, &marked));
    if (!marked) /* an older version's: marked now, so that the ".old" it becomes is proven ours */
        TKD_TRY(built_mark(k, final));
    tkd_status st = TKD_OK;
    if (had_final && rename(final, old) != 0)
        st = tkd_error_set(TKD_ERR_IO, "%s: moving the previous version aside failed: %s", final, strerror(errno));
    if (st == TKD_OK && rename(tmp, final) != 0) {
        st = tkd_error_set(errno == ENOSPC ? TKD_ERR_NOSPACE : TKD_ERR_IO,
                           "%s: renaming the new version into place failed: %s", final, strerror(errno));
        if (had_final && rename(old, final) != 0) /* put the previous version back */
            tkd_error_hint(st, "the previous version could not be put back either: it is at %s", old);
    }
    if (st == TKD_OK)
        st = fsync_parent(final);
    if (st == TKD_OK && had_final)
        st = tkd_built_dir_remove(k, old, false);
    return st;
}

tkd_status tkd_built_dir_recover(const tkd_built_kind *k, const char *final)
{
    char old[OWNED_PATH_MAX];
    TKD_TRY(old_path(final, old, sizeof old));
    if (!tkd_file_exists(old))
        return TKD_OK;
    if (tkd_file_exists(final))
        return tkd_built_dir_remove(k, old, false);
    TKD_TRY(tkd_built_dir_check(k, old, false));
    return tkd_rename_durable(old, final);
}

/* ---- the directories a tool owns ---------------------------------------------------------------- */

/* The marker's temporary (tkd_file_write_atomic's "<marker>.tmp-XXXXXX"): another process claiming
 * the same new directory at this moment (workers started together), or a claim that died half-way.
 * Either way the directory is still as good as empty. */
static bool is_marker_temp(const tkd_dir_kind *k, const char *name)
{
    return is_temp_of(k->marker, name);
}

static int marker_text(const tkd_dir_kind *k, char *out, size_t cap, bool head_only)
{
    if (head_only)
        return snprintf(out, cap, "A %s made by topkd's %s.", k->what, k->tool);
    return snprintf(out, cap,
                    "A %s made by topkd's %s. With this file here, %s --overwrite may empty the directory\n"
                    "of the files it makes (and nothing else); without it, it removes nothing.\n",
                    k->what, k->tool, k->tool);
}

/* The marker (or, cut_ok, its temporary) holds the kind's text. */
static bool marker_ok(const tkd_dir_kind *k, const char *path, bool cut_ok)
{
    char text[512];
    int n = marker_text(k, text, sizeof text, !cut_ok);
    return n > 0 && tkd_owned_file_begins(path, text, (size_t)n, cut_ok);
}

static const tkd_owned_name *rule_of(const tkd_dir_kind *k, const char *name)
{
    for (const tkd_owned_name *r = k->names; r && r->pattern; r++)
        if (fnmatch(r->pattern, name, 0) == 0)
            return r;
    return NULL;
}

/* One look through a directory: what it holds, the first entry that fails, and (when asked) the
 * entries to remove. */
typedef struct dir_scan {
    const tkd_dir_kind *k;
    const char *dir;
    void *ctx;                /* the kind's proof context */
    bool foreign_ok;          /* an entry without one of the kind's names is no failure */
    tkd_owned_pick pick;      /* which proven entries to collect into rm (NULL: none) */
    void *pick_arg;
    bool marked, empty, signed_;
    char bad[256];            /* the first entry that fails; "" when none */
    char why[OWNED_WHY_MAX];  /* and why */
    char **rm;                /* (n_rm) names to remove */
    const tkd_owned_name **rm_rule; /* (n_rm) their rules (NULL: the marker's temporary) */
    size_t n_rm, cap_rm;
} dir_scan;

static void scan_free(dir_scan *s)
{
    for (size_t i = 0; i < s->n_rm; i++)
        free(s->rm[i]);
    free(s->rm);
    free(s->rm_rule);
    s->rm = NULL;
    s->rm_rule = NULL;
    s->n_rm = s->cap_rm = 0;
}

static tkd_status collect(dir_scan *s, const char *name, const tkd_owned_name *rule)
{
    if (s->n_rm == s->cap_rm) {
        size_t cap = s->cap_rm ? 2 * s->cap_rm : 64;
        char **rm = realloc(s->rm, cap * sizeof *rm);
        if (rm)
            s->rm = rm;
        const tkd_owned_name **rr = rm ? realloc(s->rm_rule, cap * sizeof *rr) : NULL;
        if (!rr)
            return tkd_error_set(TKD_ERR_NOMEM, "%s: out of memory listing the directory", s->dir);
        s->rm_rule = rr;
        s->cap_rm = cap;
    }
    if (!(s->rm[s->n_rm] = strdup(name)))
        return tkd_error_set(TKD_ERR_NOMEM, "%s: out of memory listing the directory", s->dir);
    s->rm_rule[s->n_rm++] = rule;
    return TKD_OK;
}

/* What dir/name is, for a refusal: "a directory", "a symbolic link", ... */
static const char *type_name(mode_t m)
{
    return S_ISDIR(m) ? "a directory" : S_ISLNK(m) ? "a symbolic link" : "not a regular file";
}

/* Proves dir/name against its rule (r NULL: the marker or its temporary); false with the reason in
 * why (OWNED_WHY_MAX bytes) when it fails. */
static bool prove(const dir_scan *s, const char *name, const char *path, const struct stat *sb,
                  const tkd_owned_name *r, char *why)
{
    const tkd_dir_kind *k = s->k;
    why[0] = '\0';
    if (r && r->built) {
        bool marked;
        if (!S_ISDIR(sb->st_mode))
            snprintf(why, OWNED_WHY_MAX, "%s, where %s makes only a %s directory of that name",
                     type_name(sb->st_mode), k->tool, r->built->what);
        else {
            char inner[OWNED_WHY_MAX] = "";
            if (built_why(r->built, path, r->built_old_ok, &marked, inner, sizeof inner) == TKD_OK)
                return true;
            snprintf(why, OWNED_WHY_MAX, "a directory %s did not build (%.300s)", k->tool,
                     inner[0] ? inner : tkd_error_msg());
        }
        return false;
    }
    if (!S_ISREG(sb->st_mode)) {
        snprintf(why, OWNED_WHY_MAX, "%s, where %s writes only a file of that name", type_name(sb->st_mode),
                 k->tool);
        return false;
    }
    bool ok = r ? r->prove(path, s->ctx) : marker_ok(k, path, strcmp(name, k->marker) != 0);
    if (!ok)
        snprintf(why, OWNED_WHY_MAX, "a file %s did not write (%s)", k->tool,
                 r ? r->proof : "it does not hold the marker's text");
    return ok;
}

/* prove, allowing for a cooperating writer (another worker of a split dump) that is writing the entry
 * or renaming it into place as we look: one that is gone since is no failure, and one that changed
 * meanwhile gets a second look. */
static bool proven(const dir_scan *s, const char *name, const char *path, struct stat *sb, const tkd_owned_name *r,
                   char *why)
{
    for (int look = 0; look < 2; look++) {
        if (prove(s, name, path, sb, r, why))
            return true;
        struct stat now;
        if (lstat(path, &now) != 0)
            return errno == ENOENT;
        bool changed = now.st_ino != sb->st_ino || now.st_size != sb->st_size ||
                       now.st_mtim.tv_sec != sb->st_mtim.tv_sec || now.st_mtim.tv_nsec != sb->st_mtim.tv_nsec ||
                       now.st_mode != sb->st_mode;
        *sb = now;
        if (!changed)
            return false;
    }
    return false;
}

/* Looks at one entry: marks what the directory holds, proves it, collects it for removal. */
static tkd_status scan_entry(dir_scan *s, const char *name)
{
    const tkd_dir_kind *k = s->k;
    bool mtemp = is_marker_temp(k, name), marker = !strcmp(name, k->marker);
    const tkd_owned_name *r = marker || mtemp ? NULL : rule_of(k, name);
    if (!mtemp)
        s->empty = false;
    if (!marker && !mtemp && !r) {
        if (!s->foreign_ok && !s->bad[0]) {
            snprintf(s->bad, sizeof s->bad, "%s", name);
            snprintf(s->why, sizeof s->why, "which %s does not make", k->tool);
        }
        return TKD_OK;
    }
    char path[OWNED_PATH_MAX];
    struct stat sb;
    TKD_TRY(tkd_path_join(path, sizeof path, s->dir, name));
    if (lstat(path, &sb) != 0)
        return TKD_OK; /* gone since readdir (another worker's temporary renamed into place) */
    if (s->bad[0] && !marker) /* refused already; only whether it is marked still matters */
        return TKD_OK;
    char why[OWNED_WHY_MAX];
    if (!proven(s, name, path, &sb, r, why)) {
        if (!s->bad[0]) {
            snprintf(s->bad, sizeof s->bad, "%s", name);
            snprintf(s->why, sizeof s->why, "%s", why);
        }
        return TKD_OK;
    }
    s->marked |= marker;
    if (!s->signed_ && k->sign_name && fnmatch(k->sign_name, name, 0) == 0)
        s->signed_ = tkd_owned_file_begins(path, k->sign_text, strlen(k->sign_text), false);
    if (s->pick && !marker && !matches(name, k->keep) && s->pick(name, s->pick_arg))
        return collect(s, name, r);
    return TKD_OK;
}

static tkd_status scan(dir_scan *s)
{
    s->empty = true;
    DIR *d = opendir(s->dir);
    if (!d)
        return tkd_error_set(errno == ENOENT ? TKD_ERR_NOT_FOUND : TKD_ERR_IO, "%s: cannot list the directory: %s",
                             s->dir, strerror(errno));
    tkd_status st = s->k->proofs_open ? s->k->proofs_open(s->dir, &s->ctx) : TKD_OK;
    struct dirent *e;
    while (st == TKD_OK && (e = readdir(d)) != NULL)
        if (!is_dot(e->d_name))
            st = scan_entry(s, e->d_name);
    closedir(d);
    if (s->k->proofs_close && s->ctx)
        s->k->proofs_close(s->ctx);
    s->ctx = NULL;
    return st;
}

/* Removes the entries a scan collected: files by unlink (which never removes a directory), built
 * directories by tkd_built_dir_remove (which checks them again). */
static tkd_status remove_collected(const dir_scan *s)
{
    tkd_status st = TKD_OK;
    for (size_t i = 0; st == TKD_OK && i < s->n_rm; i++) {
        char path[OWNED_PATH_MAX];
        const tkd_owned_name *r = s->rm_rule[i];
        st = tkd_path_join(path, sizeof path, s->dir, s->rm[i]);
        if (st == TKD_OK && r && r->built)
            st = tkd_built_dir_remove(r->built, path, r->built_old_ok);
        else if (st == TKD_OK && unlink(path) != 0 && errno != ENOENT)
            st = tkd_error_set(TKD_ERR_IO, "%s: cannot remove it: %s — check permissions", path, strerror(errno));
    }
    return st;
}

static tkd_status write_marker(const tkd_dir_kind *k, const char *dir)
{
    char path[OWNED_PATH_MAX], text[512];
    TKD_TRY(tkd_path_join(path, sizeof path, dir, k->marker));
    int n = marker_text(k, text, sizeof text, false);
    return tkd_file_write_atomic(path, text, (size_t)n);
}

tkd_status tkd_owned_dir_claim(const tkd_dir_kind *k, const char *dir)
{
    char marker[OWNED_PATH_MAX];
    struct stat sb;
    TKD_TRY(tkd_mkdir_p(dir));
    TKD_TRY(tkd_path_join(marker, sizeof marker, dir, k->marker));
    /* marked: ours whatever else it holds (taking it into use removes nothing), and no need to
     * prove each entry here (which reads every manifest of a cache) */
    if (lstat(marker, &sb) == 0 && S_ISREG(sb.st_mode) && marker_ok(k, marker, false))
        return TKD_OK;
    dir_scan s = {.k = k, .dir = dir};
    TKD_TRY(scan(&s));
    if (s.marked)
        return TKD_OK;
    if (s.bad[0])
        return tkd_error_set(TKD_ERR_INVALID_ARG,
                             "%s: not a %s of %s's: it holds '%s', %s — use a new or empty directory", dir, k->what,
                             k->tool, s.bad, s.why);
    if (!s.empty && !s.signed_)
        return tkd_error_set(TKD_ERR_INVALID_ARG,
                             "%s: not a %s of %s's: no %s file, and no %s written by %s — use a new or empty "
                             "directory, or delete this one yourself", dir, k->what, k->tool, k->marker, k->sign_name,
                             k->tool);
    return write_marker(k, dir);
}

static bool pick_all(const char *name, void *arg)
{
    (void)name, (void)arg;
    return true;
}

tkd_status tkd_owned_dir_clear(const tkd_dir_kind *k, const char *dir, tkd_owned_pick pick, void *arg)
{
    dir_scan s = {.k = k, .dir = dir, .pick = pick ? pick : pick_all, .pick_arg = arg};
    tkd_status st = scan(&s);
    if (st == TKD_OK && s.bad[0])
        st = tkd_error_set(TKD_ERR_INVALID_ARG, "%s: holds '%s', %s, so --overwrite removes nothing there — move it "
                           "away, or use another directory", dir, s.bad, s.why);
    else if (st == TKD_OK && !s.marked)
        st = tkd_error_set(TKD_ERR_INVALID_ARG,
                           "%s: not made by %s (no %s file in it), so --overwrite removes nothing there — "
                           "delete it yourself if you mean to, or use another directory", dir, k->tool, k->marker);
    if (st == TKD_OK)
        st = remove_collected(&s);
    scan_free(&s);
    return st;
}

static bool pick_patterns(const char *name, void *arg)
{
    return matches(name, arg);
}

tkd_status tkd_owned_dir_tidy(const tkd_dir_kind *k, const char *dir, const char *const *temps)
{
    dir_scan s = {.k = k, .dir = dir, .foreign_ok = true, .pick = temps ? pick_patterns : NULL,
                  .pick_arg = (void *)temps};
    tkd_status st = scan(&s);
    if (st == TKD_OK && s.bad[0])
        st = tkd_error_set(TKD_ERR_INVALID_ARG, "%s: holds '%s', %s — %s removes or writes over only what it wrote, "
                           "so it stops here with nothing removed: move that entry away, or use another directory",
                           dir, s.bad, s.why, k->tool);
    if (st == TKD_OK)
        st = remove_collected(&s);
    scan_free(&s);
    return st;
}
