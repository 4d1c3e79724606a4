/* tokens_megatron.c — Megatron-LM indexed datasets (PREFIX.idx + PREFIX.bin): the index checked
 * against the data file (tkd_tokens_parse_megatron_index), loading a dataset into the list, and
 * telling a dataset's names from other token files (tokens_internal.h).
 */
#include "formats/tokens_internal.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#define MM_MAGIC "MMIDIDX\0\0"   /* 9 bytes */
#define MM_HEADER_BYTES 34        /* magic 9, version 8, dtype code 1, sequence_count 8, document_count 8 */

/* ---- Megatron-LM indexed datasets ---------------------------------------------------------- */

static uint64_t rd_u64(const uint8_t *p) { uint64_t v; memcpy(&v, p, 8); return v; }
static int64_t rd_i64(const uint8_t *p, int64_t i) { int64_t v; memcpy(&v, p + 8 * (size_t)i, 8); return v; }
static int32_t rd_i32(const uint8_t *p, int64_t i) { int32_t v; memcpy(&v, p + 4 * (size_t)i, 4); return v; }

/* Megatron's DType codes (megatron/core/datasets/indexed_dataset.py); kind < 0: not an integer. */
static const struct mm_dtype {
    int code;
    const char *name;
    int kind;
} mm_dtypes[] = {
    {1, "uint8", TOK_U8},  {2, "int8", TOK_I8},     {3, "int16", TOK_I16},  {4, "int32", TOK_I32},
    {5, "int64", TOK_I64}, {6, "float64", -1},      {7, "float32", -1},     {8, "uint16", TOK_U16},
};

static tkd_status mm_dtype(const char *ip, int code, tok_kind *kind)
{
    for (size_t i = 0; i < sizeof mm_dtypes / sizeof mm_dtypes[0]; i++) {
        if (mm_dtypes[i].code != code)
            continue;
        if (mm_dtypes[i].kind < 0)
            return tkd_error_set(TKD_ERR_UNSUPPORTED, "%s: dtype code %d (%s) is not an integer type: tokens must be "
                                 "stored as integers", ip, code, mm_dtypes[i].name);
        *kind = (tok_kind)mm_dtypes[i].kind;
        return TKD_OK;
    }
    return tkd_error_set(TKD_ERR_FORMAT, "%s: dtype code %d is not one Megatron defines (1 to 8)", ip, code);
}

/* Magic, version, dtype, and counts that match the index's length exactly; fills the views. */
static tkd_status mm_header(const char *ip, const uint8_t *b, size_t size, tkd_megatron_index *mi)
{
    if (size < MM_HEADER_BYTES)
        return tkd_error_set(TKD_ERR_FORMAT, "%s: %zu bytes, shorter than the %d-byte MMIDIDX header: truncated or "
                             "not a Megatron-LM index", ip, size, MM_HEADER_BYTES);
    if (memcmp(b, MM_MAGIC, 9) != 0)
        return tkd_error_set(TKD_ERR_FORMAT, "%s: bad magic (expected \"MMIDIDX\\x00\\x00\"): not a Megatron-LM "
                             "index", ip);
    uint64_t version = rd_u64(b + 9), nseq = rd_u64(b + 18), ndoc = rd_u64(b + 26);
    if (version != 1)
        return tkd_error_set(TKD_ERR_FORMAT, "%s: index version %llu is not supported (expected 1)", ip,
                             (unsigned long long)version);
    tok_kind kind = TOK_I32; /* set by mm_dtype; initialised for the compiler */
    TKD_TRY(mm_dtype(ip, b[17], &kind));
    uint64_t body = size - MM_HEADER_BYTES; /* sizes (int32), pointers (int64), document_indices (int64) */
    if (nseq >= (1ull << 59) || ndoc >= (1ull << 59))
        return tkd_error_set(TKD_ERR_FORMAT, "%s: sequence_count %llu and document_count %llu are too large for any "
                             "index: corrupt", ip, (unsigned long long)nseq, (unsigned long long)ndoc);
    if (12 * nseq + 8 * ndoc > body) /* < 2^63 after the check above */
        return tkd_error_set(TKD_ERR_FORMAT, "%s: sequence_count %llu and document_count %llu make a %llu-byte "
                             "index, but the file holds %zu bytes: truncated", ip, (unsigned long long)nseq,
                             (unsigned long long)ndoc, (unsigned long long)(MM_HEADER_BYTES + 12 * nseq + 8 * ndoc),
                             size);
    uint64_t extra = body - 12 * nseq - 8 * ndoc;
    if (extra && extra == nseq)
        return tkd_error_set(TKD_ERR_UNSUPPORTED, "%s: a multimodal index (a mode byte per sequence after the "
                             "document indices) is not supported", ip);
    if (extra)
        return tkd_error_set(TKD_ERR_FORMAT, "%s: %llu bytes follow the document indices that sequence_count %llu "
                             "and document_count %llu do not describe", ip, (unsigned long long)extra,
                             (unsigned long long)nseq, (unsigned long long)ndoc);
    if (ndoc == 0)
        return tkd_error_set(TKD_ERR_FORMAT, "%s: document_count is 0, but document_indices always holds at least "
                             "its leading 0", ip);
    *mi = (tkd_megatron_index){.dtype_code = b[17], .token_bytes = (int)tkd_tokens_kind_size(kind),
                               .num_sequences = (int64_t)nseq, .num_documents = (int64_t)ndoc - 1,
                               .sizes = b + MM_HEADER_BYTES, .pointers = b + MM_HEADER_BYTES + 4 * nseq,
                               .doc_idx = b + MM_HEADER_BYTES + 12 * nseq};
    return TKD_OK;
}

/* document_indices: 0, never decreasing, ending at sequence_count. */
static tkd_status mm_doc_idx(const char *ip, const tkd_megatron_index *mi)
{
    int64_t prev = rd_i64(mi->doc_idx, 0), last = mi->num_documents;
    if (prev != 0)
        return tkd_error_set(TKD_ERR_FORMAT, "%s: document_indices[0] = %lld (expected 0)", ip, (long long)prev);
    for (int64_t d = 1; d <= last; d++) {
        int64_t v = rd_i64(mi->doc_idx, d);
        if (v < prev)
            return tkd_error_set(TKD_ERR_FORMAT, "%s: document_indices[%lld] = %lld is below document_indices[%lld] "
                                 "= %lld: they must not decrease", ip, (long long)d, (long long)v, (long long)(d - 1),
                                 (long long)prev);
        prev = v;
    }
    if (prev != mi->num_sequences)
        return tkd_error_set(TKD_ERR_FORMAT, "%s: document_indices ends at %lld, but sequence_count is %lld", ip,
                             (long long)prev, (long long)mi->num_sequences);
    return TKD_OK;
}

/* sizes >= 0 adding up to the .bin's length; pointers inside it, one sequence after another. */
static tkd_status mm_sequences(const char *ip, const char *bp, uint64_t bin, tkd_megatron_index *mi)
{
    uint64_t tsz = (uint64_t)mi->token_bytes, total = 0;
    for (int64_t s = 0; s < mi->num_sequences; s++) {
        int32_t n = rd_i32(mi->sizes, s);
        if (n < 0)
            return tkd_error_set(TKD_ERR_FORMAT, "%s: sizes[%lld] = %d is negative", ip, (long long)s, n);
        total += (uint64_t)n; /* < 2^31 per sequence and < 2^60 sequences: no overflow */
    }
    if (total > (uint64_t)INT64_MAX / 8)
        return tkd_error_set(TKD_ERR_FORMAT, "%s: sizes add up to %llu tokens, more than any file holds", ip,
                             (unsigned long long)total);
    if (bin != TKD_MEGATRON_BIN_UNKNOWN && total * tsz != bin)
        return tkd_error_set(TKD_ERR_FORMAT, "%s: %llu bytes, but the sizes in %s add up to %llu tokens of %llu "
                             "bytes (%llu bytes)", bp, (unsigned long long)bin, ip, (unsigned long long)total,
                             (unsigned long long)tsz, (unsigned long long)(total * tsz));
    uint64_t at = 0; /* where sequence s starts when the sequences lie back to back */
    for (int64_t s = 0; s < mi->num_sequences; s++) {
        int64_t p = rd_i64(mi->pointers, s);
        uint64_t len = (uint64_t)rd_i32(mi->sizes, s) * tsz;
        if (bin != TKD_MEGATRON_BIN_UNKNOWN && (p < 0 || (uint64_t)p > bin || len > bin - (uint64_t)p))
            return tkd_error_set(TKD_ERR_FORMAT, "%s: pointers[%lld] = %lld puts sequence %lld (%llu bytes) outside "
                                 "%s (%llu bytes)", ip, (long long)s, (long long)p, (long long)s,
                                 (unsigned long long)len, bp, (unsigned long long)bin);
        if (p < 0 || (uint64_t)p != at)
            return tkd_error_set(TKD_ERR_FORMAT, "%s: pointers[%lld] = %lld, but the sequences before it end at byte "
                                 "%llu (Megatron's builder stores sequences back to back)", ip, (long long)s,
                                 (long long)p, (unsigned long long)at);
        at += len;
    }
    mi->num_tokens = (int64_t)total;
    mi->data_bytes = total * tsz;
    return TKD_OK;
}

tkd_status tkd_tokens_parse_megatron_index(const char *idx_name, const void *idx, size_t size, const char *bin_name,
                                           uint64_t bin_bytes, tkd_megatron_index *out)
{
    tkd_megatron_index mi;
    TKD_TRY(mm_header(idx_name, idx, size, &mi));
    TKD_TRY(mm_doc_idx(idx_name, &mi));
    TKD_TRY(mm_sequences(idx_name, bin_name, bin_bytes, &mi));
    *out = mi;
    return TKD_OK;
}

/* Token offset (in its file) where document d of a checked index starts; d = num_documents: the end. */
int64_t tkd_tokens_mm_doc_start(const tkd_megatron_index *mi, int64_t d)
{
    int64_t s = rd_i64(mi->doc_idx, d);
    return s == mi->num_sequences ? mi->num_tokens : rd_i64(mi->pointers, s) / mi->token_bytes;
}

/* Appends the Megatron dataset PREFIX.idx + PREFIX.bin to ds. */
tkd_status tkd_tokens_load_megatron(tkd_tokens *ds, const char *prefix)
{
    size_t n = strlen(prefix);
    char *ip = malloc(2 * n + 10), *bp = ip + n + 5;
    if (!ip)
        return tkd_error_set(TKD_ERR_NOMEM, "%s: out of memory", prefix);
    snprintf(ip, n + 5, "%s.idx", prefix);
    snprintf(bp, n + 5, "%s.bin", prefix);
    char what[4200];
    snprintf(what, sizeof what, "the data file of Megatron index %s", ip);
    tok_file f = {0};
    tkd_status st = tkd_tokens_map_path(ip, "Megatron index", &f.idx_map, &f.idx_len);
    if (st == TKD_OK)
        st = tkd_tokens_map_path(bp, what, &f.map, &f.map_len);
    if (st == TKD_OK)
        st = tkd_tokens_parse_megatron_index(ip, f.idx_map, f.idx_len, bp, f.map_len, &f.mm);
    if (st == TKD_OK) {
        mm_dtype(ip, f.mm.dtype_code, &f.kind); /* checked by the parse */
        f.count = f.mm.num_tokens;
        f.tok = f.map;
        st = tkd_tokens_check_fit(&f, bp);
    }
    if (st == TKD_OK)
        st = tkd_tokens_add_file(ds, &f, bp, prefix);
    else
        tkd_tokens_release_file(&f);
    free(ip);
    return st;
}

int tkd_tokens_has_suffix(const char *s, const char *suffix)
{
    size_t n = strlen(s), m = strlen(suffix);
    return n >= m && strcmp(s + n - m, suffix) == 0;
}

static int starts_with_mm_magic(const char *path)
{
    char b[9];
    FILE *fp = fopen(path, "rb");
    int yes = fp && fread(b, 1, 9, fp) == 9 && memcmp(b, MM_MAGIC, 9) == 0;
    if (fp)
        fclose(fp);
    return yes;
}

/* The Megatron dataset path names, as its prefix in *prefix (malloc'd), or NULL: PREFIX.idx always
 * names one; PREFIX.bin when a PREFIX.idx beginning with the MMIDIDX magic lies beside it; PREFIX
 * when no such file exists but PREFIX.idx does (Megatron's own way of naming a dataset). */
tkd_status tkd_tokens_megatron_prefix(const char *path, char **prefix)
{
    *prefix = NULL;
    int is_idx = tkd_tokens_has_suffix(path, ".idx"), is_bin = tkd_tokens_has_suffix(path, ".bin");
    size_t keep = strlen(path) - (is_idx || is_bin ? 4 : 0);
    char *p = malloc(keep + 5);
    if (!p)
        return tkd_error_set(TKD_ERR_NOMEM, "%s: out of memory", path);
    memcpy(p, path, keep);
    memcpy(p + keep, ".idx", 5);
    struct stat sb;
    if (is_idx || (is_bin && starts_with_mm_magic(p)) ||
        (!is_bin && stat(path, &sb) != 0 && errno == ENOENT && stat(p, &sb) == 0)) {
        p[keep] = '\0';
        *prefix = p;
    } else {
        free(p);
    }
    return TKD_OK;
}
