/* watermark_detect: scores text for the watermark of `watermark` (Kirchenbauer et al.).
 * Usage: watermark_detect TEXT [KEY]
 * Tokenizes the text, counts the tokens that are on the green list of their predecessor and
 * sends "z=Z green=G scored=T". Watermarked text scores high (z > 4 for a few dozen tokens);
 * other text scores near 0. Needs no pred at all: only the tokenizer and the key. */
#include "gallery.h"
#include "watermark.h"

static text_t t;

int main(int argc, char **argv) {
    if (argc < 2) {
        fprintf(stderr, "usage: watermark_detect TEXT [KEY]\n");
        return 2;
    }
    uint64_t key = argc > 2 ? (uint64_t)atoll(argv[2]) : 42;
    if (text_push_str(&t, argv[1], 0) < 0) return 2;
    int green = 0, scored = 0;
    for (int i = 1; i < t.n; i++, scored++) green += is_green(key, t.ids[i - 1], t.ids[i]);
    char line[96];
    int len = snprintf(line, sizeof line, "z=%.2f green=%d scored=%d\n", watermark_z(green, scored), green, scored);
    sym_send(line, len);
    return 0;
}
