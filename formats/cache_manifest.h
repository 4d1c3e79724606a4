/* cache_manifest.h — manifest.yaml of a teacher cache directory (format version 1): what teacher
 * and dataset the cache was made from, its identity (k, dtype, temperature, tail draws) and the
 * list of finished shards with their sizes and sha256 digests.
 *
 * teacher-dump rewrites the manifest atomically after every finished shard (any file name: workers
 * write manifest.worker-N.yaml and tkd_cache_manifest_merge joins them); student-train reads it
 * through cache_reader.h. Parse errors name file:line:column. docs/cache-format.md lists the keys.
 */
#ifndef TKD_CACHE_MANIFEST_H
#define TKD_CACHE_MANIFEST_H

#include <stddef.h>
#include <stdint.h>

#include "common/status.h"
#include "formats/cache_shard.h"

#define TKD_CACHE_MANIFEST_NAME "manifest.yaml"

/* A manifest in memory. All strings are malloc'd and owned by the manifest (NULL = absent); set
 * them with tkd_cache_manifest_set_str. `shards` is owned too, grown by _add_shard. */
typedef struct tkd_cache_manifest {
    int32_t version;          /* TKD_CACHE_FORMAT_VERSION for manifests we write */
    tkd_cache_identity id;    /* vocab_size, k, seq_len, temperature, dtype, S, digests */
    char *teacher_path;
    char *teacher_arch;       /* e.g. "LlamaForCausalLM" */
    char *dataset_path;
    int64_t dataset_tokens;   /* tokens in the dataset (0 = unknown) */
    int64_t stride;           /* window stride in tokens (0 = unknown) */
    uint64_t tail_seed;       /* seed of the tail draws (meaningful when id.tail_samples > 0) */
    char *tool_version;
    char *config_text;        /* the effective config, opaque text (a YAML block in the file) */
    int32_t workers;          /* a merged manifest: the number of workers whose parts it joins (key
                               * `workers`); 0 = written by one process, or merged by a version that
                               * did not record it (a worker's own manifest has its split in config) */
    int64_t num_shards;
    int64_t cap_shards;
    tkd_cache_shard_entry *shards; // (num_shards) sorted by first_seq, no overlaps
} tkd_cache_manifest;

/* Zeroes m and sets version. Pair with tkd_cache_manifest_free. */
void tkd_cache_manifest_init(tkd_cache_manifest *m);

/* Frees every owned string and the shard list, leaving m initialised and empty. NULL-safe. */
void tkd_cache_manifest_free(tkd_cache_manifest *m);

/* Replaces an owned string field with a copy of value (NULL clears it). */
tkd_status tkd_cache_manifest_set_str(char **field, const char *value);

/* Deep copy of src into dst (dst is overwritten, not freed first: pass an initialised-empty or
 * fresh struct). */
tkd_status tkd_cache_manifest_copy(tkd_cache_manifest *dst, const tkd_cache_manifest *src);

/* Appends a finished shard. It must start at or after the end of the last listed shard (shards
 * are appended in order); an overlap or a duplicate file name is TKD_ERR_INVALID_ARG. */
tkd_status tkd_cache_manifest_add_shard(tkd_cache_manifest *m, const tkd_cache_shard_entry *e);

/* Lists a finished shard in its place by first_seq (a shard re-made into a gap of the list): the
 * same checks as _add_shard against both neighbours. */
tkd_status tkd_cache_manifest_insert_shard(tkd_cache_manifest *m, const tkd_cache_shard_entry *e);

/* Sum of num_seq over the listed shards. */
int64_t tkd_cache_manifest_num_seq(const tkd_cache_manifest *m);

/* first_seq + num_seq of the last shard (where the next shard starts), or `start` when empty. */
int64_t tkd_cache_manifest_end_seq(const tkd_cache_manifest *m, int64_t start);

/* Writes m as YAML to path atomically (temp file in the same directory, fsync, rename, fsync of
 * the directory): readers see the old or the new manifest, never a mix. */
tkd_status tkd_cache_manifest_write(const tkd_cache_manifest *m, const char *path);

/* Reads and validates a manifest. On success *m (which need not be initialised) is the caller's to
 * free; on failure it is left empty. Errors: TKD_ERR_NOT_FOUND (no file), TKD_ERR_FORMAT with
 * "path:line:col: what" (bad YAML, missing key, wrong type, overlapping shards),
 * TKD_ERR_UNSUPPORTED (another format version). Unknown keys are ignored (docs: versioning). */
tkd_status tkd_cache_manifest_read(tkd_cache_manifest *m, const char *path);

/* The same for a manifest's text already in memory (len bytes); path names it in messages. */
tkd_status tkd_cache_manifest_parse(tkd_cache_manifest *m, const char *path, const char *text, size_t len);

/* Checks that two manifests describe the same cache (identity, teacher and dataset, stride, tail
 * seed): TKD_ERR_MISMATCH naming the first differing field. Names label the two in the message. */
tkd_status tkd_cache_manifest_check_same(const tkd_cache_manifest *a, const char *a_name,
                                         const tkd_cache_manifest *b, const char *b_name);

/* Joins the shard lists of n manifests of the same cache (e.g. per-worker manifests) into *out
 * (initialised here; the caller frees it). Metadata comes from parts[0]. The shards must tile
 * [0, total) with no overlap and no gap: TKD_ERR_MISMATCH naming the manifests and the sequence
 * range otherwise. names[i] labels parts[i] in messages. */
tkd_status tkd_cache_manifest_merge(tkd_cache_manifest *out, const tkd_cache_manifest *parts,
                                    int n, const char *const *names);

/* Checks that the shard file named by e exists in dir with the listed size and sha256:
 * TKD_ERR_NOT_FOUND, or TKD_ERR_CHECKSUM naming the file and both digests. Reads the whole file. */
tkd_status tkd_cache_manifest_verify_shard(const char *dir, const tkd_cache_shard_entry *e);

#endif /* TKD_CACHE_MANIFEST_H */
