/* beam: beam search with forks.
 * Usage: beam PROMPT [WIDTH] [STEPS]
 * Each beam is a KV file; every step asks each beam for its top WIDTH tokens (all in flight
 * together, one batch), keeps the WIDTH best continuations by total log-probability, and forks
 * the parents' KV files for them (pages shared, copy-on-write). Prints the best beam. */
#include <stdio.h>
#include <stdlib.h>
#include "symphony.h"

#define MAX_WIDTH 8
#define MAX_LEN 512

typedef struct {
    sym_kv kv;          /* holds every token but `tokens[len - 1]`, which is fed next */
    int32_t tokens[MAX_LEN];
    int len;
    double score;
} beam_t;

static beam_t beams[MAX_WIDTH], next[MAX_WIDTH];
static int32_t prompt[MAX_LEN];
static char text[1 << 14];

typedef struct { int parent; int32_t token; double score; } cand_t;

/* Best first; ties by parent, then by the parent's ranking of the token. */
static int better(const cand_t *a, int ai, const cand_t *b, int bi) {
    if (a->score != b->score) return a->score > b->score;
    return ai < bi;
}

int main(int argc, char **argv) {
    const char *text_in = argc > 1 ? argv[1] : "Once upon a time";
    int width = argc > 2 ? atoi(argv[2]) : 3;
    int steps = argc > 3 ? atoi(argv[3]) : 12;
    if (width < 1 || width > MAX_WIDTH) return 2;
    int n = sym_tokenize_prompt(text_in, prompt, MAX_LEN);
    if (n < 1 || n + steps + 1 > MAX_LEN) return 2;

    /* One beam holding the prompt but its last token. */
    int live = 1;
    beams[0].kv = sym_kv_create();
    if (n > 1) {
        sym_ticket t = sym_pred_submit_sample(beams[0].kv, prompt, NULL, n - 1, NULL);
        if (t < 0 || sym_pred_wait_sample(t) < 0) return 1;
    }
    for (int i = 0; i < n; i++) beams[0].tokens[i] = prompt[i];
    beams[0].len = n;
    beams[0].score = 0;

    for (int step = 0; step < steps; step++) {
        sym_ticket tickets[MAX_WIDTH];
        for (int b = 0; b < live; b++)
            tickets[b] = sym_pred_submit_topk(beams[b].kv, &beams[b].tokens[beams[b].len - 1], NULL, 1, width);
        cand_t cands[MAX_WIDTH * MAX_WIDTH];
        int nc = 0;
        for (int b = 0; b < live; b++) {
            int32_t ids[MAX_WIDTH];
            float lp[MAX_WIDTH];
            int k = sym_pred_wait_topk(tickets[b], ids, lp, width);
            if (k < 0) {
                fprintf(stderr, "beam: pred failed with %d\n", k);
                return 1;
            }
            for (int j = 0; j < k; j++) {
                cands[nc].parent = b;
                cands[nc].token = ids[j];
                cands[nc].score = beams[b].score + lp[j];
                nc++;
            }
        }
        /* Select the best `width` candidates (stable selection sort). */
        int chosen[MAX_WIDTH * MAX_WIDTH] = {0};
        int keep = nc < width ? nc : width;
        for (int i = 0; i < keep; i++) {
            int best = -1;
            for (int c = 0; c < nc; c++)
                if (!chosen[c] && (best < 0 || better(&cands[c], c, &cands[best], best))) best = c;
            chosen[best] = 1;
            beam_t *parent = &beams[cands[best].parent];
            next[i].kv = sym_kv_fork(parent->kv);
            for (int t = 0; t < parent->len; t++) next[i].tokens[t] = parent->tokens[t];
            next[i].tokens[parent->len] = cands[best].token;
            next[i].len = parent->len + 1;
            next[i].score = cands[best].score;
        }
        for (int b = 0; b < live; b++) sym_kv_close(beams[b].kv);
        for (int i = 0; i < keep; i++) beams[i] = next[i];
        live = keep;
    }
    int len = sym_detokenize(beams[0].tokens, beams[0].len, text, sizeof text - 1);
    if (len > (int)sizeof text - 1) len = sizeof text - 1;
    sym_send(text, len);
    char tail[64];
    int t = snprintf(tail, sizeof tail, "\nscore %.4f\n", beams[0].score);
    sym_send(tail, t);
    for (int b = 0; b < live; b++) sym_kv_close(beams[b].kv);
    return 0;
}
