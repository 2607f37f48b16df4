/* bench_lip.h: helpers shared by the benchmark LIPs in bench/lips/ (on top of symphony.h).
 *
 * Token ids come in as arguments, written as decimal ids separated by spaces or commas, so a
 * program and a prompt-path client can be handed exactly the same tokens. Generated ids go
 * out as one line of decimal ids per segment ("12 7 391\n"). Decoding is greedy on the host
 * and stops at the model's end-of-sequence token, as the OpenAI path does at temperature 0.
 *
 * A `seq_t` is one KV file plus the tokens not yet fed to it: `seq_push` queues tokens, and a
 * generation step feeds the queue in the same pred that predicts the next token. */
#ifndef BENCH_LIP_H
#define BENCH_LIP_H

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "symphony.h"

#define SEQ_MAX_PENDING 8192

typedef struct {
    sym_kv kv;
    int32_t pending[SEQ_MAX_PENDING];
    int n_pending;
    int32_t out[SEQ_MAX_PENDING];  /* the latest segment generate() wrote */
    int n_out;
    int done;
    sym_ticket ticket;
} seq_t;

static inline int32_t check(int32_t result, const char *what) {
    if (result < 0) {
        fprintf(stderr, "%s failed with error %d\n", what, result);
        exit(1);
    }
    return result;
}

/* Parses ids from text; returns how many (at most cap are written). */
static inline int parse_ids(const char *s, int32_t *out, int cap) {
    int n = 0;
    while (*s) {
        char *end;
        long v = strtol(s, &end, 10);
        if (end == s) { s++; continue; }
        if (n < cap) out[n] = (int32_t)v;
        n++;
        s = end;
    }
    return n;
}

static inline void send_ids(const int32_t *ids, int n) {
    static char line[SEQ_MAX_PENDING * 8 + 2];
    int at = 0;
    for (int i = 0; i < n; i++) at += snprintf(line + at, sizeof line - at, i ? " %d" : "%d", ids[i]);
    line[at++] = '\n';
    sym_send(line, at);
}

static inline seq_t *seq_new(sym_kv kv) {
    seq_t *s = calloc(1, sizeof(seq_t));
    if (!s) { fprintf(stderr, "out of memory\n"); exit(1); }
    s->kv = kv;
    return s;
}

static inline void seq_push(seq_t *s, const int32_t *ids, int n) {
    if (s->n_pending + n > SEQ_MAX_PENDING) { fprintf(stderr, "sequence too long\n"); exit(1); }
    memcpy(s->pending + s->n_pending, ids, sizeof(int32_t) * n);
    s->n_pending += n;
}

static inline void seq_push_str(seq_t *s, const char *text) {
    static int32_t ids[SEQ_MAX_PENDING];
    int n = check(sym_tokenize(text, ids, SEQ_MAX_PENDING), "tokenize");
    seq_push(s, ids, n < SEQ_MAX_PENDING ? n : SEQ_MAX_PENDING);
}

/* Feeds the pending tokens without predicting (their KV is computed; the output is dropped). */
static inline void seq_flush(seq_t *s) {
    if (!s->n_pending) return;
    check(sym_pred_sample(s->kv, s->pending, NULL, s->n_pending, NULL), "prefill");
    s->n_pending = 0;
}

/* Greedy decoding of up to `max` tokens on every sequence at once: each step submits one pred
 * per live sequence before waiting, so they share the engine's batches. Each sequence's
 * segment lands in its `out`; its last token stays pending (not yet in the KV file). */
static inline void generate(seq_t **seqs, int n, int max) {
    for (int i = 0; i < n; i++) { seqs[i]->n_out = 0; seqs[i]->done = max <= 0; }
    for (int step = 0; step < max; step++) {
        int live = 0;
        for (int i = 0; i < n; i++) {
            seq_t *s = seqs[i];
            if (s->done) continue;
            s->ticket = check(sym_pred_submit_sample(s->kv, s->pending, NULL, s->n_pending, NULL), "pred");
            s->n_pending = 0;
            live++;
        }
        if (!live) break;
        for (int i = 0; i < n; i++) {
            seq_t *s = seqs[i];
            if (s->done) continue;
            int32_t token = check(sym_pred_wait_sample(s->ticket), "pred_wait");
            if (sym_is_eos(token)) { s->done = 1; continue; }
            s->out[s->n_out++] = token;
            s->pending[s->n_pending++] = token;
            if (s->n_out == max) s->done = 1;
        }
    }
}

static inline void generate_one(seq_t *s, int max) { generate(&s, 1, max); }

/* A new sequence over a fork of s's file, carrying s's pending tokens. */
static inline seq_t *seq_fork(const seq_t *s) {
    seq_t *f = seq_new(check(sym_kv_fork(s->kv), "kv_fork"));
    seq_push(f, s->pending, s->n_pending);
    return f;
}

static inline void seq_close(seq_t *s) {
    sym_kv_close(s->kv);
    free(s);
}

#endif /* BENCH_LIP_H */
