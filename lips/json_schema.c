/* json_schema: constrained decoding into JSON that matches a small schema.
 * Usage: json_schema [PROMPT] [TEMPERATURE] [SEED]
 * Output: {"name": "<letters and spaces>", "age": <integer>}, always valid JSON. The program
 * walks the schema: literal parts ({"name": ", ", "age": , }) are appended as forced tokens,
 * and value tokens are sampled on the host under an allowed-token mask (sym_sampling.allowed):
 * inside the string only tokens made of letters and spaces, then the closing quote; inside
 * the integer only digit tokens (no leading zero), then the closing brace. The model chooses
 * everything the schema leaves open. */
#include "gallery.h"

#define MAX_VOCAB (1 << 18)
#define MAX_STRING_TOKENS 8
#define MAX_DIGIT_TOKENS 3

static text_t t;
static char piece[64];
static int32_t letters[MAX_VOCAB], digits[MAX_VOCAB], first_digits[MAX_VOCAB];
static int n_letters, n_digits, n_first_digits;
static int32_t quote_id, brace_id;
static sym_kv kv;
static int fed;  /* tokens of t already in kv */
static sym_sampling sampling;

/* The text a token adds after other text (SentencePiece drops a leading space at the start,
   so decode it after an anchor token and take the difference). */
static int token_text(int32_t anchor, int anchor_len, int32_t id, char *out, int cap) {
    int32_t pair[2] = {anchor, id};
    int len = sym_detokenize(pair, 2, out, cap - 1);
    if (len < anchor_len || len > cap - 1) return -1;
    memmove(out, out + anchor_len, len - anchor_len);
    out[len - anchor_len] = 0;
    return len - anchor_len;
}

static int all_in(const char *s, const char *set) {
    if (!*s) return 0;
    for (; *s; s++) if (!strchr(set, *s)) return 0;
    return 1;
}

static void classify_vocab(void) {
    int vocab = sym_vocab_size();
    int32_t anchor;
    sym_tokenize("a", &anchor, 1);
    int anchor_len = sym_detokenize(&anchor, 1, piece, sizeof piece);
    for (int32_t id = 0; id < vocab && id < MAX_VOCAB; id++) {
        if (sym_is_eos(id) || token_text(anchor, anchor_len, id, piece, sizeof piece) < 1) continue;
        if (all_in(piece, "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ "))
            letters[n_letters++] = id;
        if (all_in(piece, "0123456789")) {
            digits[n_digits++] = id;
            if (piece[0] != '0') first_digits[n_first_digits++] = id;
        }
        if (!strcmp(piece, "\"")) quote_id = id;
        if (!strcmp(piece, "}")) brace_id = id;
    }
}

/* Appends literal text as forced tokens (the model reads them, nothing is sampled). */
static void force(const char *literal) { text_push_str(&t, literal, 0); }

/* Samples the next token among `allowed` (plus `stop` when >= 0); feeds what is pending. */
static int32_t choose(const int32_t *allowed, int n, int32_t stop) {
    static int32_t mask[MAX_VOCAB];
    memcpy(mask, allowed, sizeof(int32_t) * n);
    if (stop >= 0) mask[n++] = stop;
    sampling.allowed = mask;
    sampling.n_allowed = n;
    sampling.seed++;
    int32_t token = check(sym_pred_sample(kv, t.ids + fed, NULL, t.n - fed, &sampling), "pred");
    fed = t.n;
    return token;
}

int main(int argc, char **argv) {
    const char *prompt = argc > 1 ? argv[1] : "Tom is a little boy. He is";
    sampling.temperature = argc > 2 ? (float)atof(argv[2]) : 0.0f;
    if (!(sampling.temperature >= 0 && sampling.temperature <= 1e6f)) {  /* NaN too */
        fprintf(stderr, "json_schema: the temperature is a number from 0 to 1e6\n");
        return 2;
    }
    sampling.top_p = 1.0f;
    sampling.has_seed = 1;
    sampling.seed = argc > 3 ? (uint64_t)atoll(argv[3]) * 1000 : 0;
    classify_vocab();
    if (!n_letters || !n_first_digits || !quote_id || !brace_id) {
        fprintf(stderr, "json_schema: the vocabulary lacks letters, digits, '\"' or '}'\n");
        return 1;
    }
    kv = check(sym_kv_create(), "kv_create");
    text_push_str(&t, prompt, 1);
    int start = t.n;  /* the JSON begins here */
    force(" {\"name\": \"");
    for (int i = 0; i < MAX_STRING_TOKENS; i++) {
        int32_t token = choose(letters, n_letters, i > 0 ? quote_id : -1);
        if (token == quote_id) break;
        text_push(&t, &token, 1);
    }
    force("\", \"age\": ");
    for (int i = 0; i < MAX_DIGIT_TOKENS; i++) {
        int32_t token = i == 0 ? choose(first_digits, n_first_digits, -1) : choose(digits, n_digits, brace_id);
        if (token == brace_id) break;
        text_push(&t, &token, 1);
    }
    force("}");
    int len = sym_detokenize(t.ids + start, t.n - start, t.bytes, TEXT_MAX_BYTES - 1);
    if (len < 0 || len > TEXT_MAX_BYTES - 1) return 1;
    /* The text of the JSON's tokens, from the model's detokenizer, minus SentencePiece's space. */
    char *json = t.bytes;
    while (*json == ' ') json++;
    sym_send(json, len - (int)(json - t.bytes));
    sym_send("\n", 1);
    sym_kv_close(kv);
    return 0;
}
