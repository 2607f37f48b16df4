/* fork: shared-prefix parallel generation. The prefix is computed once, each branch forks it
 * (pages shared copy-on-write), appends its own suffix and decodes; every step submits one pred
 * per branch before waiting, so all branches share each batch.
 * Usage: fork MAX_TOKENS "PREFIX IDS" "SUFFIX IDS" ...   Sends one line of ids per branch, in order. */
#include "bench_lip.h"

#define MAX_BRANCHES 64
static int32_t ids[SEQ_MAX_PENDING];

int main(int argc, char **argv) {
    int branches = argc - 3;
    if (branches < 1 || branches > MAX_BRANCHES) {
        fprintf(stderr, "usage: fork MAX_TOKENS \"PREFIX IDS\" \"SUFFIX IDS\" ... (1 to %d suffixes)\n", MAX_BRANCHES);
        return 2;
    }
    seq_t *root = seq_new(check(sym_kv_create(), "kv_create")), *seqs[MAX_BRANCHES];
    seq_push(root, ids, parse_ids(argv[2], ids, SEQ_MAX_PENDING));
    seq_flush(root);
    for (int b = 0; b < branches; b++) {
        seqs[b] = seq_fork(root);
        int n = parse_ids(argv[3 + b], ids, SEQ_MAX_PENDING);
        if (n < 1) return 2;
        seq_push(seqs[b], ids, n);
    }
    seq_close(root);
    generate(seqs, branches, atoi(argv[1]));
    for (int b = 0; b < branches; b++) {
        send_ids(seqs[b]->out, seqs[b]->n_out);
        seq_close(seqs[b]);
    }
    return 0;
}
