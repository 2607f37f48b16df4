/* watermark: sampling with a red/green-list watermark (Kirchenbauer et al., 2023).
 * Usage: watermark [PROMPT] [MAX_TOKENS] [KEY] [DELTA] [SEED]
 * Each step the program computes the green list that follows the previous token (watermark.h)
 * and asks the host to sample (temperature 1) with DELTA added to the green tokens' logits
 * through the sampling record's logit bias. Sends the continuation only (not the prompt), so
 * `watermark_detect` can score it. DELTA 0 samples the same way without a watermark. */
#include "gallery.h"
#include "watermark.h"

#define MAX_VOCAB (1 << 18)

static text_t prompt, out;
static int32_t green_ids[MAX_VOCAB];
static float green_bias[MAX_VOCAB];

int main(int argc, char **argv) {
    const char *text = argc > 1 ? argv[1] : "Once upon a time";
    int max_tokens = argc > 2 ? atoi(argv[2]) : 64;
    uint64_t key = argc > 3 ? (uint64_t)atoll(argv[3]) : 42;
    float delta = argc > 4 ? (float)atof(argv[4]) : 4.0f;
    uint64_t seed = argc > 5 ? (uint64_t)atoll(argv[5]) : 1;
    int vocab = sym_vocab_size();
    if (vocab <= 0 || vocab > MAX_VOCAB) return 2;
    if (text_push_str(&prompt, text, 1) < 1) return 2;
    sym_kv kv = check(sym_kv_create(), "kv_create");
    sym_sampling sampling = {.temperature = 1.0f, .top_p = 1.0f, .has_seed = 1};
    const int32_t *feed = prompt.ids;
    int feed_len = prompt.n;
    int32_t prev = prompt.ids[prompt.n - 1];
    for (int step = 0; step < max_tokens; step++) {
        int n_green = 0;
        for (int32_t id = 0; id < vocab && delta != 0.0f; id++)
            if (is_green(key, prev, id)) { green_ids[n_green] = id; green_bias[n_green++] = delta; }
        sampling.bias_ids = green_ids;
        sampling.bias_values = green_bias;
        sampling.n_bias = n_green;
        sampling.seed = seed * 100003 + step;
        int32_t token = check(sym_pred_sample(kv, feed, NULL, feed_len, &sampling), "pred");
        if (sym_is_eos(token)) break;
        text_push(&out, &token, 1);
        feed = &out.ids[out.n - 1];
        feed_len = 1;
        prev = token;
    }
    sym_send(out.bytes, out.len);
    sym_send("\n", 1);
    sym_kv_close(kv);
    return 0;
}
