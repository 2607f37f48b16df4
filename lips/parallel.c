/* parallel: the paper's "prefix caching + parallel decoding".
 * Usage: parallel SYSTEM_PROMPT MAX_TOKENS QUERY...
 * The system prompt's KV is computed once and saved as a named file ("prefix/<hash>"), so
 * later processes reuse it. Each query forks it (pages shared, copy-on-write) and all branches
 * decode together: every step submits one pred per branch before waiting, so the branches
 * land in the same batch. Prints "[i] <query + continuation>" per branch. */
#include <stdio.h>
#include <stdlib.h>
#include "symphony.h"

#define MAX_BRANCHES 16
#define MAX_IDS 1024

static int32_t prefix[MAX_IDS];
static int32_t ids[MAX_BRANCHES][MAX_IDS];
static int lens[MAX_BRANCHES];
static int starts[MAX_BRANCHES];
static char text[1 << 14];

static unsigned hash(const char *s) {
    unsigned h = 2166136261u;
    while (*s) h = (h ^ (unsigned char)*s++) * 16777619u;
    return h;
}

int main(int argc, char **argv) {
    if (argc < 4) {
        fprintf(stderr, "usage: parallel SYSTEM_PROMPT MAX_TOKENS QUERY...\n");
        return 2;
    }
    const char *system = argv[1];
    int max_tokens = atoi(argv[2]);
    int branches = argc - 3 > MAX_BRANCHES ? MAX_BRANCHES : argc - 3;
    char name[64];
    snprintf(name, sizeof name, "prefix/%08x", hash(system));

    /* The shared prefix: reuse it when another process already computed it. */
    sym_kv shared = sym_kv_open(name, SYM_KV_CREATE | SYM_KV_EXCLUSIVE);
    int n = sym_tokenize_prompt(system, prefix, MAX_IDS);
    if (shared > 0) {
        fprintf(stderr, "parallel: prefilling %d prefix tokens into %s\n", n, name);
        /* Keep the last prefix token out: each branch feeds it with its query. */
        sym_ticket t = sym_pred_submit_sample(shared, prefix, NULL, n - 1, NULL);
        if (t < 0 || sym_pred_wait_sample(t) < 0) return 1;
    } else if (shared == SYM_EEXIST) {
        shared = sym_kv_open(name, SYM_KV_READ_ONLY);
        fprintf(stderr, "parallel: reusing %s (%d tokens)\n", name, sym_kv_len(shared));
    }
    if (shared < 0) {
        fprintf(stderr, "parallel: cannot open %s: %d\n", name, shared);
        return 1;
    }

    sym_kv kv[MAX_BRANCHES];
    for (int b = 0; b < branches; b++) {
        kv[b] = sym_kv_fork(shared);
        ids[b][0] = prefix[n - 1];
        int q = sym_tokenize(argv[3 + b], &ids[b][1], MAX_IDS - 1 - max_tokens);
        lens[b] = 1 + q;
        starts[b] = 1;
    }
    sym_kv_close(shared);

    int done[MAX_BRANCHES] = {0};
    int fed[MAX_BRANCHES] = {0};  /* tokens of ids[b] already in kv[b] */
    for (int step = 0; step < max_tokens; step++) {
        sym_ticket tickets[MAX_BRANCHES];
        for (int b = 0; b < branches; b++)
            tickets[b] = done[b] ? 0 : sym_pred_submit_sample(kv[b], &ids[b][fed[b]], NULL, lens[b] - fed[b], NULL);
        for (int b = 0; b < branches; b++) {
            if (done[b]) continue;
            int32_t token = sym_pred_wait_sample(tickets[b]);
            if (token < 0) {
                fprintf(stderr, "parallel: branch %d failed with %d\n", b, token);
                return 1;
            }
            fed[b] = lens[b];
            if (sym_is_eos(token)) done[b] = 1;
            else ids[b][lens[b]++] = token;
        }
    }
    for (int b = 0; b < branches; b++) {
        int len = sym_detokenize(&ids[b][starts[b]], lens[b] - starts[b], text, sizeof text - 1);
        if (len < 0) return 1;
        if (len > (int)sizeof text - 1) len = sizeof text - 1;
        char head[16];
        int h = snprintf(head, sizeof head, "[%d] ", b);
        sym_send(head, h);
        sym_send(text, len);
        sym_send("\n", 1);
        sym_kv_close(kv[b]);
    }
    return 0;
}
