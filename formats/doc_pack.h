/* doc_pack.h — sequences made of whole documents (data.packing: documents), the alternative to
 * cutting the token stream into windows that run across document boundaries (tokens.h).
 *
 * The documents are the ones the dataset records (tkd_tokens_num_docs / doc_start: a Megatron index,
 * or the flags sidecar teacher-dump tokenize writes); every file of the dataset must record them.
 * Packing, in dataset order and so the same on every machine and every run:
 *   - a document of n ≤ T tokens is one piece; a longer one is cut into pieces of T tokens (the last
 *     shorter), each starting its own context (it attends to nothing before it);
 *   - pieces fill sequences of T positions greedily: a piece joins the current sequence when it
 *     fits, else the sequence is closed (its remaining positions padded) and the piece starts the
 *     next one;
 *   - position i's label is the next token of the same document, or −100 (TKD_TOKENS_IGNORE_LABEL)
 *     where the document ends (its last token predicts nothing: the next token is another
 *     document's) and on padding; a piece cut from a longer document keeps the label of its last
 *     position (the document's next token);
 *   - with a flags sidecar (tokens.h), a label whose token is not marked trained is −100 too;
 *   - doc[i] is the position in the sequence where position i's piece starts (what
 *     tkd_model_forward_docs takes); padding is one more piece, its tokens −100 (as the cache's
 *     /tokens marks padding: a model input reads them as token 0).
 *
 * Memory: 16 bytes a piece (pieces ≤ documents + tokens / T), built once when the dataset opens.
 */
#ifndef TKD_DOC_PACK_H
#define TKD_DOC_PACK_H

#include <stdint.h>

#include "common/status.h"
#include "formats/tokens.h"

/* data.packing's values, indexed by tkd_packing (NULL-terminated: the configs' enum list). */
typedef enum tkd_packing {
    TKD_PACKING_STREAM = 0,    /* windows of the token stream, across documents (tokens.h) */
    TKD_PACKING_DOCUMENTS = 1, /* whole documents, this file */
} tkd_packing;
extern const char *const tkd_packing_names[];

typedef struct tkd_doc_pack tkd_doc_pack;

/* Packs ds's documents into sequences of seq_len positions. TKD_ERR_CONFIG naming data.packing and
 * the file when a file records no documents. On success *out is owned by the caller
 * (tkd_doc_pack_free) and refers to ds, which must outlive it. */
tkd_status tkd_doc_pack_build(const tkd_tokens *ds, int seq_len, tkd_doc_pack **out);
void tkd_doc_pack_free(tkd_doc_pack *p); /* NULL is a no-op */

/* Sequences, documents packed, and positions that hold a label (not −100). */
int64_t tkd_doc_pack_count(const tkd_doc_pack *p);
int64_t tkd_doc_pack_docs(const tkd_doc_pack *p);
int64_t tkd_doc_pack_labels(const tkd_doc_pack *p);

/* Sequence i (one reader at a time per pack: it reads the flags through a scratch buffer): tokens
 * (seq_len + 1) — the inputs, then the last position's label (−100 when it has
 * none) — labels (seq_len) and doc (seq_len), as the file comment says; labels and doc may be NULL.
 * *n_valid (optional): labels that are not −100. TKD_ERR_INVALID_ARG when i is out of range. */
tkd_status tkd_doc_pack_read(const tkd_doc_pack *p, int64_t i, int32_t *tokens, int32_t *labels, int32_t *doc,
                             int *n_valid);

#endif /* TKD_DOC_PACK_H */
