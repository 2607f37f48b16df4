/* tool_use: tool calls inside the server, with no client round trip.
 * Usage: tool_use [PROMPT] [MAX_TOKENS]
 * Greedy decoding that watches the text for <read>TOPIC</read> (the operator's `docs` tool)
 * and <calc>EXPRESSION</calc> (the `calculator` tool). When a tag closes, the program calls
 * the tool through the `tool` system call, appends "<result>OUTPUT</result>" to the text (the
 * model reads it with its next pred, into the same KV file) and keeps generating. Tags in the
 * prompt count too: a model too small to write tags itself (stories260K) gets them there. */
#include "gallery.h"

static text_t t;
static char result[4096], call[1024];

static const struct { const char *open, *close, *tool; } TAGS[] = {
    {"<read>", "</read>", "docs"},
    {"<calc>", "</calc>", "calculator"},
};

/* Finds the earliest complete tag in text[from..] (of any kind); runs its tool and appends the
   result. Returns where scanning resumes (the end of the text, after the result: a tool's output
   is never scanned for tags), or -1 if there is none. */
static int run_next_tool(int from) {
    int best = -1;
    char *best_open = NULL, *best_close = NULL;
    for (int k = 0; k < (int)(sizeof TAGS / sizeof TAGS[0]); k++) {
        char *open = strstr(t.bytes + from, TAGS[k].open);
        if (!open || (best_open && open > best_open)) continue;
        char *close = strstr(open + strlen(TAGS[k].open), TAGS[k].close);
        if (!close || close - open - (int)strlen(TAGS[k].open) >= (int)sizeof call) continue;
        best = k, best_open = open, best_close = close;
    }
    if (best < 0) return -1;
    char *arg = best_open + strlen(TAGS[best].open);
    memcpy(call, arg, best_close - arg);
    call[best_close - arg] = 0;
    int len = sym_tool(TAGS[best].tool, call, result, sizeof result - 1);
    if (len < 0) len = snprintf(result, sizeof result, "error %d", len);
    if (len > (int)sizeof result - 1) len = sizeof result - 1;
    result[len] = 0;
    fprintf(stderr, "tool_use: %s(\"%s\") -> \"%s\"\n", TAGS[best].tool, call, result);
    text_push_str(&t, " <result>", 0);
    text_push_str(&t, result, 0);
    text_push_str(&t, "</result>", 0);
    return t.len;
}

int main(int argc, char **argv) {
    const char *prompt = argc > 1 ? argv[1] : "Tom wanted to know about cats. <read>cat</read>";
    int max_tokens = argc > 2 ? atoi(argv[2]) : 40;
    t.streaming = 1;
    if (text_push_str(&t, prompt, 1) < 1) return 2;
    sym_kv kv = check(sym_kv_create(), "kv_create");
    int fed = 0, scan_from = 0;
    for (int step = 0; step < max_tokens; step++) {
        for (int resume; (resume = run_next_tool(scan_from)) >= 0;) scan_from = resume;
        int32_t token = check(sym_pred_sample(kv, t.ids + fed, NULL, t.n - fed, NULL), "pred");
        fed = t.n;
        if (sym_is_eos(token)) break;
        text_push(&t, &token, 1);
    }
    sym_send("\n", 1);
    sym_kv_close(kv);
    return 0;
}
