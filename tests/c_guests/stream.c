/* Streams its argument's tokens one at a time exactly as lips/hello.c streams what it generates
 * (its loop, with the tokens given instead of predicted): what it sends, joined, must be what
 * one decode of them gives. */
#include "symphony.h"

#define WINDOW 8

static int32_t ids[4096];
static char text[1 << 16];

int main(int argc, char **argv) {
    int n = sym_tokenize(argc > 1 ? argv[1] : "", ids, 4096);
    if (n < 1 || n > 4096) return 1;
    /* The first token plays the prompt (sent whole), the rest the generated tokens. */
    int total = 1, prefix = 0, mark = 0;
    int sent = sym_detokenize(ids, 1, text, sizeof text), now = sent;
    sym_send(text, sent);
    while (total < n && sent >= 0) {
        total++;
        now = sym_detokenize(ids + prefix, total - prefix, text, sizeof text);
        if (now < 0 || now > (int)sizeof text) break;
        int settled = sym_text_settled(text, now);
        if (settled > sent) sym_send(text + sent, settled - sent);
        if (settled > sent) sent = settled;
        if (settled == now) {
            if (total - prefix >= 2 * WINDOW) {
                prefix = mark;
                sent = now = sym_detokenize(ids + prefix, total - prefix, text, sizeof text);
            }
            mark = total;
        }
    }
    if (sent >= 0 && now > sent) {
        now = sym_detokenize(ids + prefix, total - prefix, text, sizeof text);
        if (now > sent && now <= (int)sizeof text) sym_send(text + sent, now - sent);
    }
    return 0;
}
