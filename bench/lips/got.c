/* got: Graph-of-Thought as one program. BRANCHES thoughts (a power of two) fork one prefill of
 * the prompt, each led by its own seed token, and decode in shared batches; then pairs of
 * nodes are aggregated level by level until one is left: an aggregate forks the first node's
 * KV file (its whole history kept, nothing recomputed), appends the second node's segment and
 * the CONCLUDE ids, and decodes. All aggregates of a level decode in shared batches.
 * Usage: got BRANCHES TOKENS "PROMPT IDS" "SEED IDS (one per branch)" "CONCLUDE IDS"
 * Sends one line of generated ids per node: the thoughts, then each level's aggregates. */
#include "bench_lip.h"

#define MAX_NODES 64

typedef struct {
    seq_t *seq;
    int32_t *seg;  /* the node's tokens after the prompt: seed + thought, or x + y + conclude + answer */
    int n_seg;
} node_t;

static int32_t ids[SEQ_MAX_PENDING], seeds[MAX_NODES], conclude[256];

static void append_seg(node_t *n, const int32_t *src, int count) {
    n->seg = realloc(n->seg, sizeof(int32_t) * (n->n_seg + count));
    memcpy(n->seg + n->n_seg, src, sizeof(int32_t) * count);
    n->n_seg += count;
}

int main(int argc, char **argv) {
    int branches = argc == 6 ? atoi(argv[1]) : 0, tokens = argc == 6 ? atoi(argv[2]) : 0;
    if (branches < 1 || branches > MAX_NODES || (branches & (branches - 1))
        || parse_ids(argv[4], seeds, MAX_NODES) != branches) {
        fprintf(stderr, "usage: got BRANCHES TOKENS \"PROMPT IDS\" \"SEED IDS\" \"CONCLUDE IDS\" (BRANCHES a power of two)\n");
        return 2;
    }
    int n_conclude = parse_ids(argv[5], conclude, 256);
    seq_t *root = seq_new(check(sym_kv_create(), "kv_create")), *batch[MAX_NODES];
    seq_push(root, ids, parse_ids(argv[3], ids, SEQ_MAX_PENDING));
    seq_flush(root);
    node_t level[MAX_NODES] = {{0}};
    for (int b = 0; b < branches; b++) {
        level[b].seq = batch[b] = seq_fork(root);
        seq_push(level[b].seq, &seeds[b], 1);
        append_seg(&level[b], &seeds[b], 1);
    }
    seq_close(root);
    for (int width = branches;; width /= 2) {
        generate(batch, width, tokens);
        for (int i = 0; i < width; i++) {
            send_ids(level[i].seq->out, level[i].seq->n_out);
            append_seg(&level[i], level[i].seq->out, level[i].seq->n_out);
        }
        if (width == 1) break;
        node_t next[MAX_NODES] = {{0}};
        for (int i = 0; i < width / 2; i++) {
            node_t *x = &level[2 * i], *y = &level[2 * i + 1];
            next[i].seq = batch[i] = seq_fork(x->seq);
            seq_push(next[i].seq, y->seg, y->n_seg);
            seq_push(next[i].seq, conclude, n_conclude);
            append_seg(&next[i], x->seg, x->n_seg);
            append_seg(&next[i], y->seg, y->n_seg);
            append_seg(&next[i], conclude, n_conclude);
        }
        for (int i = 0; i < width; i++) { seq_close(level[i].seq); free(level[i].seg); }
        memcpy(level, next, sizeof next);
    }
    seq_close(level[0].seq);
    free(level[0].seg);
    return 0;
}
