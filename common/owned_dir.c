/* owned_dir.c — see owned_dir.h. */
#include "common/owned_dir.h"

#include <dirent.h>
#include <errno.h>
#include <fnmatch.h>
#include <stdbool.h>
#include <stdio.h>
#include <string.h>

#include "common/fileio.h"

#define OWNED_PATH_MAX 4096

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

/* The marker's temporary (tkd_file_write_atomic's "<marker>.tmp-XXXXXX"): another process claiming
 * the same new directory at this moment (workers started together), or a claim that died half-way.
 * Either way the directory is still as good as empty. */
static bool is_marker_temp(const tkd_dir_kind *k, const char *name)
{
    size_t n = strlen(k->marker);
    return strncmp(name, k->marker, n) == 0 && strncmp(name + n, ".tmp-", 5) == 0;
}

/* True when dir/name is a file beginning with text (an old version's signature). */
static bool begins_with(const char *dir, const char *name, const char *text)
{
    char path[OWNED_PATH_MAX], head[256] = {0};
    size_t n = strlen(text);
    if (n >= sizeof head || tkd_path_join(path, sizeof path, dir, name) != TKD_OK)
        return false;
    FILE *f = fopen(path, "rb");
    size_t got = f ? fread(head, 1, n, f) : 0;
    if (f)
        fclose(f);
    return got == n && memcmp(head, text, n) == 0;
}

/* What a look through a directory found. */
typedef struct dir_scan {
    bool marked;    /* the marker is there */
    bool empty;     /* no entry at all */
    bool signed_;   /* a file of the kind's signature is there (an old version's directory) */
    char bad[256];  /* the first entry outside the kind's names; "" when none */
} dir_scan;

static tkd_status scan(const tkd_dir_kind *k, const char *dir, dir_scan *s)
{
    memset(s, 0, sizeof *s);
    s->empty = true;
    DIR *d = opendir(dir);
    if (!d)
        return tkd_error_set(errno == ENOENT ? TKD_ERR_NOT_FOUND : TKD_ERR_IO, "%s: cannot list the directory: %s",
                             dir, strerror(errno));
    struct dirent *e;
    while ((e = readdir(d)) != NULL) {
        if (is_dot(e->d_name) || is_marker_temp(k, e->d_name))
            continue;
        s->empty = false;
        if (!strcmp(e->d_name, k->marker))
            s->marked = true;
        else if (!s->bad[0] && !matches(e->d_name, k->names))
            snprintf(s->bad, sizeof s->bad, "%s", e->d_name);
        if (!s->signed_ && k->sign_name && fnmatch(k->sign_name, e->d_name, 0) == 0)
            s->signed_ = begins_with(dir, e->d_name, k->sign_text);
    }
    closedir(d);
    return TKD_OK;
}

static tkd_status write_marker(const tkd_dir_kind *k, const char *dir)
{
    char path[OWNED_PATH_MAX], text[512];
    TKD_TRY(tkd_path_join(path, sizeof path, dir, k->marker));
    int n = snprintf(text, sizeof text,
                     "A %s made by topkd's %s. With this file here, %s --overwrite may empty the directory\n"
                     "of the files it makes (and nothing else); without it, it removes nothing.\n",
                     k->what, k->tool, k->tool);
    return tkd_file_write_atomic(path, text, (size_t)n);
}

tkd_status tkd_owned_dir_claim(const tkd_dir_kind *k, const char *dir)
{
    TKD_TRY(tkd_mkdir_p(dir));
    dir_scan s;
    TKD_TRY(scan(k, dir, &s));
    if (s.marked)
        return TKD_OK;
    if (s.bad[0])
        return tkd_error_set(TKD_ERR_INVALID_ARG,
                             "%s: not a %s of %s's: it holds '%s', which %s does not make — use a new or empty "
                             "directory", dir, k->what, k->tool, s.bad, k->tool);
    if (!s.empty && !s.signed_)
        return tkd_error_set(TKD_ERR_INVALID_ARG,
                             "%s: not a %s of %s's: no %s file, and no %s written by %s — use a new or empty "
                             "directory, or delete this one yourself", dir, k->what, k->tool, k->marker, k->sign_name,
                             k->tool);
    return write_marker(k, dir);
}

tkd_status tkd_owned_dir_check(const tkd_dir_kind *k, const char *dir)
{
    dir_scan s;
    TKD_TRY(scan(k, dir, &s));
    if (!s.marked)
        return tkd_error_set(TKD_ERR_INVALID_ARG,
                             "%s: not made by %s (no %s file in it), so --overwrite removes nothing there — "
                             "delete it yourself if you mean to, or use another directory", dir, k->tool, k->marker);
    if (s.bad[0])
        return tkd_error_set(TKD_ERR_INVALID_ARG,
                             "%s: holds '%s', which %s did not make, so --overwrite removes nothing there — move it "
                             "away, or use another directory", dir, s.bad, k->tool);
    return TKD_OK;
}

/* Removes the entries of dir matching `which` and not `keep` (nor the marker, when marker is set). */
static tkd_status remove_matching(const char *dir, const char *const *which, const char *const *keep,
                                  const char *marker)
{
    DIR *d = opendir(dir);
    if (!d)
        return tkd_error_set(TKD_ERR_IO, "%s: cannot list the directory: %s", dir, strerror(errno));
    tkd_status st = TKD_OK;
    struct dirent *e;
    while (st == TKD_OK && (e = readdir(d)) != NULL) {
        if (is_dot(e->d_name) || (marker && !strcmp(e->d_name, marker)) || matches(e->d_name, keep) ||
            !matches(e->d_name, which))
            continue;
        char path[OWNED_PATH_MAX];
        st = tkd_path_join(path, sizeof path, dir, e->d_name);
        if (st == TKD_OK)
            st = tkd_remove_tree(path);
    }
    closedir(d);
    return st;
}

tkd_status tkd_owned_dir_clear(const tkd_dir_kind *k, const char *dir, const char *const *keep)
{
    TKD_TRY(tkd_owned_dir_check(k, dir));
    /* only the kind's names, again: an entry that appeared since the check is not ours either */
    return remove_matching(dir, k->names, keep, k->marker);
}

tkd_status tkd_owned_dir_remove(const char *dir, const char *const *patterns)
{
    return remove_matching(dir, patterns, NULL, NULL);
}
