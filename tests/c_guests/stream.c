/* Streams its argument's tokens one at a time as lips/hello.c streams what it generates (the
 * text beyond the last whole chunk, a character held back until its tokens have all come):
 * what it sends, joined, must be the argument itself. */
#include "symphony.h"

static int32_t ids[4096];
static char text[1 << 16];

int main(int argc, char **argv) {
    int n = sym_tokenize(argc > 1 ? argv[1] : "", ids, 4096);
    if (n < 0 || n > 4096) return 1;
    int prefix = 0, read = 0;
    for (int total = 1; total <= n; total++) {
        int before = sym_detokenize(ids + prefix, read - prefix, text, sizeof text);
        int now = sym_detokenize(ids + prefix, total - prefix, text, sizeof text);
        if (before >= 0 && now > before && now <= (int)sizeof text && sym_text_settled(text, now) == now) {
            sym_send(text + before, now - before);
            prefix = read;
            read = total;
        }
    }
    if (read < n) {
        int before = sym_detokenize(ids + prefix, read - prefix, text, sizeof text);
        int now = sym_detokenize(ids + prefix, n - prefix, text, sizeof text);
        if (before >= 0 && now > before && now <= (int)sizeof text) sym_send(text + before, now - before);
    }
    return 0;
}
