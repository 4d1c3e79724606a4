/* tokenizer_load_internal.h — what the parts of the tokenizer.json reader share while loading:
 * the loading state, messages naming a field by its JSON path, and typed field lookups
 * (tokenizer_json.c); the byte-level alphabet and the model's tables (tokenizer_model.c).
 * tokenizer.c reads the rest of the file and tokenizer_config.json. Only those files include it.
 */
#ifndef TKD_TOKENIZER_LOAD_INTERNAL_H
#define TKD_TOKENIZER_LOAD_INTERNAL_H

#include <cjson/cJSON.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "formats/tokenizer_internal.h"

/* The loading state: the tokenizer being filled and what reading it needs. */
typedef struct loader {
    tkd_tokenizer *tok;
    const char *path;   /* tokenizer.json, for messages */
    int16_t char_byte[324];
    size_t bytes_cap;
} loader;

/* A field's JSON path for messages: where.key (key alone at the top level), where.key[i]. */
typedef struct jpath {
    char s[256];
} jpath;

/* Every field read is checked for its type (tokenizer_json.c), so that a file Hugging Face refuses (serde) is not
 * read with a default in its place. cJSON type bits name the types a field may have. */
#define J_BOOL (cJSON_True | cJSON_False)

/* Messages and typed fields (tokenizer_json.c). */
jpath tkd_tokjson_at_key(const char *where, const char *key);
jpath tkd_tokjson_at_index(const char *where, const char *key, int i);
tkd_status tkd_tokjson_refuse(const loader *L, const char *field, const char *what);
tkd_status tkd_tokjson_malformed(const loader *L, const char *field, const char *what);
const char *tkd_tokjson_kind(const cJSON *v);
tkd_status tkd_tokjson_get_typed(const char *file, const cJSON *obj, const char *where, const char *key, int types,
                                 const char *want, const cJSON **out);
tkd_status tkd_tokjson_get_required(const char *file, const cJSON *obj, const char *where, const char *key,
                                    int types, const char *want, const cJSON **out);
bool tkd_tokjson_id_value(const cJSON *v, uint32_t *id);
tkd_status tkd_tokjson_bad_id(const char *file, const cJSON *v, const char *field);
tkd_status tkd_tokjson_id(const char *file, const cJSON *v, const char *field, uint32_t *id);
tkd_status tkd_tokjson_flag(const loader *L, const cJSON *obj, const char *where, const char *key, bool dflt,
                            bool *out);
tkd_status tkd_tokjson_want_off(const loader *L, const cJSON *obj, const char *where, const char *key, int types,
                                const char *want);
tkd_status tkd_tokjson_known_keys(const loader *L, const cJSON *obj, const char *where, const char *const *keys);
tkd_status tkd_tokjson_node_type(const loader *L, const cJSON *node, const char *where, const char **type);
typedef tkd_status (*node_fn)(loader *L, const cJSON *node, const char *where);
tkd_status tkd_tokjson_each_member(loader *L, const cJSON *node, const char *where, const char *list_key,
                                   node_fn fn);
tkd_status tkd_tokjson_refuse_type(const loader *L, const char *field, const char *type);
tkd_status tkd_tokjson_read(const char *path, bool integers_only, cJSON **out);

/* The byte-level alphabet and the model's tables (tokenizer_model.c). */
void tkd_tokmodel_byte_alphabet(int16_t char_byte[324]);
long tkd_tokmodel_byte_level_decode(const int16_t char_byte[324], const char *s, uint8_t *out);
tkd_status tkd_tokmodel_load(loader *L, const cJSON *model, const cJSON *added);
tkd_status tkd_tokmodel_load_added(loader *L, const cJSON *added);

#endif
