/* config_print.c — a config written back out (config.h): --print-config and config.yaml as YAML
 * that reads back to the same values, and --help derived from the schema. The reader is config.c.
 */
#include "common/config.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <yaml.h>

#include "common/config_internal.h"

/* ---- printing ------------------------------------------------------------------------------- */

/* Shortest %g spelling that reads back to exactly d, with ".0" so it looks like a float. */
static void fmt_double(char *buf, size_t cap, double d)
{
    for (int prec = 15; prec <= 17; prec++) {
        snprintf(buf, cap, "%.*g", prec, d);
        if (strtod(buf, NULL) == d)
            break;
    }
    if (!strpbrk(buf, ".eEn"))
        strncat(buf, ".0", cap - strlen(buf) - 1);
}

static bool emit_scalar(yaml_emitter_t *em, const char *s, yaml_scalar_style_t style)
{
    yaml_event_t ev;
    /* plain style for a null word would read back as null, not as the string */
    if (style == YAML_PLAIN_SCALAR_STYLE && tkd_config_is_null_word(s))
        style = YAML_DOUBLE_QUOTED_SCALAR_STYLE;
    return yaml_scalar_event_initialize(&ev, NULL, NULL, (yaml_char_t *)s, (int)strlen(s), 1, 1,
                                        style) &&
           yaml_emitter_emit(em, &ev);
}

static bool emit_simple(yaml_emitter_t *em, int which)
{
    yaml_event_t ev;
    int ok;
    switch (which) {
    case 0: ok = yaml_mapping_start_event_initialize(&ev, NULL, NULL, 1, YAML_BLOCK_MAPPING_STYLE); break;
    case 1: ok = yaml_mapping_end_event_initialize(&ev); break;
    case 2: ok = yaml_sequence_start_event_initialize(&ev, NULL, NULL, 1, YAML_FLOW_SEQUENCE_STYLE); break;
    default: ok = yaml_sequence_end_event_initialize(&ev); break;
    }
    return ok && yaml_emitter_emit(em, &ev);
}

static bool emit_value(yaml_emitter_t *em, const tkd_config_field *f, const void *cfg)
{
    char buf[64];
    const void *p = tkd_config_field_cptr(f, cfg);
    switch (f->type) {
    case TKD_CONFIG_INT:
        snprintf(buf, sizeof buf, "%d", *(const int *)p);
        return emit_scalar(em, buf, YAML_PLAIN_SCALAR_STYLE);
    case TKD_CONFIG_INT64:
        snprintf(buf, sizeof buf, "%lld", (long long)*(const int64_t *)p);
        return emit_scalar(em, buf, YAML_PLAIN_SCALAR_STYLE);
    case TKD_CONFIG_FLOAT:
        fmt_double(buf, sizeof buf, *(const double *)p);
        return emit_scalar(em, buf, YAML_PLAIN_SCALAR_STYLE);
    case TKD_CONFIG_BOOL:
        return emit_scalar(em, *(const bool *)p ? "true" : "false", YAML_PLAIN_SCALAR_STYLE);
    case TKD_CONFIG_ENUM:
        return emit_scalar(em, f->allowed[*(const int *)p], YAML_PLAIN_SCALAR_STYLE);
    case TKD_CONFIG_STRING: {
        const char *s = *(char *const *)p;
        return emit_scalar(em, s ? s : "", YAML_PLAIN_SCALAR_STYLE);
    }
    case TKD_CONFIG_STRING_LIST: {
        const tkd_strlist *l = p;
        if (!emit_simple(em, 2))
            return false;
        for (size_t i = 0; i < l->n; i++)
            if (!emit_scalar(em, l->items[i], YAML_PLAIN_SCALAR_STYLE))
                return false;
        return emit_simple(em, 3);
    }
    }
    return false;
}

/* Number of leading dotted segments a and b share. */
static int common_segments(const char *a, const char *b)
{
    int n = 0;
    for (size_t i = 0;; i++) {
        if (a[i] != b[i])
            return n;
        if (a[i] == '.')
            n++;
        if (!a[i])
            return n; /* identical keys cannot happen (schema check) */
    }
}

static int count_segments(const char *k)
{
    int n = 1;
    for (; *k; k++)
        n += *k == '.';
    return n;
}

/* Emits the mapping body: opens and closes nested mappings as the dotted keys change. */
static bool emit_fields(yaml_emitter_t *em, const tkd_config_schema *schema, const void *cfg)
{
    const char *prev = NULL;
    int depth = 0; /* open nested mappings beyond the root */
    for (size_t i = 0; i < schema->nfields; i++) {
        const tkd_config_field *f = &schema->fields[i];
        int keep = prev ? common_segments(prev, f->key) : 0;
        for (; depth > keep; depth--)
            if (!emit_simple(em, 1))
                return false;
        const char *seg = f->key;
        for (int s = 0; s < depth; s++)
            seg = strchr(seg, '.') + 1;
        int total = count_segments(f->key);
        for (; depth < total - 1; depth++) {
            char name[KEY_MAX];
            size_t len = strcspn(seg, ".");
            memcpy(name, seg, len);
            name[len] = '\0';
            if (!emit_scalar(em, name, YAML_PLAIN_SCALAR_STYLE) || !emit_simple(em, 0))
                return false;
            seg += len + 1;
        }
        if (!emit_scalar(em, seg, YAML_PLAIN_SCALAR_STYLE) || !emit_value(em, f, cfg))
            return false;
        prev = f->key;
    }
    for (; depth > 0; depth--)
        if (!emit_simple(em, 1))
            return false;
    return true;
}

tkd_status tkd_config_print(const tkd_config_schema *schema, const void *cfg, FILE *out)
{
    yaml_emitter_t em;
    yaml_event_t ev;
    if (!yaml_emitter_initialize(&em))
        return tkd_error_set(TKD_ERR_NOMEM, "cannot initialise the YAML emitter");
    yaml_emitter_set_output_file(&em, out);
    yaml_emitter_set_unicode(&em, 1);
    yaml_emitter_set_width(&em, -1);
    fprintf(out, "# effective config of %s (topkd %s)\n", schema->tool ? schema->tool : "topkd",
            TKD_VERSION);
    bool ok = yaml_stream_start_event_initialize(&ev, YAML_UTF8_ENCODING) &&
              yaml_emitter_emit(&em, &ev) &&
              yaml_document_start_event_initialize(&ev, NULL, NULL, NULL, 1) &&
              yaml_emitter_emit(&em, &ev) && emit_simple(&em, 0) && emit_fields(&em, schema, cfg) &&
              emit_simple(&em, 1) && yaml_document_end_event_initialize(&ev, 1) &&
              yaml_emitter_emit(&em, &ev) && yaml_stream_end_event_initialize(&ev) &&
              yaml_emitter_emit(&em, &ev) && yaml_emitter_flush(&em);
    const char *problem = em.problem;
    yaml_emitter_delete(&em);
    if (!ok)
        return tkd_error_set(TKD_ERR_IO, "printing the config failed: %s",
                             problem ? problem : "write error");
    if (fflush(out) != 0 || ferror(out))
        return tkd_error_set(errno == ENOSPC ? TKD_ERR_NOSPACE : TKD_ERR_IO,
                             "printing the config failed: %s", strerror(errno));
    return TKD_OK;
}

tkd_status tkd_config_to_text(const tkd_config_schema *schema, const void *cfg, char **out)
{
    size_t len = 0;
    *out = NULL;
    FILE *f = open_memstream(out, &len);
    if (!f)
        return tkd_error_set(TKD_ERR_NOMEM, "out of memory printing the config");
    tkd_status st = tkd_config_print(schema, cfg, f);
    /* fclose is what sizes and terminates *out; if it fails the text may be cut short */
    if (fclose(f) != 0 && st == TKD_OK)
        st = tkd_error_set(TKD_ERR_NOMEM, "out of memory printing the config");
    if (st != TKD_OK) {
        free(*out);
        *out = NULL;
    }
    return st;
}

static void help_default(char *buf, size_t cap, const tkd_config_field *f)
{
    const char *d = f->def ? f->def : "";
    if (*d)
        snprintf(buf, cap, "%s", d);
    else
        snprintf(buf, cap, "%s", f->type == TKD_CONFIG_STRING_LIST ? "[]" : "\"\"");
}

void tkd_config_print_help(const tkd_config_schema *schema, FILE *out)
{
    fprintf(out, "Config keys of %s (YAML file via --config FILE; override with --set key=value):\n",
            schema->tool ? schema->tool : "topkd");
    for (size_t i = 0; i < schema->nfields; i++) {
        const tkd_config_field *f = &schema->fields[i];
        char def[256], extra[600] = "";
        help_default(def, sizeof def, f);
        if (f->ranged) {
            char lo[64], hi[64];
            tkd_config_fmt_num(lo, sizeof lo, f->min, tkd_config_is_int_type(f->type));
            tkd_config_fmt_num(hi, sizeof hi, f->max, tkd_config_is_int_type(f->type));
            snprintf(extra, sizeof extra, ", range [%s, %s]", lo, hi);
        } else if (f->type == TKD_CONFIG_ENUM) {
            size_t na = 0;
            while (f->allowed[na])
                na++;
            char list[512];
            tkd_config_join_names(list, sizeof list, f->allowed, na);
            snprintf(extra, sizeof extra, ", one of: %s", list);
        }
        fprintf(out, "  %s  (%s, default %s%s)\n      %s\n", f->key, tkd_config_type_name(f->type),
                def, extra, f->help ? f->help : "");
    }
}
