/* complete_ids: plain greedy completion of a prompt given as token ids, the program-path twin
 * of one /v1/completions request (no prefix cache, no stop strings, no log-probabilities).
 * Usage: complete_ids MAX_TOKENS "PROMPT IDS"      Sends the completion's ids as one line. */
#include "bench_lip.h"

static int32_t prompt[SEQ_MAX_PENDING];

int main(int argc, char **argv) {
    if (argc != 3) {
        fprintf(stderr, "usage: complete_ids MAX_TOKENS \"PROMPT IDS\"\n");
        return 2;
    }
    int n = parse_ids(argv[2], prompt, SEQ_MAX_PENDING);
    if (n < 1 || n > SEQ_MAX_PENDING) return 2;
    seq_t *s = seq_new(check(sym_kv_create(), "kv_create"));
    seq_push(s, prompt, n);
    generate_one(s, atoi(argv[1]));
    send_ids(s->out, s->n_out);
    seq_close(s);
    return 0;
}
