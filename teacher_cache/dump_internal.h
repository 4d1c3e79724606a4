/* dump_internal.h — helpers shared by dump.c and dump_merge.c (not part of the public API). */
#ifndef TKD_DUMP_INTERNAL_H
#define TKD_DUMP_INTERNAL_H

#include <stdint.h>

#include "common/status.h"
#include "teacher_cache/dump_config.h"

/* Copies the calling thread's error message into buf and returns buf, so a new message can quote
 * the old one (tkd_error_set must not read the buffer it writes). */
const char *tkd_dump_saved_msg(char buf[TKD_ERROR_MSG_MAX]);
/* The previous message, copied into a block-scoped buffer: tkd_error_set(st, "%s — hint", TKD_DUMP_PREV_MSG()). */
#define TKD_DUMP_PREV_MSG() tkd_dump_saved_msg((char[TKD_ERROR_MSG_MAX]){0})

/* The effective config as YAML text (malloc'd into *out, the caller frees). */
tkd_status tkd_dump_config_text(const tkd_dump_config *cfg, char **out);

/* Worker i of n > 1 has finished its range [first, end): writes <output.dir>/worker-<i>.done
 * atomically (no-op for a single worker). merge requires one per worker. */
tkd_status tkd_dump_mark_done(const tkd_dump_config *cfg, int64_t first, int64_t end);

#endif /* TKD_DUMP_INTERNAL_H */
