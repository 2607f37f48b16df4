/* The system-call behaviour table (tests/test_system_calls.py), through the core-module ABI: the
 * same calls, in the same order, as tests/python_guests/behaviour.py makes through the component
 * ABI. Sends one line `label=value` per step: a call's result, or its (negative) error code. */
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "symphony.h"

static void report(const char *label, long value) {
    char line[128];
    int n = snprintf(line, sizeof line, "%s=%ld\n", label, value);
    __sym_send(line, n);
}

static void report_text(const char *label, const char *text, int len) {
    char line[512];
    int n = len < 0 ? snprintf(line, sizeof line, "%s=%d\n", label, len)
                    : snprintf(line, sizeof line, "%s=%.*s\n", label, len, text);
    __sym_send(line, n);
}

int main(void) {
    int32_t ids[64];
    char text[256];
    report("vocab-size", __sym_vocab_size());
    report("bos-id", __sym_bos_id());
    report_text("model-name", text, __sym_model_name(text, sizeof text));
    const char *prompt = "Once upon a time";
    int count = __sym_tokenize(prompt, (int32_t)strlen(prompt), 0, ids, 64);
    report("tokenize", count);
    report_text("detokenize", text, __sym_detokenize(ids, count, text, sizeof text));
    int32_t bad = -1;
    report("detokenize-bad-id", __sym_detokenize(&bad, 1, text, sizeof text));

    int h = __sym_kv_create();
    report("kv-len-new", __sym_kv_len(h));
    int token = __sym_pred(h, ids, 0, count, SYM_PRED_SAMPLE, 0, 0, 0);
    report("pred-greedy", token);
    report("kv-len", __sym_kv_len(h));
    int fork = __sym_kv_fork(h);
    report("kv-fork-len", __sym_kv_len(fork));
    int part = __sym_kv_extract(h, 0, 3);
    report("kv-extract-len", __sym_kv_len(part));
    report("kv-extract-outside", __sym_kv_extract(h, 2, 1000));
    int merged = __sym_kv_merge(part, part);
    report("kv-merge-len", __sym_kv_len(merged));
    report("kv-truncate", __sym_kv_truncate(fork, 2));
    report("kv-truncated-len", __sym_kv_len(fork));
    report("kv-close", __sym_kv_close(fork));
    report("kv-len-closed", __sym_kv_len(fork));
    report("kv-close-again", __sym_kv_close(fork));
    report("pred-closed", __sym_pred(fork, ids, 0, 1, SYM_PRED_SAMPLE, 0, 0, 0));
    report("kv-open-create", __sym_kv_open("table/doc", 9, SYM_KV_CREATE) > 0);
    report("kv-open-exclusive", __sym_kv_open("table/doc", 9, SYM_KV_CREATE | SYM_KV_EXCLUSIVE));
    report("kv-remove", __sym_kv_remove("table/doc", 9));
    report("kv-open-missing", __sym_kv_open("table/doc", 9, 0));
    report("kv-open-dot-dot", __sym_kv_open("../x", 4, SYM_KV_CREATE));
    report("kv-remove-foreign", __sym_kv_remove("@bob/secret", 11));
    report("kv-hint-bad-flags", __sym_kv_hint(h, 4, -1, 0));
    report("kv-hint", __sym_kv_hint(h, SYM_HINT_PINNED, 1000, 1));
    report("kv-truncate-past-end", __sym_kv_truncate(h, 1000));

    int32_t next[1] = {token};
    struct { int32_t ids[3]; float logprobs[3]; } top;
    int ticket = __sym_pred_submit(h, next, 0, 1, SYM_PRED_TOPK, 3);
    report("pred-wait-top-k", __sym_pred_wait(ticket, &top, 6));
    report("top-k-first", top.ids[0]);
    report("pred-wait-again", __sym_pred_wait(ticket, &top, 6));
    report("pred-wait-unknown", __sym_pred_wait(999, &top, 6));
    int32_t out_of_vocab[1] = {1 << 20};
    report("pred-bad-token", __sym_pred(h, out_of_vocab, 0, 1, SYM_PRED_SAMPLE, 0, 0, 0));
    int32_t gap[1] = {5000};
    report("pred-position-gap", __sym_pred(h, next, gap, 1, SYM_PRED_SAMPLE, 0, 0, 0));
    report("pred-after-errors", __sym_pred(h, next, 0, 1, SYM_PRED_SAMPLE, 0, 0, 0) >= 0);
    /* min-p and a repetition penalty (a sym_sampling_more after the record) */
    int penalized_kv = __sym_kv_create();
    sym_sampling_ext penalty = {{.top_p = 1.0f, .has_seed = SYM_SAMPLING_MORE}, {0, 1e6f, &token, 1, 0, 0}};
    int second = __sym_pred(penalized_kv, ids, 0, count, SYM_PRED_SAMPLE, (int32_t)(intptr_t)&penalty, 0, 0);
    report("pred-penalized", second);
    sym_sampling_ext min_p = {{.temperature = 1.0f, .top_p = 1.0f, .has_seed = SYM_SAMPLING_SEED | SYM_SAMPLING_MORE,
                               .seed = 1}, {1.0f, 1.0f, 0, 0, 0, 0}};
    report("pred-min-p-one", __sym_pred(penalized_kv, &second, 0, 1, SYM_PRED_SAMPLE, (int32_t)(intptr_t)&min_p, 0, 0));
    penalty.more.repetition_penalty = 0;
    report("pred-no-penalty", __sym_pred(penalized_kv, &second, 0, 1, SYM_PRED_SAMPLE, (int32_t)(intptr_t)&penalty, 0, 0));
    /* a sampled token with the model's log-probabilities: its own, then the top 2 ids and theirs */
    sym_sampling_ext scored = {{.top_p = 1.0f, .has_seed = SYM_SAMPLING_MORE}, {0, 1.0f, 0, 0, 1, 2}};
    struct { float logprob; int32_t ids[2]; float logprobs[2]; } answer;
    report("pred-logprobs", __sym_pred(penalized_kv, &second, 0, 1, SYM_PRED_SAMPLE, (int32_t)(intptr_t)&scored,
                                       &answer, 5));
    report("pred-logprob-milli", (int)lroundf(answer.logprob * 1000));
    report("pred-top-logprob-ids", answer.ids[0] * 100000 + answer.ids[1]);
    int scored_ticket = __sym_pred_submit(penalized_kv, &second, 0, 1, SYM_PRED_SAMPLE, (int32_t)(intptr_t)&scored);
    answer.logprob = 0;
    report("pred-wait-logprobs", __sym_pred_wait(scored_ticket, &answer, 5));
    report("pred-wait-logprob-milli", (int)lroundf(answer.logprob * 1000));
    /* the prompt scored: each token after the first, with the top 2 there */
    struct { float scores[3]; int32_t ids[3][2]; float logprobs[3][2]; } scores;
    int scored_kv = __sym_kv_create();
    report("pred-score-each", sym_pred_score_each(scored_kv, ids, 4, 2, &scores, 15));
    report("score-last-milli", (int)lroundf(scores.scores[2] * 1000));
    report("score-last-top", scores.ids[2][0]);
    report("score-each-one-token", sym_pred_score_each(scored_kv, ids, 1, 2, &scores, 15));

    report_text("tool", text, __sym_tool("calculator", 10, "6*7", 3, text, sizeof text));
    report("tool-unknown", __sym_tool("format-disk", 11, "now", 3, text, sizeof text));
    report_text("recv", text, __sym_recv(text, sizeof text));
    report("recv-closed", __sym_recv(text, sizeof text));
    return 0;
}
