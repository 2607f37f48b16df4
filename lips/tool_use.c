/* tool_use: tool calls inside the server, with no client round trip.
 * Usage: tool_use [PROMPT] [MAX_TOKENS]
 * Greedy decoding that watches the text for <read>TOPIC</read> (the operator's `docs` tool)
 * and <calc>EXPRESSION</calc> (the `calculator` tool). When a tag closes, the program calls
 * the tool through the `tool` system call, appends "<result>OUTPUT</result>" to the text (the
 * model reads it with its next pred, into the same KV file) and keeps generating. Tags in the
 * prompt count too, each in turn: a model too small to write tags itself (stories260K) gets
 * them there. A result is never scanned for tags. */
#include "gallery.h"

static text_t t;
static char result[4096], call[1024];

static const struct { const char *open, *close, *tool; } TAGS[] = {
    {"<read>", "</read>", "docs"},
    {"<calc>", "</calc>", "calculator"},
};

/* The tools' results in the text, [from, to) byte ranges: never scanned for tags. */
#define MAX_RESULTS 64
static int result_from[MAX_RESULTS], result_to[MAX_RESULTS], results;

static int in_a_result(int at) {
    for (int i = 0; i < results; i++)
        if (result_from[i] <= at && at < result_to[i]) return i;
    return -1;
}

/* The first `needle` in text[from..] outside the results (NULL if none). */
static char *find_outside_results(int from, const char *needle) {
    for (;;) {
        char *found = strstr(t.bytes + from, needle);
        if (!found) return NULL;
        int inside = in_a_result(found - t.bytes);
        if (inside < 0) return found;
        from = result_to[inside];
    }
}

/* Finds the earliest complete tag in text[from..] (of any kind, outside the tools' results);
   runs its tool and appends the result. Returns where scanning resumes (just after the tag:
   a later tag in the prompt runs next), or -1 if there is none. */
static int run_next_tool(int from) {
    int best = -1;
    char *best_open = NULL, *best_close = NULL;
    for (int k = 0; k < (int)(sizeof TAGS / sizeof TAGS[0]); k++) {
        char *open = find_outside_results(from, TAGS[k].open);
        if (!open || (best_open && open > best_open)) continue;
        char *arg = open + strlen(TAGS[k].open);
        char *close = find_outside_results(arg - t.bytes, TAGS[k].close);
        if (!close || close - arg >= (int)sizeof call) continue;
        int spans_a_result = 0;  /* a tag opened before a result and closed after it is not one */
        for (int i = 0; i < results; i++)
            spans_a_result |= arg - t.bytes <= result_from[i] && result_from[i] < close - t.bytes;
        if (spans_a_result) continue;
        best = k, best_open = open, best_close = close;
    }
    if (best < 0) return -1;
    char *arg = best_open + strlen(TAGS[best].open);
    memcpy(call, arg, best_close - arg);
    call[best_close - arg] = 0;
    int resume = best_close + strlen(TAGS[best].close) - t.bytes;
    int len = sym_tool(TAGS[best].tool, call, result, sizeof result - 1);
    if (len < 0) len = snprintf(result, sizeof result, "error %d", len);
    if (len > (int)sizeof result - 1) len = sizeof result - 1;
    result[len] = 0;
    fprintf(stderr, "tool_use: %s(\"%s\") -> \"%s\"\n", TAGS[best].tool, call, result);
    int start = t.len;
    if (results == MAX_RESULTS || text_push_str(&t, " <result>", 0) < 0 || text_push_str(&t, result, 0) < 0
        || text_push_str(&t, "</result>", 0) < 0)
        return -1;  /* no room for more: no more tools */
    result_from[results] = start, result_to[results] = t.len, results++;
    return resume;
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
        if (sym_is_eos(token) || text_push(&t, &token, 1) < 0) break;
    }
    sym_send("\n", 1);
    sym_kv_close(kv);
    return 0;
}
