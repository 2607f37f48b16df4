/* react: a ReAct agent loop (Thought / Action / Observation) inside the server.
 * Usage: react QUESTION [TOOL:INPUT ...]
 * Each turn the model writes a thought; an action "Action: TOOL[INPUT]" in it is run with the
 * `tool` system call, and the observation is appended to the same KV file, so the transcript
 * is computed once, token by token, instead of re-sent and re-prefilled every turn as through
 * a prompt API. A model too small to write actions (stories260K) gets them from the arguments:
 * when a thought names no action, the next TOOL:INPUT argument is taken. After the last
 * action the model writes the final answer. Sends the transcript; the log has each step. */
#include "gallery.h"

#define THOUGHT_TOKENS 16
#define ANSWER_TOKENS 16

static text_t t;
static char tool[64], input[512], observation[1024];
static sym_kv kv;
static int fed;

/* Greedy tokens until a newline or `max` tokens. */
static void generate(int max) {
    int start = t.len;
    for (int i = 0; i < max; i++) {
        int32_t token = check(sym_pred_sample(kv, t.ids + fed, NULL, t.n - fed, NULL), "pred");
        fed = t.n;
        if (sym_is_eos(token)) return;
        text_push(&t, &token, 1);
        if (strchr(t.bytes + start, '\n')) return;
    }
}

/* "Action: TOOL[INPUT]" in text -> tool, input. */
static int parse_action(const char *text) {
    const char *a = strstr(text, "Action: ");
    if (!a || sscanf(a, "Action: %63[a-z_][%511[^]]]", tool, input) != 2) return 0;
    return 1;
}

int main(int argc, char **argv) {
    if (argc < 2) {
        fprintf(stderr, "usage: react QUESTION [TOOL:INPUT ...]\n");
        return 2;
    }
    kv = check(sym_kv_create(), "kv_create");
    text_push_str(&t, "Question: ", 1);
    text_push_str(&t, argv[1], 0);
    int next_arg = 2;
    for (int step = 1;; step++) {
        text_push_str(&t, "\nThought:", 0);
        int thought = t.len;
        generate(THOUGHT_TOKENS);
        if (!parse_action(t.bytes + thought)) {
            if (next_arg >= argc) break;
            const char *colon = strchr(argv[next_arg], ':');
            if (!colon || colon - argv[next_arg] >= (int)sizeof tool) return 2;
            memcpy(tool, argv[next_arg], colon - argv[next_arg]);
            tool[colon - argv[next_arg]] = 0;
            snprintf(input, sizeof input, "%s", colon + 1);
            next_arg++;
            char action[640];
            snprintf(action, sizeof action, "\nAction: %s[%s]", tool, input);
            text_push_str(&t, action, 0);
        }
        int len = sym_tool(tool, input, observation, sizeof observation - 1);
        if (len < 0) len = snprintf(observation, sizeof observation, "error %d", len);
        if (len > (int)sizeof observation - 1) len = sizeof observation - 1;
        observation[len] = 0;
        fprintf(stderr, "react: step %d: %s[%s] -> %s\n", step, tool, input, observation);
        text_push_str(&t, "\nObservation: ", 0);
        text_push_str(&t, observation, 0);
    }
    text_push_str(&t, "\nFinal answer:", 0);
    generate(ANSWER_TOKENS);
    sym_send(t.bytes, t.len);
    sym_send("\n", 1);
    fprintf(stderr, "react: transcript of %d tokens, %d in the KV file, each computed once\n", t.n,
            check(sym_kv_len(kv), "kv_len"));
    sym_kv_close(kv);
    return 0;
}
