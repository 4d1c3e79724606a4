/* fileio.c — see fileio.h. */
#include "common/fileio.h"

#include "common/signals.h"

#include <dirent.h>
#include <errno.h>
#include <fnmatch.h>
#include <fcntl.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <unistd.h>

static tkd_status errno_status(int err)
{
    return err == ENOSPC || err == EDQUOT ? TKD_ERR_NOSPACE : err == ENOENT ? TKD_ERR_NOT_FOUND : TKD_ERR_IO;
}

/* Maps errno to a status and a one-line message; disk full gets its own code and advice. */
static tkd_status io_error(const char *path, const char *what, int err)
{
    if (errno_status(err) == TKD_ERR_NOSPACE)
        return tkd_error_set(TKD_ERR_NOSPACE, "%s: disk full while %s (%s) — free space and retry",
                             path, what, strerror(err));
    return tkd_error_set(errno_status(err), "%s: %s failed: %s", path, what, strerror(err));
}

/* The directory part of path ("." when there is none) into out. */
static void dir_of(const char *path, char *out, size_t cap)
{
    const char *slash = strrchr(path, '/');
    if (!slash)
        snprintf(out, cap, ".");
    else if (slash == path)
        snprintf(out, cap, "/");
    else
        snprintf(out, cap, "%.*s", (int)(slash - path), path);
}

static char *concat(const char *a, const char *b)
{
    size_t la = strlen(a), lb = strlen(b);
    char *s = malloc(la + lb + 1);
    if (s) {
        memcpy(s, a, la);
        memcpy(s + la, b, lb + 1);
    }
    return s;
}

tkd_status tkd_fsync_dir(const char *dir)
{
    int fd = open(dir, O_RDONLY | O_DIRECTORY);
    if (fd < 0)
        return io_error(dir, "opening the directory for fsync", errno);
    int rc = fsync(fd), err = errno;
    close(fd);
    /* some filesystems cannot fsync a directory; the rename itself has happened */
    if (rc != 0 && err != EINVAL && err != EROFS)
        return io_error(dir, "fsync of the directory", err);
    return TKD_OK;
}

static tkd_status fsync_parent(const char *path)
{
    char dir[4096];
    dir_of(path, dir, sizeof dir);
    return tkd_fsync_dir(dir);
}

tkd_status tkd_fsync_file(const char *path)
{
    int fd = open(path, O_RDONLY);
    if (fd < 0)
        return io_error(path, "opening for fsync", errno);
    int rc = fsync(fd), err = errno;
    close(fd);
    return rc != 0 ? io_error(path, "fsync", err) : TKD_OK;
}

tkd_status tkd_rename_durable(const char *from, const char *to)
{
    if (rename(from, to) != 0) {
        int err = errno;
        return tkd_error_set(errno_status(err), "rename %s -> %s failed: %s", from, to, strerror(err));
    }
    return fsync_parent(to);
}

static void atomic_release(tkd_atomic_file *af)
{
    free(af->path);
    free(af->tmp);
    af->path = af->tmp = NULL;
    af->fp = NULL;
}

tkd_status tkd_atomic_file_open(tkd_atomic_file *af, const char *path)
{
    memset(af, 0, sizeof *af);
    af->path = strdup(path);
    af->tmp = concat(path, ".tmp-XXXXXX");
    if (!af->path || !af->tmp) {
        atomic_release(af);
        return tkd_error_set(TKD_ERR_NOMEM, "%s: out of memory", path);
    }
    int fd = mkstemp(af->tmp);
    if (fd < 0) {
        tkd_status st = io_error(path, "creating a temporary file next to it", errno);
        atomic_release(af);
        return st;
    }
    fchmod(fd, 0644); /* mkstemp makes 0600; outputs are meant to be shared */
    af->fp = fdopen(fd, "wb");
    if (!af->fp) {
        tkd_status st = io_error(af->tmp, "fdopen", errno);
        close(fd);
        unlink(af->tmp);
        atomic_release(af);
        return st;
    }
    return TKD_OK;
}

void tkd_atomic_file_abort(tkd_atomic_file *af)
{
    if (af->fp)
        fclose(af->fp);
    if (af->tmp)
        unlink(af->tmp);
    atomic_release(af);
}

tkd_status tkd_atomic_file_commit(tkd_atomic_file *af)
{
    tkd_status st = TKD_OK;
    if (fflush(af->fp) != 0 || ferror(af->fp))
        st = io_error(af->path, "writing", errno ? errno : EIO);
    else if (fsync(fileno(af->fp)) != 0)
        st = io_error(af->path, "fsync", errno);
    int rc = fclose(af->fp);
    af->fp = NULL;
    if (st == TKD_OK && rc != 0)
        st = io_error(af->path, "closing", errno);
    if (st == TKD_OK && rename(af->tmp, af->path) != 0)
        st = io_error(af->path, "renaming the temporary file over it", errno);
    if (st != TKD_OK)
        unlink(af->tmp);
    else
        st = fsync_parent(af->path);
    atomic_release(af);
    return st;
}

tkd_status tkd_file_write_atomic(const char *path, const void *data, size_t len)
{
    tkd_atomic_file af;
    TKD_TRY(tkd_atomic_file_open(&af, path));
    if (len && fwrite(data, 1, len, af.fp) != len) {
        tkd_status st = io_error(path, "writing", errno ? errno : EIO);
        tkd_atomic_file_abort(&af);
        return st;
    }
    return tkd_atomic_file_commit(&af);
}

tkd_status tkd_mkdir_p(const char *path)
{
    return tkd_mkdir_p_made(path, NULL, 0);
}

tkd_status tkd_mkdir_p_made(const char *path, char *made, size_t cap)
{
    char buf[4096];
    size_t n = strlen(path);
    if (made && cap)
        made[0] = '\0';
    if (n == 0 || n >= sizeof buf || (made && cap <= n))
        return tkd_error_set(TKD_ERR_INVALID_ARG, "mkdir: bad path '%.100s'", path);
    memcpy(buf, path, n + 1);
    for (size_t i = 1; i <= n; i++) {
        if (buf[i] != '/' && buf[i] != '\0')
            continue;
        char c = buf[i];
        buf[i] = '\0';
        if (mkdir(buf, 0755) == 0) {
            if (made && !made[0]) /* every folder after the first made is below it, and ours */
                memcpy(made, buf, i + 1);
        } else if (errno != EEXIST) {
            return io_error(buf, "mkdir", errno);
        }
        buf[i] = c;
    }
    struct stat sb;
    if (stat(path, &sb) != 0)
        return io_error(path, "stat", errno);
    if (!S_ISDIR(sb.st_mode))
        return tkd_error_set(TKD_ERR_IO, "%s: exists and is not a directory", path);
    return TKD_OK;
}

void tkd_rmdir_made(const char *path, const char *made)
{
    char buf[4096];
    size_t top = strlen(made), n = strlen(path);
    if (top == 0 || n >= sizeof buf)
        return;
    memcpy(buf, path, n + 1);
    /* made is a prefix of path (tkd_mkdir_p_made cut it there): stop once the folder is above it */
    while (n >= top) {
        while (n > 1 && buf[n - 1] == '/') /* "a/b/" is "a/b" */
            buf[--n] = '\0';
        if (n < top || rmdir(buf) != 0)
            return;
        char *slash = strrchr(buf, '/');
        if (!slash || slash == buf)
            return;
        *slash = '\0';
        n = (size_t)(slash - buf);
    }
}

tkd_status tkd_path_join(char *out, size_t cap, const char *a, const char *b)
{
    int n;
    if (b[0] == '/' || !a[0])
        n = snprintf(out, cap, "%s", b);
    else if (a[strlen(a) - 1] == '/')
        n = snprintf(out, cap, "%s%s", a, b);
    else
        n = snprintf(out, cap, "%s/%s", a, b);
    if (n < 0 || (size_t)n >= cap)
        return tkd_error_set(TKD_ERR_INVALID_ARG, "path too long (%d bytes, room for %zu): %.60s/%.60s",
                             n, cap ? cap - 1 : 0, a, b);
    return TKD_OK;
}

tkd_status tkd_path_join_alloc(char **out, const char *a, const char *b)
{
    size_t cap = strlen(a) + strlen(b) + 2;
    *out = malloc(cap);
    if (!*out)
        return tkd_error_set(TKD_ERR_NOMEM, "out of memory joining %.60s and %.60s", a, b);
    tkd_status st = tkd_path_join(*out, cap, a, b); /* cannot fail: cap fits "a/b" */
    if (st != TKD_OK) {
        free(*out);
        *out = NULL;
    }
    return st;
}

bool tkd_file_exists(const char *path)
{
    struct stat sb;
    return lstat(path, &sb) == 0;
}

tkd_status tkd_file_size(const char *path, uint64_t *size)
{
    struct stat sb;
    if (stat(path, &sb) != 0)
        return io_error(path, "stat", errno);
    if (!S_ISREG(sb.st_mode))
        return tkd_error_set(TKD_ERR_IO, "%s: not a regular file", path);
    *size = (uint64_t)sb.st_size;
    return TKD_OK;
}

/* "a FIFO (named pipe)", "a directory", ... for a file type that is not a regular file. */
static const char *kind_of(mode_t m)
{
    if (S_ISFIFO(m))
        return "a FIFO (named pipe)";
    if (S_ISDIR(m))
        return "a directory";
    if (S_ISCHR(m))
        return "a character device";
    if (S_ISBLK(m))
        return "a block device";
    if (S_ISSOCK(m))
        return "a socket";
    return "not a plain file";
}

static tkd_status not_regular(const char *path, const char *what, mode_t m)
{
    return tkd_error_set(TKD_ERR_IO, "%s: %s is %s, not a regular file — give the path of a regular file",
                         path, what, kind_of(m));
}

/* Also what an open or read that returned EINTR means: the user asked to stop (our handlers are
 * installed without SA_RESTART for exactly this). */
tkd_status tkd_input_interrupted(const char *path, const char *what)
{
    int sig = tkd_interrupted();
    return tkd_error_set(TKD_ERR_INTERRUPTED, "%s: interrupted by %s while reading the %s", path,
                         sig == SIGTERM ? "SIGTERM" : sig == SIGINT ? "SIGINT" : "a signal", what);
}

static tkd_status open_error(const char *path, const char *what, int err)
{
    if (err == EINTR)
        return tkd_input_interrupted(path, what);
    return tkd_error_set(errno_status(err) == TKD_ERR_NOT_FOUND ? TKD_ERR_NOT_FOUND : TKD_ERR_IO,
                         "%s: cannot open %s: %s", path, what, strerror(err));
}

tkd_status tkd_input_check(const char *path, const char *what)
{
    struct stat sb;
    if (stat(path, &sb) != 0)
        return open_error(path, what, errno);
    return S_ISREG(sb.st_mode) ? TKD_OK : not_regular(path, what, sb.st_mode);
}

tkd_status tkd_open_input(const char *path, const char *what, int *fd)
{
    *fd = -1;
    /* stat first: opening a device can have effects of its own, and a FIFO would block */
    TKD_TRY(tkd_input_check(path, what));
    int f = open(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK);
    if (f < 0)
        return open_error(path, what, errno);
    struct stat sb;
    tkd_status st = TKD_OK;
    if (fstat(f, &sb) != 0)
        st = io_error(path, "fstat", errno);
    else if (!S_ISREG(sb.st_mode)) /* swapped for something else since the stat */
        st = not_regular(path, what, sb.st_mode);
    if (st != TKD_OK) {
        close(f);
        return st;
    }
    int fl = fcntl(f, F_GETFL);
    if (fl < 0 || fcntl(f, F_SETFL, fl & ~O_NONBLOCK) != 0) {
        st = io_error(path, "fcntl", errno);
        close(f);
        return st;
    }
    *fd = f;
    return TKD_OK;
}

tkd_status tkd_fopen_input(const char *path, const char *what, FILE **fp)
{
    int fd;
    *fp = NULL;
    TKD_TRY(tkd_open_input(path, what, &fd));
    *fp = fdopen(fd, "rb");
    if (!*fp) {
        tkd_status st = io_error(path, "fdopen", errno);
        close(fd);
        return st;
    }
    return TKD_OK;
}

tkd_status tkd_fread_input(FILE *fp, void *buf, size_t n, size_t *got, const char *path)
{
    errno = 0;
    *got = fread(buf, 1, n, fp);
    if (*got == n || !ferror(fp))
        return TKD_OK;
    if (errno == EINTR)
        return tkd_input_interrupted(path, "file");
    return io_error(path, "read", errno ? errno : EIO);
}

tkd_status tkd_read_input(const char *path, const char *what, void **data, size_t *size)
{
    *data = NULL;
    *size = 0;
    FILE *fp;
    TKD_TRY(tkd_fopen_input(path, what, &fp));
    struct stat sb;
    if (fstat(fileno(fp), &sb) != 0) {
        tkd_status st = io_error(path, "fstat", errno);
        fclose(fp);
        return st;
    }
    size_t n = (size_t)sb.st_size, got = 0;
    char *buf = malloc(n + 1);
    if (!buf) {
        fclose(fp);
        return tkd_error_set(TKD_ERR_NOMEM, "%s: out of memory reading %zu bytes", path, n);
    }
    tkd_status st = tkd_fread_input(fp, buf, n, &got, path);
    fclose(fp);
    if (st == TKD_OK && got != n)
        st = tkd_error_set(TKD_ERR_IO, "%s: file shrank while reading (%zu of %zu bytes)", path, got, n);
    if (st != TKD_OK) {
        free(buf);
        return st;
    }
    buf[n] = '\0';
    *data = buf;
    *size = n;
    return TKD_OK;
}

tkd_status tkd_read_file(const char *path, void **data, size_t *size)
{
    return tkd_read_input(path, "file", data, size);
}

tkd_status tkd_remove_tree(const char *path)
{
    struct stat sb;
    if (lstat(path, &sb) != 0)
        return errno == ENOENT ? TKD_OK : io_error(path, "lstat", errno);
    if (S_ISDIR(sb.st_mode)) {
        DIR *d = opendir(path);
        if (!d)
            return io_error(path, "opendir", errno);
        struct dirent *e;
        tkd_status st = TKD_OK;
        while (st == TKD_OK && (e = readdir(d)) != NULL) {
            if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, ".."))
                continue;
            char child[4096];
            st = tkd_path_join(child, sizeof child, path, e->d_name);
            if (st == TKD_OK)
                st = tkd_remove_tree(child);
        }
        closedir(d);
        if (st != TKD_OK)
            return st;
        if (rmdir(path) != 0)
            return io_error(path, "rmdir", errno);
        return TKD_OK;
    }
    if (unlink(path) != 0 && errno != ENOENT)
        return io_error(path, "unlink", errno);
    return TKD_OK;
}

/* Drops the last component of path in place ("a/b/" -> "a", "a" -> "."); false when nothing is
 * left to drop ("/" or "."). */
static bool strip_last(char *path)
{
    size_t n = strlen(path);
    while (n > 1 && path[n - 1] == '/')
        path[--n] = '\0';
    if (!strcmp(path, "/") || !strcmp(path, "."))
        return false;
    char *slash = strrchr(path, '/');
    if (!slash)
        strcpy(path, ".");
    else
        slash[slash == path ? 1 : 0] = '\0';
    return true;
}

/* realpath of the deepest existing ancestor of path (malloc'd into *out). */
static tkd_status real_ancestor(const char *path, char **out)
{
    char buf[4096];
    if (snprintf(buf, sizeof buf, "%s", path) >= (int)sizeof buf)
        return tkd_error_set(TKD_ERR_INVALID_ARG, "path too long: %.60s…", path);
    while ((*out = realpath(buf, NULL)) == NULL) {
        if ((errno != ENOENT && errno != ENOTDIR) || !strip_last(buf))
            return io_error(path, "resolving the path", errno);
    }
    return TKD_OK;
}

tkd_status tkd_path_within(const char *inner, const char *outer, bool *within)
{
    *within = false;
    struct stat o, s;
    if (stat(outer, &o) != 0)
        return errno == ENOENT || errno == ENOTDIR ? TKD_OK : io_error(outer, "stat", errno);
    char *real = NULL;
    TKD_TRY(real_ancestor(inner, &real));
    /* real has no symlinks and no "..", so cutting components walks up the tree */
    for (bool more = true; more && !*within; more = strip_last(real))
        *within = stat(real, &s) == 0 && s.st_dev == o.st_dev && s.st_ino == o.st_ino;
    free(real);
    return TKD_OK;
}

int tkd_dir_holds_only(const char *dir, const char *const *patterns)
{
    DIR *d = opendir(dir);
    if (!d)
        return 0;
    int only = 1;
    for (struct dirent *e; only && (e = readdir(d)) != NULL;) {
        if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, ".."))
            continue;
        only = 0;
        for (const char *const *p = patterns; *p && !only; p++)
            only = fnmatch(*p, e->d_name, 0) == 0;
    }
    closedir(d);
    return only;
}
