/* tokenize_out.c — the output files of `teacher-dump tokenize` (tokenize_internal.h): llm.c .bin or
 * NumPy tokens, one file or shards, and in --chat mode each file's flags sidecar (F.flags.npy,
 * formats/tokens.h), every file written under a temporary name and renamed only when the whole run
 * has succeeded. */
#include "teacher_cache/tokenize_internal.h"

#include <dirent.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#define LLMC_MAGIC_U32 20240801
#define LLMC_HEADER_INTS 256

bool tkd_tokenize_is_npy(const tkd_tokenize_opts *o)
{
    size_t n = strlen(o->output);
    return n > 4 && strcmp(o->output + n - 4, ".npy") == 0;
}

/* ---- output: llm.c .bin files, maybe sharded ------------------------------------------------------ */

/* The directory of path ("." when none) into dir; *base = its last component. */
void tkd_tokenize_split_path(const char *path, char *dir, size_t cap, const char **base)
{
    const char *slash = strrchr(path, '/');
    *base = slash ? slash + 1 : path;
    if (!slash)
        snprintf(dir, cap, ".");
    else
        snprintf(dir, cap, "%.*s", slash == path ? 1 : (int)(slash - path), path);
}

/* OUT.bin (or OUT.npy) itself, or OUT_%06d.bin for shard i (the extension kept). */
tkd_status tkd_tokenize_shard_path(const tkd_tokenize_opts *o, int i, char *out, size_t cap)
{
    size_t n = strlen(o->output);
    const char *ext = tkd_tokenize_is_npy(o) ? ".npy" : ".bin";
    if (n > 4 && strcmp(o->output + n - 4, ext) == 0)
        n -= 4;
    int w = o->shard_tokens > 0 ? snprintf(out, cap, "%.*s_%06d%s", (int)n, o->output, i, ext)
                                : snprintf(out, cap, "%s", o->output);
    if (w < 0 || (size_t)w >= cap)
        return tkd_error_set(TKD_ERR_INVALID_ARG, "tokenize: --output '%s' is too long", o->output);
    return TKD_OK;
}

/* Refuses path when it is (stat: symlinks followed, hard links seen) one of the files being read. */
static tkd_status check_not_read(const out_writer *w, const char *path)
{
    struct stat sb;
    if (stat(path, &sb) != 0)
        return TKD_OK;
    for (int i = 0; i < w->nreads; i++)
        if (w->reads[i].dev == sb.st_dev && w->reads[i].ino == sb.st_ino) {
            tkd_error_set(TKD_ERR_INVALID_ARG, "tokenize: the output %s is the %s %s (the same file)", path,
                          w->reads[i].role, w->reads[i].path);
            return tkd_error_hint(TKD_ERR_INVALID_ARG, "choose another --output; writing it would replace a file "
                                  "this run reads");
        }
    return TKD_OK;
}

/* An output file that is already there: one of the inputs never; else only with --overwrite. */
static tkd_status check_existing(const out_writer *w, const char *path)
{
    TKD_TRY(check_not_read(w, path));
    if (!w->o->overwrite) {
        tkd_error_set(TKD_ERR_INVALID_ARG, "tokenize: %s exists", path);
        return tkd_error_hint(TKD_ERR_INVALID_ARG, "pass --overwrite to replace it, or choose another --output");
    }
    return TKD_OK;
}

/* Is name ("train_000012.bin") "<stem><6 or more digits><ext>", a shard name of this output? */
static bool is_shard_name(const char *name, const char *stem, size_t stem_len, const char *ext)
{
    size_t n = strlen(name), e = strlen(ext);
    if (n < stem_len + 6 + e || strncmp(name, stem, stem_len) != 0 || strcmp(name + n - e, ext) != 0)
        return false;
    return strspn(name + stem_len, "0123456789") == n - stem_len - e;
}

/* A shard's name, or its flags sidecar's ("<shard>.flags.npy"): is_shard_name of the shard's part. */
static bool is_output_name(const char *name, const char *stem, size_t stem_len, const char *ext)
{
    char shard[1024];
    size_t n = strlen(name), sl = strlen(".flags.npy");
    if (n > sl && n - sl < sizeof shard && strcmp(name + n - sl, ".flags.npy") == 0) {
        memcpy(shard, name, n - sl);
        shard[n - sl] = '\0';
        return is_shard_name(shard, stem, stem_len, ext);
    }
    return is_shard_name(name, stem, stem_len, ext);
}

/* Before anything is written: each output name already there (the one file and its flags sidecar,
 * or every shard name OUT_<digits>.ext in its directory and their sidecars, whatever the count) is
 * checked by check_existing, so an input that is an old shard is refused up front and a run without
 * --overwrite stops at once. */
tkd_status tkd_tokout_check_outputs(const out_writer *w)
{
    char first[4096], dir[4096], path[8192];
    const char *base;
    TKD_TRY(tkd_tokenize_shard_path(w->o, 0, first, sizeof first));
    if (w->o->shard_tokens == 0) {
        snprintf(path, sizeof path, "%s.flags.npy", first);
        if (tkd_file_exists(first))
            TKD_TRY(check_existing(w, first));
        return tkd_file_exists(path) ? check_existing(w, path) : TKD_OK;
    }
    tkd_tokenize_split_path(first, dir, sizeof dir, &base);
    size_t stem_len = strlen(base) - strlen("000000.bin"); /* base is "<stem>000000.bin" (or .npy) */
    DIR *d = opendir(dir);
    if (!d)
        return TKD_OK; /* no directory yet: the temporary file's creation names the problem */
    tkd_status st = TKD_OK;
    for (struct dirent *e; st == TKD_OK && (e = readdir(d)) != NULL;)
        if (is_output_name(e->d_name, base, stem_len, base + strlen(base) - 4)) {
            snprintf(path, sizeof path, "%s/%s", dir, e->d_name);
            st = check_existing(w, strchr(first, '/') ? path : e->d_name);
        }
    closedir(d);
    return st;
}

/* llm.c: 256 int32 {magic, version, count, 0...}. NumPy (an output named .npy, and every flags
 * sidecar): format 1.0, a 1-D array, the header padded to NPY_HEADER bytes so that the count fits
 * when it is known. */
#define NPY_HEADER 128

/* A failed write, flush, fsync or close of file path: errno's reason in the message (ENOSPC /
 * EDQUOT: TKD_ERR_NOSPACE, "disk full"). */
static tkd_status write_failed(const char *path, const char *what, int err)
{
    if (err == 0)
        err = EIO;
    if (err == ENOSPC || err == EDQUOT) {
        tkd_error_set(TKD_ERR_NOSPACE, "%s: disk full while %s (%s)", path, what, strerror(err));
        return tkd_error_hint(TKD_ERR_NOSPACE, "free space and re-run");
    }
    return tkd_error_set(TKD_ERR_IO, "%s: %s failed: %s", path, what, strerror(err));
}

/* The header of one output file holding n elements: tokens (llm.c or '<u4') or flags ('|u1'). */
static tkd_status write_header(const out_writer *w, const tkd_atomic_file *af, bool flags, int64_t n)
{
    size_t ok;
    errno = 0;
    if (flags || tkd_tokenize_is_npy(w->o)) {
        char h[NPY_HEADER + 1];
        int len = snprintf(h + 10, sizeof h - 10, "{'descr': '%s', 'fortran_order': False, 'shape': (%lld,), }",
                           flags ? "|u1" : "<u4", (long long)n);
        memcpy(h, "\x93NUMPY\x01\x00", 8);
        h[8] = (char)(NPY_HEADER - 10), h[9] = 0;
        memset(h + 10 + len, ' ', (size_t)(NPY_HEADER - 10 - len));
        h[NPY_HEADER - 1] = '\n';
        ok = fwrite(h, NPY_HEADER, 1, af->fp);
    } else {
        int32_t h[LLMC_HEADER_INTS] = {LLMC_MAGIC_U32, TKD_TOKENIZE_VERSION, (int32_t)n};
        ok = fwrite(h, sizeof h, 1, af->fp);
    }
    return ok == 1 ? TKD_OK : write_failed(af->path, "writing the header", errno);
}

/* The sidecar of token file path: path + ".flags.npy" (formats/tokens.h). */
static tkd_status flags_path(const char *path, char *out, size_t cap)
{
    int n = snprintf(out, cap, "%s.flags.npy", path);
    return n >= 0 && (size_t)n < cap ? TKD_OK
                                     : tkd_error_set(TKD_ERR_INVALID_ARG, "tokenize: --output '%s' is too long", path);
}

tkd_status tkd_tokout_open_file(out_writer *w)
{
    TKD_TRY(tkd_tokenize_shard_path(w->o, w->shard, w->path, sizeof w->path));
    char fp[4200];
    TKD_TRY(flags_path(w->path, fp, sizeof fp));
    if (tkd_file_exists(w->path)) /* checked up front too; this sees a name made since */
        TKD_TRY(check_existing(w, w->path));
    if (tkd_file_exists(fp))
        TKD_TRY(check_existing(w, fp));
    TKD_TRY(tkd_atomic_file_open(&w->af, w->path));
    w->open = true;
    w->shard++;
    w->in_file = 0;
    if (w->o->chat) {
        TKD_TRY(tkd_atomic_file_open(&w->flags_af, fp));
        TKD_TRY(write_header(w, &w->flags_af, true, 0));
    }
    return write_header(w, &w->af, false, 0);
}

static tkd_status stage_room(out_writer *w)
{
    if (w->ndone < w->cap_done)
        return TKD_OK;
    int cap = w->cap_done ? 2 * w->cap_done : 16;
    staged *p = realloc(w->done, (size_t)cap * sizeof *p);
    if (!p)
        return tkd_error_set(TKD_ERR_NOMEM, "out of memory");
    w->done = p, w->cap_done = cap;
    return TKD_OK;
}

/* af's header gets the count, then the file is flushed, fsynced and closed under its temporary
 * name and joins w->done; publish renames it. On failure af is aborted (its temporary removed). */
static tkd_status seal(out_writer *w, tkd_atomic_file *af, bool flags)
{
    tkd_status st = TKD_OK;
    errno = 0;
    if (fflush(af->fp) != 0 || fseek(af->fp, 0, SEEK_SET) != 0)
        st = write_failed(af->path, "writing", errno);
    if (st == TKD_OK)
        st = write_header(w, af, flags, w->in_file);
    errno = 0;
    if (st == TKD_OK && (fflush(af->fp) != 0 || ferror(af->fp)))
        st = write_failed(af->path, "writing", errno);
    if (st == TKD_OK && fsync(fileno(af->fp)) != 0)
        st = write_failed(af->path, "fsync", errno);
    if (st == TKD_OK)
        st = stage_room(w);
    if (st != TKD_OK) {
        tkd_atomic_file_abort(af);
        return st;
    }
    int rc = fclose(af->fp), err = errno;
    w->done[w->ndone++] = (staged){af->tmp, af->path}; /* taken over: tkd_atomic_file holds nothing now */
    tkd_status closed = rc == 0 ? TKD_OK : write_failed(af->path, "closing", err);
    *af = (tkd_atomic_file){0};
    return closed;
}

tkd_status tkd_tokout_finish_file(out_writer *w)
{
    w->open = false;
    tkd_status st = seal(w, &w->af, false);
    if (w->o->chat) {
        if (st == TKD_OK)
            return seal(w, &w->flags_af, true);
        tkd_atomic_file_abort(&w->flags_af);
    }
    return st;
}

/* Without --chat, a sidecar left beside a token file this run replaced (--overwrite) would give the
 * new tokens an old mask: it goes when the new file gets its name. */
static tkd_status drop_stale_flags(const out_writer *w, const char *path)
{
    char fp[4200];
    if (w->o->chat || flags_path(path, fp, sizeof fp) != TKD_OK || unlink(fp) == 0 || errno == ENOENT)
        return TKD_OK;
    return tkd_error_set(TKD_ERR_IO, "%s: cannot remove the flags sidecar of the token file it replaced: %s", fp,
                         strerror(errno));
}

/* The end of a successful run: every staged file gets its final name, in order, then the
 * directory is fsynced. Until here an interrupted run left no output name behind. */
tkd_status tkd_tokout_publish(out_writer *w)
{
    char dir[4096];
    const char *base;
    for (int i = 0; i < w->ndone; i++) {
        if (rename(w->done[i].tmp, w->done[i].path) != 0)
            return tkd_error_set(TKD_ERR_IO, "%s: renaming the finished file %s to it failed: %s", w->done[i].path,
                                 w->done[i].tmp, strerror(errno));
        free(w->done[i].tmp);
        w->done[i].tmp = NULL;
        TKD_TRY(drop_stale_flags(w, w->done[i].path));
    }
    if (w->ndone == 0)
        return TKD_OK;
    tkd_tokenize_split_path(w->done[0].path, dir, sizeof dir, &base);
    return tkd_fsync_dir(dir);
}

/* Removes what an unsuccessful run staged (the open files and the finished ones not renamed). */
void tkd_tokout_free(out_writer *w)
{
    if (w->open)
        tkd_atomic_file_abort(&w->af);
    if (w->open && w->flags_af.fp)
        tkd_atomic_file_abort(&w->flags_af);
    for (int i = 0; i < w->ndone; i++) {
        if (w->done[i].tmp)
            unlink(w->done[i].tmp);
        free(w->done[i].tmp);
        free(w->done[i].path);
    }
    free(w->done);
    free(w->reads);
}

/* n ids (and, in --chat mode, their n flags) into the open file, the next shard when it is full.
 * llm.c's header holds the count as int32, so one llm.c file holds at most INT32_MAX tokens. */
tkd_status tkd_tokout_put(out_writer *w, const uint32_t *ids, const uint8_t *flags, size_t n)
{
    int64_t limit = tkd_tokenize_is_npy(w->o) ? INT64_MAX : INT32_MAX;
    while (n > 0) {
        if (!w->open)
            TKD_TRY(tkd_tokout_open_file(w));
        int64_t room = w->o->shard_tokens > 0 ? w->o->shard_tokens - w->in_file : limit - w->in_file;
        if (room == 0 && w->o->shard_tokens == 0) {
            tkd_error_set(TKD_ERR_INVALID_ARG, "tokenize: %s would hold more than %d tokens (llm.c's limit)", w->path,
                          INT32_MAX);
            return tkd_error_hint(TKD_ERR_INVALID_ARG, "split the output with --shard-tokens");
        }
        size_t take = (size_t)room < n ? (size_t)room : n;
        errno = 0;
        if (fwrite(ids, sizeof *ids, take, w->af.fp) != take)
            return write_failed(w->path, "writing", errno);
        if (flags && fwrite(flags, 1, take, w->flags_af.fp) != take)
            return write_failed(w->flags_af.path, "writing", errno);
        w->in_file += (int64_t)take, ids += take, n -= take, flags = flags ? flags + take : NULL;
        if (w->o->shard_tokens > 0 && w->in_file == w->o->shard_tokens)
            TKD_TRY(tkd_tokout_finish_file(w));
    }
    return TKD_OK;
}

/* Remembers path (device and inode, symlinks followed) as a file this run reads; missing is fine. */
tkd_status tkd_tokout_add_read(out_writer *w, const char *path, const char *role)
{
    struct stat sb;
    if (stat(path, &sb) != 0)
        return TKD_OK;
    file_id *p = realloc(w->reads, (size_t)(w->nreads + 1) * sizeof *p);
    if (!p)
        return tkd_error_set(TKD_ERR_NOMEM, "out of memory");
    w->reads = p;
    w->reads[w->nreads++] = (file_id){sb.st_dev, sb.st_ino, path, role};
    return TKD_OK;
}

