/* dump.c — see dump.h. The compute loop and the resume / overwrite checks; merge and the
 * worker-finished markers live in dump_merge.c. */
#include "teacher_cache/dump.h"

#include <cblas.h>
#include <glob.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "common/fileio.h"
#include "common/sha256.h"
#include "common/signals.h"
#include "formats/cache_manifest.h"
#include "formats/tokens.h"
#include "kernels/tail_sample.h"
#include "kernels/topk.h"
#include "model/model.h"
#include "teacher_cache/dump_internal.h"
#include "teacher_cache/writer_thread.h"

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* ---- identity --------------------------------------------------------------------------------- */

static int cmp_str(const void *a, const void *b)
{
    return strcmp(*(const char *const *)a, *(const char *const *)b);
}

tkd_status tkd_dump_teacher_sha256(const char *dir, char hex[65])
{
    char pat[4096];
    TKD_TRY(tkd_path_join(pat, sizeof pat, dir, "*.safetensors"));
    glob_t g;
    memset(&g, 0, sizeof g);
    int rc = glob(pat, 0, NULL, &g);
    if (rc != 0 && rc != GLOB_NOMATCH) {
        globfree(&g);
        return tkd_error_set(TKD_ERR_IO, "%s: cannot list the teacher's files — check the directory", dir);
    }
    /* config.json first, then the weight files in name order (glob sorts them). */
    size_t n = g.gl_pathc + 1;
    char **files = malloc(n * sizeof *files);
    char cfg_path[4096];
    tkd_status st = files ? tkd_path_join(cfg_path, sizeof cfg_path, dir, "config.json")
                          : tkd_error_set(TKD_ERR_NOMEM, "out of memory");
    if (st == TKD_OK) {
        files[0] = cfg_path;
        for (size_t i = 0; i < g.gl_pathc; i++)
            files[i + 1] = g.gl_pathv[i];
        qsort(files + 1, n - 1, sizeof *files, cmp_str);
    }
    tkd_sha256 ctx;
    tkd_sha256_init(&ctx);
    for (size_t i = 0; st == TKD_OK && i < n; i++) {
        char fhex[65], line[4200];
        st = tkd_sha256_file_hex(files[i], fhex);
        const char *base = strrchr(files[i], '/');
        base = base ? base + 1 : files[i];
        int len = snprintf(line, sizeof line, "%s %s\n", base, fhex);
        tkd_sha256_update(&ctx, line, (size_t)len);
    }
    if (st == TKD_OK) {
        uint8_t d[TKD_SHA256_BYTES];
        tkd_sha256_final(&ctx, d);
        tkd_sha256_hex(d, hex);
    }
    free(files);
    globfree(&g);
    return st;
}

const char *tkd_dump_saved_msg(char buf[TKD_ERROR_MSG_MAX])
{
    snprintf(buf, TKD_ERROR_MSG_MAX, "%s", tkd_error_msg());
    return buf;
}

static const char *arch_class(tkd_arch a)
{
    switch (a) {
    case TKD_ARCH_LLAMA: return "LlamaForCausalLM";
    case TKD_ARCH_QWEN2: return "Qwen2ForCausalLM";
    case TKD_ARCH_MISTRAL: return "MistralForCausalLM";
    }
    return "?";
}

/* data.paths joined with ", " (the manifest's dataset path). */
static char *join_paths(const tkd_strlist *l)
{
    size_t len = 1;
    for (size_t i = 0; i < l->n; i++)
        len += strlen(l->items[i]) + 2;
    char *s = malloc(len);
    if (!s)
        return NULL;
    s[0] = 0;
    for (size_t i = 0; i < l->n; i++) {
        if (i)
            strcat(s, ", ");
        strcat(s, l->items[i]);
    }
    return s;
}

tkd_status tkd_dump_config_text(const tkd_dump_config *cfg, char **out)
{
    size_t len = 0;
    *out = NULL;
    FILE *f = open_memstream(out, &len);
    if (!f)
        return tkd_error_set(TKD_ERR_NOMEM, "out of memory printing the config");
    tkd_status st = tkd_config_print(&tkd_dump_schema, cfg, f);
    /* fclose is what sizes and terminates *out; if it fails the text may be cut short */
    if (fclose(f) != 0 && st == TKD_OK)
        st = tkd_error_set(TKD_ERR_NOMEM, "out of memory printing the config");
    if (st != TKD_OK) {
        free(*out);
        *out = NULL;
    }
    return st;
}

/* The manifest this run would write, with no shards yet. */
static tkd_status make_template(tkd_cache_manifest *m, const tkd_dump_config *cfg, const tkd_model *model,
                                const tkd_tokens *ds, const char *teacher_hex, const char *dataset_hex)
{
    tkd_cache_manifest_init(m);
    m->id.vocab_size = model->cfg.vocab_size;
    m->id.k = cfg->k;
    m->id.seq_len = cfg->seq_len;
    m->id.temperature = (float)cfg->temperature;
    m->id.logits_dtype = (tkd_cache_dtype)cfg->logits_dtype;
    m->id.tail_samples = cfg->tail_samples;
    memcpy(m->id.teacher_sha256, teacher_hex, 65);
    memcpy(m->id.dataset_sha256, dataset_hex, 65);
    m->dataset_tokens = tkd_tokens_count(ds);
    m->stride = cfg->stride;
    m->tail_seed = cfg->tail_samples > 0 ? (uint64_t)cfg->seed : 0;
    char *paths = join_paths(&cfg->data_paths);
    tkd_status st = paths ? TKD_OK : tkd_error_set(TKD_ERR_NOMEM, "out of memory");
    if (st == TKD_OK) st = tkd_cache_manifest_set_str(&m->teacher_path, cfg->teacher_path);
    if (st == TKD_OK) st = tkd_cache_manifest_set_str(&m->teacher_arch, arch_class(model->cfg.arch));
    if (st == TKD_OK) st = tkd_cache_manifest_set_str(&m->dataset_path, paths);
    if (st == TKD_OK) st = tkd_cache_manifest_set_str(&m->tool_version, TKD_VERSION);
    if (st == TKD_OK) {
        free(m->config_text);
        st = tkd_dump_config_text(cfg, &m->config_text);
    }
    free(paths);
    if (st == TKD_OK)
        st = tkd_cache_identity_check(&m->id, "config");
    return st;
}

/* ---- existing cache: identity, overwrite, resume ------------------------------------------------ */

/* Settings outside the manifest's identity that still decide what the shards hold. */
static tkd_status check_same_layout(const tkd_dump_config *cfg, const char *path, const char *config_text)
{
    tkd_dump_config old = {0};
    tkd_status st = tkd_config_defaults(&tkd_dump_schema, &old);
    if (st == TKD_OK && config_text)
        st = tkd_config_apply_string(&tkd_dump_schema, &old, path, config_text, strlen(config_text));
    if (st != TKD_OK) {
        tkd_config_free(&tkd_dump_schema, &old);
        return tkd_error_set(TKD_ERR_FORMAT, "%s: config: cannot read the config it was made with (%s) — "
                             "pass --overwrite to replace the cache", path, TKD_DUMP_PREV_MSG());
    }
    const char *key = old.shard_sequences != cfg->shard_sequences ? "cache.shard_sequences"
                      : old.last_window != cfg->last_window       ? "data.last_window"
                                                                  : NULL;
    tkd_config_free(&tkd_dump_schema, &old);
    if (key)
        return tkd_error_set(TKD_ERR_MISMATCH, "%s: %s: differs from the config the cache was made with — "
                             "keep the old value, use another output.dir, or pass --overwrite", path, key);
    return TKD_OK;
}

/* Every manifest already in the directory must describe this cache (unless overwrite). */
static tkd_status check_existing(const char *dir, const tkd_cache_manifest *tmpl, const tkd_dump_config *cfg)
{
    char pat[4096];
    TKD_TRY(tkd_path_join(pat, sizeof pat, dir, "manifest*.yaml"));
    glob_t g;
    memset(&g, 0, sizeof g);
    tkd_status st = TKD_OK;
    if (glob(pat, 0, NULL, &g) == 0) {
        for (size_t i = 0; st == TKD_OK && i < g.gl_pathc; i++) {
            tkd_cache_manifest old;
            st = tkd_cache_manifest_read(&old, g.gl_pathv[i]);
            if (st != TKD_OK) {
                st = tkd_error_set(st, "%s — fix or delete it, or pass --overwrite", TKD_DUMP_PREV_MSG());
                break;
            }
            st = tkd_cache_manifest_check_same(&old, g.gl_pathv[i], tmpl, "this config");
            if (st != TKD_OK)
                st = tkd_error_set(st, "%s — this directory holds another cache: use another output.dir, "
                                   "or pass --overwrite to replace it", TKD_DUMP_PREV_MSG());
            else
                st = check_same_layout(cfg, g.gl_pathv[i], old.config_text);
            tkd_cache_manifest_free(&old);
        }
    }
    globfree(&g);
    return st;
}

static tkd_status remove_glob(const char *dir, const char *pattern, int64_t id_lo, int64_t id_hi)
{
    char pat[4096];
    TKD_TRY(tkd_path_join(pat, sizeof pat, dir, pattern));
    glob_t g;
    memset(&g, 0, sizeof g);
    tkd_status st = TKD_OK;
    if (glob(pat, 0, NULL, &g) == 0) {
        for (size_t i = 0; i < g.gl_pathc && st == TKD_OK; i++) {
            const char *base = strrchr(g.gl_pathv[i], '/');
            long long id = -1;
            if (id_lo >= 0 && (sscanf(base ? base + 1 : g.gl_pathv[i], "shard-%lld", &id) != 1 ||
                               id < id_lo || id >= id_hi))
                continue;
            if (remove(g.gl_pathv[i]) != 0)
                st = tkd_error_set(TKD_ERR_IO, "%s: cannot remove it for --overwrite — check permissions",
                                   g.gl_pathv[i]);
        }
    }
    globfree(&g);
    return st;
}

/* --overwrite: a single worker clears the whole cache; worker i of n clears its own shards, its
 * manifest and marker, and the merged manifest (which no longer holds). */
static tkd_status overwrite_clean(const char *dir, const tkd_dump_config *cfg, int64_t first, int64_t end)
{
    if (cfg->worker_count == 1) {
        TKD_TRY(remove_glob(dir, "shard-*.h5", -1, -1));
        TKD_TRY(remove_glob(dir, "shard-*.h5.tmp", -1, -1));
        TKD_TRY(remove_glob(dir, "worker-*.done", -1, -1));
        return remove_glob(dir, "manifest*.yaml", -1, -1);
    }
    int64_t ss = cfg->shard_sequences;
    TKD_TRY(remove_glob(dir, "shard-*.h5", first / ss, (end + ss - 1) / ss));
    TKD_TRY(remove_glob(dir, "shard-*.h5.tmp", first / ss, (end + ss - 1) / ss));
    char name[64];
    snprintf(name, sizeof name, "worker-%d.done", cfg->worker_index);
    TKD_TRY(remove_glob(dir, name, -1, -1));
    tkd_dump_manifest_name(cfg->worker_index, cfg->worker_count, name, sizeof name);
    TKD_TRY(remove_glob(dir, name, -1, -1));
    return remove_glob(dir, TKD_CACHE_MANIFEST_NAME, -1, -1);
}

/* This worker's manifest from an earlier run: its shards must start at the range start, stay in
 * the range, exist with their sizes, and the last one must pass its sha256. */
static tkd_status load_resume(tkd_cache_manifest *m, const char *dir, const char *path, int64_t first,
                              int64_t end)
{
    TKD_TRY(tkd_cache_manifest_read(m, path));
    int64_t got_end = tkd_cache_manifest_end_seq(m, first);
    if (m->num_shards > 0 && (m->shards[0].first_seq != first || got_end > end))
        return tkd_error_set(TKD_ERR_MISMATCH, "%s: lists sequences [%lld, %lld) but this worker's range is "
                             "[%lld, %lld) — keep workers.* and data.max_sequences as before, or pass --overwrite",
                             path, (long long)m->shards[0].first_seq, (long long)got_end, (long long)first,
                             (long long)end);
    for (int64_t i = 0; i + 1 < m->num_shards; i++) {
        char p[4096];
        uint64_t size = 0;
        TKD_TRY(tkd_path_join(p, sizeof p, dir, m->shards[i].file));
        if (tkd_file_size(p, &size) != TKD_OK || size != m->shards[i].bytes)
            return tkd_error_set(TKD_ERR_NOT_FOUND, "%s: listed in %s with %llu bytes but missing or resized — "
                                 "restore it, or pass --overwrite to start again", p, path,
                                 (unsigned long long)m->shards[i].bytes);
    }
    if (m->num_shards > 0) {
        tkd_status st = tkd_cache_manifest_verify_shard(dir, &m->shards[m->num_shards - 1]);
        if (st != TKD_OK)
            return tkd_error_set(st, "%s (the last shard %s lists) — or pass --overwrite", TKD_DUMP_PREV_MSG(), path);
    }
    return TKD_OK;
}

/* ---- compute ----------------------------------------------------------------------------------- */

typedef struct dump_buffers {
    int32_t *inputs;   // (B, T)
    int32_t *labels;   // (T)
    float *logits;     // (C, V)
    int64_t *row_seq;  // (C) sequence index of each chunk row (tail draws)
    int32_t *row_pos;  // (C) its position
} dump_buffers;

static void buffers_free(dump_buffers *b)
{
    free(b->inputs);
    free(b->labels);
    free(b->logits);
    free(b->row_seq);
    free(b->row_pos);
    memset(b, 0, sizeof *b);
}

static tkd_status buffers_alloc(dump_buffers *b, int B, int T, int C, int64_t V)
{
    b->inputs = malloc((size_t)B * (size_t)T * sizeof *b->inputs);
    b->labels = malloc((size_t)T * sizeof *b->labels);
    b->logits = malloc((size_t)C * (size_t)V * sizeof *b->logits);
    b->row_seq = malloc((size_t)C * sizeof *b->row_seq);
    b->row_pos = malloc((size_t)C * sizeof *b->row_pos);
    if (!b->inputs || !b->labels || !b->logits || !b->row_seq || !b->row_pos) {
        buffers_free(b);
        return tkd_error_set(TKD_ERR_NOMEM, "lm_head.chunk_rows: out of memory for %d x %lld logits — "
                             "lower lm_head.chunk_rows or run.batch_size", C, (long long)V);
    }
    return TKD_OK;
}

/* Windows [s, s + nb) into the batch's /tokens (padding labels become -100) and the inputs. */
static tkd_status fill_tokens(const tkd_tokens *ds, const tkd_dump_config *cfg, int64_t s, int nb,
                              tkd_cache_batch *b, dump_buffers *buf)
{
    int T = cfg->seq_len;
    for (int j = 0; j < nb; j++) {
        int32_t *tok = b->tokens + (size_t)j * (size_t)(T + 1);
        TKD_TRY(tkd_tokens_window(ds, T, cfg->stride, cfg->last_window == TKD_DUMP_LAST_WINDOW_PAD, s + j,
                                  tok, buf->labels, NULL));
        memcpy(buf->inputs + (size_t)j * (size_t)T, tok, (size_t)T * sizeof *tok);
        for (int t = 0; t < T; t++)
            if (buf->labels[t] == TKD_TOKENS_IGNORE_LABEL)
                tok[t + 1] = TKD_TOKENS_IGNORE_LABEL;
        b->seq_index[j] = s + j;
    }
    b->num_seq = nb;
    return TKD_OK;
}

/* The LM head over rows [0, N) of hidden, chunk by chunk: top-k + LSE (+ tail draws) per row. */
static tkd_status lm_head_topk(const tkd_dump_config *cfg, const tkd_model *m, const float *hidden, // (N, D)
                               int64_t N, int64_t s, tkd_cache_batch *b, dump_buffers *buf)
{
    const int64_t V = m->cfg.vocab_size, D = m->cfg.hidden_size;
    const int T = cfg->seq_len, k = cfg->k, S = cfg->tail_samples;
    const float tau = (float)cfg->temperature;
    const float *W = tkd_model_lm_head(m); // (V, D)
    for (int64_t r0 = 0; r0 < N; r0 += cfg->chunk_rows) {
        if (tkd_interrupted())
            return tkd_error_set(TKD_ERR_INTERRUPTED, "interrupted");
        int64_t c = N - r0 < cfg->chunk_rows ? N - r0 : cfg->chunk_rows;
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (int)c, (int)V, (int)D, 1.0f,
                    hidden + r0 * D, (int)D, W, (int)D, 0.0f, buf->logits, (int)V);
        uint32_t *idx = b->topk_indices + r0 * k;
        tkd_status st = tkd_topk_cpu(buf->logits, c, V, k, tau, idx, b->topk_logits + r0 * k, b->lse + r0);
        if (st == TKD_OK && S > 0) {
            for (int64_t r = 0; r < c; r++) {
                buf->row_seq[r] = s + (r0 + r) / T;
                buf->row_pos[r] = (int32_t)((r0 + r) % T);
            }
            st = tkd_tail_sample_cpu(buf->logits, c, V, idx, k, tau, S, (uint64_t)cfg->seed, buf->row_seq,
                                     buf->row_pos, b->tail_indices + r0 * S);
        }
        if (st != TKD_OK)
            return tkd_error_set(st, "%s: sequences %lld..%lld: %s — check the teacher's weights", cfg->teacher_path,
                                 (long long)s, (long long)(s + N / T - 1), TKD_DUMP_PREV_MSG());
    }
    return TKD_OK;
}

/* ---- the run ------------------------------------------------------------------------------------ */

typedef struct dump_ctx {
    const tkd_dump_config *cfg;
    const tkd_dump_opts *opts;
    tkd_dump_summary *sum;
    tkd_model *model;
    tkd_tokens *ds;
    tkd_cache_manifest tmpl;   /* identity + (after resume) the listed shards */
    char manifest_path[4096];
} dump_ctx;

static tkd_status check_compute_args(const dump_ctx *c)
{
    const tkd_dump_config *cfg = c->cfg;
    int64_t V = c->model->cfg.vocab_size;
    if (cfg->device == TKD_DUMP_DEVICE_CUDA)
        return tkd_error_set(TKD_ERR_UNSUPPORTED, "device: cuda: the GPU teacher forward is not built yet — "
                             "use device: cpu (or auto)");
    tkd_status st = tkd_topk_check_args(cfg->chunk_rows, V, cfg->k, (float)cfg->temperature);
    if (st == TKD_OK && cfg->tail_samples > 0)
        st = tkd_tail_sample_check_args(cfg->chunk_rows, V, cfg->k, (float)cfg->temperature, cfg->tail_samples);
    if (st != TKD_OK)
        return tkd_error_set(TKD_ERR_CONFIG, "cache.k / cache.tail_samples: %s (teacher %s has vocab %lld) — "
                             "lower cache.k", TKD_DUMP_PREV_MSG(), cfg->teacher_path, (long long)V);
    if (cfg->seq_len > c->model->cfg.max_position_embeddings)
        return tkd_error_set(TKD_ERR_CONFIG, "data.seq_len: %d is above the teacher's max_position_embeddings %d (%s) "
                             "— lower data.seq_len", cfg->seq_len, c->model->cfg.max_position_embeddings,
                             cfg->teacher_path);
    return TKD_OK;
}

static tkd_status load_inputs(dump_ctx *c)
{
    const tkd_dump_config *cfg = c->cfg;
    tkd_status st = tkd_model_load_hf(cfg->teacher_path, &c->model);
    if (st != TKD_OK)
        return tkd_error_prefix(st, "teacher.path");
    TKD_TRY(check_compute_args(c));
    st = tkd_tokens_open_list((const char *const *)cfg->data_paths.items, (int)cfg->data_paths.n, &c->ds);
    if (st != TKD_OK)
        return tkd_error_prefix(st, "data.paths");
    st = tkd_tokens_check_vocab(c->ds, c->model->cfg.vocab_size);
    if (st != TKD_OK)
        return tkd_error_set(st, "%s (teacher %s has vocab %d) — use the teacher's own tokenizer",
                             TKD_DUMP_PREV_MSG(), cfg->teacher_path, c->model->cfg.vocab_size);
    TKD_TRY(tkd_dump_teacher_sha256(cfg->teacher_path, c->sum->teacher_sha256));
    tkd_tokens_sha256(c->ds, c->sum->dataset_sha256);
    return make_template(&c->tmpl, cfg, c->model, c->ds, c->sum->teacher_sha256, c->sum->dataset_sha256);
}

/* Output directory state → c->tmpl holds the shards already done; sets sum->resumed_at. */
static tkd_status prepare_output(dump_ctx *c)
{
    const tkd_dump_config *cfg = c->cfg;
    const char *dir = cfg->output_dir;
    TKD_TRY(tkd_mkdir_p(dir));
    char name[64];
    tkd_dump_manifest_name(cfg->worker_index, cfg->worker_count, name, sizeof name);
    TKD_TRY(tkd_path_join(c->manifest_path, sizeof c->manifest_path, dir, name));
    snprintf(c->sum->manifest, sizeof c->sum->manifest, "%s", c->manifest_path);
    int64_t first = c->sum->range_first, end = c->sum->range_end;
    if (c->opts->overwrite)
        TKD_TRY(overwrite_clean(dir, cfg, first, end));
    else
        TKD_TRY(check_existing(dir, &c->tmpl, cfg));
    c->sum->resumed_at = first;
    if (tkd_file_exists(c->manifest_path)) {
        tkd_cache_manifest old;
        tkd_cache_manifest_init(&old);
        tkd_status st = load_resume(&old, dir, c->manifest_path, first, end);
        if (st != TKD_OK) {
            tkd_cache_manifest_free(&old);
            return st;
        }
        for (int64_t i = 0; i < old.num_shards; i++)
            tkd_cache_manifest_add_shard(&c->tmpl, &old.shards[i]);
        tkd_cache_manifest_free(&old);
        c->sum->resumed_at = tkd_cache_manifest_end_seq(&c->tmpl, first);
        /* data.max_sequences grew since a run whose last shard was cut short: that shard is
         * recomputed whole. Unlist it first, so the manifest never names a file being replaced. */
        if (c->sum->resumed_at < end && c->sum->resumed_at % cfg->shard_sequences != 0) {
            c->tmpl.num_shards--;
            c->sum->resumed_at = tkd_cache_manifest_end_seq(&c->tmpl, first);
            TKD_TRY(tkd_cache_manifest_write(&c->tmpl, c->manifest_path));
        }
    } else {
        /* An empty manifest records the identity at once, so a second run with another config
         * is refused even before the first shard is done. */
        TKD_TRY(tkd_cache_manifest_write(&c->tmpl, c->manifest_path));
    }
    return TKD_OK;
}

static void report_progress(dump_ctx *c, tkd_dump_writer *w, int64_t done, double t0)
{
    if (!c->opts->progress)
        return;
    tkd_dump_writer_stats ws;
    tkd_dump_writer_get_stats(w, &ws);
    tkd_dump_progress p = {
        .seq_done = done - c->sum->range_first,
        .seq_total = c->sum->range_end - c->sum->range_first,
        .seq_start = c->sum->resumed_at - c->sum->range_first,
        .tokens_run = c->sum->tokens_run,
        .elapsed_s = now_s() - t0,
        .bytes_written = ws.bytes,
        .tokens_written = ws.seqs * c->cfg->seq_len,
    };
    c->opts->progress(&p, c->opts->progress_user);
}

static tkd_status compute_loop(dump_ctx *c, tkd_dump_writer *w, dump_buffers *buf, double t0)
{
    const tkd_dump_config *cfg = c->cfg;
    const int64_t ss = cfg->shard_sequences, T = cfg->seq_len;
    int64_t nbatches = 0;
    for (int64_t s = c->sum->resumed_at; s < c->sum->range_end;) {
        if (tkd_interrupted() || (c->opts->stop_after_batches > 0 && nbatches >= c->opts->stop_after_batches))
            return tkd_error_set(TKD_ERR_INTERRUPTED, "interrupted");
        /* A batch never crosses a shard boundary, so a resumed or split run computes exactly the
         * same batches as one uninterrupted run. */
        int64_t shard_end = (s / ss + 1) * ss;
        int64_t lim = shard_end < c->sum->range_end ? shard_end : c->sum->range_end;
        int nb = (int)(lim - s < cfg->batch_size ? lim - s : cfg->batch_size);
        tkd_cache_batch *b;
        TKD_TRY(tkd_dump_writer_acquire(w, &b));
        TKD_TRY(fill_tokens(c->ds, cfg, s, nb, b, buf));
        const float *hidden;
        TKD_TRY(tkd_model_forward(c->model, buf->inputs, nb, (int)T, 0, &hidden));
        TKD_TRY(lm_head_topk(cfg, c->model, hidden, (int64_t)nb * T, s, b, buf));
        TKD_TRY(tkd_dump_writer_submit(w, b, s));
        s += nb;
        nbatches++;
        c->sum->seqs_run += nb;
        c->sum->tokens_run += nb * T;
        if (c->opts->kill_after_batches > 0 && nbatches == c->opts->kill_after_batches) {
            tkd_dump_writer_drain(w);
            raise(SIGKILL);
        }
        report_progress(c, w, s, t0);
    }
    return TKD_OK;
}

static tkd_status run_compute(dump_ctx *c)
{
    const tkd_dump_config *cfg = c->cfg;
    dump_buffers buf = {0};
    TKD_TRY(tkd_model_reserve(c->model, cfg->batch_size, cfg->seq_len, 0));
    TKD_TRY(buffers_alloc(&buf, cfg->batch_size, cfg->seq_len, cfg->chunk_rows, c->model->cfg.vocab_size));
    tkd_dump_writer_opts wo = {
        .dir = cfg->output_dir,
        .manifest_path = c->manifest_path,
        .manifest = &c->tmpl,
        .range_end = c->sum->range_end,
        .shard_sequences = cfg->shard_sequences,
        .shard = {.zstd_level = cfg->zstd_level, .chunk_seqs = 0, .tail_seed = (uint64_t)cfg->seed},
        .batch_capacity = cfg->batch_size,
    };
    tkd_dump_writer *w = NULL;
    tkd_status st = tkd_dump_writer_start(&w, &wo);
    double t0 = now_s();
    if (st == TKD_OK)
        st = compute_loop(c, w, &buf, t0);
    if (st == TKD_OK) {
        st = tkd_dump_writer_finish(w);
    } else {
        char msg[TKD_ERROR_MSG_MAX];
        snprintf(msg, sizeof msg, "%s", tkd_error_msg());
        /* On Ctrl-C, batches already computed are still written (a shard they complete is kept);
         * then the shard in progress is removed. Other errors stop at once. */
        if (st == TKD_ERR_INTERRUPTED && w)
            tkd_dump_writer_drain(w);
        tkd_dump_writer_abort(w);
        tkd_error_copy(st, msg);
        if (st == TKD_ERR_NOSPACE && !strstr(msg, "disk full"))
            tkd_error_set(st, "%s: disk full: %s — free space there and re-run the same command to resume",
                          cfg->output_dir, msg);
    }
    c->sum->seconds = now_s() - t0;
    buffers_free(&buf);
    return st;
}

/* Counts what this run added to the manifest (for the summary). */
static void summarize(dump_ctx *c)
{
    tkd_cache_manifest m;
    if (tkd_cache_manifest_read(&m, c->manifest_path) != TKD_OK)
        return;
    for (int64_t i = 0; i < m.num_shards; i++) {
        if (m.shards[i].first_seq < c->sum->resumed_at)
            continue;
        c->sum->shards_run++;
        c->sum->bytes_run += m.shards[i].bytes;
        c->sum->tokens_written += m.shards[i].num_seq * c->cfg->seq_len;
    }
    tkd_cache_manifest_free(&m);
}

static tkd_status interrupted_message(dump_ctx *c)
{
    int sig = tkd_interrupted();
    tkd_cache_manifest m;
    int64_t done = c->sum->resumed_at;
    if (tkd_cache_manifest_read(&m, c->manifest_path) == TKD_OK) {
        done = tkd_cache_manifest_end_seq(&m, c->sum->range_first);
        tkd_cache_manifest_free(&m);
    }
    return tkd_error_set(TKD_ERR_INTERRUPTED,
                         "%s: stopped by %s with %lld of %lld sequences in whole shards (the shard in progress was "
                         "removed) — re-run the same command to resume",
                         c->manifest_path, sig == SIGTERM ? "SIGTERM" : "SIGINT",
                         (long long)(done - c->sum->range_first),
                         (long long)(c->sum->range_end - c->sum->range_first));
}

tkd_status tkd_dump_run(const tkd_dump_config *cfg, const tkd_dump_opts *opts, tkd_dump_summary *sum)
{
    static const tkd_dump_opts no_opts;
    tkd_dump_summary local;
    dump_ctx c = {.cfg = cfg, .opts = opts ? opts : &no_opts, .sum = sum ? sum : &local};
    memset(c.sum, 0, sizeof *c.sum);
    tkd_cache_manifest_init(&c.tmpl);
    c.sum->raw_bytes_per_token = tkd_dump_raw_bytes_per_token(cfg);
    tkd_status st = load_inputs(&c);
    if (st == TKD_OK) {
        int64_t nw = tkd_tokens_num_windows(c.ds, cfg->seq_len, cfg->stride,
                                            cfg->last_window == TKD_DUMP_LAST_WINDOW_PAD);
        if (cfg->max_sequences > 0 && cfg->max_sequences < nw)
            nw = cfg->max_sequences;
        if (nw == 0)
            st = tkd_error_set(TKD_ERR_CONFIG, "data.paths: %lld tokens give no window of data.seq_len %d + 1 — "
                               "use a shorter seq_len or data.last_window: pad", (long long)tkd_tokens_count(c.ds),
                               cfg->seq_len);
        tkd_dump_worker_range(nw, cfg->shard_sequences, cfg->worker_index, cfg->worker_count,
                              &c.sum->range_first, &c.sum->range_end);
    }
    if (st == TKD_OK)
        st = prepare_output(&c);
    if (st == TKD_OK && c.sum->resumed_at < c.sum->range_end)
        st = run_compute(&c);
    if (st == TKD_OK)
        st = tkd_dump_mark_done(cfg, c.sum->range_first, c.sum->range_end);
    if (st == TKD_ERR_INTERRUPTED && c.manifest_path[0]) /* else: stopped while reading the inputs */
        st = interrupted_message(&c);
    if (c.manifest_path[0]) {
        char msg[TKD_ERROR_MSG_MAX];
        snprintf(msg, sizeof msg, "%s", tkd_error_msg());
        summarize(&c);
        tkd_error_copy(st, msg);
    }
    tkd_cache_manifest_free(&c.tmpl);
    tkd_tokens_free(c.ds);
    tkd_model_free(c.model);
    return st;
}
