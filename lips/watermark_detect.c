/* watermark_detect: scores text for the watermark of `watermark` (Kirchenbauer et al.).
 * Usage: watermark_detect TEXT [KEY]
 * Tokenizes the text, counts the tokens that are on the green list of their predecessor and
 * sends "z=Z green=G scored=T". Each distinct (predecessor, token) pair is scored once, as
 * Kirchenbauer et al. do: a repeated pair is green every time or red every time, so "ha ha ha"
 * scored z=7.5 unwatermarked. Watermarked text scores high (z > 4 at 100 tokens); other text
 * scores near 0. Needs no pred at all: only the tokenizer and the key. */
#include "gallery.h"
#include "watermark.h"

static text_t t;

/* The pairs scored so far: an open-addressing set, twice the most pairs a text can have. */
#define PAIR_SLOTS (2 * TEXT_MAX_IDS)
static uint64_t pairs[PAIR_SLOTS];
static unsigned char pair_used[PAIR_SLOTS];

static int first_time(int32_t prev, int32_t token) {
    uint64_t pair = (uint64_t)(uint32_t)prev << 32 | (uint32_t)token;
    size_t slot = splitmix64(pair) % PAIR_SLOTS;
    for (; pair_used[slot]; slot = (slot + 1) % PAIR_SLOTS)
        if (pairs[slot] == pair) return 0;
    pair_used[slot] = 1, pairs[slot] = pair;
    return 1;
}

int main(int argc, char **argv) {
    if (argc < 2) {
        fprintf(stderr, "usage: watermark_detect TEXT [KEY]\n");
        return 2;
    }
    uint64_t key = argc > 2 ? (uint64_t)atoll(argv[2]) : 42;
    if (text_push_str(&t, argv[1], 0) < 0) return 2;
    int green = 0, scored = 0;
    for (int i = 1; i < t.n; i++)
        if (first_time(t.ids[i - 1], t.ids[i])) scored++, green += is_green(key, t.ids[i - 1], t.ids[i]);
    char line[96];
    int len = snprintf(line, sizeof line, "z=%.2f green=%d scored=%d\n", watermark_z(green, scored), green, scored);
    sym_send(line, len);
    return 0;
}
