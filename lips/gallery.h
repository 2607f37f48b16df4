/* gallery.h: small helpers shared by the gallery programs in lips/ (on top of symphony.h).
 * A `text_t` holds a token sequence and streams its text: the whole sequence is detokenized
 * after each append (a character may span tokens) and only the new bytes are sent. */
#ifndef GALLERY_H
#define GALLERY_H

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "symphony.h"

#define TEXT_MAX_IDS 4096
#define TEXT_MAX_BYTES (1 << 15)

typedef struct {
    int32_t ids[TEXT_MAX_IDS];
    int n;          /* tokens in ids */
    int sent;       /* bytes of the text already sent (when streaming) */
    int streaming;  /* send new text as tokens arrive */
    char bytes[TEXT_MAX_BYTES];
    int len;        /* bytes of the current text */
} text_t;

/* Re-decodes the sequence into t->bytes (NUL-terminated); sends what is new when streaming. */
static inline void text_refresh(text_t *t) {
    int len = sym_detokenize(t->ids, t->n, t->bytes, TEXT_MAX_BYTES - 1);
    if (len < 0) len = 0;
    if (len > TEXT_MAX_BYTES - 1) len = TEXT_MAX_BYTES - 1;
    t->bytes[len] = 0;
    t->len = len;
    if (t->streaming && len > t->sent) {
        sym_send(t->bytes + t->sent, len - t->sent);
        t->sent = len;
    }
}

/* Appends tokens; returns 0, or -1 when the buffer is full. */
static inline int text_push(text_t *t, const int32_t *ids, int n) {
    if (t->n + n > TEXT_MAX_IDS) return -1;
    memcpy(t->ids + t->n, ids, sizeof(int32_t) * n);
    t->n += n;
    text_refresh(t);
    return 0;
}

/* Tokenizes `s` (with BOS when `prompt`) and appends it; returns how many tokens, or < 0. */
static inline int text_push_str(text_t *t, const char *s, int prompt) {
    int n = prompt ? sym_tokenize_prompt(s, t->ids + t->n, TEXT_MAX_IDS - t->n)
                   : sym_tokenize(s, t->ids + t->n, TEXT_MAX_IDS - t->n);
    if (n < 0 || t->n + n > TEXT_MAX_IDS) return -1;
    t->n += n;
    text_refresh(t);
    return n;
}

/* Fails the program with a message on a negative result. */
static inline int32_t check(int32_t result, const char *what) {
    if (result < 0) {
        fprintf(stderr, "%s failed with error %d\n", what, result);
        exit(1);
    }
    return result;
}

#endif /* GALLERY_H */
