/* dump_config.c — see dump_config.h. */
#include "teacher_cache/dump_config.h"

#include <errno.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cjson/cJSON.h>

#include "common/dist.h"
#include "formats/cache_shard.h"
#include "formats/doc_pack.h"
#include "formats/text_docs.h"

static const char *const last_window_names[] = {"drop", "pad", NULL};
static const char *const data_format_names[] = {"auto", "text", "jsonl", "chat", NULL}; /* tkd_dump_data_format */
/* Same order as tkd_cache_dtype, so the enum index is the dtype. */
static const char *const dtype_names[] = {"half", "bfloat16", "float32", NULL};

#define C tkd_dump_config
static const tkd_config_field dump_fields[] = {
    TKD_CFG_STRING(C, teacher_path, "teacher.path", NULL,
                   "Hugging Face checkpoint directory of the teacher (config.json + *.safetensors)."),
    TKD_CFG_STRING_LIST(C, data_paths, "data.paths", NULL,
                        "token files (llm.c .bin, .npy, Megatron prefix) or glob patterns, concatenated in order; with "
                        "data.tokenizer, text or JSON Lines files instead."),
    TKD_CFG_STRING(C, data_tokenizer, "data.tokenizer", "",
                   "tokenize data.paths (text, .jsonl) with this tokenizer.json or checkpoint directory "
                   "first, as `teacher-dump tokenize` does; empty = data.paths are token files."),
    TKD_CFG_STRING(C, data_text_field, "data.text_field", "text",
                   "with data.tokenizer: the JSON Lines field holding the text."),
    TKD_CFG_STRING(C, data_doc_separator, "data.doc_separator", "",
                   "with data.tokenizer: text files are cut into documents at this string (\\n, \\t, \\r, \\\\ read as "
                   "tokenize --doc-separator reads them); empty = one per file."),
    TKD_CFG_ENUM(C, data_format, "data.format", "auto", data_format_names,
                 "with data.tokenizer: auto (.jsonl/.ndjson are JSON Lines, other files text), text, jsonl, or "
                 "chat (JSON Lines conversations through the chat template, only assistant tokens trained; "
                 "as tokenize --chat)."),
    TKD_CFG_STRING(C, data_chat_template, "data.chat_template", "",
                   "with data.format: chat: this Jinja file instead of the tokenizer's chat template."),
    TKD_CFG_STRING(C, data_chat_kwargs, "data.chat_kwargs", "",
                   "with data.format: chat: a JSON object added to the template's variables, e.g. "
                   "{\"enable_thinking\": false}."),
    TKD_CFG_INT(C, seq_len, "data.seq_len", "256", 1, 1 << 20,
                "positions per sequence; a window holds seq_len + 1 tokens (inputs + next-token labels)."),
    TKD_CFG_INT(C, stride, "data.stride", "0", 0, 1 << 30,
                "tokens between window starts; 0 = seq_len (windows share one boundary token)."),
    TKD_CFG_ENUM(C, last_window, "data.last_window", "drop", last_window_names,
                 "the last partial window: drop it, or pad it (padding labels are -100 in /tokens)."),
    TKD_CFG_ENUM(C, packing, "data.packing", "stream", tkd_packing_names,
                 "stream: windows of the token stream, across documents; documents: whole documents (cut at "
                 "seq_len), packed with attention kept inside each (needs recorded documents)."),
    TKD_CFG_INT64(C, max_sequences, "data.max_sequences", "0", 0, 1e15,
                  "dump at most this many windows (the first ones); 0 = all."),
    TKD_CFG_INT(C, k, "cache.k", "100", 1, 128, "top-k teacher logits kept per position."),
    TKD_CFG_ENUM(C, logits_dtype, "cache.logits_dtype", "half", dtype_names,
                 "how /topk/logits is stored."),
    TKD_CFG_FLOAT(C, temperature, "cache.temperature", "1.0", 1e-3, 1e3,
                  "temperature of the stored LSE and tail draws (logits are stored raw)."),
    TKD_CFG_INT(C, tail_samples, "cache.tail_samples", "0", 0, 1024,
                "S tokens drawn per position from the teacher's distribution outside its top-k (0 = none)."),
    TKD_CFG_INT64(C, seed, "cache.seed", "1234", 0, 9.0e18,
                  "seed of the tail draws (keyed by seed, sequence index, position)."),
    TKD_CFG_INT(C, shard_sequences, "cache.shard_sequences", "0", 0, 1 << 30,
                "sequences per shard file; fixed for the life of a cache; 0 = 1024, or from cache.shard_tokens."),
    TKD_CFG_INT64(C, shard_tokens, "cache.shard_tokens", "0", 0, 1 << 30,
                  "size shards by positions instead: shard_sequences = max(1, shard_tokens / data.seq_len); "
                  "0 = off; not with cache.shard_sequences."),
    TKD_CFG_INT(C, zstd_level, "cache.zstd_level", "3", 1, 22, "zstd compression level of the shards."),
    TKD_CFG_INT(C, writer_threads, "cache.writer_threads", "0", 0, TKD_SHARD_WRITER_MAX_THREADS,
                "threads compressing shard chunks; 0 = min(8, cores - 1), at least 1."),
    TKD_CFG_INT(C, batch_size, "run.batch_size", "8", 1, 1 << 16, "sequences per teacher forward."),
    TKD_CFG_INT(C, chunk_rows, "lm_head.chunk_rows", "0", 0, 1 << 20,
                "positions per LM-head chunk: memory is chunk_rows x vocab floats; 0 = auto (256 on "
                "the CPU, about 2 GiB of logits on a GPU)."),
    TKD_CFG_ENUM(C, device, "device", "auto", tkd_device_names,
                 "auto (CUDA when this build has it and a GPU answers, else CPU), cpu, cuda (bf16 "
                 "weights and activations on the GPU that LOCAL_RANK or SLURM_LOCALID names when workers.* "
                 "are left to the environment, else GPU 0)."),
    TKD_CFG_STRING(C, output_dir, "output.dir", NULL, "the cache directory (created when absent)."),
    TKD_CFG_INT(C, worker_index, "workers.index", "0", 0, 1 << 20,
                "this worker's index (0 = read RANK or SLURM_PROCID when set)."),
    TKD_CFG_INT(C, worker_count, "workers.count", "1", 1, 1 << 20,
                "number of workers splitting the dump (1 = read WORLD_SIZE or SLURM_NTASKS when set)."),
};
#undef C

const tkd_config_schema tkd_dump_schema = TKD_CONFIG_SCHEMA("teacher-dump", dump_fields);

static const char *plain_getenv(const char *name) { return getenv(name); }

/* RANK/WORLD_SIZE, else SLURM_PROCID/SLURM_NTASKS (srun, one task per GPU): common/dist.h reads
 * them as student-train does, so both tools agree on who is which rank and which GPU it takes
 * (its local rank). */
static tkd_status workers_from_env(tkd_dump_config *cfg, const char *(*get)(const char *))
{
    tkd_status st = tkd_dist_from_getenv(&cfg->dist, get);
    if (st != TKD_OK)
        return tkd_error_hint(st, "unset it or set workers.* in the config");
    cfg->worker_index = cfg->dist.rank;
    cfg->worker_count = cfg->dist.world;
    return TKD_OK;
}

#define DEFAULT_SHARD_SEQUENCES 1024

/* cache.shard_tokens into cache.shard_sequences: a CPU run wants shards of minutes, not of hours,
 * and positions are what its time is proportional to. */
static tkd_status resolve_shard_sequences(tkd_dump_config *cfg)
{
    if (cfg->shard_tokens > 0 && cfg->shard_sequences > 0)
        return tkd_error_set(TKD_ERR_CONFIG, "cache.shard_tokens (%lld) and cache.shard_sequences (%d) are both set — "
                             "keep one (shard_tokens gives shard_tokens / data.seq_len sequences per shard)",
                             (long long)cfg->shard_tokens, cfg->shard_sequences);
    if (cfg->shard_tokens > 0) {
        int64_t n = cfg->shard_tokens / cfg->seq_len;
        cfg->shard_sequences = n > 1 ? (int)n : 1;
        cfg->shard_tokens = 0; /* resolved: the printed config must load back to the same cache */
    } else if (cfg->shard_sequences == 0) {
        cfg->shard_sequences = DEFAULT_SHARD_SEQUENCES;
    }
    return TKD_OK;
}

static bool set(const char *s) { return s && *s; }

/* data.format and the chat keys only mean something when data.tokenizer tokenizes data.paths. */
static tkd_status check_data_format(const tkd_dump_config *cfg)
{
    bool chat = cfg->data_format == TKD_DUMP_DATA_FORMAT_CHAT;
    if (!set(cfg->data_tokenizer) && cfg->data_format != TKD_DUMP_DATA_FORMAT_AUTO)
        return tkd_error_set(TKD_ERR_CONFIG, "data.format: %s needs data.tokenizer (data.paths are token files "
                             "without it)", data_format_names[cfg->data_format]);
    if (!chat && (set(cfg->data_chat_template) || set(cfg->data_chat_kwargs)))
        return tkd_error_set(TKD_ERR_CONFIG, "%s: set, but data.format is not chat",
                             set(cfg->data_chat_template) ? "data.chat_template" : "data.chat_kwargs");
    if (!set(cfg->data_chat_kwargs)) /* checked here, before a teacher is loaded; tokenizing reads it again */
        return TKD_OK;
    cJSON *k = cJSON_Parse(cfg->data_chat_kwargs);
    bool object = cJSON_IsObject(k);
    cJSON_Delete(k);
    return object ? TKD_OK
                  : tkd_error_set(TKD_ERR_CONFIG, "data.chat_kwargs: '%.200s' is not a JSON object (e.g. "
                                  "'{\"enable_thinking\": false}', quoted in YAML)", cfg->data_chat_kwargs);
}

tkd_status tkd_dump_config_finalize(tkd_dump_config *cfg, const char *(*getenv_fn)(const char *))
{
    if (!getenv_fn)
        getenv_fn = plain_getenv;
    /* workers.* in the config replace the environment: it is not read (rank 0 of 1 on its node,
     * GPU 0) */
    memset(&cfg->dist, 0, sizeof cfg->dist);
    cfg->dist.world = cfg->dist.local_world = 1;
    if (cfg->worker_index == 0 && cfg->worker_count == 1)
        TKD_TRY(workers_from_env(cfg, getenv_fn));
    if (cfg->stride == 0)
        cfg->stride = cfg->seq_len;
    TKD_TRY(resolve_shard_sequences(cfg));
    if (!cfg->teacher_path || !*cfg->teacher_path)
        return tkd_error_set(TKD_ERR_CONFIG, "teacher.path: not set — give the teacher's Hugging Face "
                                             "checkpoint directory (--set teacher.path=DIR)");
    if (cfg->data_paths.n == 0)
        return tkd_error_set(TKD_ERR_CONFIG,
                             "data.paths: not set — give token files or globs (--set data.paths=[a.bin])");
    if (!cfg->output_dir || !*cfg->output_dir)
        return tkd_error_set(TKD_ERR_CONFIG,
                             "output.dir: not set — name the cache directory (--set output.dir=DIR)");
    if (cfg->worker_index >= cfg->worker_count)
        return tkd_error_set(TKD_ERR_CONFIG,
                             "workers.index: %d is not below workers.count %d — indices run 0..count-1",
                             cfg->worker_index, cfg->worker_count);
    TKD_TRY(check_data_format(cfg));
    if (cfg->packing == TKD_PACKING_DOCUMENTS && cfg->stride != cfg->seq_len)
        return tkd_error_set(TKD_ERR_CONFIG, "data.stride: %d with data.packing: documents, whose sequences are "
                             "whole documents, not windows every stride tokens: leave data.stride unset",
                             cfg->stride);
    char *sep = NULL; /* checked here, before a teacher is loaded; the dataset reads it again */
    tkd_status st = tkd_dump_doc_separator(cfg, &sep);
    free(sep);
    return st;
}

tkd_status tkd_dump_doc_separator(const tkd_dump_config *cfg, char **out)
{
    *out = NULL;
    const char *s = cfg->data_doc_separator;
    return s && *s ? tkd_text_unescape(s, "data.doc_separator", TKD_ERR_CONFIG, out) : TKD_OK;
}

double tkd_dump_raw_bytes_per_token(const tkd_dump_config *cfg)
{
    size_t lsz = tkd_cache_dtype_size((tkd_cache_dtype)cfg->logits_dtype);
    return (4.0 + (double)lsz) * cfg->k + 4.0 + 4.0 * cfg->tail_samples;
}

void tkd_dump_worker_range(int64_t total, int64_t shard_sequences, int index, int count,
                           int64_t *first, int64_t *end)
{
    int64_t nshards = (total + shard_sequences - 1) / shard_sequences;
    int64_t s0 = nshards * index / count, s1 = nshards * (index + 1) / count;
    *first = s0 * shard_sequences < total ? s0 * shard_sequences : total;
    *end = s1 * shard_sequences < total ? s1 * shard_sequences : total;
}

void tkd_dump_manifest_name(int index, int count, char *out, size_t cap)
{
    if (count <= 1)
        snprintf(out, cap, "manifest.yaml");
    else
        snprintf(out, cap, "manifest.worker-%d.yaml", index);
}
