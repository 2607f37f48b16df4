/* hello: the paper's basic autoregressive decoding.
 * Usage: hello [PROMPT] [MAX_TOKENS]
 * Fills a KV file with the prompt, then repeatedly asks for the next-token distribution,
 * picks the most likely token in the guest (argmax), appends it, and streams the text. */
#include <stdio.h>
#include <stdlib.h>
#include "symphony.h"

#define MAX_IDS 4096
#define WINDOW 8 /* tokens of context decoded to stream each new token */

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
    /* Streaming: the text from ids[start] on, decoded, is `decoded` bytes long. The tokenizer
       joins tokens with context, so a new token's text is what it adds to the decode of a
       window of recent tokens (not its decode alone); a whole-text decode per token would cost
       O(length). The window start moves up every WINDOW tokens. */
    int start = n, decoded = 0;
    for (int step = 0; step < max_tokens; step++) {
        int got = sym_pred(kv, feed, NULL, feed_len, dist, vocab);
        if (got < 0) {
            fprintf(stderr, "hello: pred failed with %d\n", got);
            return 1;
        }
        int32_t best = sym_argmax(dist, vocab);
        if (sym_is_eos(best)) break;
        ids[total++] = best;
        if (total - 1 - start >= 2 * WINDOW || start == n) {
            start = total - 1 > WINDOW ? total - 1 - WINDOW : 0;
            decoded = sym_detokenize(ids + start, total - 1 - start, text, sizeof text);
            if (decoded >= 0 && decoded <= (int)sizeof text) decoded = sym_text_settled(text, decoded);
        }
        int now = sym_detokenize(ids + start, total - start, text, sizeof text);
        if (now >= 0 && now <= (int)sizeof text) now = sym_text_settled(text, now); /* a character still coming */
        if (decoded >= 0 && now > decoded && now <= (int)sizeof text)
            sym_send(text + decoded, now - decoded);
        if (now > decoded) decoded = now;
        feed = &ids[total - 1];
        feed_len = 1;
    }
    sym_send("\n", 1);
    sym_kv_close(kv);
    return 0;
}
