/* agent: a tool-using agent whose every action is valid by construction. Each step the model
 * writes one JSON action under a grammar (the grammar system calls): {"tool": "calculator" or
 * "docs", "input": ...} or {"answer": ...}. A tool's action runs the operator's tool inside the
 * server (the `tool` call) and its output goes back into the same KV file as an observation;
 * an answer ends the run. Nothing is parsed that the grammar did not allow, so the program
 * needs no retry for malformed output.
 * Usage: agent [QUESTION] [MAX_STEPS]      Sends "action: JSON", "observation: ..." and
 * "answer: ..." lines (or "no answer" after MAX_STEPS). */
#include "gallery.h"

#define MAX_ACTION_TOKENS 120

static const char ACTION_SCHEMA[] =
    "{\"anyOf\": ["
    "{\"type\": \"object\", \"additionalProperties\": false, \"required\": [\"tool\", \"input\"],"
    " \"properties\": {\"tool\": {\"enum\": [\"calculator\", \"docs\"]},"
    " \"input\": {\"type\": \"string\", \"maxLength\": 60}}},"
    "{\"type\": \"object\", \"additionalProperties\": false, \"required\": [\"answer\"],"
    " \"properties\": {\"answer\": {\"type\": \"string\", \"maxLength\": 200}}}]}";

static const char INSTRUCTIONS[] =
    "Answer the question. Each step, write one JSON action: {\"tool\": \"calculator\", \"input\": "
    "\"an arithmetic expression\"}, {\"tool\": \"docs\", \"input\": \"a topic\"}, or {\"answer\": "
    "\"the final answer\"}.";

static int32_t ids[TEXT_MAX_IDS];
static char messages[1 << 13], prompt[1 << 14], action[4096], value[512], tool_name[64], output[2048], line[4096];

/* Writes `s` as a JSON string body (no quotes) at out; returns the bytes written, -1 if full. */
static int json_escape(const char *s, char *out, int cap) {
    int n = 0;
    for (const unsigned char *c = (const unsigned char *)s; *c; c++) {
        if (n + 8 >= cap) return -1;
        if (*c == '"' || *c == '\\') { out[n++] = '\\'; out[n++] = (char)*c; }
        else if (*c < 0x20) n += snprintf(out + n, (size_t)(cap - n), "\\u%04x", *c);
        else out[n++] = (char)*c;
    }
    out[n] = 0;
    return n;
}

/* The string value of "key" in the action (JSON the grammar allowed), unescaped into out. */
static int field(const char *json, const char *key, char *out, int cap) {
    char pattern[32];
    snprintf(pattern, sizeof pattern, "\"%s\":", key);
    const char *at = strstr(json, pattern);
    if (!at) return -1;
    at += strlen(pattern);
    while (*at == ' ') at++;
    if (*at++ != '"') return -1;
    int n = 0;
    for (; *at && *at != '"' && n < cap - 1; at++) {
        if (*at == '\\' && at[1]) {
            at++;
            out[n++] = *at == 'n' ? '\n' : *at == 't' ? '\t' : *at;  /* (\uXXXX kept as is) */
        } else {
            out[n++] = *at;
        }
    }
    out[n] = 0;
    return n;
}

/* Feeds tokens into the KV file (their KV computed; the next token is not wanted). */
static void feed(sym_kv kv, const int32_t *tokens, int n) {
    if (n > 0) check(sym_pred_sample(kv, tokens, NULL, n, NULL), "feed");
}

int main(int argc, char **argv) {
    const char *question = argc > 1 ? argv[1] : "What is 12 times 7?";
    int max_steps = argc > 2 ? atoi(argv[2]) : 4;
    char escaped[1024], instructions[1024];
    if (json_escape(question, escaped, sizeof escaped) < 0 || json_escape(INSTRUCTIONS, instructions, sizeof instructions) < 0) {
        fprintf(stderr, "agent: the question is too long\n");
        return 2;
    }
    snprintf(messages, sizeof messages, "[{\"role\": \"system\", \"content\": \"%s\"}, {\"role\": \"user\", "
             "\"content\": \"%s\"}]", instructions, escaped);
    int len = sym_chat_template(messages, prompt, sizeof prompt - 1);
    if (len == SYM_EUNSUPPORTED)  /* a model without a chat template: plain text */
        len = snprintf(prompt, sizeof prompt, "%s\nQuestion: %s\n", INSTRUCTIONS, question);
    if (len < 0 || len >= (int)sizeof prompt) {
        fprintf(stderr, "agent: cannot render the prompt (%d)\n", len);
        return 1;
    }
    prompt[len] = 0;
    int n = check(sym_tokenize(prompt, ids, TEXT_MAX_IDS), "tokenize");
    sym_kv kv = check(sym_kv_create(), "kv_create");
    int32_t pristine = check(sym_grammar_new(SYM_GRAMMAR_JSON_SCHEMA, ACTION_SCHEMA), "grammar_new");
    feed(kv, ids, n - 1);  /* the prompt but its last token: that one comes with the first draw */
    int32_t last = ids[n - 1];
    for (int step = 0; step < max_steps; step++) {
        int32_t grammar = check(sym_grammar_fork(pristine), "grammar_fork");
        sym_sampling sampling = {0};
        sampling.top_p = 1;
        sampling.grammar = grammar;
        int count = 0;
        int32_t token = last;
        while (count < MAX_ACTION_TOKENS) {  /* one action: until the grammar is complete */
            token = check(sym_pred_sample(kv, &token, NULL, 1, &sampling), "pred");
            if (sym_is_eos(token)) break;
            ids[count++] = token;
            if (sym_grammar_state(grammar) & SYM_GRAMMAR_MUST_END) break;
        }
        sym_grammar_close(grammar);
        if (count == 0) {
            sym_send("no answer: the model ended\n", 27);
            return 0;
        }
        int bytes = sym_detokenize(ids, count, action, sizeof action - 1);
        action[bytes < 0 ? 0 : bytes < (int)sizeof action ? bytes : (int)sizeof action - 1] = 0;
        sym_send(line, snprintf(line, sizeof line, "action: %s\n", action));
        last = ids[count - 1];
        if (field(action, "answer", value, sizeof value) >= 0) {
            sym_send(line, snprintf(line, sizeof line, "answer: %s\n", value));
            return 0;
        }
        if (field(action, "tool", tool_name, sizeof tool_name) < 0 || field(action, "input", value, sizeof value) < 0) {
            sym_send("no answer: the action was cut short\n", 36);  /* MAX_ACTION_TOKENS reached */
            return 0;
        }
        int got = sym_tool(tool_name, value, output, sizeof output - 1);
        if (got < 0) got = snprintf(output, sizeof output, "error %d", got);
        output[got < (int)sizeof output ? got : (int)sizeof output - 1] = 0;
        sym_send(line, snprintf(line, sizeof line, "observation: %s\n", output));
        /* The observation joins the text the model reads next, in the same KV file. */
        int m = snprintf(line, sizeof line, "\nObservation: %s\n", output);
        line[m < (int)sizeof line ? m : (int)sizeof line - 1] = 0;
        int k = check(sym_tokenize(line, ids, TEXT_MAX_IDS), "tokenize");
        if (k == 0) continue;
        feed(kv, &last, 1);
        feed(kv, ids, k - 1);
        last = ids[k - 1];
    }
    sym_send("no answer\n", 10);
    return 0;
}
