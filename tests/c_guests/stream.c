/* Streams its argument's tokens, one more token each time, sending only settled text
 * (sym_text_settled): what it sends, joined, must be the argument itself. */
#include "symphony.h"

static int32_t ids[4096];
static char text[1 << 16];

int main(int argc, char **argv) {
    int n = sym_tokenize(argc > 1 ? argv[1] : "", ids, 4096);
    if (n < 0 || n > 4096) return 1;
    int sent = 0;
    for (int end = 1; end <= n; end++) {
        int len = sym_detokenize(ids, end, text, sizeof text);
        if (len < 0 || len > (int)sizeof text) return 1;
        len = sym_text_settled(text, len);
        if (len > sent) sym_send(text + sent, len - sent);
        if (len > sent) sent = len;
    }
    return 0;
}
