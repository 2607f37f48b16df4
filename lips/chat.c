/* chat: asks the model a question in the model's own chat format (the chat-template call), then
 * streams its greedy answer. Usage: chat [QUESTION] [MAX_TOKENS] */
#include <stdio.h>
#include <stdlib.h>
#include "symphony.h"

#define MAX_IDS 4096

static int32_t ids[MAX_IDS];
static char messages[1 << 14], prompt[1 << 15], text[1 << 16];

/* `[{"role": "user", "content": QUESTION}]` with QUESTION escaped as a JSON string; -1 if it
   does not fit. */
static int user_message(const char *question, char *out, int cap) {
    static const char head[] = "[{\"role\": \"user\", \"content\": \"", tail[] = "\"}]";
    int n = 0;
    for (const char *c = head; *c; c++) out[n++] = *c;
    for (const unsigned char *c = (const unsigned char *)question; *c; c++) {
        if (n + 8 + (int)sizeof tail >= cap) return -1;
        if (*c == '"' || *c == '\\') {
            out[n++] = '\\';
            out[n++] = (char)*c;
        } else if (*c < 0x20) {
            n += snprintf(out + n, (size_t)(cap - n), "\\u%04x", *c);
        } else {
            out[n++] = (char)*c;
        }
    }
    for (const char *c = tail; *c; c++) out[n++] = *c;
    out[n] = 0;
    return n;
}

int main(int argc, char **argv) {
    const char *question = argc > 1 ? argv[1] : "What is the capital of France?";
    int max_tokens = argc > 2 ? atoi(argv[2]) : 64;
    if (user_message(question, messages, sizeof messages) < 0) {
        fprintf(stderr, "chat: the question is too long\n");
        return 2;
    }
    int len = sym_chat_template(messages, prompt, sizeof prompt - 1);
    if (len < 0 || len >= (int)sizeof prompt) {
        fprintf(stderr, "chat: cannot render the question in the model's chat template (%d)\n", len);
        return 1;
    }
    prompt[len] = 0;
    int n = sym_tokenize(prompt, ids, MAX_IDS); /* no BOS: the template writes its own tokens */
    if (n <= 0 || n + max_tokens > MAX_IDS) {
        fprintf(stderr, "chat: cannot tokenize the prompt (%d)\n", n);
        return 1;
    }
    sym_kv kv = sym_kv_create();
    sym_stream stream; /* the text of each new token, in context (symphony.h) */
    if (sym_stream_start(&stream, ids, n, text, sizeof text) < 0) return 1;
    const int32_t *feed = ids;
    int feed_len = n, total = n;
    for (int step = 0; step < max_tokens; step++) {
        int32_t next = sym_pred_sample(kv, feed, NULL, feed_len, NULL); /* greedy, on the host */
        if (next < 0) {
            fprintf(stderr, "chat: pred failed with %d\n", next);
            return 1;
        }
        if (sym_is_eos(next)) break;
        ids[total++] = next;
        if (sym_stream_push(&stream, ids, total) < 0) return 1;
        feed = &ids[total - 1];
        feed_len = 1;
    }
    if (sym_stream_finish(&stream, ids, total) < 0) return 1;
    sym_send("\n", 1);
    sym_kv_close(kv);
    return 0;
}
