/* hello: the paper's basic autoregressive decoding.
 * Usage: hello [PROMPT] [MAX_TOKENS]
 * Fills a KV file with the prompt, then repeatedly asks for the next-token distribution,
 * picks the most likely token in the guest (argmax), appends it, and streams the text. */
#include <stdio.h>
#include <stdlib.h>
#include "symphony.h"

#define MAX_IDS 4096
#define WINDOW 8 /* about how many tokens of context are decoded to stream each new one */

static int32_t ids[MAX_IDS];
static float dist[1 << 18];
static char text[1 << 16];

int main(int argc, char **argv) {
    const char *prompt = argc > 1 ? argv[1] : "Once upon a time";
    int max_tokens = argc > 2 ? atoi(argv[2]) : 32;
    int vocab = sym_vocab_size();
    if (vocab <= 0 || vocab > (int)(sizeof dist / sizeof dist[0])) {
        fprintf(stderr, "hello: vocabulary of %d does not fit\n", vocab);
        return 1;
    }
    int n = sym_tokenize_prompt(prompt, ids, MAX_IDS);
    if (n < 0 || n + max_tokens > MAX_IDS) {
        fprintf(stderr, "hello: cannot tokenize the prompt (%d)\n", n);
        return 1;
    }
    sym_kv kv = sym_kv_create();
    int printed = sym_detokenize(ids, n, text, sizeof text);
    sym_send(text, printed < (int)sizeof text ? printed : (int)sizeof text);
    const int32_t *feed = ids;
    int feed_len = n, total = n;
    /* Streaming: the text from ids[prefix] on, decoded, of which `sent` bytes went out. Decoding
       from a recent token gives a new token its context (spaces, byte pieces) at the cost of a
       few tokens, not of the whole text. Every WINDOW tokens `prefix` moves up to `mark`, an
       earlier token that starts a character (the text before it decoded whole). A character
       whose tokens have not all come decodes as U+FFFD until complete: it is held back (and
       sent at the end, if it never completes). */
    int prefix = n > 0 ? n - 1 : 0, mark = prefix;
    int sent = sym_detokenize(ids + prefix, n - prefix, text, sizeof text), now = sent;
    for (int step = 0; step < max_tokens && sent >= 0; step++) {
        int got = sym_pred(kv, feed, NULL, feed_len, dist, vocab);
        if (got < 0) {
            fprintf(stderr, "hello: pred failed with %d\n", got);
            return 1;
        }
        int32_t best = sym_argmax(dist, vocab);
        if (sym_is_eos(best)) break;
        ids[total++] = best;
        now = sym_detokenize(ids + prefix, total - prefix, text, sizeof text);
        if (now < 0 || now > (int)sizeof text) break;
        int settled = sym_text_settled(text, now);
        if (settled > sent) sym_send(text + sent, settled - sent);
        if (settled > sent) sent = settled;
        if (settled == now) { /* whole: a character starts at ids[total] */
            if (total - prefix >= 2 * WINDOW) {
                prefix = mark;
                sent = now = sym_detokenize(ids + prefix, total - prefix, text, sizeof text);
            }
            mark = total;
        }
        feed = &ids[total - 1];
        feed_len = 1;
    }
    if (sent >= 0 && now > sent) { /* a character that never completed */
        now = sym_detokenize(ids + prefix, total - prefix, text, sizeof text);
        if (now > sent && now <= (int)sizeof text) sym_send(text + sent, now - sent);
    }
    sym_send("\n", 1);
    sym_kv_close(kv);
    return 0;
}
