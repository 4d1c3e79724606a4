/* cache_shard.h — one shard of the teacher cache (format version 1): an HDF5 file holding the
 * teacher's top-k indices and logits, LSE, tokens and sequence indices for a run of sequences.
 *
 * The writer (used by teacher-dump) appends batches of whole sequences in order and publishes the
 * file atomically: it writes "<name>.tmp", closes and fsyncs it, then renames it, so a file named
 * shard-*.h5 is always complete. The reader side (used by cache_reader.c and tests) opens one
 * shard, checks its identity attributes and reads runs of sequences, optionally only the first
 * k' <= k columns. docs/cache-format.md is the user-facing spec of the file layout.
 *
 * HDF5 never prints: every failure becomes one tkd_status message naming the file and dataset.
 */
#ifndef TKD_CACHE_SHARD_H
#define TKD_CACHE_SHARD_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/sha256.h"
#include "common/status.h"

#define TKD_CACHE_FORMAT_NAME "topkd-cache"
#define TKD_CACHE_FORMAT_VERSION 1 /* windows of the token stream, every position's teacher data */
/* Packed documents or trained positions only: /tokens' labels and /topk's rows mean something a
 * version-1 reader would misread (a label across a document, zeros as a teacher), so such a cache
 * says version 2 and those readers refuse it. */
#define TKD_CACHE_FORMAT_VERSION_LAYOUTS 2
#define TKD_CACHE_SHA256_HEX TKD_SHA256_HEX_LEN /* 64 hex digits + NUL */
#define TKD_CACHE_FILE_MAX 256  /* shard file names inside a cache directory */

/* What to do about a shard that is missing, damaged or not the one the manifest lists: the hint of
 * every such message. teacher-dump re-run on a cache checks each listed shard's sha256 and re-makes
 * exactly the ones that fail (docs/teacher-dump.md, "Resume and repair"). */
#define TKD_CACHE_REPAIR_HINT                                                                        \
    "repair it by re-running the teacher-dump command that made this cache, without --overwrite "  \
    "(its config is saved under config: in the manifest): it re-makes only missing or damaged shards"

/* How /topk/logits is stored. Values are stable (they never appear in files: names do). */
typedef enum tkd_cache_dtype {
    TKD_CACHE_DTYPE_HALF = 0,     /* IEEE binary16 (h5py: float16) */
    TKD_CACHE_DTYPE_BFLOAT16 = 1, /* bfloat16 (an HDF5 float type with 8 exponent bits) */
    TKD_CACHE_DTYPE_FLOAT32 = 2,
} tkd_cache_dtype;

/* Canonical name as written in files and manifests: "half", "bfloat16", "float32". */
const char *tkd_cache_dtype_name(tkd_cache_dtype dt);

/* Parses a dtype name ("half"/"float16"/"f16"/"fp16", "bfloat16"/"bf16", "float32"/"f32"/"fp32").
 * TKD_ERR_CONFIG with the allowed values on anything else. */
tkd_status tkd_cache_dtype_parse(const char *name, tkd_cache_dtype *out);

/* Bytes per stored logit (2 or 4). */
size_t tkd_cache_dtype_size(tkd_cache_dtype dt);

/* Largest finite magnitude the dtype stores: 65504 (half), 0x1.fep127 ≈ 3.39e38 (bfloat16), FLT_MAX
 * (float32). A larger float would be stored as inf (or clamped), so producers refuse it. */
float tkd_cache_dtype_max(tkd_cache_dtype dt);

/* x as the dtype stores it and reads it back (round to nearest even; beyond the dtype's range the
 * result is its inf, so callers check tkd_cache_dtype_max first). */
float tkd_cache_dtype_round(tkd_cache_dtype dt, float x);

/* The magnitude below which the dtype stores every float within tol of its value (0 < tol): rounding
 * to nearest moves a value by at most half a spacing, so every |x| < 2^(m + 2 + floor(log2 tol)) is
 * within tol (m the stored mantissa bits: 10 half, 7 bfloat16), capped at the dtype's largest value;
 * INFINITY for float32 (finite values are stored exactly). At tol 1/8: 512 half, 64 bfloat16. A
 * producer checks only values at or beyond it (teacher-dump's per-logit rule). */
float tkd_cache_dtype_exact_below(tkd_cache_dtype dt, double tol);

/* What makes two shards (or a shard and its manifest) belong to the same cache. */
typedef struct tkd_cache_identity {
    int64_t vocab_size;
    int32_t k;            /* stored top-k columns, 1..65535 */
    int32_t seq_len;      /* positions per sequence (tokens hold seq_len + 1) */
    float temperature;    /* the temperature the logits were taken at */
    tkd_cache_dtype logits_dtype;
    int32_t tail_samples; /* S tail draws per position; 0 = no /tail/indices */
    int32_t packed;       /* 1: sequences of packed documents (data.packing: documents, formats/doc_pack.h):
                           * /doc_start holds each position's document start; 0: windows of the stream */
    int32_t trained_only; /* 1: the dataset marked its trained positions (a flags sidecar): /labels holds
                           * each position's label, −100 where it is not trained, and those positions'
                           * top-k, LSE and tail data are zeros (compressed to almost nothing) */
    char teacher_sha256[TKD_CACHE_SHA256_HEX];
    char dataset_sha256[TKD_CACHE_SHA256_HEX];
} tkd_cache_identity;

/* The format version a cache of this identity is written with (1, or 2 when packed or trained_only). */
int tkd_cache_format_version(const tkd_cache_identity *id);

/* Checks that the identity is usable (positive sizes, finite temperature > 0, hex digests).
 * `what` names the source in the message (a file path or "config"). */
tkd_status tkd_cache_identity_check(const tkd_cache_identity *id, const char *what);

/* Compares two identities field by field; TKD_ERR_MISMATCH naming the first differing field and
 * both values, prefixed with "<a_name> vs <b_name>". */
tkd_status tkd_cache_identity_compare(const tkd_cache_identity *a, const char *a_name,
                                      const tkd_cache_identity *b, const char *b_name);

/* Bytes per token the stored datasets take before compression: (4 + logit size)·k for the top-k
 * indices and logits, + 4 for LSE, + 4·S for tail draws (tokens and seq_index are ignored:
 * under 1% at real sequence lengths). For half and S = 0 that is (4 + 2)·k + 4. */
double tkd_cache_raw_bytes_per_token(const tkd_cache_identity *id);

/* What a shard costs on disk per token: file bytes / (num_seq · seq_len). 0 when empty. */
double tkd_cache_bytes_per_token(uint64_t file_bytes, int64_t num_seq, int32_t seq_len);

/* A batch of whole sequences in host memory, all row-major.
 * As writer input the caller fills the pointers with its own buffers (nothing is copied or freed).
 * As reader output the buffers come from tkd_cache_batch_alloc and belong to the batch until
 * tkd_cache_batch_free. `k` is the number of columns the buffers hold (k' <= the cache's k). */
typedef struct tkd_cache_batch {
    int64_t num_seq;        /* sequences filled */
    int64_t capacity;       /* sequences the buffers hold (reader side) */
    int32_t seq_len;
    int32_t k;
    int32_t tail_samples;   /* S; 0 = no tail buffer */
    int32_t *tokens;        // (capacity, seq_len + 1)
    uint32_t *topk_indices; // (capacity, seq_len, k), largest teacher logit first
    float *topk_logits;     // (capacity, seq_len, k), raw logits (widened to float on read)
    float *lse;             // (capacity, seq_len)
    int64_t *seq_index;     // (capacity) position of each sequence in the dataset
    uint32_t *tail_indices; // (capacity, seq_len, S) or NULL when S == 0
    int32_t *doc_start;     // (capacity, seq_len) or NULL: packed caches' document starts
                            // (tkd_cache_batch_alloc_doc_start; a reader fills it when not NULL)
    int32_t *labels;        // (capacity, seq_len) or NULL: trained_only caches' labels
                            // (tkd_cache_batch_alloc_labels; a reader fills it when not NULL)
    int64_t *cache_seq;     // (capacity) global position in the cache (reader fills; may be NULL)
} tkd_cache_batch;

/* Allocates all buffers of a batch for `capacity` sequences (tail buffer only when S > 0) and sets
 * the shape fields; num_seq = 0. On failure nothing stays allocated. */
tkd_status tkd_cache_batch_alloc(tkd_cache_batch *b, int64_t capacity, int32_t seq_len, int32_t k,
                                 int32_t tail_samples);

/* Adds the doc_start buffer (capacity, seq_len) to an allocated batch (a packed cache's reader). */
tkd_status tkd_cache_batch_alloc_doc_start(tkd_cache_batch *b);
/* Adds the labels buffer (capacity, seq_len) (a trained_only cache's reader). */
tkd_status tkd_cache_batch_alloc_labels(tkd_cache_batch *b);

/* Frees what tkd_cache_batch_alloc allocated and zeroes the struct. NULL-safe. */
void tkd_cache_batch_free(tkd_cache_batch *b);

/* ---- writer -------------------------------------------------------------------------------- */

typedef struct tkd_shard_writer tkd_shard_writer;

#define TKD_SHARD_WRITER_MAX_THREADS 256

typedef struct tkd_shard_writer_opts {
    int zstd_level;      /* 1..22; 0 = TKD_H5ZSTD_DEFAULT_LEVEL */
    int64_t chunk_seqs;  /* sequences per HDF5 chunk; 0 = automatic (about 1 MiB per chunk) */
    uint64_t tail_seed;  /* recorded as an attribute when tail_samples > 0 */
    int threads;         /* threads filtering chunks (0..TKD_SHARD_WRITER_MAX_THREADS; 0 = automatic,
                          * see tkd_shard_writer_threads) */
    int h5dwrite;        /* nonzero: let H5Dwrite filter every chunk on the calling thread, the way
                          * HDF5 does it alone — the reference the parallel path is tested against */
} tkd_shard_writer_opts;

/* How the writer filters: by default it runs the datasets' pipeline (shuffle → zstd → fletcher32)
 * itself, on `threads` threads, one whole chunk each, and hands HDF5 the finished chunks
 * (H5Dwrite_chunk, all filters applied). The file is the one H5Dwrite would make: same dataset
 * properties, same chunk bytes, read by any HDF5 through its normal pipeline. */

/* The threads a writer opened with opts.threads = requested uses: requested when > 0, else
 * min(8, cores - 1) and at least 1, cores being the CPUs this process may run on — so a 2-core
 * machine filters on the writer's own thread and leaves the other core to the teacher. */
int tkd_shard_writer_threads(int requested);

/* What a finished shard looks like to the manifest. */
typedef struct tkd_cache_shard_entry {
    char file[TKD_CACHE_FILE_MAX]; /* name inside the cache directory, e.g. "shard-00000.h5" */
    int64_t first_seq;             /* global cache position of the shard's first sequence */
    int64_t num_seq;
    uint64_t bytes;                /* file size */
    char sha256[TKD_CACHE_SHA256_HEX];
} tkd_cache_shard_entry;

/* Creates "<path>.tmp" (replacing a stale one) and the empty datasets. `first_seq` is the global
 * cache position of the first sequence that will be appended. opts may be NULL (defaults).
 * On success *out is owned by the caller and must end with _finish or _abort. */
tkd_status tkd_shard_writer_open(tkd_shard_writer **out, const char *path,
                                 const tkd_cache_identity *id, int64_t first_seq,
                                 const tkd_shard_writer_opts *opts);

/* Appends b->num_seq sequences (shapes as in tkd_cache_batch with b->k == id.k, b->seq_len ==
 * id.seq_len, b->tail_samples == id.tail_samples). Logits are converted from float to the shard's
 * dtype with round-to-nearest-even. The batch is only read. On error the writer is still valid
 * for _abort only. */
tkd_status tkd_shard_writer_append(tkd_shard_writer *w, const tkd_cache_batch *b);

/* Writes num_seq, closes, fsyncs, renames "<path>.tmp" to path, fsyncs the directory, and fills
 * *entry (may be NULL) with the file's name, range, size and sha256. Frees w in every case; on
 * failure the .tmp file is removed. */
tkd_status tkd_shard_writer_finish(tkd_shard_writer *w, tkd_cache_shard_entry *entry);

/* Closes w, removes the .tmp file and frees w. NULL-safe. */
void tkd_shard_writer_abort(tkd_shard_writer *w);

/* Sequences appended so far. */
int64_t tkd_shard_writer_num_seq(const tkd_shard_writer *w);

/* ---- reader -------------------------------------------------------------------------------- */

typedef struct tkd_shard tkd_shard;

/* What a shard says about itself (root attributes). */
typedef struct tkd_shard_info {
    tkd_cache_identity id;
    int32_t version;
    int64_t first_seq;
    int64_t num_seq;
    int64_t chunk_seqs;
} tkd_shard_info;

/* Opens a shard read-only, reads and checks its attributes (format name, version 1, identity
 * valid) and the shapes and types of every dataset. `cache_bytes` bounds HDF5's chunk cache per
 * dataset (0 = enough for one chunk). On success *out is the caller's, released by
 * tkd_shard_close. Errors name the path: TKD_ERR_NOT_FOUND (no file / missing dataset),
 * TKD_ERR_FORMAT (not HDF5, truncated, wrong shapes), TKD_ERR_UNSUPPORTED (other version). */
tkd_status tkd_shard_open(tkd_shard **out, const char *path, size_t cache_bytes);

/* Closes the file. NULL-safe. */
void tkd_shard_close(tkd_shard *s);

/* True when path is an HDF5 file whose root attribute "format" is TKD_CACHE_FORMAT_NAME (any version,
 * damaged data or not): a file teacher-dump wrote, which its --overwrite may remove. False on any
 * failure (its message is not meant to be shown). */
bool tkd_shard_has_cache_format(const char *path);

/* The attributes read at open; valid while s is open. */
const tkd_shard_info *tkd_shard_get_info(const tkd_shard *s);

/* Reads sequences [first, first + count) of the shard (shard-local numbering) into slots
 * [slot, slot + count) of b, only the first b->k columns of the top-k datasets (b->k <= k), and
 * /tail/indices when b->tail_samples > 0 (must then equal the shard's S). Sets b->cache_seq when
 * present. Does not change b->num_seq. TKD_ERR_CHECKSUM when fletcher32 or zstd reports a corrupt
 * chunk, naming the file, dataset and sequence range. */
tkd_status tkd_shard_read(tkd_shard *s, int64_t first, int64_t count, tkd_cache_batch *b,
                          int64_t slot);

/* Sequences per chunk that a shard of this identity gets by default. */
int64_t tkd_shard_default_chunk_seqs(const tkd_cache_identity *id);

#endif /* TKD_CACHE_SHARD_H */
