/* chat_internal.h — what chat.c (opening) and chat_encode.c (records) share: the opened template. */
#ifndef TKD_CHAT_INTERNAL_H
#define TKD_CHAT_INTERNAL_H

#include <jansson.h>

#include "formats/chat.h"
#include "formats/jinja.h"

struct tkd_chat {
    const tkd_tokenizer *tok;
    tkd_jinja_template *tmpl;
    json_t *base;       /* the context every render starts from: special tokens, then kwargs */
    long long now;      /* strftime_now's clock (< 0: the system's) */
    char source[4300];  /* where the template came from */
};

#endif /* TKD_CHAT_INTERNAL_H */
