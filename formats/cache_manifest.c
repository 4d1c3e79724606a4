/* cache_manifest.c — see cache_manifest.h. Written with libyaml's emitter (so any path or config
 * text is quoted correctly) and read with libyaml's document loader (so every node has a mark). */
#include "formats/cache_manifest.h"

#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <yaml.h>

#include "common/fileio.h"
#include "common/sha256.h"
#include "common/yaml_check.h"

void tkd_cache_manifest_init(tkd_cache_manifest *m)
{
    memset(m, 0, sizeof *m);
    m->version = TKD_CACHE_FORMAT_VERSION;
}

void tkd_cache_manifest_free(tkd_cache_manifest *m)
{
    if (!m)
        return;
    free(m->teacher_path);
    free(m->teacher_arch);
    free(m->dataset_path);
    free(m->tool_version);
    free(m->config_text);
    free(m->shards);
    tkd_cache_manifest_init(m);
}

tkd_status tkd_cache_manifest_set_str(char **field, const char *value)
{
    char *copy = NULL;
    if (value && !(copy = strdup(value)))
        return tkd_error_set(TKD_ERR_NOMEM, "manifest: out of memory");
    free(*field);
    *field = copy;
    return TKD_OK;
}

tkd_status tkd_cache_manifest_copy(tkd_cache_manifest *dst, const tkd_cache_manifest *src)
{
    *dst = *src;
    dst->teacher_path = dst->teacher_arch = dst->dataset_path = NULL;
    dst->tool_version = dst->config_text = NULL;
    dst->shards = NULL;
    dst->num_shards = dst->cap_shards = 0;
    tkd_status st = TKD_OK;
    if (st == TKD_OK) st = tkd_cache_manifest_set_str(&dst->teacher_path, src->teacher_path);
    if (st == TKD_OK) st = tkd_cache_manifest_set_str(&dst->teacher_arch, src->teacher_arch);
    if (st == TKD_OK) st = tkd_cache_manifest_set_str(&dst->dataset_path, src->dataset_path);
    if (st == TKD_OK) st = tkd_cache_manifest_set_str(&dst->tool_version, src->tool_version);
    if (st == TKD_OK) st = tkd_cache_manifest_set_str(&dst->config_text, src->config_text);
    for (int64_t i = 0; st == TKD_OK && i < src->num_shards; i++)
        st = tkd_cache_manifest_add_shard(dst, &src->shards[i]);
    if (st != TKD_OK)
        tkd_cache_manifest_free(dst);
    return st;
}

static tkd_status manifest_push_shard(tkd_cache_manifest *m, const tkd_cache_shard_entry *e)
{
    if (m->num_shards == m->cap_shards) {
        int64_t cap = m->cap_shards ? 2 * m->cap_shards : 16;
        tkd_cache_shard_entry *p = realloc(m->shards, (size_t)cap * sizeof *p);
        if (!p)
            return tkd_error_set(TKD_ERR_NOMEM, "manifest: out of memory for %lld shards", (long long)cap);
        m->shards = p;
        m->cap_shards = cap;
    }
    m->shards[m->num_shards++] = *e;
    return TKD_OK;
}

/* What add and insert both require: a plain file name with sequences, not listed yet. */
static tkd_status check_new_entry(const tkd_cache_manifest *m, const tkd_cache_shard_entry *e)
{
    if (e->num_seq > INT64_MAX - e->first_seq) /* the end of the shard would overflow */
        return tkd_error_set(TKD_ERR_INVALID_ARG, "manifest: shard %s: first_seq %lld + num_seq %lld is past 2^63",
                             e->file, (long long)e->first_seq, (long long)e->num_seq);
    if (e->first_seq < 0 || e->num_seq < 1 || !e->file[0] || strchr(e->file, '/'))
        return tkd_error_set(TKD_ERR_INVALID_ARG, "manifest: shard '%s' (first_seq %lld, num_seq %lld) is not a plain file name with sequences",
                             e->file, (long long)e->first_seq, (long long)e->num_seq);
    for (int64_t i = 0; i < m->num_shards; i++)
        if (strcmp(m->shards[i].file, e->file) == 0)
            return tkd_error_set(TKD_ERR_INVALID_ARG, "manifest: shard %s is listed twice", e->file);
    return TKD_OK;
}

/* a (listed before b) must end where b starts or before. */
static tkd_status check_order(const tkd_cache_shard_entry *a, const tkd_cache_shard_entry *b)
{
    if (b->first_seq < a->first_seq + a->num_seq)
        return tkd_error_set(TKD_ERR_INVALID_ARG,
                             "manifest: shard %s starts at sequence %lld, before the end (%lld) of %s",
                             b->file, (long long)b->first_seq, (long long)(a->first_seq + a->num_seq), a->file);
    return TKD_OK;
}

tkd_status tkd_cache_manifest_add_shard(tkd_cache_manifest *m, const tkd_cache_shard_entry *e)
{
    TKD_TRY(check_new_entry(m, e));
    if (m->num_shards > 0)
        TKD_TRY(check_order(&m->shards[m->num_shards - 1], e));
    return manifest_push_shard(m, e);
}

tkd_status tkd_cache_manifest_insert_shard(tkd_cache_manifest *m, const tkd_cache_shard_entry *e)
{
    int64_t i = m->num_shards; /* e goes before shards[i..] */
    while (i > 0 && m->shards[i - 1].first_seq > e->first_seq)
        i--;
    TKD_TRY(check_new_entry(m, e));
    if (i > 0)
        TKD_TRY(check_order(&m->shards[i - 1], e));
    if (i < m->num_shards)
        TKD_TRY(check_order(e, &m->shards[i]));
    TKD_TRY(manifest_push_shard(m, e));
    memmove(&m->shards[i + 1], &m->shards[i], (size_t)(m->num_shards - 1 - i) * sizeof *m->shards);
    m->shards[i] = *e;
    return TKD_OK;
}

int64_t tkd_cache_manifest_num_seq(const tkd_cache_manifest *m)
{
    int64_t n = 0;
    for (int64_t i = 0; i < m->num_shards; i++)
        n += m->shards[i].num_seq;
    return n;
}

int64_t tkd_cache_manifest_end_seq(const tkd_cache_manifest *m, int64_t start)
{
    if (m->num_shards == 0)
        return start;
    const tkd_cache_shard_entry *l = &m->shards[m->num_shards - 1];
    return l->first_seq + l->num_seq;
}

/* ---- writing -------------------------------------------------------------------------------- */

typedef struct text_buf {
    char *p;
    size_t len, cap;
    int oom;
} text_buf;

static int text_buf_write(void *data, unsigned char *buffer, size_t size)
{
    text_buf *b = data;
    if (b->len + size + 1 > b->cap) {
        size_t cap = b->cap ? b->cap : 4096;
        while (cap < b->len + size + 1)
            cap *= 2;
        char *p = realloc(b->p, cap);
        if (!p) {
            b->oom = 1;
            return 0;
        }
        b->p = p;
        b->cap = cap;
    }
    memcpy(b->p + b->len, buffer, size);
    b->len += size;
    b->p[b->len] = 0;
    return 1;
}

typedef struct emit {
    yaml_emitter_t e;
    int ok;
} emit;

static void em_event(emit *em, yaml_event_t *ev, int init_ok)
{
    if (!em->ok)
        return;
    if (!init_ok || !yaml_emitter_emit(&em->e, ev))
        em->ok = 0;
}

static void em_scalar(emit *em, const char *v, yaml_scalar_style_t style)
{
    yaml_event_t ev;
    int r = yaml_scalar_event_initialize(&ev, NULL, NULL, (yaml_char_t *)v, (int)strlen(v), 1, 1, style);
    em_event(em, &ev, r);
}

static void em_map_begin(emit *em)
{
    yaml_event_t ev;
    em_event(em, &ev, yaml_mapping_start_event_initialize(&ev, NULL, NULL, 1, YAML_BLOCK_MAPPING_STYLE));
}

static void em_map_end(emit *em)
{
    yaml_event_t ev;
    em_event(em, &ev, yaml_mapping_end_event_initialize(&ev));
}

static void em_str(emit *em, const char *key, const char *v)
{
    em_scalar(em, key, YAML_PLAIN_SCALAR_STYLE);
    if (v)
        em_scalar(em, v, YAML_DOUBLE_QUOTED_SCALAR_STYLE);
    else
        em_scalar(em, "null", YAML_PLAIN_SCALAR_STYLE);
}

static void em_plain(emit *em, const char *key, const char *v)
{
    em_scalar(em, key, YAML_PLAIN_SCALAR_STYLE);
    em_scalar(em, v, YAML_PLAIN_SCALAR_STYLE);
}

static void em_int(emit *em, const char *key, long long v)
{
    char buf[32];
    snprintf(buf, sizeof buf, "%lld", v);
    em_plain(em, key, buf);
}

static void em_uint(emit *em, const char *key, unsigned long long v)
{
    char buf[32];
    snprintf(buf, sizeof buf, "%llu", v);
    em_plain(em, key, buf);
}

static void em_shards(emit *em, const tkd_cache_manifest *m)
{
    yaml_event_t ev;
    em_scalar(em, "shards", YAML_PLAIN_SCALAR_STYLE);
    em_event(em, &ev, yaml_sequence_start_event_initialize(&ev, NULL, NULL, 1, YAML_BLOCK_SEQUENCE_STYLE));
    for (int64_t i = 0; i < m->num_shards; i++) {
        const tkd_cache_shard_entry *s = &m->shards[i];
        em_map_begin(em);
        em_str(em, "file", s->file);
        em_int(em, "first_seq", s->first_seq);
        em_int(em, "num_seq", s->num_seq);
        em_uint(em, "bytes", s->bytes);
        em_str(em, "sha256", s->sha256);
        em_map_end(em);
    }
    em_event(em, &ev, yaml_sequence_end_event_initialize(&ev));
}

static void em_body(emit *em, const tkd_cache_manifest *m)
{
    char temp[32];
    em_map_begin(em);
    em_plain(em, "format", TKD_CACHE_FORMAT_NAME);
    em_int(em, "version", tkd_cache_format_version(&m->id)); /* what the identity asks, whatever was read */
    em_scalar(em, "teacher", YAML_PLAIN_SCALAR_STYLE);
    em_map_begin(em);
    em_str(em, "path", m->teacher_path);
    em_str(em, "architecture", m->teacher_arch);
    em_int(em, "vocab_size", m->id.vocab_size);
    em_str(em, "sha256", m->id.teacher_sha256);
    em_map_end(em);
    em_scalar(em, "dataset", YAML_PLAIN_SCALAR_STYLE);
    em_map_begin(em);
    em_str(em, "path", m->dataset_path);
    em_str(em, "sha256", m->id.dataset_sha256);
    em_int(em, "tokens", m->dataset_tokens);
    em_int(em, "seq_len", m->id.seq_len);
    em_int(em, "stride", m->stride);
    if (m->id.packed) /* absent: windows of the stream, as every cache before packing */
        em_plain(em, "packing", "documents");
    if (m->id.trained_only) /* absent: every position's teacher data */
        em_plain(em, "positions", "trained");
    em_map_end(em);
    em_int(em, "k", m->id.k);
    em_plain(em, "logits_dtype", tkd_cache_dtype_name(m->id.logits_dtype));
    /* the shortest decimal that reads back as the same float (9 digits always do) */
    for (int digits = 6; digits <= 9; digits++) {
        snprintf(temp, sizeof temp, "%.*g", digits, (double)m->id.temperature);
        if (strtof(temp, NULL) == m->id.temperature)
            break;
    }
    em_plain(em, "temperature", temp);
    em_int(em, "tail_samples", m->id.tail_samples);
    em_uint(em, "tail_seed", m->tail_seed);
    em_str(em, "tool_version", m->tool_version);
    if (m->workers > 0) /* absent otherwise: a single worker's manifest reads as before */
        em_int(em, "workers", m->workers);
    em_shards(em, m);
    em_scalar(em, "config", YAML_PLAIN_SCALAR_STYLE);
    if (m->config_text)
        em_scalar(em, m->config_text, YAML_LITERAL_SCALAR_STYLE);
    else
        em_scalar(em, "null", YAML_PLAIN_SCALAR_STYLE);
    em_map_end(em);
}

/* Renders m as YAML into a malloc'd NUL-terminated string. */
static tkd_status manifest_render(const tkd_cache_manifest *m, const char *path, text_buf *out)
{
    emit em;
    memset(&em, 0, sizeof em);
    memset(out, 0, sizeof *out);
    if (!yaml_emitter_initialize(&em.e))
        return tkd_error_set(TKD_ERR_NOMEM, "%s: cannot start the YAML emitter", path);
    em.ok = 1;
    yaml_emitter_set_output(&em.e, text_buf_write, out);
    yaml_emitter_set_unicode(&em.e, 1);
    yaml_emitter_set_width(&em.e, -1); /* never fold long paths */
    yaml_event_t ev;
    em_event(&em, &ev, yaml_stream_start_event_initialize(&ev, YAML_UTF8_ENCODING));
    em_event(&em, &ev, yaml_document_start_event_initialize(&ev, NULL, NULL, NULL, 1));
    em_body(&em, m);
    em_event(&em, &ev, yaml_document_end_event_initialize(&ev, 1));
    em_event(&em, &ev, yaml_stream_end_event_initialize(&ev));
    int ok = em.ok;
    const char *problem = em.e.problem ? em.e.problem : "unknown";
    tkd_status st = TKD_OK;
    if (!ok)
        st = tkd_error_set(out->oom ? TKD_ERR_NOMEM : TKD_ERR_INTERNAL, "%s: YAML emitter failed: %s",
                           path, problem);
    yaml_emitter_delete(&em.e);
    if (st != TKD_OK) {
        free(out->p);
        out->p = NULL;
    }
    return st;
}

tkd_status tkd_cache_manifest_write(const tkd_cache_manifest *m, const char *path)
{
    text_buf out;
    TKD_TRY(manifest_render(m, path, &out));
    static const char header[] = "# topkd teacher cache manifest: see docs/cache-format.md\n";
    size_t hl = sizeof header - 1;
    char *all = malloc(hl + out.len);
    if (!all) {
        free(out.p);
        return tkd_error_set(TKD_ERR_NOMEM, "%s: out of memory", path);
    }
    memcpy(all, header, hl);
    memcpy(all + hl, out.p, out.len);
    tkd_status st = tkd_file_write_atomic(path, all, hl + out.len);
    free(all);
    free(out.p);
    return st;
}

/* ---- reading -------------------------------------------------------------------------------- */

typedef struct yreader {
    const char *path;
    yaml_document_t doc;
} yreader;

static tkd_status y_err(const yreader *y, const yaml_node_t *n, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static tkd_status y_err(const yreader *y, const yaml_node_t *n, const char *fmt, ...)
{
    char what[TKD_ERROR_MSG_MAX];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(what, sizeof what, fmt, ap);
    va_end(ap);
    return tkd_error_set(TKD_ERR_FORMAT, "%s:%lu:%lu: %s", y->path,
                         (unsigned long)(n ? n->start_mark.line + 1 : 1),
                         (unsigned long)(n ? n->start_mark.column + 1 : 1), what);
}

/* Value node of `key` in mapping node map, or NULL. */
static yaml_node_t *y_get(yreader *y, yaml_node_t *map, const char *key)
{
    if (!map || map->type != YAML_MAPPING_NODE)
        return NULL;
    for (yaml_node_pair_t *p = map->data.mapping.pairs.start; p < map->data.mapping.pairs.top; p++) {
        yaml_node_t *k = yaml_document_get_node(&y->doc, p->key);
        if (k && k->type == YAML_SCALAR_NODE && strcmp((const char *)k->data.scalar.value, key) == 0)
            return yaml_document_get_node(&y->doc, p->value);
    }
    return NULL;
}

static int y_is_null(const yaml_node_t *n)
{
    if (!n || n->type != YAML_SCALAR_NODE || n->data.scalar.style != YAML_PLAIN_SCALAR_STYLE)
        return 0;
    const char *v = (const char *)n->data.scalar.value;
    return strcmp(v, "null") == 0 || strcmp(v, "~") == 0 || v[0] == 0;
}

/* A required (or optional) scalar's text. Missing required key -> error at the parent map. */
static tkd_status y_scalar(yreader *y, yaml_node_t *map, const char *key, int required,
                           const char **out, yaml_node_t **node)
{
    yaml_node_t *n = y_get(y, map, key);
    *out = NULL;
    if (node)
        *node = n;
    if (!n || y_is_null(n)) {
        if (required)
            return y_err(y, n ? n : map, "required key '%s' is missing or null", key);
        return TKD_OK;
    }
    if (n->type != YAML_SCALAR_NODE)
        return y_err(y, n, "'%s' must be a scalar", key);
    *out = (const char *)n->data.scalar.value;
    return TKD_OK;
}

static tkd_status y_int(yreader *y, yaml_node_t *map, const char *key, int required, int64_t lo,
                        int64_t hi, int64_t *out)
{
    const char *v;
    yaml_node_t *n;
    TKD_TRY(y_scalar(y, map, key, required, &v, &n));
    if (!v)
        return TKD_OK;
    char *end;
    errno = 0;
    long long x = strtoll(v, &end, 10);
    if (errno || end == v || *end || x < lo || x > hi)
        return y_err(y, n, "'%s' must be an integer in [%lld, %lld], got '%s'", key, (long long)lo,
                     (long long)hi, v);
    *out = x;
    return TKD_OK;
}

static tkd_status y_u64(yreader *y, yaml_node_t *map, const char *key, uint64_t *out)
{
    const char *v;
    yaml_node_t *n;
    TKD_TRY(y_scalar(y, map, key, 0, &v, &n));
    if (!v)
        return TKD_OK;
    char *end;
    errno = 0;
    unsigned long long x = strtoull(v, &end, 10);
    if (errno || end == v || *end || v[0] == '-')
        return y_err(y, n, "'%s' must be a non-negative integer", key);
    *out = x;
    return TKD_OK;
}

static tkd_status y_str(yreader *y, yaml_node_t *map, const char *key, int required, char **field)
{
    const char *v;
    TKD_TRY(y_scalar(y, map, key, required, &v, NULL));
    return tkd_cache_manifest_set_str(field, v);
}

static tkd_status y_digest(yreader *y, yaml_node_t *map, const char *key, char out[65])
{
    const char *v;
    yaml_node_t *n;
    TKD_TRY(y_scalar(y, map, key, 1, &v, &n));
    if (strlen(v) != 64 || strspn(v, "0123456789abcdef") != 64)
        return y_err(y, n, "'%s' must be 64 lowercase hex digits (a sha256)", key);
    memcpy(out, v, 65);
    return TKD_OK;
}

static tkd_status y_map(yreader *y, yaml_node_t *parent, const char *key, yaml_node_t **out)
{
    *out = y_get(y, parent, key);
    if (!*out)
        return y_err(y, parent, "required section '%s' is missing", key);
    if ((*out)->type != YAML_MAPPING_NODE)
        return y_err(y, *out, "'%s' must be a mapping", key);
    return TKD_OK;
}

static tkd_status read_header(yreader *y, yaml_node_t *root, tkd_cache_manifest *m)
{
    const char *fmt;
    yaml_node_t *n;
    TKD_TRY(y_scalar(y, root, "format", 1, &fmt, &n));
    if (strcmp(fmt, TKD_CACHE_FORMAT_NAME) != 0)
        return y_err(y, n, "format is '%s', expected 'topkd-cache' — not a topkd cache manifest", fmt);
    int64_t version = 0;
    TKD_TRY(y_int(y, root, "version", 1, 0, INT32_MAX, &version));
    if (version < TKD_CACHE_FORMAT_VERSION || version > TKD_CACHE_FORMAT_VERSION_LAYOUTS) {
        n = y_get(y, root, "version");
        return tkd_error_set(TKD_ERR_UNSUPPORTED,
                             "%s:%lu:%lu: cache format version %lld, this build reads versions %d and %d — use a matching topkd or re-create the cache",
                             y->path, (unsigned long)n->start_mark.line + 1,
                             (unsigned long)n->start_mark.column + 1, (long long)version,
                             TKD_CACHE_FORMAT_VERSION, TKD_CACHE_FORMAT_VERSION_LAYOUTS);
    }
    m->version = (int32_t)version;
    return TKD_OK;
}

static tkd_status read_identity(yreader *y, yaml_node_t *root, tkd_cache_manifest *m)
{
    yaml_node_t *teacher, *dataset, *n;
    int64_t v = 0, k = 0, T = 0, S = 0;
    const char *s;
    TKD_TRY(y_map(y, root, "teacher", &teacher));
    TKD_TRY(y_map(y, root, "dataset", &dataset));
    TKD_TRY(y_str(y, teacher, "path", 0, &m->teacher_path));
    TKD_TRY(y_str(y, teacher, "architecture", 0, &m->teacher_arch));
    TKD_TRY(y_int(y, teacher, "vocab_size", 1, 1, UINT32_MAX, &v));
    TKD_TRY(y_digest(y, teacher, "sha256", m->id.teacher_sha256));
    TKD_TRY(y_str(y, dataset, "path", 0, &m->dataset_path));
    TKD_TRY(y_digest(y, dataset, "sha256", m->id.dataset_sha256));
    TKD_TRY(y_int(y, dataset, "tokens", 0, 0, INT64_MAX, &m->dataset_tokens));
    TKD_TRY(y_int(y, dataset, "seq_len", 1, 1, INT32_MAX, &T));
    TKD_TRY(y_int(y, dataset, "stride", 0, 0, INT64_MAX, &m->stride));
    TKD_TRY(y_scalar(y, dataset, "packing", 0, &s, &n)); /* absent: windows (caches before packing) */
    if (s && strcmp(s, "documents") != 0 && strcmp(s, "stream") != 0)
        return y_err(y, n, "dataset.packing '%s' is not stream or documents", s);
    m->id.packed = s && !strcmp(s, "documents");
    TKD_TRY(y_scalar(y, dataset, "positions", 0, &s, &n)); /* absent: every position */
    if (s && strcmp(s, "trained") != 0 && strcmp(s, "all") != 0)
        return y_err(y, n, "dataset.positions '%s' is not all or trained", s);
    m->id.trained_only = s && !strcmp(s, "trained");
    if (m->version != tkd_cache_format_version(&m->id))
        return y_err(y, y_get(y, root, "version"), "version %d does not match dataset.packing / dataset.positions "
                     "(version %d)", m->version, tkd_cache_format_version(&m->id));
    TKD_TRY(y_int(y, root, "k", 1, 1, 65535, &k));
    TKD_TRY(y_int(y, root, "tail_samples", 0, 0, 65535, &S));
    TKD_TRY(y_u64(y, root, "tail_seed", &m->tail_seed));
    TKD_TRY(y_scalar(y, root, "logits_dtype", 1, &s, &n));
    if (tkd_cache_dtype_parse(s, &m->id.logits_dtype) != TKD_OK)
        return y_err(y, n, "logits_dtype '%s' is not one of half, bfloat16, float32", s);
    TKD_TRY(y_scalar(y, root, "temperature", 1, &s, &n));
    char *end;
    float t = strtof(s, &end);
    if (end == s || *end || !isfinite(t) || !(t > 0))
        return y_err(y, n, "temperature '%s' must be a finite number > 0", s);
    m->id.vocab_size = v;
    m->id.k = (int32_t)k;
    m->id.seq_len = (int32_t)T;
    m->id.tail_samples = (int32_t)S;
    m->id.temperature = t;
    if (k > v)
        return y_err(y, y_get(y, root, "k"), "k is larger than teacher.vocab_size");
    TKD_TRY(y_str(y, root, "tool_version", 0, &m->tool_version));
    int64_t w = 0;
    TKD_TRY(y_int(y, root, "workers", 0, 0, INT32_MAX, &w));
    m->workers = (int32_t)w;
    return y_str(y, root, "config", 0, &m->config_text);
}

static tkd_status read_shard(yreader *y, yaml_node_t *item, tkd_cache_manifest *m)
{
    if (item->type != YAML_MAPPING_NODE)
        return y_err(y, item, "each entry of 'shards' must be a mapping");
    tkd_cache_shard_entry e;
    memset(&e, 0, sizeof e);
    const char *file;
    yaml_node_t *n;
    int64_t bytes = 0;
    TKD_TRY(y_scalar(y, item, "file", 1, &file, &n));
    if (strlen(file) >= sizeof e.file || strchr(file, '/') || strcmp(file, "..") == 0)
        return y_err(y, n, "shard file '%s' must be a plain file name inside the cache directory", file);
    snprintf(e.file, sizeof e.file, "%s", file);
    TKD_TRY(y_int(y, item, "first_seq", 1, 0, INT64_MAX, &e.first_seq));
    TKD_TRY(y_int(y, item, "num_seq", 1, 1, INT64_MAX, &e.num_seq));
    TKD_TRY(y_int(y, item, "bytes", 1, 0, INT64_MAX, &bytes));
    TKD_TRY(y_digest(y, item, "sha256", e.sha256));
    e.bytes = (uint64_t)bytes;
    if (tkd_cache_manifest_add_shard(m, &e) != TKD_OK)
        return y_err(y, item, "%s", tkd_error_msg()); /* y_err formats its arguments before it sets */
    return TKD_OK;
}

static tkd_status read_shards(yreader *y, yaml_node_t *root, tkd_cache_manifest *m)
{
    yaml_node_t *list = y_get(y, root, "shards");
    if (!list || y_is_null(list))
        return TKD_OK; /* a cache with no finished shard yet */
    if (list->type != YAML_SEQUENCE_NODE)
        return y_err(y, list, "'shards' must be a list");
    for (yaml_node_item_t *it = list->data.sequence.items.start; it < list->data.sequence.items.top; it++)
        TKD_TRY(read_shard(y, yaml_document_get_node(&y->doc, *it), m));
    return TKD_OK;
}

static tkd_status read_doc(yreader *y, tkd_cache_manifest *m)
{
    yaml_node_t *root = yaml_document_get_root_node(&y->doc);
    if (!root)
        return tkd_error_set(TKD_ERR_FORMAT, "%s:1:1: empty manifest", y->path);
    if (root->type != YAML_MAPPING_NODE)
        return y_err(y, root, "the manifest must be a mapping of keys");
    TKD_TRY(read_header(y, root, m));
    TKD_TRY(read_identity(y, root, m));
    TKD_TRY(read_shards(y, root, m));
    if (tkd_cache_identity_check(&m->id, y->path) != TKD_OK)
        return TKD_ERR_FORMAT; /* its message names the file and the field */
    return TKD_OK;
}

/* A key given twice would leave one of its values unread: refused, naming both lines. */
static tkd_status duplicate_keys(yreader *y)
{
    const yaml_node_t *first, *second;
    if (!tkd_yaml_duplicate_key(&y->doc, &first, &second))
        return TKD_OK;
    return y_err(y, second, "duplicate key '%s' (first at line %zu)", (const char *)second->data.scalar.value,
                 first->start_mark.line + 1);
}

tkd_status tkd_cache_manifest_parse(tkd_cache_manifest *m, const char *path, const char *text, size_t len)
{
    tkd_cache_manifest_init(m);
    yreader y;
    memset(&y, 0, sizeof y);
    y.path = path;
    yaml_mark_t deep;
    if (tkd_yaml_too_deep(text, len, TKD_YAML_MAX_DEPTH, &deep))
        return tkd_error_set(TKD_ERR_FORMAT, "%s:%zu:%zu: YAML nested deeper than %d levels: not a cache manifest",
                             path, deep.line + 1, deep.column + 1, TKD_YAML_MAX_DEPTH);
    yaml_parser_t p;
    tkd_status st = TKD_OK;
    if (!yaml_parser_initialize(&p))
        return tkd_error_set(TKD_ERR_NOMEM, "%s: cannot start the YAML parser", path);
    yaml_parser_set_input_string(&p, (const unsigned char *)text, len);
    if (!yaml_parser_load(&p, &y.doc)) {
        st = tkd_error_set(TKD_ERR_FORMAT, "%s:%lu:%lu: malformed YAML: %s%s%s", path,
                           (unsigned long)p.problem_mark.line + 1,
                           (unsigned long)p.problem_mark.column + 1,
                           p.problem ? p.problem : "parse error", p.context ? " " : "",
                           p.context ? p.context : "");
    } else {
        st = duplicate_keys(&y);
        if (st == TKD_OK)
            st = read_doc(&y, m);
        yaml_document_delete(&y.doc);
    }
    yaml_parser_delete(&p);
    if (st != TKD_OK)
        tkd_cache_manifest_free(m);
    return st;
}

tkd_status tkd_cache_manifest_read(tkd_cache_manifest *m, const char *path)
{
    void *text = NULL;
    size_t len = 0;
    tkd_cache_manifest_init(m);
    TKD_TRY(tkd_read_input(path, "cache manifest", &text, &len));
    tkd_status st = tkd_cache_manifest_parse(m, path, text, len);
    free(text);
    return st;
}

/* ---- identity, merge, verification ------------------------------------------------------------ */


tkd_status tkd_cache_manifest_check_same(const tkd_cache_manifest *a, const char *a_name,
                                         const tkd_cache_manifest *b, const char *b_name)
{
    /* Identity is content (the sha256 digests inside id), not where the files lived: a moved
     * teacher or dataset directory must not block a resume or a merge. */
    TKD_TRY(tkd_cache_identity_compare(&a->id, a_name, &b->id, b_name));
    const char *field = a->dataset_tokens != b->dataset_tokens      ? "dataset.tokens"
                        : a->stride != b->stride                    ? "dataset.stride"
                        : a->tail_seed != b->tail_seed              ? "tail_seed"
                                                                    : NULL;
    if (field)
        return tkd_error_set(TKD_ERR_MISMATCH, "%s vs %s: %s differs", a_name, b_name, field);
    return TKD_OK;
}

typedef struct merge_item {
    tkd_cache_shard_entry e;
    int part;
} merge_item;

static int merge_cmp(const void *pa, const void *pb)
{
    const merge_item *a = pa, *b = pb;
    return a->e.first_seq < b->e.first_seq ? -1 : a->e.first_seq > b->e.first_seq;
}

tkd_status tkd_cache_manifest_merge(tkd_cache_manifest *out, const tkd_cache_manifest *parts,
                                    int n, const char *const *names)
{
    tkd_cache_manifest_init(out);
    if (n < 1)
        return tkd_error_set(TKD_ERR_INVALID_ARG, "manifest merge: no manifests given");
    int64_t total = 0;
    for (int i = 0; i < n; i++) {
        TKD_TRY(tkd_cache_manifest_check_same(&parts[0], names[0], &parts[i], names[i]));
        total += parts[i].num_shards;
    }
    merge_item *items = malloc((size_t)(total ? total : 1) * sizeof *items);
    if (!items)
        return tkd_error_set(TKD_ERR_NOMEM, "manifest merge: out of memory");
    int64_t c = 0;
    for (int i = 0; i < n; i++)
        for (int64_t j = 0; j < parts[i].num_shards; j++)
            items[c++] = (merge_item){parts[i].shards[j], i};
    qsort(items, (size_t)total, sizeof *items, merge_cmp);
    tkd_status st = tkd_cache_manifest_copy(out, &parts[0]);
    out->num_shards = 0;
    for (int64_t j = 0, end = 0; st == TKD_OK && j < total; j++) {
        const merge_item *it = &items[j];
        if (it->e.first_seq != end)
            st = tkd_error_set(TKD_ERR_MISMATCH,
                               "manifest merge: %s (%s) starts at sequence %lld but the shards before it end at %lld — %s",
                               it->e.file, names[it->part], (long long)it->e.first_seq, (long long)end,
                               it->e.first_seq > end ? "a worker has not finished (gap)" : "two workers overlap");
        else
            st = tkd_cache_manifest_add_shard(out, &it->e);
        end = it->e.first_seq + it->e.num_seq;
    }
    free(items);
    if (st != TKD_OK)
        tkd_cache_manifest_free(out);
    return st;
}

tkd_status tkd_cache_manifest_verify_shard(const char *dir, const tkd_cache_shard_entry *e)
{
    char *path;
    TKD_TRY(tkd_path_join_alloc(&path, dir, e->file));
    char hex[TKD_SHA256_HEX_LEN];
    uint64_t bytes = 0;
    tkd_status st = tkd_file_size(path, &bytes);
    if (st == TKD_OK)
        st = tkd_sha256_file_hex(path, hex);
    if (st == TKD_ERR_NOT_FOUND)
        st = tkd_error_set(st, "%s: listed in the manifest but missing — " TKD_CACHE_REPAIR_HINT, path);
    else if (st == TKD_OK && (bytes != e->bytes || strcmp(hex, e->sha256) != 0))
        st = tkd_error_set(TKD_ERR_CHECKSUM,
                           "%s: %llu bytes with sha256 %.16s..., the manifest lists %llu bytes with %.16s... — the shard is damaged; " TKD_CACHE_REPAIR_HINT,
                           path, (unsigned long long)bytes, hex, (unsigned long long)e->bytes, e->sha256);
    free(path);
    return st;
}
