/* Constrained decoding through the grammar calls. Receives a grammar kind ("0" JSON schema,
 * "1" regex, "2" Lark) and its source as two messages, then decodes greedily under it after a
 * short prompt (at most argv[1] tokens) and sends the text. With argv[2] "calls", reports the
 * grammar calls' answers instead ("label=value" lines). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "symphony.h"

static char source[1 << 21];
static char text[1 << 16];

static void report(const char *label, int value) {
    char line[96];
    int len = snprintf(line, sizeof line, "%s=%d\n", label, value);
    sym_send(line, len);
}

static int decode(int32_t grammar, int max_tokens, int32_t *out) {
    int32_t ids[64];
    int n = sym_tokenize("Once upon a time", ids, 64);
    sym_kv kv = sym_kv_create();
    sym_sampling sampling = {0};
    sampling.top_p = 1;
    sampling.grammar = grammar;
    int count = 0;
    int32_t token = sym_pred_sample(kv, ids, 0, n, &sampling);
    while (token >= 0 && !sym_is_eos(token) && count < max_tokens) {
        out[count++] = token;
        if (sym_grammar_state(grammar) & SYM_GRAMMAR_MUST_END) break;
        token = sym_pred_sample(kv, &token, 0, 1, &sampling);
    }
    sym_kv_close(kv);
    return token < 0 ? token : count;
}

int main(int argc, char **argv) {
    char kind_text[8] = {0};
    if (sym_recv(kind_text, sizeof kind_text - 1) < 0) return 2;
    int length = sym_recv(source, sizeof source - 1);
    if (length < 0) return 2;
    source[length] = 0;
    int32_t grammar = __sym_grammar_new(atoi(kind_text), source, length);
    if (argc > 2 && strcmp(argv[2], "calls") == 0) {
        report("new", grammar > 0);
        int32_t tokens[256];
        int count = decode(grammar, 200, tokens);
        report("decoded", count > 0);
        report("state-after", sym_grammar_state(grammar));
        int32_t fork = sym_grammar_fork(grammar);
        report("fork", fork > 0 && fork != grammar);
        report("rollback", sym_grammar_rollback(grammar, count));
        report("state-rolled-back", sym_grammar_state(grammar));
        report("accept-all", sym_grammar_accept(grammar, tokens, count));
        report("state-accepted", sym_grammar_state(grammar) == sym_grammar_state(fork));
        report("accept-refused", sym_grammar_accept(grammar, tokens, 1));
        report("rollback-too-far", sym_grammar_rollback(grammar, 100000));
        report("close", sym_grammar_close(grammar));
        report("state-closed", sym_grammar_state(grammar));
        report("close-fork", sym_grammar_close(fork));
        report("bad-kind", __sym_grammar_new(7, "x", 1));
        report("not-a-schema", __sym_grammar_new(0, "{", 1));
        report("bad-handle-in-sampling", decode(999, 4, tokens));
        return 0;
    }
    if (grammar < 0) {
        report("grammar-new", grammar);
        return 0;
    }
    int32_t tokens[4096];
    int count = decode(grammar, argc > 1 ? atoi(argv[1]) : 256, tokens);
    if (count < 0) {
        report("decode", count);
        return 0;
    }
    int bytes = sym_detokenize(tokens, count, text, sizeof text - 1);
    sym_send(text, bytes < (int)sizeof text ? bytes : (int)sizeof text - 1);
    return 0;
}
