/* speculative: speculative decoding with a prompt-lookup (n-gram) draft.
 * Usage: speculative [PROMPT] [MAX_TOKENS] [DRAFT]
 * Greedy decoding, but each round guesses the next DRAFT tokens by finding the last two
 * tokens earlier in the text and copying what followed them there (no draft model). One pred
 * appends the pending token and the whole draft and returns the greedy next token after each
 * of them (SYM_PRED_GREEDY_EACH): the draft is accepted up to its first mismatch, plus the
 * model's own token there, and the rejected tail is cut off the KV file (kv_truncate). The
 * output is exactly greedy decoding's (hello's), in fewer pred rounds when the text repeats.
 * DRAFT 0 is plain greedy decoding, one round per token. The counts go to the log. */
#include "gallery.h"

#define NGRAM 2
#define MAX_DRAFT 16

static text_t t;
static int32_t feed[TEXT_MAX_IDS], out[TEXT_MAX_IDS];

/* Up to `k` tokens that followed the latest earlier occurrence of the last NGRAM tokens. */
static int lookup_draft(const int32_t *ids, int n, int32_t *draft, int k) {
    if (n < NGRAM + 1) return 0;
    for (int i = n - NGRAM - 1; i >= 0; i--) {
        if (memcmp(ids + i, ids + n - NGRAM, sizeof(int32_t) * NGRAM) != 0) continue;
        int got = 0;
        while (got < k && i + NGRAM + got < n) { draft[got] = ids[i + NGRAM + got]; got++; }
        return got;
    }
    return 0;
}

int main(int argc, char **argv) {
    const char *prompt = argc > 1 ? argv[1] : "Once upon a time";
    int max_tokens = argc > 2 ? atoi(argv[2]) : 32;
    int max_draft = argc > 3 ? atoi(argv[3]) : 4;
    if (max_draft < 0) max_draft = 0;
    if (max_draft > MAX_DRAFT) max_draft = MAX_DRAFT;
    t.streaming = 1;
    /* (no sum that could overflow: MAX_TOKENS near INT_MAX passed it) */
    if (text_push_str(&t, prompt, 1) < 1 || max_tokens < 0 || max_tokens > TEXT_MAX_IDS - t.n - MAX_DRAFT - 1)
        return 2;
    sym_kv kv = check(sym_kv_create(), "kv_create");

    int pending = t.n;  /* tokens of t not yet in the KV file */
    int generated = 0, rounds = 0, drafted = 0, accepted = 0, done = 0;
    while (!done && generated < max_tokens) {
        int k = max_draft ? lookup_draft(t.ids, t.n, feed + pending, max_draft) : 0;
        memcpy(feed, t.ids + t.n - pending, sizeof(int32_t) * pending);
        int kv_len = check(sym_kv_len(kv), "kv_len");
        check(sym_pred_greedy_each(kv, feed, NULL, pending + k, out, TEXT_MAX_IDS), "pred");
        rounds++;
        drafted += k;
        /* out[pending - 1 + j] is the greedy token after the j-th draft token's predecessor. */
        int j = 0;
        while (j < k && out[pending - 1 + j] == feed[pending + j]) j++;
        accepted += j;
        /* Keep the pending tokens and the accepted draft in the KV; cut the rejected tail. */
        check(sym_kv_truncate(kv, kv_len + pending + j), "kv_truncate");
        for (int i = 0; i <= j && !done; i++) {
            int32_t token = i < j ? feed[pending + i] : out[pending - 1 + j];
            if (sym_is_eos(token)) { done = 1; break; }
            text_push(&t, &token, 1);
            if (++generated == max_tokens) done = 1;
        }
        /* The accepted draft is in the KV already; the model's own last token is not. */
        pending = 1;
    }
    sym_send("\n", 1);
    fprintf(stderr, "speculative: %d tokens in %d pred rounds (%d drafted, %d accepted)\n",
            generated, rounds, drafted, accepted);
    sym_kv_close(kv);
    return 0;
}
