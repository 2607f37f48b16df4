/* Streams a text's tokens as lips/hello.c streams what it generates (sym_stream): the first K
 * tokens (argv[2], default 1) play the prompt, sent whole; the rest come one at a time. Usage:
 * stream TEXT [K], or stream --ids 1,2,3 [K]. What it sends, joined, must be one decode of all. */
#include <stdlib.h>
#include <string.h>
#include "symphony.h"

static int32_t ids[4096];
static char text[1 << 16];

int main(int argc, char **argv) {
    int n = 0;
    if (argc > 2 && strcmp(argv[1], "--ids") == 0) {
        for (char *at = argv[2]; *at && n < 4096; at = *at ? at + 1 : at) ids[n++] = (int32_t)strtol(at, &at, 10);
        argv += 1, argc -= 1;
    } else {
        n = sym_tokenize(argc > 1 ? argv[1] : "", ids, 4096);
    }
    int k = argc > 2 ? atoi(argv[2]) : 1;
    if (n < 1 || n > 4096 || k < 1 || k > n) return 1;
    int shown = sym_detokenize(ids, k, text, sizeof text);
    if (shown < 0 || shown > (int)sizeof text) return 1;
    sym_send(text, shown);
    sym_stream stream;
    if (sym_stream_start(&stream, ids, k, text, sizeof text) < 0) return 1;
    for (int total = k + 1; total <= n; total++)
        if (sym_stream_push(&stream, ids, total) < 0) return 1;
    return sym_stream_finish(&stream, ids, n) < 0;
}
