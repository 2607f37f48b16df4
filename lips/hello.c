/* hello: the paper's basic autoregressive decoding.
 * Usage: hello [PROMPT] [MAX_TOKENS]
 * Fills a KV file with the prompt, then repeatedly asks for the next-token distribution,
 * picks the most likely token in the guest (argmax), appends it, and streams the text. */
#include <stdio.h>
#include <stdlib.h>
#include "symphony.h"

#define MAX_IDS 4096

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
    sym_stream stream; /* the text of each new token, in context (symphony.h) */
    if (sym_stream_start(&stream, ids, n, text, sizeof text) < 0) return 1;
    for (int step = 0; step < max_tokens; step++) {
        int got = sym_pred(kv, feed, NULL, feed_len, dist, vocab);
        if (got < 0) {
            fprintf(stderr, "hello: pred failed with %d\n", got);
            return 1;
        }
        int32_t best = sym_argmax(dist, vocab);
        if (sym_is_eos(best)) break;
        ids[total++] = best;
        if (sym_stream_push(&stream, ids, total) < 0) return 1;
        feed = &ids[total - 1];
        feed_len = 1;
    }
    if (sym_stream_finish(&stream, ids, total) < 0) return 1;
    sym_send("\n", 1);
    sym_kv_close(kv);
    return 0;
}
