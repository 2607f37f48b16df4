/* Decode steps the host's decode lane takes in C (fiber_native.c), and the calls around them that
 * send the guest the ordinary way. Reports "label=value" lines (a token, an error code, a count).
 * Usage: decode_lane MODE [STEPS]
 *   pred N         N blocking greedy preds, then the tokens as one "tokens=..." line
 *   submit-wait N  the same through pred_submit + pred_wait
 *   tickets        a lane ticket, an ordinary call between a lane pred_submit and its wait, a
 *                  second wait on an ended ticket, an ordinary ticket after the lane's
 *   submit-exit    a lane pred_submit the guest never waits for, then exit
 *   spin           decode for ever, computing between steps and reporting every 100th (for a
 *                  limit or a kill to end) */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "symphony.h"

static void report(const char *label, int value) {
    char line[64];
    int len = snprintf(line, sizeof line, "%s=%d\n", label, value);
    sym_send(line, len);
}

static int h;
static int32_t token;

static void step_submit_wait(void) {
    int ticket = __sym_pred_submit(h, &token, 0, 1, SYM_PRED_SAMPLE, 0);
    token = ticket < 0 ? ticket : __sym_pred_wait(ticket, 0, 0);
}

int main(int argc, char **argv) {
    if (argc < 2) return 2;
    const char *mode = argv[1];
    int steps = argc > 2 ? atoi(argv[2]) : 0;
    int32_t ids[64];
    int n = __sym_tokenize("Once upon a time", 16, 0, ids, 64);
    h = __sym_kv_create();
    token = __sym_pred(h, ids, 0, n, SYM_PRED_SAMPLE, 0, 0, 0);
    if (!strcmp(mode, "pred") || !strcmp(mode, "submit-wait")) {
        static char line[16 * 4096];
        int len = snprintf(line, sizeof line, "tokens=%d", token);
        for (int i = 0; i < steps && len < (int)sizeof line - 16; i++) {
            if (mode[0] == 'p')
                token = __sym_pred(h, &token, 0, 1, SYM_PRED_SAMPLE, 0, 0, 0);
            else
                step_submit_wait();
            len += snprintf(line + len, sizeof line - len, " %d", token);
        }
        line[len++] = '\n';
        sym_send(line, len);
        return 0;
    }
    if (!strcmp(mode, "tickets")) {
        for (int i = 0; i < 3; i++)  /* the lane opens on the first pair's wait, takes the rest */
            step_submit_wait();
        int first = __sym_pred_submit(h, &token, 0, 1, SYM_PRED_SAMPLE, 0);
        token = __sym_pred_wait(first, 0, 0);
        report("lane-ticket", first);
        report("lane-token", token);
        int pending = __sym_pred_submit(h, &token, 0, 1, SYM_PRED_SAMPLE, 0);
        report("length-between", __sym_kv_len(h));  /* an ordinary call: the lane closes */
        token = __sym_pred_wait(pending, 0, 0);
        report("pending-ticket", pending);
        report("pending-token", token);
        report("wait-again", __sym_pred_wait(pending, 0, 0));
        int32_t position = __sym_kv_len(h);
        int ordinary = __sym_pred_submit(h, &token, &position, 1, SYM_PRED_SAMPLE, 0);
        report("ordinary-ticket", ordinary);
        report("ordinary-token", __sym_pred_wait(ordinary, 0, 0));
        report("length", __sym_kv_len(h));
        return 0;
    }
    if (!strcmp(mode, "submit-exit")) {
        for (int i = 0; i < 3; i++)
            step_submit_wait();
        report("ticket", __sym_pred_submit(h, &token, 0, 1, SYM_PRED_SAMPLE, 0));
        return 0;
    }
    if (!strcmp(mode, "spin")) {
        report("started", 1);
        volatile uint32_t work = 0;
        for (int step = 1;; step++) {
            step_submit_wait();
            if (token < 0) {
                report("error", token);
                return 0;
            }
            for (int i = 0; i < 20000; i++) work += (uint32_t)i * 2654435761u;
            if (step % 100 == 0) {  /* ordinary calls now and then (the lane reopens after them) */
                report("steps", step);
                __sym_kv_truncate(h, n);
            }
        }
    }
    return 2;
}
