/* dump.c — see dump.h. The compute loop and the resume / overwrite checks; merge and the
 * worker-finished markers live in dump_merge.c. */
#include "teacher_cache/dump.h"

#include <math.h>
#include <glob.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/fileio.h"
#include "common/log.h"
#include "common/progress.h"
#include "common/sha256.h"
#include "common/signals.h"
#include "formats/cache_manifest.h"
#include "formats/doc_pack.h"
#include "formats/tokens.h"
#include "kernels/backend.h"
#include "kernels/loss/kl_loss.h"
#include "model/model.h"
#include "teacher_cache/dump_merge.h"
#include "teacher_cache/dump_text.h"
#include "teacher_cache/dump_dir.h"
#include "teacher_cache/writer_thread.h"

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
    m->id.packed = cfg->packing == TKD_PACKING_DOCUMENTS;
    m->id.trained_only = tkd_tokens_has_flags(ds); /* the dataset marks its trained positions */
    m->tail_seed = cfg->tail_samples > 0 ? (uint64_t)cfg->seed : 0;
    char *paths = join_paths(&cfg->data_paths);
    tkd_status st = paths ? TKD_OK : tkd_error_set(TKD_ERR_NOMEM, "out of memory");
    if (st == TKD_OK) st = tkd_cache_manifest_set_str(&m->teacher_path, cfg->teacher_path);
    if (st == TKD_OK) st = tkd_cache_manifest_set_str(&m->teacher_arch, tkd_arch_class(model->cfg.arch));
    if (st == TKD_OK) st = tkd_cache_manifest_set_str(&m->dataset_path, paths);
    if (st == TKD_OK) st = tkd_cache_manifest_set_str(&m->tool_version, TKD_VERSION);
    if (st == TKD_OK) {
        free(m->config_text);
        st = tkd_config_to_text(&tkd_dump_schema, cfg, &m->config_text);
    }
    if (st == TKD_OK && model->be && model->be->policy) /* which GPU kernels made the cache */
        st = tkd_cuda_policy_append_note(model->be->policy, &m->config_text);
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
        tkd_error_prefix(st, "%s: config: cannot read the config it was made with", path);
        return tkd_error_hint(TKD_ERR_FORMAT, "pass --overwrite to replace the cache");
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
                st = tkd_error_hint(st, "fix or delete it, or pass --overwrite");
                break;
            }
            st = tkd_cache_manifest_check_same(&old, g.gl_pathv[i], tmpl, "this config");
            if (st != TKD_OK)
                st = tkd_error_hint(st, "this directory holds another cache: use another output.dir, "
                                    "or pass --overwrite to replace it");
            else
                st = check_same_layout(cfg, g.gl_pathv[i], old.config_text);
            tkd_cache_manifest_free(&old);
        }
    }
    globfree(&g);
    return st;
}

/* What worker i of n removes for --overwrite: its own shards (with their temporaries), its done
 * marker and manifest, and the merged manifest (which no longer holds). */
typedef struct worker_own {
    int64_t shard_lo, shard_hi; /* [lo, hi): the shard numbers of its range */
    char done[64], manifest[64];
} worker_own;

static bool worker_picks(const char *name, void *arg)
{
    const worker_own *w = arg;
    long long id = -1;
    int end = 0;
    if (sscanf(name, "shard-%lld.h5%n", &id, &end) == 1 && (!name[end] || !strcmp(name + end, ".tmp")))
        return id >= w->shard_lo && id < w->shard_hi;
    return !strcmp(name, w->done) || !strcmp(name, w->manifest) || !strcmp(name, TKD_CACHE_MANIFEST_NAME);
}

/* --overwrite, only in a directory teacher-dump made whose every entry it can prove it wrote
 * (dump_dir.h): a single worker clears the whole cache; worker i of n only what worker_picks names.
 * The lock files stay: this run holds one of them. */
static tkd_status overwrite_clean(const char *dir, const tkd_dump_config *cfg, int64_t first, int64_t end)
{
    if (cfg->worker_count == 1)
        return tkd_owned_dir_clear(&tkd_dump_dir_kind, dir, NULL, NULL);
    int64_t ss = cfg->shard_sequences;
    worker_own w = {.shard_lo = first / ss, .shard_hi = (end + ss - 1) / ss};
    snprintf(w.done, sizeof w.done, "worker-%d.done", cfg->worker_index);
    tkd_dump_manifest_name(cfg->worker_index, cfg->worker_count, w.manifest, sizeof w.manifest);
    return tkd_owned_dir_clear(&tkd_dump_dir_kind, dir, worker_picks, &w);
}

/* ---- compute ----------------------------------------------------------------------------------- */

typedef struct dump_buffers {
    int32_t *inputs;   // (B, T)
    int32_t *labels;   // (T)
    int64_t *row_seq;  // (B·T) sequence index of each row (tail draws)
    int32_t *row_pos;  // (B·T) its position
    const tkd_doc_pack *pack; /* data.packing: documents (the run's), else NULL */
} dump_buffers;

static void buffers_free(dump_buffers *b)
{
    free(b->inputs);
    free(b->labels);
    free(b->row_seq);
    free(b->row_pos);
    memset(b, 0, sizeof *b);
}

static tkd_status buffers_alloc(dump_buffers *b, int B, int T)
{
    size_t N = (size_t)B * (size_t)T;
    b->inputs = malloc(N * sizeof *b->inputs);
    b->labels = malloc((size_t)T * sizeof *b->labels);
    b->row_seq = malloc(N * sizeof *b->row_seq);
    b->row_pos = malloc(N * sizeof *b->row_pos);
    if (!b->inputs || !b->labels || !b->row_seq || !b->row_pos) {
        buffers_free(b);
        return tkd_error_set(TKD_ERR_NOMEM, "run.batch_size: out of memory for a batch of %d x %d tokens", B, T);
    }
    return TKD_OK;
}

/* Windows [s, s + nb) into the batch's /tokens (padding becomes -100) and the inputs. buf->labels
 * holds the window's labels, -100 also where a flags sidecar says the target is not trained; the
 * /tokens keep those tokens, since they are the next position's input. */
/* Packed documents: sequences [s, s + nb) of pack into the batch's /tokens (padding −100) and
 * /doc_start, the inputs (padding as token 0) and the documents the forward confines attention to. */
static tkd_status fill_packed(const tkd_doc_pack *pack, int T, int64_t s, int nb, tkd_cache_batch *b,
                              dump_buffers *buf)
{
    for (int j = 0; j < nb; j++) {
        int32_t *tok = b->tokens + (size_t)j * (size_t)(T + 1), *in = buf->inputs + (size_t)j * (size_t)T;
        TKD_TRY(tkd_doc_pack_read(pack, s + j, tok, b->labels ? b->labels + (size_t)j * (size_t)T : NULL,
                                  b->doc_start + (size_t)j * (size_t)T, NULL));
        for (int t = 0; t < T; t++)
            in[t] = tok[t] == TKD_TOKENS_IGNORE_LABEL ? 0 : tok[t];
        b->seq_index[j] = s + j;
    }
    b->num_seq = nb;
    return TKD_OK;
}

static tkd_status fill_tokens(const tkd_tokens *ds, const tkd_dump_config *cfg, int64_t s, int nb,
                              tkd_cache_batch *b, dump_buffers *buf)
{
    int T = cfg->seq_len;
    if (buf->pack)
        return fill_packed(buf->pack, T, s, nb, b, buf);
    for (int j = 0; j < nb; j++) {
        int32_t *tok = b->tokens + (size_t)j * (size_t)(T + 1);
        TKD_TRY(tkd_tokens_window(ds, T, cfg->stride, cfg->last_window == TKD_DUMP_LAST_WINDOW_PAD, s + j,
                                  tok, buf->labels, NULL));
        memcpy(buf->inputs + (size_t)j * (size_t)T, tok, (size_t)T * sizeof *tok);
        if (b->labels) /* trained_only: the flags' labels (−100 where not trained) */
            memcpy(b->labels + (size_t)j * (size_t)T, buf->labels, (size_t)T * sizeof *buf->labels);
        int64_t left = tkd_tokens_count(ds) - (s + j) * cfg->stride - 1; /* labels before the padding */
        for (int t = left > 0 ? (int)(left < T ? left : T) : 0; t < T; t++)
            tok[t + 1] = TKD_TOKENS_IGNORE_LABEL;
        b->seq_index[j] = s + j;
    }
    b->num_seq = nb;
    return TKD_OK;
}

/* trained_only caches: the positions whose label is −100 keep no teacher data (zeros, which the
 * shards' zstd stores in almost no bytes). The teacher still ran over them: they are context. */
static void zero_untrained(tkd_cache_batch *b, int64_t rows)
{
    if (!b->labels)
        return;
    const size_t k = (size_t)b->k, S = (size_t)b->tail_samples;
    for (int64_t r = 0; r < rows; r++)
        if (b->labels[r] == TKD_TOKENS_IGNORE_LABEL) {
            memset(b->topk_indices + (size_t)r * k, 0, k * sizeof *b->topk_indices);
            memset(b->topk_logits + (size_t)r * k, 0, k * sizeof *b->topk_logits);
            b->lse[r] = 0.0f;
            if (S)
                memset(b->tail_indices + (size_t)r * S, 0, S * sizeof *b->tail_indices);
        }
}

/* lm_head.chunk_rows, or the backend's automatic value (kernels/backend.h: 256 rows on the CPU,
 * about 2 GiB of fp32 logits on a GPU). */
static int chunk_rows_of(const tkd_dump_config *cfg, const tkd_model *m)
{
    if (cfg->chunk_rows > 0)
        return cfg->chunk_rows;
    return m->be->op->lmhead_chunk_rows(m->be, m->cfg.vocab_size);
}

/* The LM head met a non-finite logit at row a->bad_row of the batch starting at sequence s: names
 * the sequence, position, token and value. A NaN or inf in the teacher's hidden states ends here
 * too (every logit of that position is then NaN). */
static tkd_status nonfinite_logit(const tkd_dump_config *cfg, const tkd_lmhead_topk_args *a, int64_t s)
{
    const int64_t r = a->bad_row, T = cfg->seq_len;
    tkd_error_set(TKD_ERR_NUMERIC, "%s: sequence %lld, position %lld: the teacher's logit for token %lld is %g",
                  cfg->teacher_path, (long long)(s + r / T), (long long)(r % T), (long long)a->bad_col,
                  (double)a->bad_value);
    return tkd_error_hint(TKD_ERR_NUMERIC, "no cache.logits_dtype holds a non-finite value; check the teacher's "
                          "weights (NaN or inf in them or in its activations)");
}

/* The LM head over rows [0, N) of hidden, chunk by chunk on the model's backend: top-k + LSE
 * (+ tail draws) per row, straight into the batch's host buffers. */
static tkd_status lm_head_topk(const tkd_dump_config *cfg, const tkd_model *m, const void *hidden, // (N, D)
                               int64_t N, int64_t s, tkd_cache_batch *b, dump_buffers *buf)
{
    const int T = cfg->seq_len;
    for (int64_t r = 0; r < N; r++) {
        buf->row_seq[r] = s + r / T;
        buf->row_pos[r] = (int32_t)(r % T);
    }
    tkd_lmhead_topk_args a = {
        .hidden = hidden, .w = tkd_model_lm_head_dev(m), .rows = N, .d = m->cfg.hidden_size,
        .v = m->cfg.vocab_size, .k = cfg->k, .tau = (float)cfg->temperature, .chunk_rows = chunk_rows_of(cfg, m),
        .s = cfg->tail_samples, .seed = (uint64_t)cfg->seed, .row_seq = buf->row_seq, .row_pos = buf->row_pos,
        .idx = b->topk_indices, .val = b->topk_logits, .lse = b->lse,
        .tail = cfg->tail_samples > 0 ? b->tail_indices : NULL,
    };
    tkd_status st = m->be->op->lmhead_topk(m->be, &a);
    if (st == TKD_ERR_NUMERIC)
        return nonfinite_logit(cfg, &a, s);
    if (st != TKD_OK && st != TKD_ERR_INTERRUPTED) {
        tkd_error_prefix(st, "%s: sequences %lld..%lld", cfg->teacher_path, (long long)s, (long long)(s + N / T - 1));
        return tkd_error_hint(st, "check the teacher's weights");
    }
    return st;
}

/* Whether dtype dt stores logit x within TKD_KL_LOGIT_ROUND_TOL · τ (kernels/loss/kl_loss.h): in its range,
 * and rounded to it by so little that exp(t/τ − lse) moves by at most a factor e^(1/8). */
static bool dtype_holds(tkd_cache_dtype dt, float x, double tau)
{
    return fabsf(x) <= tkd_cache_dtype_max(dt) &&
           fabs((double)tkd_cache_dtype_round(dt, x) - (double)x) <= TKD_KL_LOGIT_ROUND_TOL * tau;
}

/* The hint for a logit x that cache.logits_dtype does not hold: the other dtypes that do. */
static tkd_status hint_dtypes(const tkd_dump_config *cfg, float x)
{
    if (!isfinite(x))
        return tkd_error_hint(TKD_ERR_NUMERIC, "no dtype holds a non-finite value; check the teacher's weights");
    char list[64] = "";
    int n = 0;
    for (int dt = TKD_CACHE_DTYPE_HALF; dt <= TKD_CACHE_DTYPE_FLOAT32; dt++)
        if (dt != cfg->logits_dtype && dtype_holds((tkd_cache_dtype)dt, x, cfg->temperature))
            snprintf(list + strlen(list), sizeof list - strlen(list), "%s%s", n++ ? " or " : "",
                     tkd_cache_dtype_name((tkd_cache_dtype)dt));
    return tkd_error_hint(TKD_ERR_NUMERIC, "set cache.logits_dtype: %s, which hold%s it (a new cache: pass --overwrite "
                          "or use another output.dir)", list, n > 1 ? "" : "s");
}

/* Logit i of the batch is not held by cache.logits_dtype: beyond its range, or rounded by more than
 * the cache promises. Names its sequence, position and value and the dtypes that hold it. */
static tkd_status unstorable_logit(const tkd_dump_config *cfg, const tkd_cache_batch *b, size_t i)
{
    const size_t T = (size_t)b->seq_len, k = (size_t)b->k;
    const tkd_cache_dtype dt = (tkd_cache_dtype)cfg->logits_dtype;
    const float x = b->topk_logits[i];
    const long long seq = (long long)b->seq_index[i / (T * k)];
    if (!(fabsf(x) <= tkd_cache_dtype_max(dt))) /* NaN fails the comparison too */
        tkd_error_set(TKD_ERR_NUMERIC, "%s: sequence %lld, position %zu: the teacher's logit %g (top-k column %zu) "
                      "does not fit cache.logits_dtype %s (largest magnitude %g)", cfg->teacher_path, seq,
                      (i / k) % T, (double)x, i % k, tkd_cache_dtype_name(dt), (double)tkd_cache_dtype_max(dt));
    else
        tkd_error_set(TKD_ERR_NUMERIC, "%s: sequence %lld, position %zu: the teacher's logit %.9g (top-k column %zu) "
                      "would be stored as %.9g in cache.logits_dtype %s, %g off — more than %g x cache.temperature, "
                      "so its probability would be off by a factor up to e^%.1f", cfg->teacher_path, seq, (i / k) % T,
                      (double)x, i % k, (double)tkd_cache_dtype_round(dt, x), tkd_cache_dtype_name(dt),
                      fabs((double)tkd_cache_dtype_round(dt, x) - x), TKD_KL_LOGIT_ROUND_TOL,
                      fabs((double)tkd_cache_dtype_round(dt, x) - x) / cfg->temperature);
    return hint_dtypes(cfg, x);
}

/* Every value of a finished batch is held by the cache: each top-k logit in cache.logits_dtype's
 * range (beyond it half and bfloat16 would store inf) and rounded to it by at most
 * TKD_KL_LOGIT_ROUND_TOL · τ (a half logit near 45,000 is rounded by up to 16, and the stored
 * probabilities of a row would sum to millions: kernels/loss/kl_loss.h), the LSE finite (float32).
 * Checked on the batch, after whichever top-k path made it, so that no path puts a value into a
 * shard that breaks the stored distribution. */
static tkd_status check_storable(const tkd_dump_config *cfg, const tkd_cache_batch *b)
{
    const tkd_cache_dtype dt = (tkd_cache_dtype)cfg->logits_dtype;
    const size_t T = (size_t)b->seq_len, n = (size_t)b->num_seq * T, nk = n * (size_t)b->k;
    /* one comparison for the logits any real teacher has (|t| < 512 at τ = 1 in half); only larger
     * ones, and NaN, are rounded to see */
    const float exact = tkd_cache_dtype_exact_below(dt, TKD_KL_LOGIT_ROUND_TOL * cfg->temperature);
    for (size_t i = 0; i < nk; i++)
        if (!(fabsf(b->topk_logits[i]) < exact) && !dtype_holds(dt, b->topk_logits[i], cfg->temperature))
            return unstorable_logit(cfg, b, i);
    for (size_t i = 0; i < n; i++)
        if (!isfinite(b->lse[i])) {
            tkd_error_set(TKD_ERR_NUMERIC, "%s: sequence %lld, position %zu: the log-sum-exp of the teacher's logits "
                          "at cache.temperature %g is %g, beyond float32", cfg->teacher_path,
                          (long long)b->seq_index[i / T], i % T, cfg->temperature, (double)b->lse[i]);
            return tkd_error_hint(TKD_ERR_NUMERIC, "check the teacher's weights, or raise cache.temperature");
        }
    return TKD_OK;
}

/* ---- the run ------------------------------------------------------------------------------------ */

typedef struct dump_ctx {
    const tkd_dump_config *cfg;
    const tkd_dump_opts *opts;
    tkd_dump_summary *sum;
    tkd_backend *be;           /* where the teacher runs (device:) */
    tkd_model *model;
    tkd_tokens *ds;
    tkd_doc_pack *pack;        /* data.packing: documents: the dataset's sequences, else NULL */
    tkd_cache_manifest tmpl;   /* identity + the shards kept from an earlier run (sorted) */
    int64_t kept_seqs;         /* sequences in those shards */
    int64_t windows;           /* sequences of the whole dump, all workers' */
    char manifest_path[4096];
} dump_ctx;

/* data.packing: documents: the dataset's documents packed into sequences of data.seq_len, and what
 * that made, logged once. */
static tkd_status open_pack(dump_ctx *c)
{
    TKD_TRY(tkd_doc_pack_build(c->ds, c->cfg->seq_len, &c->pack));
    int64_t n = tkd_doc_pack_count(c->pack), T = c->cfg->seq_len;
    tkd_log_info("teacher-dump: data.packing: documents: %lld documents in %lld sequences of %lld positions, "
                 "%.1f %% of them labelled", (long long)tkd_doc_pack_docs(c->pack), (long long)n, (long long)T,
                 n ? 100.0 * (double)tkd_doc_pack_labels(c->pack) / ((double)n * (double)T) : 0.0);
    return TKD_OK;
}

static tkd_status check_compute_args(const dump_ctx *c)
{
    const tkd_dump_config *cfg = c->cfg;
    int64_t V = c->model->cfg.vocab_size;
    const int C = chunk_rows_of(cfg, c->model);
    tkd_status st = tkd_backend_lmhead_topk_check(C, V, cfg->k, (float)cfg->temperature, cfg->tail_samples);
    if (st != TKD_OK) {
        tkd_error_prefix(st, "cache.k / cache.tail_samples");
        return tkd_error_hint(TKD_ERR_CONFIG, "lower cache.k (teacher %s has vocab %lld)", cfg->teacher_path,
                              (long long)V);
    }
    if (cfg->seq_len > c->model->cfg.max_position_embeddings)
        return tkd_error_set(TKD_ERR_CONFIG, "data.seq_len: %d is above the teacher's max_position_embeddings %d (%s) "
                             "— lower data.seq_len", cfg->seq_len, c->model->cfg.max_position_embeddings,
                             cfg->teacher_path);
    return TKD_OK;
}

/* The identity of an in-memory teacher: its parameter list (names, shapes) and init seed. */
static void memory_teacher_sha256(const tkd_model *m, uint64_t seed, char hex[65])
{
    tkd_sha256 h;
    tkd_sha256_init(&h);
    tkd_sha256_update(&h, "in-memory teacher", 17);
    tkd_sha256_update(&h, &seed, sizeof seed);
    for (int i = 0; i < m->n_info; i++) {
        tkd_sha256_update(&h, m->info[i].name, strlen(m->info[i].name));
        tkd_sha256_update(&h, m->info[i].shape, sizeof m->info[i].shape);
    }
    uint8_t d[TKD_SHA256_BYTES];
    tkd_sha256_final(&h, d);
    tkd_sha256_hex(d, hex);
}

/* -v: the CUDA kernel choices in force (docs/config.md). */
static void log_policy(const tkd_backend *be)
{
    char text[512];
    if (be->policy && tkd_cuda_policy_format(be->policy, text, sizeof text) > 0)
        tkd_log_debug("teacher-dump: CUDA kernel choices: %s", text);
}

static tkd_status load_inputs(dump_ctx *c)
{
    const tkd_dump_config *cfg = c->cfg;
    tkd_status st = TKD_OK;
    if (c->opts->teacher) {
        c->model = c->opts->teacher;
        memory_teacher_sha256(c->model, c->opts->teacher_seed, c->sum->teacher_sha256);
    } else {
        tkd_device dev;
        TKD_TRY(tkd_backend_resolve((tkd_device)cfg->device, &dev));
        TKD_TRY(tkd_backend_open_local(dev, &cfg->dist, &c->be)); /* the GPU of this worker on its node */
        log_policy(c->be);
        st = tkd_model_load_hf_on(cfg->teacher_path, c->be, &c->model);
        if (st != TKD_OK)
            return tkd_error_prefix(st, "teacher.path");
        TKD_TRY(tkd_dump_teacher_sha256(cfg->teacher_path, c->sum->teacher_sha256));
    }
    TKD_TRY(check_compute_args(c));
    TKD_TRY(tkd_dump_open_dataset(cfg, c->model->cfg.vocab_size, &c->ds));
    char trained[160];
    if (tkd_tokens_trained_summary(c->ds, trained, sizeof trained))
        tkd_log_info("teacher-dump: data: %s", trained);
    st = tkd_tokens_check_vocab(c->ds, c->model->cfg.vocab_size);
    if (st != TKD_OK)
        return tkd_error_hint(st, "use the tokenizer of teacher %s (vocab %d)", cfg->teacher_path,
                              c->model->cfg.vocab_size);
    TKD_TRY(tkd_tokens_sha256(c->ds, c->sum->dataset_sha256));
    return make_template(&c->tmpl, cfg, c->model, c->ds, c->sum->teacher_sha256, c->sum->dataset_sha256);
}

/* An earlier run's manifest lists shards of this worker's range only, each starting where this
 * config starts a shard; otherwise the range or the split changed. */
static tkd_status check_listed_range(const tkd_cache_manifest *m, const char *path, int64_t first, int64_t end,
                                     int64_t ss)
{
    for (int64_t i = 0; i < m->num_shards; i++) {
        const tkd_cache_shard_entry *e = &m->shards[i];
        if (e->first_seq < first || e->first_seq + e->num_seq > end || e->first_seq % ss != 0)
            return tkd_error_set(TKD_ERR_MISMATCH, "%s: lists %s with sequences [%lld, %lld) but this worker's range "
                                 "is [%lld, %lld) — keep workers.* and data.max_sequences as before, or pass "
                                 "--overwrite", path, e->file, (long long)e->first_seq,
                                 (long long)(e->first_seq + e->num_seq), (long long)first, (long long)end);
    }
    return TKD_OK;
}

/* Checks every listed shard's file against its listed size and sha256, several files at a time
 * (one thread reads a few hundred MB/s: a large cache is otherwise a long wait at every re-run).
 * (*failed)[i] is NULL for a good file, else its status and message; the caller frees them. */
static tkd_status verify_listed(const char *dir, const tkd_cache_manifest *m, tkd_error_saved ***failed)
{
    tkd_error_saved **f = calloc((size_t)m->num_shards + 1, sizeof *f);
    if (!f)
        return tkd_error_set(TKD_ERR_NOMEM, "out of memory");
    int oom = 0;
#pragma omp parallel for schedule(dynamic, 1) reduction(| : oom)
    for (int64_t i = 0; i < m->num_shards; i++) {
        tkd_status st = tkd_cache_manifest_verify_shard(dir, &m->shards[i]);
        if (st != TKD_OK && (f[i] = malloc(sizeof *f[i])))
            tkd_error_save(f[i], st);
        oom |= st != TKD_OK && !f[i];
    }
    *failed = f;
    return oom ? tkd_error_set(TKD_ERR_NOMEM, "out of memory") : TKD_OK;
}

/* *keep = 1 when listed shard e stays: it is whole (not cut short by a smaller data.max_sequences
 * before) and its file passed verify_listed (failed == NULL). A missing or damaged file is re-made
 * and counted in the summary; other failures (unreadable) are errors. */
static tkd_status shard_keep(dump_ctx *c, const tkd_cache_shard_entry *e, const tkd_error_saved *failed, int *keep)
{
    const int64_t ss = c->cfg->shard_sequences, left = c->sum->range_end - e->first_seq;
    *keep = 0;
    if (e->num_seq != (left < ss ? left : ss))
        return TKD_OK;
    if (failed && (failed->st == TKD_ERR_NOT_FOUND || failed->st == TKD_ERR_CHECKSUM)) {
        /* the note is what was wrong, without the message's hint: the run is that hint */
        const char *hint = strstr(failed->msg, " \xe2\x80\x94 ");
        int len = hint ? (int)(hint - failed->msg) : (int)strlen(failed->msg);
        if (c->sum->shards_damaged++ == 0)
            snprintf(c->sum->damaged_note, sizeof c->sum->damaged_note, "%.*s", len, failed->msg);
        return TKD_OK;
    }
    *keep = !failed;
    return failed ? tkd_error_restore(failed) : TKD_OK;
}

/* This worker's manifest from an earlier run: the shards that pass shard_keep go into c->tmpl,
 * the others are left to be re-made. The manifest is rewritten without them first, so that it
 * never names a file being replaced. */
static tkd_status load_resume(dump_ctx *c)
{
    tkd_cache_manifest old;
    TKD_TRY(tkd_cache_manifest_read(&old, c->manifest_path));
    tkd_error_saved **failed = NULL;
    tkd_status st = check_listed_range(&old, c->manifest_path, c->sum->range_first, c->sum->range_end,
                                       c->cfg->shard_sequences);
    if (st == TKD_OK)
        st = verify_listed(c->cfg->output_dir, &old, &failed);
    for (int64_t i = 0; st == TKD_OK && i < old.num_shards; i++) {
        int keep = 0;
        st = shard_keep(c, &old.shards[i], failed[i], &keep);
        if (st == TKD_OK && keep)
            st = tkd_cache_manifest_add_shard(&c->tmpl, &old.shards[i]);
    }
    if (st == TKD_OK && c->tmpl.num_shards < old.num_shards)
        st = tkd_cache_manifest_write(&c->tmpl, c->manifest_path);
    for (int64_t i = 0; failed && i < old.num_shards; i++)
        free(failed[i]);
    free(failed);
    tkd_cache_manifest_free(&old);
    return st;
}

/* The first window at or after s that no kept shard holds. *next is the caller's cursor into the
 * kept shards (sorted), carried from call to call as s grows. */
static int64_t skip_kept(const tkd_cache_manifest *kept, int64_t *next, int64_t s)
{
    for (; *next < kept->num_shards && kept->shards[*next].first_seq <= s; (*next)++)
        if (kept->shards[*next].first_seq == s)
            s += kept->shards[*next].num_seq;
    return s;
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
    if (c->opts->overwrite) {
        TKD_TRY(overwrite_clean(dir, cfg, first, end));
        TKD_TRY(tkd_dump_drop_other_split(cfg));
    } else {
        TKD_TRY(check_existing(dir, &c->tmpl, cfg));
        TKD_TRY(tkd_dump_check_split(cfg, c->windows));
    }
    if (tkd_file_exists(c->manifest_path)) {
        TKD_TRY(load_resume(c));
    } else {
        /* An empty manifest records the identity at once, so a second run with another config
         * is refused even before the first shard is done. */
        TKD_TRY(tkd_cache_manifest_write(&c->tmpl, c->manifest_path));
    }
    int64_t next = 0;
    c->sum->resumed_at = skip_kept(&c->tmpl, &next, first);
    c->kept_seqs = tkd_cache_manifest_num_seq(&c->tmpl);
    return TKD_OK;
}

static void report_progress(dump_ctx *c, tkd_dump_writer *w, double t0)
{
    if (!c->opts->progress)
        return;
    tkd_dump_writer_stats ws;
    tkd_dump_writer_get_stats(w, &ws);
    tkd_dump_progress p = {
        .seq_done = c->kept_seqs + c->sum->seqs_run,
        .seq_total = c->sum->range_end - c->sum->range_first,
        .seq_start = c->kept_seqs,
        .tokens_run = c->sum->tokens_run,
        .elapsed_s = tkd_progress_now() - t0,
        .bytes_written = ws.bytes,
        .tokens_written = ws.seqs * c->cfg->seq_len,
    };
    c->opts->progress(&p, c->opts->progress_user);
}

/* The test hooks of tkd_dump_opts, compiled into test builds only (common/test_hooks.h). */
static bool test_stop(const tkd_dump_opts *o, int64_t nbatches)
{
#ifdef TKD_TEST_HOOKS
    return o->stop_after_batches > 0 && nbatches >= o->stop_after_batches;
#else
    return false;
#endif
}

static void test_kill(const tkd_dump_opts *o, int64_t nbatches, tkd_dump_writer *w)
{
#ifdef TKD_TEST_HOOKS
    if (o->kill_after_batches > 0 && nbatches == o->kill_after_batches) {
        tkd_dump_writer_drain(w); /* the batches so far are on disk: the crash is mid-shard, not mid-write */
        raise(SIGKILL);
    }
#endif
}

static tkd_status compute_loop(dump_ctx *c, tkd_dump_writer *w, dump_buffers *buf, double t0)
{
    const tkd_dump_config *cfg = c->cfg;
    const int64_t ss = cfg->shard_sequences, T = cfg->seq_len;
    int64_t nbatches = 0, next_kept = 0;
    /* Shards kept from an earlier run are skipped: what is left is computed exactly as one
     * uninterrupted run computes it. */
    for (int64_t s = skip_kept(&c->tmpl, &next_kept, c->sum->range_first); s < c->sum->range_end;
         s = skip_kept(&c->tmpl, &next_kept, s)) {
        if (tkd_interrupted() || test_stop(c->opts, nbatches))
            return tkd_error_set(TKD_ERR_INTERRUPTED, "interrupted");
        /* A batch never crosses a shard boundary, so a resumed or split run computes exactly the
         * same batches as one uninterrupted run. */
        int64_t shard_end = (s / ss + 1) * ss;
        int64_t lim = shard_end < c->sum->range_end ? shard_end : c->sum->range_end;
        int nb = (int)(lim - s < cfg->batch_size ? lim - s : cfg->batch_size);
        tkd_cache_batch *b;
        TKD_TRY(tkd_dump_writer_acquire(w, &b));
        TKD_TRY(fill_tokens(c->ds, cfg, s, nb, b, buf));
        const void *hidden;
        TKD_TRY(tkd_model_forward_docs(c->model, buf->inputs, buf->pack ? b->doc_start : NULL, nb, (int)T, 0,
                                       &hidden));
        TKD_TRY(lm_head_topk(cfg, c->model, hidden, (int64_t)nb * T, s, b, buf));
        zero_untrained(b, (int64_t)nb * T);
        TKD_TRY(check_storable(cfg, b));
        TKD_TRY(tkd_dump_writer_submit(w, b, s));
        s += nb;
        nbatches++;
        c->sum->seqs_run += nb;
        c->sum->tokens_run += nb * T;
        test_kill(c->opts, nbatches, w);
        report_progress(c, w, t0);
    }
    return TKD_OK;
}

static tkd_status run_compute(dump_ctx *c)
{
    const tkd_dump_config *cfg = c->cfg;
    dump_buffers buf = {0};
    TKD_TRY(tkd_model_reserve(c->model, cfg->batch_size, cfg->seq_len, 0));
    TKD_TRY(buffers_alloc(&buf, cfg->batch_size, cfg->seq_len));
    buf.pack = c->pack;
    tkd_dump_writer_opts wo = {
        .dir = cfg->output_dir,
        .manifest_path = c->manifest_path,
        .manifest = &c->tmpl,
        .range_end = c->sum->range_end,
        .shard_sequences = cfg->shard_sequences,
        .shard = {.zstd_level = cfg->zstd_level, .chunk_seqs = 0, .tail_seed = (uint64_t)cfg->seed,
                  .threads = cfg->writer_threads},
        .batch_capacity = cfg->batch_size,
    };
    tkd_dump_writer *w = NULL;
    tkd_status st = tkd_dump_writer_start(&w, &wo);
    double t0 = tkd_progress_now();
    if (st == TKD_OK)
        st = compute_loop(c, w, &buf, t0);
    if (st == TKD_OK) {
        st = tkd_dump_writer_finish(w);
    } else {
        tkd_error_saved saved;
        tkd_error_save(&saved, st);
        /* On Ctrl-C, batches already computed are still written (a shard they complete is kept);
         * then the shard in progress is removed. Other errors stop at once. */
        if (st == TKD_ERR_INTERRUPTED && w)
            tkd_dump_writer_drain(w);
        tkd_dump_writer_abort(w);
        tkd_error_restore(&saved);
        if (st == TKD_ERR_NOSPACE && !strstr(saved.msg, "disk full")) {
            tkd_error_prefix(st, "%s: disk full", cfg->output_dir);
            tkd_error_hint(st, "free space there and re-run the same command to resume");
        }
    }
    c->sum->seconds = tkd_progress_now() - t0;
    buffers_free(&buf);
    return st;
}

/* Counts what this run added to the manifest, the shards not kept from before (for the summary). */
static void summarize(dump_ctx *c)
{
    tkd_cache_manifest m;
    if (tkd_cache_manifest_read(&m, c->manifest_path) != TKD_OK)
        return;
    const tkd_cache_manifest *kept = &c->tmpl; /* sorted, like m */
    for (int64_t i = 0, j = 0; i < m.num_shards; i++) {
        while (j < kept->num_shards && kept->shards[j].first_seq < m.shards[i].first_seq)
            j++;
        if (j < kept->num_shards && kept->shards[j].first_seq == m.shards[i].first_seq)
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
    int64_t done = c->kept_seqs;
    if (tkd_cache_manifest_read(&m, c->manifest_path) == TKD_OK) {
        done = tkd_cache_manifest_num_seq(&m);
        tkd_cache_manifest_free(&m);
    }
    return tkd_error_set(TKD_ERR_INTERRUPTED,
                         "%s: stopped by %s with %lld of %lld sequences in whole shards (the shard in progress was "
                         "removed) — re-run the same command to resume",
                         c->manifest_path, sig == SIGTERM ? "SIGTERM" : "SIGINT",
                         (long long)done,
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
    /* the directory and its lock first: a second writer is refused before minutes of hashing */
    tkd_dir_lock *lock = NULL;
    char made[4096]; /* the folders this run makes, removed again if it is refused (tkd_dump_dir_abandon) */
    tkd_status st = tkd_mkdir_p_made(cfg->output_dir, made, sizeof made);
    if (st == TKD_OK)
        st = tkd_dump_dir_open(cfg, &lock);
    if (st == TKD_OK)
        st = load_inputs(&c);
    if (st == TKD_OK && cfg->packing == TKD_PACKING_DOCUMENTS)
        st = open_pack(&c);
    if (st == TKD_OK) {
        int64_t nw = c.pack ? tkd_doc_pack_count(c.pack)
                            : tkd_tokens_num_windows(c.ds, cfg->seq_len, cfg->stride,
                                                     cfg->last_window == TKD_DUMP_LAST_WINDOW_PAD);
        if (cfg->max_sequences > 0 && cfg->max_sequences < nw)
            nw = cfg->max_sequences;
        if (nw == 0)
            st = tkd_error_set(TKD_ERR_CONFIG, "data.paths: %lld tokens give no window of data.seq_len %d + 1 — "
                               "use a shorter seq_len or data.last_window: pad", (long long)tkd_tokens_count(c.ds),
                               cfg->seq_len);
        c.windows = nw;
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
        tkd_error_saved saved;
        tkd_error_save(&saved, st);
        summarize(&c);
        tkd_error_restore(&saved);
    }
    tkd_cache_manifest_free(&c.tmpl);
    tkd_doc_pack_free(c.pack);
    tkd_tokens_free(c.ds);
    if (!c.opts->teacher)
        tkd_model_free(c.model);
    tkd_backend_close(c.be);
    if (st != TKD_OK && made[0] && cfg->worker_count == 1 && !c.manifest_path[0]) /* before writing */
        tkd_dump_dir_abandon(cfg->output_dir, made, lock);
    else
        tkd_dir_lock_release(lock);
    return st;
}
