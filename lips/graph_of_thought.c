/* graph_of_thought: Graph-of-Thought with forks and merges.
 * Usage: graph_of_thought [PROMPT] [BRANCHES] [TOKENS] [CONCLUSION_TOKENS]
 * Generate: the prompt is prefilled once into a root KV file, and BRANCHES thoughts fork it
 * (pages shared copy-on-write); every step submits one top-k pred per thought before waiting,
 * so the thoughts share batches, and each samples from its top 8 with its own seed.
 * Score: a thought's score is the mean log-probability of its tokens.
 * Aggregate: the best thought's KV file and the second best's thought tokens (kv_extract)
 * are merged (kv_merge) without recomputing either, and a conclusion is decoded greedily
 * from the merged file. Sends one line per thought, the merge, and the conclusion. */
#include <math.h>
#include "gallery.h"

#define MAX_BRANCHES 8
#define TOP_K 8

static text_t prompt, thought[MAX_BRANCHES], conclusion;
static char line[TEXT_MAX_BYTES + 64];

typedef struct { sym_kv kv; int32_t pending; double logprob; int tokens; int done; uint64_t rng; } branch_t;

static double uniform(uint64_t *state) {
    *state = *state * 6364136223846793005ull + 1442695040888963407ull;
    return (double)(*state >> 11) / (double)(1ull << 53);
}

int main(int argc, char **argv) {
    const char *text = argc > 1 ? argv[1] : "Lily wanted to find her lost ball.";
    int branches = argc > 2 ? atoi(argv[2]) : 4;
    int steps = argc > 3 ? atoi(argv[3]) : 12;
    int conclusion_tokens = argc > 4 ? atoi(argv[4]) : 12;
    if (branches < 2 || branches > MAX_BRANCHES || text_push_str(&prompt, text, 1) < 2) return 2;

    /* One prefill for everyone: all of the prompt but its last token, fed by each thought. */
    sym_kv root = check(sym_kv_create(), "kv_create");
    check(sym_pred_sample(root, prompt.ids, NULL, prompt.n - 1, NULL), "prefill");
    branch_t b[MAX_BRANCHES];
    for (int i = 0; i < branches; i++) {
        b[i] = (branch_t){.kv = check(sym_kv_fork(root), "kv_fork"), .pending = prompt.ids[prompt.n - 1],
                          .rng = 1000 + i};
    }
    int plen = check(sym_kv_len(root), "kv_len");
    sym_kv_close(root);

    /* Generate, all thoughts in the same batches. */
    int32_t ids[TOP_K];
    float logprobs[TOP_K];
    for (int step = 0; step < steps; step++) {
        sym_ticket tickets[MAX_BRANCHES];
        for (int i = 0; i < branches; i++)
            tickets[i] = b[i].done ? 0 : check(sym_pred_submit_topk(b[i].kv, &b[i].pending, NULL, 1, TOP_K), "pred");
        for (int i = 0; i < branches; i++) {
            if (b[i].done) continue;
            int k = check(sym_pred_wait_topk(tickets[i], ids, logprobs, TOP_K), "pred_wait");
            double total = 0, u;
            for (int j = 0; j < k; j++) total += exp(logprobs[j]);
            u = uniform(&b[i].rng) * total;
            int pick = 0;
            while (pick < k - 1 && (u -= exp(logprobs[pick])) > 0) pick++;
            if (sym_is_eos(ids[pick])) { b[i].done = 1; continue; }
            b[i].logprob += logprobs[pick];
            b[i].tokens++;
            b[i].pending = ids[pick];
            if (text_push(&thought[i], &ids[pick], 1) < 0) b[i].done = 1;  /* its buffer is full */
        }
    }

    /* Score and rank. */
    /* An empty thought (end of text at once) ranks last. */
    int best = -1, second = -1;
    double score[MAX_BRANCHES];
    for (int i = 0; i < branches; i++) {
        score[i] = b[i].tokens ? b[i].logprob / b[i].tokens : -1e9;
        int len = snprintf(line, sizeof line, "thought %d (score %.3f): %s\n", i, score[i], thought[i].bytes);
        sym_send(line, len);
        if (best < 0 || score[i] > score[best]) { second = best; best = i; }
        else if (second < 0 || score[i] > score[second]) second = i;
    }

    /* Aggregate: best thought (with the prompt) + the second's thought tokens, no recompute.
       First both files take their last (pending) token, in one batch. */
    sym_ticket t1 = check(sym_pred_submit_sample(b[best].kv, &b[best].pending, NULL, 1, NULL), "pred");
    sym_ticket t2 = check(sym_pred_submit_sample(b[second].kv, &b[second].pending, NULL, 1, NULL), "pred");
    check(sym_pred_wait_sample(t1), "pred_wait");
    check(sym_pred_wait_sample(t2), "pred_wait");
    int best_len = check(sym_kv_len(b[best].kv), "kv_len");
    int second_len = check(sym_kv_len(b[second].kv), "kv_len");
    sym_kv part = check(sym_kv_extract(b[second].kv, plen, second_len), "kv_extract");
    sym_kv merged = check(sym_kv_merge(b[best].kv, part), "kv_merge");
    sym_kv_close(part);
    int merged_len = check(sym_kv_len(merged), "kv_len");
    int len = snprintf(line, sizeof line, "merge: thoughts %d + %d -> %d tokens (%d + %d)\n", best, second,
                       merged_len, best_len, second_len - plen);
    sym_send(line, len);

    /* Conclude from the merged graph node. */
    int32_t feed[8];
    int n_feed = check(sym_tokenize(" So", feed, 8), "tokenize");
    for (int i = 0; i < conclusion_tokens; i++) {
        int32_t token = check(sym_pred_sample(merged, feed, NULL, n_feed, NULL), "pred");
        n_feed = 1;
        feed[0] = token;
        if (sym_is_eos(token) || text_push(&conclusion, &token, 1) < 0) break;
    }
    len = snprintf(line, sizeof line, "conclusion: %s\n", conclusion.bytes);
    sym_send(line, len);
    sym_kv_close(merged);
    for (int i = 0; i < branches; i++) sym_kv_close(b[i].kv);
    return 0;
}
