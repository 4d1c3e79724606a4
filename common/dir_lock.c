/* dir_lock.c — see dir_lock.h. */
#include "common/dir_lock.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <unistd.h>

#include "common/fileio.h"

#define LOCK_PATH_MAX 4096
#define HINT "wait for it to finish, or stop it (its lock goes with the process)"

struct tkd_dir_lock {
    int fd;      /* <dir>/<name>, exclusive or shared */
    int part_fd; /* <dir>/<name>.<part>, exclusive; -1 when none */
};

static tkd_status open_lock_file(const char *path, int *fd)
{
    /* O_NOFOLLOW: the pid is written into the file, so a symbolic link of that name (to a user's
     * file) is refused rather than followed and truncated */
    *fd = open(path, O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0644);
    /* another user's lock file: flock works on a read-only descriptor too (only the pid is not written) */
    if (*fd < 0 && errno == EACCES)
        *fd = open(path, O_RDONLY | O_CLOEXEC | O_NOFOLLOW);
    if (*fd < 0)
        return tkd_error_set(errno == ENOENT ? TKD_ERR_NOT_FOUND : TKD_ERR_IO,
                             "%s: cannot open the lock file: %s — check that the directory exists and is writable",
                             path, strerror(errno));
    return TKD_OK;
}

/* The holder's pid goes into the file for the messages of those refused; a failed write only
 * makes that message say "pid unknown", so it is not an error. */
static void write_pid(int fd)
{
    char buf[32];
    int n = snprintf(buf, sizeof buf, "%ld\n", (long)getpid());
    if (ftruncate(fd, 0) == 0 && pwrite(fd, buf, (size_t)n, 0) != n)
        (void)ftruncate(fd, 0);
}

/* The pid written in a lock file, 0 when none can be read. */
bool tkd_dir_lock_file_proof(const char *path, void *ctx)
{
    (void)ctx;
    char buf[32];
    int fd = open(path, O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK);
    if (fd < 0)
        return false;
    ssize_t n = read(fd, buf, sizeof buf);
    close(fd);
    if (n == 0) /* made, or truncated by write_pid, a moment ago */
        return true;
    ssize_t i = 0;
    while (i < n && buf[i] >= '0' && buf[i] <= '9')
        i++;
    return i > 0 && i == n - 1 && buf[i] == '\n';
}

static long read_pid(const char *path)
{
    char buf[32] = {0};
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return 0;
    ssize_t n = read(fd, buf, sizeof buf - 1);
    close(fd);
    return n > 0 ? strtol(buf, NULL, 10) : 0;
}

static int pid_alive(long pid)
{
    return pid > 0 && (kill((pid_t)pid, 0) == 0 || errno == EPERM);
}

/* The pids of the part holders, read from <dir>/<name>.* and kept when that process exists. Their
 * locks are not probed: a probe would briefly hold the lock a starting worker is about to take. */
static void part_pids(const char *dir, const char *name, char *out, size_t cap)
{
    size_t o = 0, nlen = strlen(name);
    out[0] = '\0';
    DIR *d = opendir(dir);
    struct dirent *e;
    while (d && (e = readdir(d)) != NULL) {
        char path[LOCK_PATH_MAX];
        if (strncmp(e->d_name, name, nlen) != 0 || e->d_name[nlen] != '.' ||
            tkd_path_join(path, sizeof path, dir, e->d_name) != TKD_OK)
            continue;
        long pid = read_pid(path);
        int n = pid_alive(pid) ? snprintf(out + o, cap - o, "%s%ld", o ? ", " : "", pid) : 0;
        if (n > 0 && (size_t)n < cap - o)
            o += (size_t)n;
    }
    if (d)
        closedir(d);
}

/* TKD_ERR_BUSY naming whoever holds <dir>/<name>: the exclusive holder's pid, or, when it is held
 * shared (a shared probe succeeds), the pids of the part holders. */
static tkd_status busy(const char *dir, const char *name, const char *path, const char *tool)
{
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    int shared = fd >= 0 && flock(fd, LOCK_SH | LOCK_NB) == 0;
    if (fd >= 0)
        close(fd);
    char pids[256];
    if (shared)
        part_pids(dir, name, pids, sizeof pids);
    else if (read_pid(path) > 0)
        snprintf(pids, sizeof pids, "%ld", read_pid(path));
    else
        snprintf(pids, sizeof pids, "unknown");
    if (shared && !pids[0])
        snprintf(pids, sizeof pids, "unknown");
    return tkd_error_set(TKD_ERR_BUSY, "%s: another %s (pid %s) is writing there — " HINT, dir, tool, pids);
}

/* flock(fd, op | LOCK_NB): 1 taken, 0 held by someone else, else an error status via *st. */
static int try_flock(int fd, int op, const char *path, tkd_status *st)
{
    if (flock(fd, op | LOCK_NB) == 0)
        return 1;
    if (errno == EWOULDBLOCK)
        return 0;
    *st = tkd_error_set(TKD_ERR_IO, "%s: cannot lock: %s", path, strerror(errno));
    return -1;
}

static tkd_status lock_one(const char *dir, const char *name, int op, int *fd, const char *tool)
{
    char path[LOCK_PATH_MAX];
    TKD_TRY(tkd_path_join(path, sizeof path, dir, name));
    TKD_TRY(open_lock_file(path, fd));
    tkd_status st = TKD_OK;
    int got = try_flock(*fd, op, path, &st);
    if (got == 1)
        return TKD_OK;
    close(*fd);
    *fd = -1;
    return got == 0 ? busy(dir, name, path, tool) : st;
}

tkd_status tkd_dir_lock_take(const char *dir, const char *name, const char *tool, tkd_dir_lock **out)
{
    *out = NULL;
    tkd_dir_lock *l = malloc(sizeof *l);
    if (!l)
        return tkd_error_set(TKD_ERR_NOMEM, "out of memory");
    l->part_fd = -1;
    tkd_status st = lock_one(dir, name, LOCK_EX, &l->fd, tool);
    if (st != TKD_OK) {
        free(l);
        return st;
    }
    write_pid(l->fd);
    *out = l;
    return TKD_OK;
}

tkd_status tkd_dir_lock_take_part(const char *dir, const char *name, const char *part, const char *tool,
                                  tkd_dir_lock **out)
{
    *out = NULL;
    char part_name[256];
    int n = snprintf(part_name, sizeof part_name, "%s.%s", name, part);
    if (n < 0 || (size_t)n >= sizeof part_name || strcspn(part, "/.") != strlen(part))
        return tkd_error_set(TKD_ERR_INVALID_ARG, "lock part '%.60s': not a plain name", part);
    tkd_dir_lock *l = malloc(sizeof *l);
    if (!l)
        return tkd_error_set(TKD_ERR_NOMEM, "out of memory");
    tkd_status st = lock_one(dir, name, LOCK_SH, &l->fd, tool);
    if (st == TKD_OK) {
        st = lock_one(dir, part_name, LOCK_EX, &l->part_fd, tool);
        if (st != TKD_OK)
            close(l->fd);
    }
    if (st != TKD_OK) {
        free(l);
        return st;
    }
    write_pid(l->part_fd);
    *out = l;
    return TKD_OK;
}

void tkd_dir_lock_release(tkd_dir_lock *l)
{
    if (!l)
        return;
    if (l->part_fd >= 0)
        close(l->part_fd);
    close(l->fd);
    free(l);
}
