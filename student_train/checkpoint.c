/* checkpoint.c — see checkpoint.h. */
#include "student_train/checkpoint.h"

#include <cjson/cJSON.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/fileio.h"
#include "formats/json_check.h"
#include "formats/safetensors.h"

#define CKPT_PATH_MAX 4096

/* 1 when the optimizer's moments are host memory (tkd_adamw_init, or the CPU backend). */
static int moments_on_host(const tkd_adamw *opt)
{
    return !opt->be || opt->be->device == TKD_DEVICE_CPU;
}

/* Host arrays of 2·n floats for moments kept in device memory. */
static tkd_status host_pair(const tkd_adamw *opt, float **out)
{
    *out = malloc(2 * opt->n * sizeof(float) + 1);
    return *out ? TKD_OK : tkd_error_set(TKD_ERR_NOMEM, "checkpoint: out of host memory for the optimizer state");
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
    tkd_st_writer *w = NULL;
    tkd_status st = tkd_st_writer_init(&w, TKD_DTYPE_F32);
    int64_t shape[1] = {(int64_t)opt->n};
    if (st == TKD_OK)
        st = tkd_st_writer_add(w, "adamw.m", 1, shape, m);
    if (st == TKD_OK)
        st = tkd_st_writer_add(w, "adamw.v", 1, shape, v);
    if (st == TKD_OK)
        st = tkd_st_writer_finish(w, path);
    tkd_st_writer_free(w);
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

static tkd_status write_state(const char *dir, const tkd_adamw *opt, const tkd_train_state *s)
{
    cJSON *o = cJSON_CreateObject();
    tkd_status st = o ? TKD_OK : tkd_error_set(TKD_ERR_NOMEM, "checkpoint: out of memory");
    if (st == TKD_OK) st = add_u64(o, "step", (uint64_t)s->step);
    if (st == TKD_OK) st = add_u64(o, "epoch", (uint64_t)s->epoch);
    if (st == TKD_OK) st = add_u64(o, "offset", (uint64_t)s->offset);
    if (st == TKD_OK) st = add_u64(o, "tokens_seen", (uint64_t)s->tokens_seen);
    if (st == TKD_OK) st = add_u64(o, "adamw_step", (uint64_t)opt->step);
    if (st == TKD_OK) st = add_u64(o, "adamw_n", (uint64_t)opt->n);
    for (int i = 0; i < 4 && st == TKD_OK; i++) {
        char key[16];
        snprintf(key, sizeof key, "rng%d", i);
        st = add_u64(o, key, s->rng.s[i]);
    }
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
    TKD_TRY(tkd_make_temp_dir(dir, tmp, sizeof tmp));
    tkd_status st = tkd_model_save_hf(m, tmp, TKD_DTYPE_F32);
    if (st == TKD_OK)
        st = write_optimizer(tmp, opt);
    if (st == TKD_OK)
        st = write_state(tmp, opt, s);
    if (st == TKD_OK && config_yaml)
        st = write_text(tmp, "config.yaml", config_yaml);
    if (st == TKD_OK)
        st = tkd_rename_dir_atomic(tmp, dir);
    if (st != TKD_OK) {
        tkd_error_saved keep;
        tkd_error_save(&keep, st);
        tkd_remove_tree(tmp); /* may set a message of its own */
        tkd_error_restore(&keep);
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

static tkd_status read_state(const char *dir, tkd_adamw *opt, tkd_train_state *s)
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
    uint64_t v[10];
    const char *keys[10] = {"step", "epoch", "offset", "tokens_seen", "adamw_step", "adamw_n",
                            "rng0", "rng1", "rng2", "rng3"};
    tkd_status st = TKD_OK;
    for (int i = 0; i < 10 && st == TKD_OK; i++)
        st = get_u64(o, keys[i], path, &v[i]);
    cJSON_Delete(o);
    TKD_TRY(st);
    if (v[5] != opt->n)
        return tkd_error_set(TKD_ERR_MISMATCH, "%s: optimizer holds %llu values, the model %zu", path,
                             (unsigned long long)v[5], opt->n);
    s->step = (int64_t)v[0];
    s->epoch = (int64_t)v[1];
    s->offset = (int64_t)v[2];
    s->tokens_seen = (int64_t)v[3];
    opt->step = (int64_t)v[4];
    for (int i = 0; i < 4; i++)
        s->rng.s[i] = v[6 + i];
    return TKD_OK;
}

static tkd_status read_optimizer(const char *dir, tkd_adamw *opt)
{
    char path[CKPT_PATH_MAX];
    TKD_TRY(tkd_path_join(path, sizeof path, dir, "optimizer.safetensors"));
    tkd_st_dir *d = NULL;
    TKD_TRY(tkd_st_open(path, &d));
    int64_t shape[1] = {(int64_t)opt->n};
    float *m = opt->m, *v = opt->v, *tmp = NULL;
    tkd_status st = moments_on_host(opt) ? TKD_OK : host_pair(opt, &tmp);
    if (tmp)
        m = tmp, v = tmp + opt->n;
    if (st == TKD_OK)
        st = tkd_st_read_f32(d, "adamw.m", 1, shape, m, opt->n);
    if (st == TKD_OK)
        st = tkd_st_read_f32(d, "adamw.v", 1, shape, v, opt->n);
    tkd_st_close(d);
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
        x->attention_bias != y->attention_bias || a->n_params != b->n_params)
        return tkd_error_set(TKD_ERR_CONFIG,
                             "%s: the checkpoint's architecture differs from the configured student "
                             "(resume with the config the run was started with)", dir);
    return TKD_OK;
}

tkd_status tkd_checkpoint_load(const char *dir, tkd_model *m, tkd_adamw *opt, tkd_train_state *s)
{
    tkd_model *saved = NULL;
    TKD_TRY(tkd_model_load_hf(dir, &saved));
    tkd_status st = check_same_arch(saved, m, dir);
    if (st == TKD_OK)
        st = tkd_model_set_params(m, saved->params);
    tkd_model_free(saved);
    TKD_TRY(st);
    TKD_TRY(read_optimizer(dir, opt));
    return read_state(dir, opt, s);
}
