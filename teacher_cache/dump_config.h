/* dump_config.h — teacher-dump's settings: the config struct, its schema (the source of --help and
 * --print-config), the checks that need more than one key, and the split of the dataset's windows
 * between workers.
 *
 * Worker ranges are whole shards: the N_s = ceil(W / shard_sequences) shards of a W-window dump are
 * dealt out contiguously, worker i getting shards [i·N_s/n, (i+1)·N_s/n). A shard's id (its file
 * name) is first_seq / shard_sequences, so workers never collide on a file name, and one worker or
 * n workers write exactly the same shards.
 */
#ifndef TKD_DUMP_CONFIG_H
#define TKD_DUMP_CONFIG_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/config.h"
#include "common/device.h"
#include "common/dist.h"
#include "common/status.h"

typedef enum tkd_dump_last_window {
    TKD_DUMP_LAST_WINDOW_DROP = 0, /* the last partial window is dropped */
    TKD_DUMP_LAST_WINDOW_PAD = 1,  /* ... or padded (its padding labels are -100 in /tokens) */
} tkd_dump_last_window;

/* data.format: how data.tokenizer reads data.paths (tokenize's --format, and --chat). */
typedef enum tkd_dump_data_format {
    TKD_DUMP_DATA_FORMAT_AUTO = 0,  /* .jsonl / .ndjson are JSON Lines, other files text */
    TKD_DUMP_DATA_FORMAT_TEXT = 1,
    TKD_DUMP_DATA_FORMAT_JSONL = 2,
    TKD_DUMP_DATA_FORMAT_CHAT = 3,  /* JSON Lines conversations through the chat template, with flags */
} tkd_dump_data_format;

typedef struct tkd_dump_config {
    char *teacher_path;        /* teacher.path: HF checkpoint directory */
    tkd_strlist data_paths;    /* data.paths: files or globs, concatenated in order */
    char *data_tokenizer;      /* data.tokenizer: "" = data_paths are token files; else they are text */
    char *data_text_field;     /* data.text_field: the JSON Lines field holding the text */
    char *data_doc_separator;  /* data.doc_separator: "" = one document per text file */
    int data_format;           /* data.format: tkd_dump_data_format */
    char *data_chat_template;  /* data.chat_template: "" = the tokenizer's own */
    char *data_chat_kwargs;    /* data.chat_kwargs: "" or a JSON object for the template */
    int seq_len;               /* data.seq_len */
    int stride;                /* data.stride; 0 = seq_len (resolved by tkd_dump_config_finalize) */
    int last_window;           /* data.last_window: tkd_dump_last_window */
    int packing;               /* data.packing: tkd_packing (formats/doc_pack.h) */
    int64_t max_sequences;     /* data.max_sequences; 0 = every window */
    int k;                     /* cache.k */
    int logits_dtype;          /* cache.logits_dtype: tkd_cache_dtype (same order) */
    double temperature;        /* cache.temperature */
    int tail_samples;          /* cache.tail_samples */
    int64_t seed;              /* cache.seed: key of the tail draws */
    int shard_sequences;       /* cache.shard_sequences; 0 = 1024 or from shard_tokens (finalize) */
    int64_t shard_tokens;      /* cache.shard_tokens; 0 = off (finalize turns it into shard_sequences) */
    int zstd_level;            /* cache.zstd_level */
    int writer_threads;        /* cache.writer_threads; 0 = automatic (tkd_shard_writer_threads) */
    int batch_size;            /* run.batch_size */
    int chunk_rows;            /* lm_head.chunk_rows */
    int device;                /* device: tkd_device (common/device.h) */
    char *output_dir;          /* output.dir */
    int worker_index;          /* workers.index */
    int worker_count;          /* workers.count */
    tkd_dist_info dist;        /* not a key: this process among a launcher's (the environment, read
                                * once by finalize; local_rank picks its GPU) */
} tkd_dump_config;

/* The schema: every key, its type, default, range and help line. */
extern const tkd_config_schema tkd_dump_schema;

/* Fills environment defaults and derived values, then checks what a single key cannot:
 * - workers.index / workers.count left at 0 / 1 take RANK / WORLD_SIZE, else SLURM_PROCID /
 *   SLURM_NTASKS, when those are set (a malformed or half-set value is an error naming the
 *   variable), and cfg->dist all of common/dist.h's reading, whose local rank is the GPU this
 *   worker takes; with workers.* set the environment is not read (cfg->dist: rank 0 of 1, GPU 0);
 * - data.stride 0 becomes data.seq_len;
 * - cache.shard_tokens N becomes shard_sequences = max(1, N / seq_len) (and then 0, so that the
 *   printed config loads back the same); with shard_sequences also set it is an error naming both;
 *   shard_sequences 0 without it becomes 1024;
 * - required keys (teacher.path, data.paths, output.dir) are set; index < count;
 * - data.doc_separator's escapes are ones tokenize's --doc-separator knows (tkd_dump_doc_separator);
 * - data.format (other than auto), data.chat_template and data.chat_kwargs need data.tokenizer, and
 *   the chat keys need data.format: chat.
 * TKD_ERR_CONFIG with "key: what — what to do". getenv_fn NULL means getenv (tests pass their own). */
tkd_status tkd_dump_config_finalize(tkd_dump_config *cfg, const char *(*getenv_fn)(const char *));

/* data.doc_separator as the tokenizer's reader takes it: its escapes read by the rule of tokenize's
 * --doc-separator (tkd_text_unescape: \n, \t, \r, \\), so that one text gives one dataset either
 * way. *out is malloc'd (the caller frees it), NULL for "" (one document per file). TKD_ERR_CONFIG
 * naming the key for an escape it does not know (tkd_dump_config_finalize checks it early). */
tkd_status tkd_dump_doc_separator(const tkd_dump_config *cfg, char **out);

/* Bytes per token of an uncompressed cache row: (4 + dtype bytes)·k + 4 (LSE) + 4·S (tail ids). */
double tkd_dump_raw_bytes_per_token(const tkd_dump_config *cfg);

/* The windows [*first, *end) that worker `index` of `count` dumps out of `total` windows cut into
 * shards of `shard_sequences`. Empty (first == end) when there are more workers than shards. */
void tkd_dump_worker_range(int64_t total, int64_t shard_sequences, int index, int count,
                           int64_t *first, int64_t *end);

/* The manifest a worker writes: "manifest.yaml" when count == 1, else "manifest.worker-<i>.yaml". */
void tkd_dump_manifest_name(int index, int count, char *out, size_t cap);

#endif /* TKD_DUMP_CONFIG_H */
