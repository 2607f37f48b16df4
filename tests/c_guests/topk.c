/* Sends the top-k ids of the next token after its argument (k = argv[2]), as int32s, by the
 * blocking call and by a ticket. */
#include <stdlib.h>
#include "symphony.h"

static int32_t ids[4096], top[4096];
static float logprobs[4096];

int main(int argc, char **argv) {
    int k = argc > 2 ? atoi(argv[2]) : 1;
    int n = sym_tokenize_prompt(argc > 1 ? argv[1] : "Once", ids, 4096);
    if (n <= 0 || n > 4096 || k > 4096) return 1;
    sym_kv a = sym_kv_create(), b = sym_kv_create();
    int got = sym_pred_topk(a, ids, NULL, n, k, top, logprobs);
    if (got < 0) return 2;
    sym_send((const char *)top, 4 * got);
    got = sym_pred_wait_topk(sym_pred_submit_topk(b, ids, NULL, n, k), top, logprobs, k);
    if (got < 0) return 3;
    sym_send((const char *)top, 4 * got);
    return 0;
}
