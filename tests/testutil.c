/* testutil.c — see testutil.h. */
#include "tests/testutil.h"

#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <dirent.h>
#include <errno.h>
#include <hdf5.h>
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "common/fileio.h"
#include "kernels/backend.h"

char *tkd_test_mkdtemp(const char *tag)
{
    const char *base = getenv("TMPDIR");
    char *path = malloc(4096);
    if (!path)
        abort();
    int n = snprintf(path, 4096, "%s/topkd-%s-XXXXXX", base && *base ? base : "/tmp", tag);
    if (n < 0 || n >= 4096) {
        fprintf(stderr, "temp dir name for %s is too long\n", tag);
        abort();
    }
    if (!mkdtemp(path)) {
        perror(path);
        abort();
    }
    return path;
}

int tkd_test_rmtree(const char *path)
{
    char cmd[4200];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", path);
    return system(cmd);
}

void tkd_test_rmdtemp(char *dir)
{
    tkd_test_rmtree(dir);
    free(dir);
}

const char *tkd_test_src(const char *rel)
{
    /* a few buffers in turn, so that one call's result survives the next ones in an argument list;
     * TKD_SOURCE_DIR in the environment wins (test binaries run from a copy of the tree elsewhere,
     * as on the GPU machine) */
    static char buf[8][4096];
    static int k;
    k = (k + 1) % 8;
    const char *root = getenv("TKD_SOURCE_DIR");
    snprintf(buf[k], sizeof buf[k], "%s/tests/%s", root ? root : TKD_SOURCE_DIR, rel);
    return buf[k];
}

const char *tkd_test_path(const char *dir, const char *name)
{
    static char buf[8][4200];
    static int k;
    k = (k + 1) % 8;
    int n = snprintf(buf[k], sizeof buf[k], "%s/%s", dir, name);
    if (n < 0 || (size_t)n >= sizeof buf[k])
        fail_msg("path %s/%s is too long", dir, name);
    return buf[k];
}

char *tkd_test_group_dir;

int tkd_test_group_dir_setup(void **state)
{
    /* the program's name tags the directory, so a leftover one says which test left it */
    char exe[4096];
    const char *tag = "group";
    ssize_t n = readlink("/proc/self/exe", exe, sizeof exe - 1);
    if (n > 0) {
        exe[n] = '\0';
        tag = strrchr(exe, '/') ? strrchr(exe, '/') + 1 : exe;
    }
    tkd_test_group_dir = tkd_test_mkdtemp(tag);
    *state = tkd_test_group_dir;
    return 0;
}

int tkd_test_group_dir_teardown(void **state)
{
    (void)state;
    tkd_test_rmdtemp(tkd_test_group_dir);
    tkd_test_group_dir = NULL;
    return 0;
}

int tkd_test_dir_setup(void **state)
{
    const char *tag = *state ? (const char *)*state : "test";
    *state = tkd_test_mkdtemp(tag);
    return 0;
}

int tkd_test_dir_teardown(void **state)
{
    tkd_test_rmdtemp(*state);
    *state = NULL;
    return 0;
}

void tkd_test_require_built(const char *const *bins)
{
    for (const char *const *b = bins; *b; b++)
        if (access(*b, X_OK) != 0) {
            printf("skipped: %s not built\n", *b);
            exit(77);
        }
}

int tkd_test_main(const char *names, const tkd_test_fn *fns, size_t n, tkd_test_fixture_fn group_setup,
                  tkd_test_fixture_fn group_teardown, int each)
{
    /* names arrives as the preprocessor wrote the macro's arguments: "test_a, test_b, ..." with
     * white space folded to single spaces; one copy, cut at the commas, names every test */
    struct CMUnitTest *tests = calloc(n, sizeof *tests);
    char *copy = strdup(names);
    if (!tests || !copy)
        abort();
    char *at = copy;
    for (size_t i = 0; i < n; i++) {
        at += strspn(at, " ");
        char *end = at + strcspn(at, ",");
        char *next = *end ? end + 1 : end;
        while (end > at && end[-1] == ' ')
            end--;
        *end = '\0';
        tests[i].name = at;
        tests[i].test_func = fns[i];
        if (each == TKD_TEST_EACH_DIR) {
            tests[i].setup_func = tkd_test_dir_setup;
            tests[i].teardown_func = tkd_test_dir_teardown;
            tests[i].initial_state = (void *)at; /* the dir's tag */
        }
        at = next;
    }
    int failed = _cmocka_run_group_tests("tests", tests, n, group_setup, group_teardown);
    free(copy);
    free(tests);
    return failed;
}

void tkd_test_assert_msg_has(const char *needle)
{
    if (!strstr(tkd_error_msg(), needle))
        fail_msg("message \"%s\" lacks \"%s\"", tkd_error_msg(), needle);
}

void tkd_test_expect_error(tkd_status got, tkd_status want, const char *const *frags)
{
    assert_int_equal(got, want);
    printf("expected error: %s\n", tkd_error_msg());
    for (; *frags; frags++)
        tkd_test_assert_msg_has(*frags);
}

int tkd_test_broken_files(const char *prefix, tkd_test_open_fn open_file)
{
    FILE *f = fopen(tkd_test_src("data/broken/EXPECTED.tsv"), "r");
    assert_non_null(f);
    char dir[4096];
    snprintf(dir, sizeof dir, "%s", tkd_test_src("data/broken"));
    char line[1024];
    int cases = 0;
    while (fgets(line, sizeof line, f)) {
        line[strcspn(line, "\n")] = '\0';
        if (strncmp(line, prefix, strlen(prefix)) != 0)
            continue;
        char *save = NULL;
        char *name = strtok_r(line, "\t", &save), *status = strtok_r(NULL, "\t", &save);
        char *sub = strtok_r(NULL, "\t", &save);
        assert_non_null(sub);
        tkd_error_clear();
        tkd_status st = open_file(tkd_test_path(dir, name));
        if (strcmp(tkd_status_name(st), status) != 0)
            fail_msg("%s: got %s (%s), expected %s", name, tkd_status_name(st), tkd_error_msg(), status);
        tkd_test_assert_msg_has(sub);
        tkd_test_assert_msg_has(name); /* the message names the file */
        cases++;
    }
    fclose(f);
    return cases;
}

void tkd_test_flip_chunk_byte(const char *path, const char *dataset, int64_t row)
{
    hid_t file = H5Fopen(path, H5F_ACC_RDONLY, H5P_DEFAULT);
    assert_true(file >= 0);
    hid_t ds = H5Dopen2(file, dataset, H5P_DEFAULT);
    assert_true(ds >= 0);
    hsize_t coords[H5S_MAX_RANK] = {(hsize_t)row};
    unsigned mask;
    haddr_t addr;
    hsize_t size;
    assert_true(H5Dget_chunk_info_by_coord(ds, coords, &mask, &addr, &size) >= 0);
    assert_true(size > 16);
    H5Dclose(ds);
    H5Fclose(file);
    FILE *fp = fopen(path, "r+b");
    assert_non_null(fp);
    long off = (long)(addr + size / 2);
    fseek(fp, off, SEEK_SET);
    int c = fgetc(fp);
    fseek(fp, off, SEEK_SET);
    fputc(c ^ 0x5a, fp);
    fclose(fp);
}

void tkd_test_require_gpu(void)
{
    if (tkd_backend_cuda_devices() == 0) {
        printf("skipped: no CUDA device answers on this machine\n");
        exit(77);
    }
}

int tkd_test_close(double a, double b, double atol, double rtol)
{
    return fabs(a - b) <= atol + rtol * fabs(b);
}

void tkd_test_randn(float *x, size_t n, uint64_t seed, float std)
{
    uint64_t s = seed * 0x9e3779b97f4a7c15ull + 1;
    for (size_t i = 0; i < n; i++) {
        double u[2];
        for (int j = 0; j < 2; j++) {
            s ^= s << 13; s ^= s >> 7; s ^= s << 17; /* xorshift64 */
            u[j] = ((s >> 11) + 0.5) * (1.0 / 9007199254740992.0);
        }
        x[i] = (float)(std * sqrt(-2.0 * log(u[0])) * cos(6.283185307179586 * u[1]));
    }
}

void tkd_test_fill_logits(float *x, size_t n, tkd_test_fill f, uint64_t seed)
{
    tkd_test_randn(x, n, seed, 3.0f);
    for (size_t i = 0; i < n; i++) {
        switch (f) {
        case TKD_TEST_FILL_RANDN: break;
        case TKD_TEST_FILL_TIES: x[i] = floorf(x[i]); break;
        case TKD_TEST_FILL_EXTREME: {
            int m = (int)(i % 7);
            x[i] = m == 0 ? 1e4f : m == 3 ? -1e4f : x[i];
            break;
        }
        case TKD_TEST_FILL_CONST: x[i] = 0.25f; break;
        case TKD_TEST_FILL_ZEROS_SIGNED: x[i] = (i % 3 == 0) ? -0.0f : (i % 3 == 1) ? 0.0f : -1.0f; break;
        }
    }
}

tkd_kl_params tkd_test_kl_params(tkd_kl_variant var, double tau, double alpha, int k, int k_use, int s)
{
    tkd_kl_params p;
    tkd_kl_params_defaults(&p, k);
    p.variant = var;
    p.temperature = (float)tau;
    p.alpha = (float)alpha;
    p.k_use = k_use;
    p.s = s;
    return p;
}

/* ---- child processes ------------------------------------------------------------------------- */

pid_t tkd_test_fork(int *fds)
{
    if (fds)
        assert_int_equal(pipe(fds), 0);
    fflush(NULL);
    pid_t pid = fork();
    assert_true(pid >= 0);
    return pid;
}

pid_t tkd_test_spawn(const char *bin, const char *const *args, const char *env, const char *out_path)
{
    const char *argv[32] = {bin};
    int n = 1;
    for (; args[n - 1]; n++) {
        assert_true(n < 31);
        argv[n] = args[n - 1];
    }
    argv[n] = NULL;
    fflush(NULL); /* else the child would write our buffered output again */
    pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        FILE *f = freopen(out_path, "w", stderr);
        if (!f || dup2(fileno(stderr), 1) < 0)
            _exit(99);
        if (env)
            putenv((char *)env);
        execv(bin, (char *const *)argv);
        _exit(98);
    }
    return pid;
}

int tkd_test_wait(pid_t pid)
{
    int status = 0;
    assert_int_equal(waitpid(pid, &status, 0), pid);
    return WIFEXITED(status) ? WEXITSTATUS(status) : 1000 + WTERMSIG(status);
}

int tkd_test_run(const char *bin, const char *const *args, const char *env, const char *out_path)
{
    return tkd_test_wait(tkd_test_spawn(bin, args, env, out_path));
}

int tkd_test_signal_when(pid_t pid, const char *path, int sig)
{
    /* 10 ms polls for up to two minutes: the tools get there in well under a second alone, far
     * longer on a loaded machine */
    for (int i = 0; i < 12000 && access(path, F_OK) != 0; i++) {
        int status = 0;
        pid_t r = waitpid(pid, &status, WNOHANG);
        assert_true(r == 0 || r == pid);
        if (r == pid) /* gone before it got there: its status tells the test what went wrong */
            return WIFEXITED(status) ? WEXITSTATUS(status) : 1000 + WTERMSIG(status);
        usleep(10000);
    }
    assert_int_equal(kill(pid, sig), 0);
    return tkd_test_wait(pid);
}

#include <signal.h>
#include <sys/prctl.h>

#include "common/dir_lock.h"

pid_t tkd_test_lock_holder(const char *dir, const char *name, const char *part)
{
    int fds[2];
    pid_t pid = tkd_test_fork(fds);
    if (pid == 0) {
        /* a test that fails while the holder lives must not leave it behind */
        if (prctl(PR_SET_PDEATHSIG, SIGKILL) != 0 || getppid() == 1)
            _exit(1);
        close(fds[0]);
        tkd_dir_lock *l = NULL;
        tkd_status st = part ? tkd_dir_lock_take_part(dir, name, part, "holder", &l)
                             : tkd_dir_lock_take(dir, name, "holder", &l);
        char ok = st == TKD_OK ? 'y' : 'n';
        if (write(fds[1], &ok, 1) != 1 || st != TKD_OK)
            _exit(1);
        for (;;)
            pause();
    }
    close(fds[1]);
    char ok = 0;
    assert_int_equal(read(fds[0], &ok, 1), 1);
    close(fds[0]);
    if (ok != 'y') {
        tkd_test_wait(pid);
        fail_msg("the lock holder could not take %s/%s", dir, name);
    }
    return pid;
}

void tkd_test_kill_holder(pid_t pid)
{
    assert_int_equal(kill(pid, SIGKILL), 0);
    assert_int_equal(tkd_test_wait(pid), 1000 + SIGKILL);
}

int tkd_test_wait_timeout(pid_t pid, double timeout_s)
{
    int status = 0;
    for (double waited = 0; waited < timeout_s; waited += 0.01) {
        pid_t r = waitpid(pid, &status, WNOHANG);
        assert_true(r == 0 || r == pid);
        if (r == pid)
            return WIFEXITED(status) ? WEXITSTATUS(status) : 1000 + WTERMSIG(status);
        usleep(10000);
    }
    kill(pid, SIGKILL);
    assert_int_equal(waitpid(pid, &status, 0), pid);
    return -1;
}

/* ---- a tiny teacher cache -------------------------------------------------------------------- */

#include "common/rng.h"
#include "formats/cache_manifest.h"
#include "formats/cache_shard.h"
#include "kernels/cpu/tail_sample.h"
#include "kernels/cpu/topk.h"
#include "model/model.h"

/* Fills sequences g0 .. g0 + n - 1 into b: random tokens (seeded per sequence, so shard and batch
 * boundaries do not matter), then the teacher's top-k / LSE / tail draws over each sequence's
 * first T tokens. logits (T, V), pos (T) and seqs (T) are scratch. */
static tkd_status teacher_fill(const tkd_test_teacher_opts *o, tkd_model *teacher, tkd_cache_batch *b,
                               int64_t g0, int64_t n, float *logits, int32_t *pos, int64_t *seqs)
{
    int T = o->seq_len, V = o->vocab;
    for (int64_t j = 0; j < n; j++) {
        int64_t g = g0 + j;
        int32_t *tok = b->tokens + j * (T + 1);
        tkd_rng r;
        tkd_rng_seed_stream(&r, o->seed ^ 0x70c5ull, (uint64_t)g);
        for (int t = 0; t <= T; t++)
            tok[t] = (int32_t)tkd_rng_below(&r, (uint64_t)V);
        const void *hidden = NULL;
        TKD_TRY(tkd_model_forward(teacher, tok, 1, T, 0, &hidden));
        tkd_model_logits(teacher, hidden, T, logits);
        size_t row = (size_t)j * T;
        TKD_TRY(tkd_topk_cpu(logits, T, V, o->k, o->temperature, b->topk_indices + row * o->k,
                             b->topk_logits + row * o->k, b->lse + row));
        if (o->tail_samples > 0) {
            for (int t = 0; t < T; t++) {
                pos[t] = t;
                seqs[t] = g;
            }
            TKD_TRY(tkd_tail_sample_cpu(logits, T, V, b->topk_indices + row * o->k, o->k, o->temperature,
                                        o->tail_samples, o->seed, seqs, pos,
                                        b->tail_indices + row * o->tail_samples));
        }
        b->seq_index[j] = g;
    }
    b->num_seq = n;
    return TKD_OK;
}

static void teacher_identity(const tkd_test_teacher_opts *o, tkd_cache_identity *id)
{
    memset(id, 0, sizeof *id);
    id->vocab_size = o->vocab;
    id->k = o->k;
    id->seq_len = o->seq_len;
    id->temperature = o->temperature;
    id->logits_dtype = TKD_CACHE_DTYPE_FLOAT32;
    id->tail_samples = o->tail_samples;
    snprintf(id->teacher_sha256, sizeof id->teacher_sha256, "%s",
             o->teacher_sha256 ? o->teacher_sha256
                               : "abababababababababababababababababababababababababababababababab");
    memset(id->dataset_sha256, 'c', 64);
}

void tkd_test_tiny_llama(tkd_model_config *mc, int vocab, int hidden, int kv_heads, int max_pos)
{
    tkd_model_config_defaults(mc);
    mc->vocab_size = vocab;
    mc->hidden_size = hidden;
    mc->intermediate_size = 2 * hidden;
    mc->num_hidden_layers = 1;
    mc->num_attention_heads = 2;
    mc->num_key_value_heads = kv_heads;
    mc->head_dim = hidden / 2;
    mc->max_position_embeddings = max_pos;
}

static tkd_status teacher_model(const tkd_test_teacher_opts *o, tkd_model **out)
{
    tkd_model_config mc;
    tkd_test_tiny_llama(&mc, o->vocab, o->hidden, 2, o->seq_len);
    mc.tie_word_embeddings = 0;
    mc.initializer_range = o->init_std > 0 ? o->init_std : 0.5f;
    TKD_TRY(tkd_model_config_validate(&mc));
    TKD_TRY(tkd_model_init_random(&mc, o->seed, out));
    /* Mostly a bigram model: the MLP's output is switched off and the attention's scaled down (with
     * weights of std 0.5 the block's outputs would otherwise swamp the embedding), so the next-token
     * distribution depends mainly on the current token (a tiny student learns it in a few dozen
     * steps) and a little on the context. */
    tkd_layer_weights *lw = &(*out)->w.layers[0];
    size_t D = (size_t)o->hidden, F = (size_t)mc.intermediate_size;
    for (size_t i = 0; i < D * D; i++)
        lw->wo[i] *= 0.03f;
    memset(lw->wd, 0, D * F * sizeof(float));
    return TKD_OK;
}

/* Writes shard `i` holding sequences [g0, g0 + n). */
static tkd_status teacher_shard(const char *dir, int i, const tkd_test_teacher_opts *o, const tkd_cache_identity *id,
                                tkd_model *teacher, tkd_cache_batch *b, int64_t g0, int64_t n, float *logits,
                                int32_t *pos, int64_t *seqs, tkd_cache_shard_entry *e)
{
    char path[4200];
    snprintf(path, sizeof path, "%s/shard-%05d.h5", dir, i);
    tkd_shard_writer_opts wo = {.zstd_level = 3, .chunk_seqs = o->chunk_seqs, .tail_seed = o->seed};
    tkd_shard_writer *w = NULL;
    TKD_TRY(tkd_shard_writer_open(&w, path, id, g0, &wo));
    tkd_status st = TKD_OK;
    for (int64_t s = 0; st == TKD_OK && s < n; s += b->capacity) {
        int64_t m = n - s < b->capacity ? n - s : b->capacity;
        st = teacher_fill(o, teacher, b, g0 + s, m, logits, pos, seqs);
        if (st == TKD_OK && o->edit)
            o->edit(b, g0 + s, o->edit_ctx);
        if (st == TKD_OK)
            st = tkd_shard_writer_append(w, b);
    }
    if (st != TKD_OK) {
        tkd_shard_writer_abort(w);
        return st;
    }
    return tkd_shard_writer_finish(w, e);
}

tkd_status tkd_test_teacher_cache(const char *dir, const tkd_test_teacher_opts *o)
{
    TKD_TRY(tkd_mkdir_p(dir));
    tkd_cache_identity id;
    teacher_identity(o, &id);
    tkd_model *teacher = NULL;
    TKD_TRY(teacher_model(o, &teacher));
    tkd_cache_batch b;
    tkd_status st = tkd_cache_batch_alloc(&b, 4, o->seq_len, o->k, o->tail_samples);
    float *logits = malloc((size_t)o->seq_len * (size_t)o->vocab * sizeof(float));
    int32_t *pos = malloc((size_t)o->seq_len * sizeof(int32_t));
    int64_t *seqs = malloc((size_t)o->seq_len * sizeof(int64_t));
    tkd_cache_manifest m;
    tkd_cache_manifest_init(&m);
    m.id = id;
    m.tail_seed = o->seed;
    m.stride = o->seq_len;
    tkd_cache_manifest_set_str(&m.teacher_path, "tests: random teacher");
    tkd_cache_manifest_set_str(&m.teacher_arch, "LlamaForCausalLM");
    tkd_cache_manifest_set_str(&m.dataset_path, "tests: random tokens");
    tkd_cache_manifest_set_str(&m.tool_version, "test");
    if (st == TKD_OK && (!logits || !pos || !seqs))
        st = tkd_error_set(TKD_ERR_NOMEM, "test teacher cache: out of memory");
    for (int i = 0, g = 0; st == TKD_OK && g < o->num_seq; i++) {
        int n = o->num_seq - g < o->shard_seqs ? o->num_seq - g : o->shard_seqs;
        tkd_cache_shard_entry e;
        st = teacher_shard(dir, i, o, &id, teacher, &b, g, n, logits, pos, seqs, &e);
        if (st == TKD_OK)
            st = tkd_cache_manifest_add_shard(&m, &e);
        g += n;
    }
    char mpath[4200];
    snprintf(mpath, sizeof mpath, "%s/" TKD_CACHE_MANIFEST_NAME, dir);
    if (st == TKD_OK)
        st = tkd_cache_manifest_write(&m, mpath);
    tkd_cache_manifest_free(&m);
    tkd_cache_batch_free(&b);
    tkd_model_free(teacher);
    free(logits);
    free(pos);
    free(seqs);
    return st;
}

tkd_status tkd_test_student_dir_make(tkd_test_student_dir *s, const char *tag, const tkd_test_teacher_opts *o)
{
    memset(s, 0, sizeof *s);
    s->dir = tkd_test_mkdtemp(tag);
    snprintf(s->cache, sizeof s->cache, "%s/cache", s->dir);
    snprintf(s->runs, sizeof s->runs, "%s/runs", s->dir);
    tkd_status st = tkd_test_teacher_cache(s->cache, o);
    if (st != TKD_OK) {
        fprintf(stderr, "teacher cache %s: %s\n", s->cache, tkd_error_msg());
        tkd_test_student_dir_free(s);
    }
    return st;
}

void tkd_test_student_dir_free(tkd_test_student_dir *s)
{
    if (s->dir)
        tkd_test_rmdtemp(s->dir);
    s->dir = NULL;
}

int tkd_test_student_setup(void **state, const char *tag, const tkd_test_teacher_opts *o)
{
    tkd_test_student_dir *s = calloc(1, sizeof *s);
    if (!s || tkd_test_student_dir_make(s, tag, o) != TKD_OK) {
        free(s);
        return -1;
    }
    *state = s;
    return 0;
}

int tkd_test_tiny_student_setup(void **state)
{
    tkd_test_teacher_opts o = {.vocab = 64, .hidden = 16, .seq_len = 8, .k = 4, .temperature = 1.0f,
                               .num_seq = 32, .shard_seqs = 16, .seed = 5};
    return tkd_test_student_setup(state, "tiny-student", &o);
}

tkd_status tkd_test_tiny_student(const tkd_test_student_dir *s, const char *run_dir, const char *name, int resume,
                                 const char *extra, struct tkd_train_result *res)
{
    char cache_set[4300];
    snprintf(cache_set, sizeof cache_set, "data.cache=%s", s->cache);
    const char *sets[14] = {"model.hidden_size=16", "model.intermediate_size=32", "model.num_layers=1",
                            "model.num_heads=2", "model.num_kv_heads=2", "model.max_position_embeddings=8",
                            "data.val_fraction=0.125", "train.batch_size=4", "train.eval_interval=0",
                            "train.max_steps=4", "train.log_interval=1", "device=cpu", cache_set, extra};
    return tkd_test_student_train(run_dir ? run_dir : s->runs, name, sets, extra ? 14 : 13, resume, res);
}

const char *tkd_test_in_run(const tkd_test_student_dir *s, const char *name, const char *file)
{
    static char buf[4][4400];
    static int k;
    k = (k + 1) % 4;
    int n = snprintf(buf[k], sizeof buf[k], "%s/%s/%s", s->runs, name, file);
    if (n < 0 || (size_t)n >= sizeof buf[k])
        fail_msg("path %s/%s/%s is too long", s->runs, name, file);
    return buf[k];
}

int tkd_test_student_teardown(void **state)
{
    if (*state)
        tkd_test_student_dir_free(*state);
    free(*state);
    *state = NULL;
    return 0;
}

const char *const *tkd_test_env;

const char *tkd_test_getenv(const char *name)
{
    for (int i = 0; tkd_test_env && tkd_test_env[i]; i += 2)
        if (strcmp(tkd_test_env[i], name) == 0)
            return tkd_test_env[i + 1];
    return NULL;
}

char *tkd_test_read_file(const char *path, size_t *len)
{
    FILE *f = fopen(path, "rb");
    if (!f)
        return NULL;
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *buf = n >= 0 ? malloc((size_t)n + 1) : NULL;
    if (buf && fread(buf, 1, (size_t)n, f) != (size_t)n) {
        free(buf);
        buf = NULL;
    }
    fclose(f);
    if (buf) {
        buf[n] = '\0';
        if (len)
            *len = (size_t)n;
    }
    return buf;
}

char *tkd_test_slurp(const char *path, size_t *len)
{
    char *buf = tkd_test_read_file(path, len);
    if (!buf)
        fail_msg("cannot read %s", path);
    return buf;
}

void tkd_test_write_text(const char *path, const char *text)
{
    FILE *f = fopen(path, "wb");
    if (!f)
        fail_msg("cannot write %s", path);
    fputs(text, f);
    assert_int_equal(fclose(f), 0);
}

void tkd_test_ascii_tokenizer(const char *dir, int z_id, const char *extra_vocab, const char *merges)
{
    if (mkdir(dir, 0755) != 0 && errno != EEXIST)
        fail_msg("mkdir %s: %s", dir, strerror(errno));
    FILE *f = fopen(tkd_test_path(dir, "tokenizer.json"), "w");
    assert_non_null(f);
    fprintf(f, "{\"added_tokens\": [{\"id\": 99, \"content\": \"<|eos|>\", \"special\": true, \"normalized\": false}],"
               " \"normalizer\": null, \"pre_tokenizer\": {\"type\": \"ByteLevel\", \"add_prefix_space\": false},"
               " \"post_processor\": null, \"decoder\": {\"type\": \"ByteLevel\"}, \"model\": {\"type\": \"BPE\","
               " \"vocab\": {");
    for (int b = 0x21; b <= 0x7E; b++)
        fprintf(f, "\"%s%c\": %d, ", b == '"' || b == '\\' ? "\\" : "", b, b == 'Z' && z_id >= 0 ? z_id : b - 0x21);
    fprintf(f, "\"\u0120\": 94, \"\u010a\": 95%s%s}, \"merges\": [%s]}}", *extra_vocab ? ", " : "", extra_vocab,
            merges);
    fclose(f);
    tkd_test_write_text(tkd_test_path(dir, "tokenizer_config.json"), "{\"eos_token\": \"<|eos|>\"}");
}

long long tkd_test_dir_sum(const char *dir, tkd_test_entry_fn each, void *ctx)
{
    DIR *d = opendir(dir);
    if (!d)
        fail_msg("cannot list %s: %s", dir, strerror(errno));
    long long sum = 0;
    for (struct dirent *e; (e = readdir(d)) != NULL;)
        if (strcmp(e->d_name, ".") != 0 && strcmp(e->d_name, "..") != 0)
            sum += each(tkd_test_path(dir, e->d_name), e->d_name, ctx);
    closedir(d);
    return sum;
}

static long long visible(const char *path, const char *name, void *ctx)
{
    (void)path, (void)ctx;
    return name[0] != '.';
}

int tkd_test_count_visible(const char *dir)
{
    return (int)tkd_test_dir_sum(dir, visible, NULL);
}

int tkd_test_files_equal(const char *a, const char *b)
{
    size_t na = 0, nb = 0;
    char *x = tkd_test_read_file(a, &na), *y = tkd_test_read_file(b, &nb);
    int eq = x && y && na == nb && memcmp(x, y, na) == 0;
    free(x);
    free(y);
    return eq;
}

/* ---- student-train in-process ------------------------------------------------------------------ */

#include "common/log.h"
#include "student_train/train.h"
#include "student_train/train_config.h"

tkd_status tkd_test_student_train(const char *run_dir, const char *name, const char *const *sets, size_t n,
                                  int resume, tkd_train_result *res)
{
    tkd_train_result scratch;
    const char **all = malloc((n + 2) * sizeof *all);
    char dir_set[4200], name_set[600];
    snprintf(dir_set, sizeof dir_set, "run.dir=%s", run_dir);
    snprintf(name_set, sizeof name_set, "run.name=%s", name);
    all[0] = dir_set;
    all[1] = name_set;
    for (size_t i = 0; i < n; i++)
        all[2 + i] = sets[i];
    tkd_train_config cfg = {0};
    tkd_status st = tkd_config_load(&tkd_train_schema, &cfg, NULL, all, n + 2);
    char *yaml = NULL;
    size_t yaml_len = 0;
    if (st == TKD_OK) {
        FILE *mem = open_memstream(&yaml, &yaml_len);
        st = tkd_config_print(&tkd_train_schema, &cfg, mem);
        fclose(mem);
    }
    if (st == TKD_OK) {
        tkd_log_level saved = tkd_log_get_level();
        tkd_log_set_level(TKD_LOG_LEVEL_WARN);
        tkd_train_opts o = {.cfg = &cfg, .run_name = name, .config_yaml = yaml, .resume = resume == 1,
                            .overwrite = resume == 2};
        st = tkd_train_run(&o, res ? res : &scratch);
        tkd_log_set_level(saved);
    }
    free(yaml);
    free(all);
    tkd_config_free(&tkd_train_schema, &cfg);
    return st;
}

int tkd_test_metrics(const char *metrics_path, const char *type, const char *key, double *out, int cap)
{
    char *text = tkd_test_read_file(metrics_path, NULL);
    char want_type[64], want_key[64];
    snprintf(want_type, sizeof want_type, "\"type\": \"%s\"", type);
    snprintf(want_key, sizeof want_key, "\"%s\": ", key);
    int count = 0;
    for (char *line = text; line && *line;) {
        char *nl = strchr(line, '\n');
        if (nl)
            *nl = '\0';
        char *k = strstr(line, want_key);
        if (strstr(line, want_type) && k) {
            const char *v = k + strlen(want_key);
            if (count < cap)
                out[count] = strncmp(v, "null", 4) == 0 ? NAN : strtod(v, NULL);
            count++;
        }
        line = nl ? nl + 1 : line + strlen(line);
    }
    free(text);
    return count;
}

void tkd_test_train_metrics(const tkd_test_student_dir *s, const char *run, const char *key, double *out, int want)
{
    char path[4400];
    snprintf(path, sizeof path, "%s/%s/metrics.jsonl", s->runs, run);
    int n = tkd_test_metrics(path, "train", key, out, want);
    if (n != want)
        fail_msg("%s: %d training records of %s, expected %d", path, n, key, want);
}

char *tkd_test_metrics_without_time(const char *path)
{
    char *text = tkd_test_read_file(path, NULL);
    assert_non_null(text);
    char *p;
    while ((p = strstr(text, ", \"elapsed_s\": ")) != NULL) {
        char *end = strchr(p + 2, '}');
        assert_non_null(end);
        memmove(p, end, strlen(end) + 1);
    }
    return text;
}

void tkd_test_write_st(const char *path, const tkd_test_st_entry *e, int n)
{
    char hdr[8192];
    size_t len = (size_t)snprintf(hdr, sizeof hdr, "{\"__metadata__\":{\"format\":\"pt\"}");
    size_t off = 0;
    for (int i = 0; i < n; i++) {
        len += (size_t)snprintf(hdr + len, sizeof hdr - len, ",\"%s\":{\"dtype\":\"%s\",\"shape\":[", e[i].name,
                                e[i].dtype);
        for (int k = 0; k < e[i].ndim; k++)
            len += (size_t)snprintf(hdr + len, sizeof hdr - len, "%s%lld", k ? "," : "", (long long)e[i].shape[k]);
        len += (size_t)snprintf(hdr + len, sizeof hdr - len, "],\"data_offsets\":[%zu,%zu]}", off,
                                off + e[i].nbytes);
        off += e[i].nbytes;
    }
    len += (size_t)snprintf(hdr + len, sizeof hdr - len, "}");
    assert_true(len < sizeof hdr);
    FILE *fp = fopen(path, "wb");
    assert_non_null(fp);
    uint64_t n8 = len;
    assert_int_equal(fwrite(&n8, 8, 1, fp), 1);
    assert_int_equal(fwrite(hdr, 1, len, fp), len);
    for (int i = 0; i < n; i++)
        if (e[i].nbytes)
            assert_int_equal(fwrite(e[i].data, 1, e[i].nbytes, fp), e[i].nbytes);
    assert_int_equal(fclose(fp), 0);
}

void tkd_test_cut_row(const float *t, int v, int k, double tau_cache, int s, int repeat,
                      int (*rand_below)(void *ctx, int n), void *ctx, int32_t *idx, float *tl, float *lse,
                      int32_t *draws)
{
    for (int j = 0; j < k; j++) {
        int best = -1;
        for (int u = 0; u < v; u++) {
            int taken = 0;
            for (int q = 0; q < j && !taken; q++)
                taken = idx[q] == u;
            if (!taken && (best < 0 || t[u] > t[best]))
                best = u;
        }
        idx[j] = best;
        tl[j] = t[best];
    }
    double m = -INFINITY, sum = 0.0;
    for (int u = 0; u < v; u++)
        m = fmax(m, t[u] / tau_cache);
    for (int u = 0; u < v; u++)
        sum += exp(t[u] / tau_cache - m);
    *lse = (float)(m + log(sum));
    for (int e = 0; e < s; e++) {
        int u, clash;
        do {
            u = rand_below(ctx, v);
            clash = 0;
            for (int q = 0; q < k; q++)
                clash |= idx[q] == u;
        } while (clash);
        draws[e] = e == repeat ? draws[0] : u;
    }
}

void tkd_test_doc_starts(const int *starts, int stride, int B, int T, int32_t *doc)
{
    for (int b = 0; b < B; b++) {
        const int *st = starts + (size_t)b * (size_t)stride;
        for (int i = 0, d = 0; i < T; i++) {
            if (d + 1 < stride && st[d + 1] == i)
                d++;
            doc[(size_t)b * T + i] = st[d];
        }
    }
}
