/* react_ids: a ReAct agent whose tool calls run inside the server.
 * Usage: react_ids THOUGHT_TOKENS ANSWER_TOKENS "QUESTION IDS" ["ACTION IDS" EXPRESSION] ...
 * The transcript is one KV file: question, then per turn a generated thought, the action's ids
 * (scripted: a random-weight model writes no actions) and the observation, which is the
 * `calculator` tool's output on EXPRESSION, tokenized and appended; then a generated answer.
 * Every token is computed once; a prompt-API client re-sends the transcript every turn and runs
 * the tool itself. Sends one line of ids per thought, then the answer's. */
#include "bench_lip.h"

static int32_t ids[SEQ_MAX_PENDING];

int main(int argc, char **argv) {
    if (argc < 4 || (argc - 4) % 2) {
        fprintf(stderr, "usage: react_ids THOUGHT_TOKENS ANSWER_TOKENS \"QUESTION IDS\" [\"ACTION IDS\" EXPRESSION] ...\n");
        return 2;
    }
    int thought_tokens = atoi(argv[1]), answer_tokens = atoi(argv[2]);
    seq_t *s = seq_new(check(sym_kv_create(), "kv_create"));
    seq_push(s, ids, parse_ids(argv[3], ids, SEQ_MAX_PENDING));
    for (int turn = 4; turn < argc; turn += 2) {
        generate_one(s, thought_tokens);
        send_ids(s->out, s->n_out);
        seq_push(s, ids, parse_ids(argv[turn], ids, SEQ_MAX_PENDING));
        static char observation[1024];
        int len = sym_tool("calculator", argv[turn + 1], observation, sizeof observation - 1);
        if (len < 0) len = snprintf(observation, sizeof observation, "error %d", len);
        if (len > (int)sizeof observation - 1) len = sizeof observation - 1;
        observation[len] = 0;
        seq_push_str(s, observation);
    }
    generate_one(s, answer_tokens);
    send_ids(s->out, s->n_out);
    seq_close(s);
    return 0;
}
