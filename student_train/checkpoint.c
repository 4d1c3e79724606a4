/* checkpoint.c — see checkpoint.h. */
#include "student_train/checkpoint.h"

#include <cjson/cJSON.h>
#include <glob.h>
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "common/dist.h"
#include "common/fileio.h"
#include "common/owned_dir.h"
#include "common/progress.h"
#include "common/signals.h"
#include "formats/json_check.h"
#include "formats/safetensors.h"

#define CKPT_PATH_MAX 4096

/* Every file a checkpoint directory holds, with the temporaries of their atomic writes. */
static const char *const ckpt_files[] = {
    "config.json",           "config.json.tmp-*",           "model.safetensors",
    "model.safetensors.tmp-*", "optimizer.safetensors",     "optimizer.safetensors.tmp-*",
    "optimizer-rank[0-9]*-of[0-9]*.safetensors", "optimizer-rank[0-9]*-of[0-9]*.safetensors.tmp-*",
    "state.json",            "state.json.tmp-*",            "config.yaml",
    "config.yaml.tmp-*",     NULL,
};

const tkd_built_kind tkd_checkpoint_kind = {
    .tool = "student-train",
    .what = "checkpoint",
    .files = ckpt_files,
    /* every version wrote state.json into each checkpoint, beside the weights */
    .old_sign = "state.json",
};

/* Removes a staging directory this process made and is abandoning (its error message kept). */
static void drop_staging(const char *stage)
{
    tkd_error_saved keep;
    tkd_error_save(&keep, TKD_ERR_IO);
    tkd_built_dir_remove(&tkd_checkpoint_kind, stage, false); /* may set a message of its own */
    tkd_error_restore(&keep);
}

/* 1 when the optimizer's moments are host fp32 arrays (tkd_adamw_init, or a host-addressable
 * backend; bf16 ones go through tkd_adamw_moments_get / _set, which convert). */
static int moments_on_host(const tkd_adamw *opt)
{
    return (!opt->be || opt->be->host_addressable) && opt->cfg.state_dtype == TKD_ADAMW_DTYPE_F32;
}

/* The safetensors dtype the moments are stored in: the one they are kept in, so resume is exact. */
static tkd_dtype file_dtype(tkd_adamw_dtype d)
{
    return d == TKD_ADAMW_DTYPE_BF16 ? TKD_DTYPE_BF16 : TKD_DTYPE_F32;
}

/* Host arrays of 2·n floats for moments kept in device memory. */
static tkd_status host_pair(const tkd_adamw *opt, float **out)
{
    *out = malloc(2 * opt->n * sizeof(float) + 1);
    return *out ? TKD_OK : tkd_error_set(TKD_ERR_NOMEM, "checkpoint: out of host memory for the optimizer state");
}

/* path: a safetensors file of the moments adamw.m and adamw.v, n values each, as F32 or BF16 (kept
 * as dt: bf16 values round to themselves; written whole or not at all). */
static tkd_status write_moments(const char *path, size_t n, tkd_adamw_dtype dt, const float *m, const float *v)
{
    tkd_st_writer *w = NULL;
    tkd_status st = tkd_st_writer_init(&w, file_dtype(dt));
    int64_t shape[1] = {(int64_t)n};
    if (st == TKD_OK)
        st = tkd_st_writer_add(w, "adamw.m", 1, shape, m);
    if (st == TKD_OK)
        st = tkd_st_writer_add(w, "adamw.v", 1, shape, v);
    if (st == TKD_OK)
        st = tkd_st_writer_finish(w, path);
    tkd_st_writer_free(w);
    return st;
}

static tkd_status write_optimizer(const char *dir, const tkd_adamw *opt)
{
    char path[CKPT_PATH_MAX];
    TKD_TRY(tkd_path_join(path, sizeof path, dir, "optimizer.safetensors"));
    const float *m = opt->m, *v = opt->v;
    float *tmp = NULL;
    if (!moments_on_host(opt)) {
        TKD_TRY(host_pair(opt, &tmp));
        tkd_status st = tkd_adamw_moments_get(opt, tmp, tmp + opt->n);
        if (st != TKD_OK) {
            free(tmp);
            return st;
        }
        m = tmp, v = tmp + opt->n;
    }
    tkd_status st = write_moments(path, opt->n, opt->cfg.state_dtype, m, v);
    free(tmp);
    return st;
}

/* 64-bit values go to JSON as decimal strings: JSON numbers are doubles and would round them. */
static tkd_status add_u64(cJSON *o, const char *key, uint64_t v)
{
    char buf[32];
    snprintf(buf, sizeof buf, "%" PRIu64, v);
    return cJSON_AddStringToObject(o, key, buf) ? TKD_OK : tkd_error_set(TKD_ERR_NOMEM, "checkpoint: out of memory");
}

/* The best evaluation so far; its value as %.17g, which reads back to the same double. */
static tkd_status add_best(cJSON *o, const tkd_train_state *s)
{
    char buf[40];
    snprintf(buf, sizeof buf, "%.17g", s->best_value);
    TKD_TRY(add_u64(o, "best_step", (uint64_t)s->best_step));
    TKD_TRY(add_u64(o, "bad_evals", (uint64_t)s->bad_evals));
    return cJSON_AddStringToObject(o, "best_value", buf) ? TKD_OK
                                                         : tkd_error_set(TKD_ERR_NOMEM, "checkpoint: out of memory");
}

/* state.json: the trainer's state, the optimizer's step and size, the world its moments were
 * sharded over (1 = optimizer.safetensors) and the dtype they are kept in. */
static tkd_status write_state(const char *dir, int64_t adamw_step, size_t n, int world, tkd_adamw_dtype dt,
                              const tkd_train_state *s)
{
    cJSON *o = cJSON_CreateObject();
    tkd_status st = o ? TKD_OK : tkd_error_set(TKD_ERR_NOMEM, "checkpoint: out of memory");
    if (st == TKD_OK) st = add_u64(o, "step", (uint64_t)s->step);
    if (st == TKD_OK) st = add_u64(o, "epoch", (uint64_t)s->epoch);
    if (st == TKD_OK) st = add_u64(o, "offset", (uint64_t)s->offset);
    if (st == TKD_OK) st = add_u64(o, "tokens_seen", (uint64_t)s->tokens_seen);
    if (st == TKD_OK) st = add_u64(o, "adamw_step", (uint64_t)adamw_step);
    if (st == TKD_OK) st = add_u64(o, "adamw_n", (uint64_t)n);
    if (st == TKD_OK) st = add_u64(o, "optimizer_world", (uint64_t)world);
    if (st == TKD_OK && !cJSON_AddStringToObject(o, "optimizer_state_dtype", tkd_adamw_dtype_name(dt)))
        st = tkd_error_set(TKD_ERR_NOMEM, "checkpoint: out of memory");
    for (int i = 0; i < 4 && st == TKD_OK; i++) {
        char key[16];
        snprintf(key, sizeof key, "rng%d", i);
        st = add_u64(o, key, s->rng.s[i]);
    }
    if (st == TKD_OK && s->best_step >= 0)
        st = add_best(o, s);
    char *text = st == TKD_OK ? cJSON_Print(o) : NULL;
    if (st == TKD_OK && !text)
        st = tkd_error_set(TKD_ERR_NOMEM, "checkpoint: out of memory");
    char path[CKPT_PATH_MAX];
    if (st == TKD_OK)
        st = tkd_path_join(path, sizeof path, dir, "state.json");
    if (st == TKD_OK)
        st = tkd_file_write_atomic(path, text, strlen(text));
    free(text);
    cJSON_Delete(o);
    return st;
}

static tkd_status write_text(const char *dir, const char *name, const char *text)
{
    char path[CKPT_PATH_MAX];
    TKD_TRY(tkd_path_join(path, sizeof path, dir, name));
    return tkd_file_write_atomic(path, text, strlen(text));
}

tkd_status tkd_checkpoint_save(const char *dir, const tkd_model *m, const tkd_adamw *opt,
                               const tkd_train_state *s, const char *config_yaml)
{
    char tmp[CKPT_PATH_MAX];
    TKD_TRY(tkd_built_dir_make_temp(&tkd_checkpoint_kind, dir, tmp, sizeof tmp));
    tkd_status st = tkd_model_save_hf(m, tmp, TKD_DTYPE_F32);
    if (st == TKD_OK)
        st = write_optimizer(tmp, opt);
    if (st == TKD_OK)
        st = write_state(tmp, opt->step, opt->n, 1, opt->cfg.state_dtype, s);
    if (st == TKD_OK && config_yaml)
        st = write_text(tmp, "config.yaml", config_yaml);
    if (st == TKD_OK)
        st = tkd_built_dir_rename(&tkd_checkpoint_kind, tmp, dir);
    if (st != TKD_OK) {
        drop_staging(tmp);
        return tkd_error_prefix(st, "checkpoint %s (the previous checkpoint is kept)", dir);
    }
    return TKD_OK;
}

static tkd_status get_u64(const cJSON *o, const char *key, const char *path, uint64_t *out)
{
    const cJSON *it = cJSON_GetObjectItemCaseSensitive(o, key);
    char *end = NULL;
    if (!cJSON_IsString(it) || !*it->valuestring)
        return tkd_error_set(TKD_ERR_FORMAT, "%s: key \"%s\" missing or not a string", path, key);
    *out = strtoull(it->valuestring, &end, 10);
    if (*end)
        return tkd_error_set(TKD_ERR_FORMAT, "%s: key \"%s\" is not an integer", path, key);
    return TKD_OK;
}

/* The best evaluation of a state.json that has one (written by add_best). */
static tkd_status get_best(const cJSON *o, const char *path, tkd_train_state *s)
{
    uint64_t step, bad;
    TKD_TRY(get_u64(o, "best_step", path, &step));
    TKD_TRY(get_u64(o, "bad_evals", path, &bad));
    const cJSON *it = cJSON_GetObjectItemCaseSensitive(o, "best_value");
    char *end = NULL;
    double v = cJSON_IsString(it) ? strtod(it->valuestring, &end) : NAN;
    if (!end || end == it->valuestring || *end || !isfinite(v))
        return tkd_error_set(TKD_ERR_FORMAT, "%s: key \"best_value\" missing or not a finite number", path);
    s->best_step = (int64_t)step, s->bad_evals = (int64_t)bad, s->best_value = v;
    return TKD_OK;
}

/* The moments' dtype of state.json o (f32 when the key is absent: a checkpoint from before
 * optim.state_dtype), which must be the run's `want`: moments are not converted on resume, so a
 * resumed run takes the same steps as one never stopped. */
static tkd_status check_state_dtype(const cJSON *o, const char *path, const char *dir, tkd_adamw_dtype want)
{
    const cJSON *it = cJSON_GetObjectItemCaseSensitive(o, "optimizer_state_dtype");
    const char *have = it ? cJSON_GetStringValue(it) : "f32";
    if (!have || (strcmp(have, "f32") != 0 && strcmp(have, "bf16") != 0))
        return tkd_error_set(TKD_ERR_FORMAT, "%s: key \"optimizer_state_dtype\" is not \"f32\" or \"bf16\"", path);
    if (strcmp(have, tkd_adamw_dtype_name(want)) != 0)
        return tkd_error_set(TKD_ERR_CONFIG, "checkpoint %s keeps the AdamW moments as %s, but optim.state_dtype is "
                             "%s: resume with optim.state_dtype: %s", dir, have, tkd_adamw_dtype_name(want), have);
    return TKD_OK;
}

/* The state.json of dir into *s; *adamw_step and the optimizer's *world (1 when the key is absent:
 * a checkpoint from before data-parallel training). Its n must equal the model's, its moments'
 * dtype the run's dt. */
static tkd_status read_state(const char *dir, size_t n, tkd_adamw_dtype dt, int64_t *adamw_step, int *world,
                             tkd_train_state *s)
{
    char path[CKPT_PATH_MAX];
    void *text = NULL;
    size_t len = 0;
    TKD_TRY(tkd_path_join(path, sizeof path, dir, "state.json"));
    TKD_TRY(tkd_read_file(path, &text, &len));
    cJSON *o = cJSON_ParseWithLength(text, len);
    tkd_status dup = o ? tkd_json_unique_keys(o, text, len, path) : TKD_OK;
    free(text);
    if (!o)
        return tkd_error_set(TKD_ERR_FORMAT, "%s: not valid JSON", path);
    if (dup != TKD_OK) {
        cJSON_Delete(o);
        return dup;
    }
    uint64_t v[11] = {[10] = 1};
    const char *keys[11] = {"step", "epoch", "offset", "tokens_seen", "adamw_step", "adamw_n",
                            "rng0", "rng1", "rng2", "rng3", "optimizer_world"};
    tkd_status st = TKD_OK;
    for (int i = 0; i < 10 && st == TKD_OK; i++)
        st = get_u64(o, keys[i], path, &v[i]);
    if (st == TKD_OK && cJSON_GetObjectItemCaseSensitive(o, keys[10]))
        st = get_u64(o, keys[10], path, &v[10]);
    s->best_step = -1, s->best_value = 0, s->bad_evals = 0;
    if (st == TKD_OK && cJSON_GetObjectItemCaseSensitive(o, "best_step"))
        st = get_best(o, path, s);
    if (st == TKD_OK)
        st = check_state_dtype(o, path, dir, dt);
    cJSON_Delete(o);
    TKD_TRY(st);
    if (v[5] != n)
        return tkd_error_set(TKD_ERR_MISMATCH, "%s: optimizer holds %llu values, the model %zu", path,
                             (unsigned long long)v[5], n);
    if (v[10] < 1 || v[10] > (1u << 20))
        return tkd_error_set(TKD_ERR_FORMAT, "%s: optimizer_world %llu is not a number of ranks", path,
                             (unsigned long long)v[10]);
    s->step = (int64_t)v[0];
    s->epoch = (int64_t)v[1];
    s->offset = (int64_t)v[2];
    s->tokens_seen = (int64_t)v[3];
    *adamw_step = (int64_t)v[4];
    *world = (int)v[10];
    for (int i = 0; i < 4; i++)
        s->rng.s[i] = v[6 + i];
    return TKD_OK;
}

static void shard_name(char *buf, size_t cap, int rank, int world)
{
    if (world <= 1)
        snprintf(buf, cap, "optimizer.safetensors");
    else
        snprintf(buf, cap, "optimizer-rank%d-of%d.safetensors", rank, world);
}

/* Copies [lo, hi) of the moments held by rank r of world (its file covers [b, e), in dt) into
 * out_m/out_v (fp32), which start at parameter `base`. */
static tkd_status read_overlap(const char *dir, int r, int world, tkd_adamw_dtype dt, size_t b, size_t e, size_t lo,
                               size_t hi, size_t base, float *out_m, float *out_v)
{
    char name[64], path[CKPT_PATH_MAX];
    shard_name(name, sizeof name, r, world);
    TKD_TRY(tkd_path_join(path, sizeof path, dir, name));
    if (!tkd_file_exists(path))
        return tkd_error_set(TKD_ERR_NOT_FOUND, "%s: missing — the checkpoint was written by %d rank%s and needs "
                             "every one's optimizer shard", path, world, world > 1 ? "s" : "");
    tkd_st_dir *d = NULL;
    TKD_TRY(tkd_st_open(path, &d));
    tkd_status st = TKD_OK;
    for (int k = 0; k < 2 && st == TKD_OK; k++) {
        const char *tn = k ? "adamw.v" : "adamw.m";
        const tkd_st_tensor *t = tkd_st_find(d, tn);
        if (!t || t->dtype != file_dtype(dt) || t->ndim != 1 || (size_t)t->shape[0] != e - b)
            st = tkd_error_set(TKD_ERR_FORMAT, "%s: tensor '%s' missing or not %s (%zu,) — the range [%zu, %zu) of "
                               "rank %d of %d", path, tn, tkd_dtype_name(file_dtype(dt)), e - b, b, e, r, world);
        else /* F32: a copy; BF16: widened, exactly */
            st = tkd_st_slice_f32(t, lo - b, hi - lo, (k ? out_v : out_m) + (lo - base));
    }
    tkd_st_close(d);
    return st;
}

/* Moments of [begin, end) from a checkpoint whose optimizer was sharded over `world` ranks (1: one
 * file): every old shard that overlaps the range gives its part (re-sharding when worlds differ). */
static tkd_status read_moments(const char *dir, size_t n, int world, tkd_adamw_dtype dt, size_t begin, size_t end,
                               float *out_m, float *out_v)
{
    for (int r = 0; r < world; r++) {
        size_t b = 0, e = n, chunk;
        if (world > 1)
            tkd_zero_range(n, world, r, &b, &e, &chunk);
        size_t lo = b > begin ? b : begin, hi = e < end ? e : end;
        if (lo < hi)
            TKD_TRY(read_overlap(dir, r, world, dt, b, e, lo, hi, begin, out_m, out_v));
    }
    return TKD_OK;
}

static tkd_status read_optimizer(const char *dir, int world, tkd_adamw *opt)
{
    float *m = opt->m, *v = opt->v, *tmp = NULL;
    if (!moments_on_host(opt)) {
        TKD_TRY(host_pair(opt, &tmp));
        m = tmp, v = tmp + opt->n;
    }
    tkd_status st = read_moments(dir, opt->n, world, opt->cfg.state_dtype, 0, opt->n, m, v);
    if (st == TKD_OK && tmp)
        st = tkd_adamw_moments_set(opt, m, v);
    free(tmp);
    return st;
}

static tkd_status check_same_arch(const tkd_model *a, const tkd_model *b, const char *dir)
{
    const tkd_model_config *x = &a->cfg, *y = &b->cfg;
    if (x->vocab_size != y->vocab_size || x->hidden_size != y->hidden_size ||
        x->intermediate_size != y->intermediate_size || x->num_hidden_layers != y->num_hidden_layers ||
        x->num_attention_heads != y->num_attention_heads || x->num_key_value_heads != y->num_key_value_heads ||
        x->head_dim != y->head_dim || x->tie_word_embeddings != y->tie_word_embeddings ||
        x->attention_bias != y->attention_bias || x->arch != y->arch || x->sliding_window != y->sliding_window ||
        memcmp(x->layer_sliding, y->layer_sliding, sizeof x->layer_sliding) != 0 || a->n_params != b->n_params)
        return tkd_error_set(TKD_ERR_CONFIG,
                             "%s: the checkpoint's architecture differs from the configured student "
                             "(resume with the config the run was started with)", dir);
    return TKD_OK;
}

/* Restores m's parameters from dir's weights (architecture checked). */
static tkd_status load_weights(const char *dir, tkd_model *m)
{
    tkd_model *saved = NULL;
    TKD_TRY(tkd_model_load_hf(dir, &saved));
    tkd_status st = check_same_arch(saved, m, dir);
    if (st == TKD_OK)
        st = tkd_model_set_params(m, saved->params);
    tkd_model_free(saved);
    return st;
}

tkd_status tkd_checkpoint_load(const char *dir, tkd_model *m, tkd_adamw *opt, tkd_train_state *s)
{
    TKD_TRY(load_weights(dir, m));
    int world = 1;
    tkd_train_state st;
    int64_t adamw_step;
    TKD_TRY(read_state(dir, opt->n, opt->cfg.state_dtype, &adamw_step, &world, &st));
    TKD_TRY(read_optimizer(dir, world, opt));
    opt->step = adamw_step;
    *s = st;
    return TKD_OK;
}

tkd_status tkd_checkpoint_load_shard(const char *dir, tkd_model *m, int rank, int world, tkd_adamw_dtype dt,
                                     float *mom_m, float *mom_v, int64_t *adamw_step, tkd_train_state *s)
{
    size_t n = (size_t)m->n_params, begin, end, chunk;
    tkd_zero_range(n, world, rank, &begin, &end, &chunk);
    TKD_TRY(load_weights(dir, m));
    int saved_world = 1;
    tkd_train_state st;
    TKD_TRY(read_state(dir, n, dt, adamw_step, &saved_world, &st));
    TKD_TRY(read_moments(dir, n, saved_world, dt, begin, end, mom_m, mom_v));
    *s = st;
    return TKD_OK;
}

/* ---- data-parallel checkpoints ------------------------------------------------------------- */

/* "<dir>.building-<job>-<step>": every rank of one job names the same staging directory. */
static tkd_status staging_dir(char *out, size_t cap, const char *dir, const char *job, int64_t step)
{
    if (!job || !*job || strchr(job, '/'))
        return tkd_error_set(TKD_ERR_INVALID_ARG, "checkpoint %s: no usable job id", dir);
    int w = snprintf(out, cap, "%s.building-%s-%" PRId64, dir, job, step);
    return w > 0 && (size_t)w < cap ? TKD_OK : tkd_error_set(TKD_ERR_INVALID_ARG, "checkpoint %s: path too long", dir);
}

tkd_status tkd_checkpoint_save_shard(const char *dir, const char *job_id, int64_t step, int rank, int world,
                                     tkd_adamw_dtype dt, size_t n, const float *m, const float *v)
{
    char stage[CKPT_PATH_MAX], name[64], path[CKPT_PATH_MAX];
    size_t b, e, chunk;
    tkd_zero_range(n, world, rank, &b, &e, &chunk);
    static const float none[1];
    TKD_TRY(staging_dir(stage, sizeof stage, dir, job_id, step));
    TKD_TRY(tkd_built_dir_make(&tkd_checkpoint_kind, stage));
    shard_name(name, sizeof name, rank, world);
    TKD_TRY(tkd_path_join(path, sizeof path, stage, name));
    tkd_status st = write_moments(path, e - b, dt, m ? m : none, v ? v : none);
    return st == TKD_OK ? TKD_OK : tkd_error_prefix(st, "checkpoint %s: rank %d's optimizer shard", dir, rank);
}

/* Waits until every rank's shard is in stage; on timeout names the missing files. */
static tkd_status wait_shards(const char *stage, int world, double timeout_s)
{
    const double t0 = tkd_progress_now();
    for (int have = 0;;) {
        char name[64], path[CKPT_PATH_MAX], missing[512] = "";
        size_t len = 0;
        have = 0;
        for (int r = 0; r < world; r++) {
            shard_name(name, sizeof name, r, world);
            TKD_TRY(tkd_path_join(path, sizeof path, stage, name));
            if (tkd_file_exists(path))
                have++;
            else if (len < sizeof missing - 1)
                len += (size_t)snprintf(missing + len, sizeof missing - len, "%s%s", len ? ", " : "", name);
        }
        if (have == world)
            return TKD_OK;
        if (tkd_interrupted())
            return tkd_error_set(TKD_ERR_INTERRUPTED, "interrupted while waiting for the ranks' optimizer shards");
        if (tkd_progress_now() - t0 > timeout_s)
            return tkd_error_set(TKD_ERR_IO, "%d of %d optimizer shards written after %.0f s; missing: %s", have,
                                 world, timeout_s, missing);
        nanosleep(&(struct timespec){0, 20000000}, NULL);
    }
}

/* Staging directories of this checkpoint other than keep (a crashed job's, a failed step's), each
 * only when proven one (its marker and checkpoint files): any other stays, and the next start of
 * the run (run_dir.h) refuses it by name. */
static void remove_other_staging(const char *dir, const char *keep)
{
    char pattern[CKPT_PATH_MAX];
    glob_t g;
    snprintf(pattern, sizeof pattern, "%s.building-*", dir);
    if (glob(pattern, GLOB_NOSORT, NULL, &g) != 0)
        return;
    for (size_t i = 0; i < g.gl_pathc; i++)
        if (strcmp(g.gl_pathv[i], keep) != 0)
            tkd_built_dir_remove(&tkd_checkpoint_kind, g.gl_pathv[i], false);
    globfree(&g);
}

tkd_status tkd_checkpoint_commit(const char *dir, const char *job_id, int64_t step, const tkd_model *m,
                                 int64_t adamw_step, int world, tkd_adamw_dtype dt, const tkd_train_state *s,
                                 const char *config_yaml, double timeout_s)
{
    char stage[CKPT_PATH_MAX];
    TKD_TRY(staging_dir(stage, sizeof stage, dir, job_id, step));
    tkd_status st = tkd_built_dir_make(&tkd_checkpoint_kind, stage);
    if (st == TKD_OK)
        st = tkd_model_save_hf(m, stage, TKD_DTYPE_F32);
    if (st == TKD_OK)
        st = write_state(stage, adamw_step, m->n_params, world, dt, s);
    if (st == TKD_OK && config_yaml)
        st = write_text(stage, "config.yaml", config_yaml);
    if (st == TKD_OK)
        st = wait_shards(stage, world, timeout_s);
    if (st == TKD_OK)
        st = tkd_built_dir_rename(&tkd_checkpoint_kind, stage, dir);
    if (st != TKD_OK) {
        drop_staging(stage);
        return tkd_error_prefix(st, "checkpoint %s (the previous checkpoint is kept)", dir);
    }
    remove_other_staging(dir, stage);
    return TKD_OK;
}
