/* dump_text.h — the dump's dataset: data.paths as token files, or, with data.tokenizer set, as
 * text and JSON Lines files tokenized on the fly exactly as `teacher-dump tokenize` does (same
 * documents, BOS/EOS and order), so a cache made from text equals one made from the tokenized file:
 * the dataset's identity is the sha256 of the token stream either way.
 */
#ifndef TKD_DUMP_TEXT_H
#define TKD_DUMP_TEXT_H

#include "common/status.h"
#include "formats/tokens.h"
#include "teacher_cache/dump_config.h"

/* Opens cfg's dataset into *out (owned by the caller: tkd_tokens_free). Text is tokenized into a
 * NumPy file in a temporary directory under $TMPDIR (else /tmp), loaded, and the directory removed;
 * an id >= vocab (the teacher's) is refused then, naming the text file and line. Messages name
 * data.paths or data.tokenizer. */
tkd_status tkd_dump_open_dataset(const tkd_dump_config *cfg, int64_t vocab, tkd_tokens **out);

#endif /* TKD_DUMP_TEXT_H */
