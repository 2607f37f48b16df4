/* Decode steps in the shape the host takes fast (lip/core_abi.py's pred_fast_shape) and in
 * shapes just outside it, each reported as "label=value" (a token, or an error code). With an
 * argument, decodes until a step fails (a limit) and reports how far it got. */
#include <stdio.h>
#include "symphony.h"

static void report(const char *label, int value) {
    char line[64];
    int len = snprintf(line, sizeof line, "%s=%d\n", label, value);
    sym_send(line, len);
}

int main(int argc, char **argv) {
    int32_t ids[64];
    int n = __sym_tokenize("Once upon a time", 16, 0, ids, 64);
    int h = __sym_kv_create();
    int32_t token = __sym_pred(h, ids, 0, n, SYM_PRED_SAMPLE, 0, 0, 0);
    report("prefill", token);
    if (argc > 1) {  /* "until-error": decode in the fast shape until a step fails */
        int steps = 0;
        while ((token = __sym_pred(h, &token, 0, 1, SYM_PRED_SAMPLE, 0, 0, 0)) >= 0)
            steps++;
        report("steps", steps);
        report("error", token);
        report("length", __sym_kv_len(h));
        return 0;
    }
    for (int i = 0; i < 6; i++) {  /* the fast shape: one token, no positions, greedy, no buffer */
        token = __sym_pred(h, &token, 0, 1, SYM_PRED_SAMPLE, 0, 0, 0);
        report("fast", token);
    }
    int32_t room[4];
    token = __sym_pred(h, &token, 0, 1, SYM_PRED_SAMPLE, 0, room, 4);  /* fast, with a buffer */
    report("fast-buffer", token);
    int ticket = __sym_pred_submit(h, &token, 0, 1, SYM_PRED_SAMPLE, 0);  /* the fast pair */
    token = __sym_pred_wait(ticket, 0, 0);
    report("submit-wait", token);
    report("wait-again", __sym_pred_wait(ticket, 0, 0));
    report("submit-bad-handle", __sym_pred_submit(h + 100, &token, 0, 1, SYM_PRED_SAMPLE, 0));
    ticket = __sym_pred_submit(h, &token, 0, 1, SYM_PRED_SAMPLE, 0);
    report("wait-cap-negative", __sym_pred_wait(ticket, room, -1));  /* the ticket stays */
    token = __sym_pred_wait(ticket, room, 4);
    report("wait-after", token);
    int32_t position = __sym_kv_len(h);
    report("positions", __sym_pred(h, &token, &position, 1, SYM_PRED_SAMPLE, 0, 0, 0));
    report("cap-negative", __sym_pred(h, &token, 0, 1, SYM_PRED_SAMPLE, 0, room, -1));
    report("ids-outside", __sym_pred(h, (const int32_t *)0x7ffffff0, 0, 1, SYM_PRED_SAMPLE, 0, 0, 0));
    report("buffer-outside", __sym_pred(h, &token, 0, 1, SYM_PRED_SAMPLE, 0, (void *)0x7ffffff0, 4));
    int32_t outside[2] = {-1, 1 << 30};
    report("token-negative", __sym_pred(h, &outside[0], 0, 1, SYM_PRED_SAMPLE, 0, 0, 0));
    report("token-past-vocab", __sym_pred(h, &outside[1], 0, 1, SYM_PRED_SAMPLE, 0, 0, 0));
    report("bad-handle", __sym_pred(h + 100, &token, 0, 1, SYM_PRED_SAMPLE, 0, 0, 0));
    report("after", __sym_pred(h, &token, 0, 1, SYM_PRED_SAMPLE, 0, 0, 0) >= 0);
    return 0;
}
