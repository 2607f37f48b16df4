/* self_consistency: ask once, answer K times, keep the answer most branches agree on.
 * Usage: self_consistency QUESTION K [MAX_TOKENS] [TEMPERATURE] [SEED]
 * The question's KV is computed once; K forks of it each sample a short answer (a grammar holds
 * it to a few words: letters, digits and spaces), every step one pred per live branch submitted
 * before any is awaited, so all K share each batch. The answers are compared once trimmed and
 * lowercased; sends "[i] answer" per branch, then "vote: ANSWER (n of K)", the first most
 * frequent one (ties to the lowest branch). */
#include <ctype.h>
#include "gallery.h"

#define MAX_BRANCHES 16
#define MAX_ANSWER_TOKENS 24
#define ANSWER_REGEX "[A-Za-z0-9][A-Za-z0-9 ]{0,40}"

static int32_t prompt[TEXT_MAX_IDS];
static int32_t answer[MAX_BRANCHES][MAX_ANSWER_TOKENS + 1];
static int lens[MAX_BRANCHES], done[MAX_BRANCHES];
static char texts[MAX_BRANCHES][256], keys[MAX_BRANCHES][256], line[512];

/* The answer as it is compared: without the spaces around it, lowercased. */
static void normalize(const char *text, char *key, int cap) {
    while (*text == ' ') text++;
    int n = 0;
    for (; *text && n < cap - 1; text++) key[n++] = (char)tolower((unsigned char)*text);
    while (n > 0 && key[n - 1] == ' ') n--;
    key[n] = 0;
}

int main(int argc, char **argv) {
    if (argc < 3) {
        fprintf(stderr, "usage: self_consistency QUESTION K [MAX_TOKENS] [TEMPERATURE] [SEED]\n");
        return 2;
    }
    int k = atoi(argv[2]);
    if (k < 1 || k > MAX_BRANCHES) k = k < 1 ? 1 : MAX_BRANCHES;
    int max_tokens = argc > 3 ? atoi(argv[3]) : 12;
    if (max_tokens < 1 || max_tokens > MAX_ANSWER_TOKENS) max_tokens = MAX_ANSWER_TOKENS;
    float temperature = argc > 4 ? (float)atof(argv[4]) : 1.0f;
    uint64_t seed = argc > 5 ? (uint64_t)atoll(argv[5]) : 0;

    int n = check(sym_tokenize_prompt(argv[1], prompt, TEXT_MAX_IDS), "tokenize");
    if (n < 1) return 2;
    sym_kv root = check(sym_kv_create(), "kv_create");
    if (n > 1) check(sym_pred_sample(root, prompt, NULL, n - 1, NULL), "prefill");  /* the last comes per branch */
    int32_t pristine = check(sym_grammar_new(SYM_GRAMMAR_REGEX, ANSWER_REGEX), "grammar_new");
    sym_kv kv[MAX_BRANCHES];
    int32_t grammar[MAX_BRANCHES];
    for (int b = 0; b < k; b++) {
        kv[b] = check(sym_kv_fork(root), "kv_fork");
        grammar[b] = check(sym_grammar_fork(pristine), "grammar_fork");
    }
    sym_ticket tickets[MAX_BRANCHES];
    for (int step = 0; step < max_tokens; step++) {
        int live = 0;
        for (int b = 0; b < k; b++) {  /* every live branch's pred first: they share the batch */
            if (done[b]) continue;
            sym_sampling s = {0};
            s.temperature = temperature;
            s.top_p = 1;
            s.has_seed = 1;
            s.seed = seed + (uint64_t)b * 1000003u + (uint64_t)step;
            s.grammar = grammar[b];
            const int32_t *feed = step == 0 ? &prompt[n - 1] : &answer[b][lens[b] - 1];
            tickets[b] = check(sym_pred_submit_sample(kv[b], feed, NULL, 1, &s), "pred_submit");
            live++;
        }
        if (!live) break;
        for (int b = 0; b < k; b++) {
            if (done[b]) continue;
            int32_t token = check(sym_pred_wait_sample(tickets[b]), "pred_wait");
            if (sym_is_eos(token)) { done[b] = 1; continue; }
            answer[b][lens[b]++] = token;
            if ((sym_grammar_state(grammar[b]) & SYM_GRAMMAR_MUST_END) || lens[b] == max_tokens) done[b] = 1;
        }
    }
    int best = 0, best_votes = 0;
    for (int b = 0; b < k; b++) {
        int bytes = sym_detokenize(answer[b], lens[b], texts[b], sizeof texts[b] - 1);
        texts[b][bytes < 0 ? 0 : bytes < (int)sizeof texts[b] ? bytes : (int)sizeof texts[b] - 1] = 0;
        normalize(texts[b], keys[b], sizeof keys[b]);
        sym_send(line, snprintf(line, sizeof line, "[%d] %s\n", b, keys[b]));
    }
    for (int b = 0; b < k; b++) {
        int votes = 0;
        for (int c = 0; c < k; c++) votes += strcmp(keys[b], keys[c]) == 0;
        if (votes > best_votes) { best = b; best_votes = votes; }
    }
    sym_send(line, snprintf(line, sizeof line, "vote: %s (%d of %d)\n", keys[best], best_votes, k));
    for (int b = 0; b < k; b++) { sym_kv_close(kv[b]); sym_grammar_close(grammar[b]); }
    sym_grammar_close(pristine);
    sym_kv_close(root);
    return 0;
}
