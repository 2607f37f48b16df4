/* complete_code: code completion on Symphony's default model (trained on Python's stdlib).
 * Usage: complete_code [PREFIX] [MAX_TOKENS] [NO_REPEAT_NGRAM]
 * Completes PREFIX ("\n" and "\t" in it are escapes) up to the end of the current block: a blank
 * line followed by a new top-level statement, end of sequence, or MAX_TOKENS. Two decoding
 * choices live here, in the program, not in the server:
 *  - token healing: the prefix's last token is taken back and the first completion token must
 *    start with its text (a buffer ending in "\n" would otherwise force a token boundary the
 *    model never saw in training, where "\n" and the next line's indentation are one token);
 *  - no repeated n-grams: each step takes the most likely of the top 8 tokens that does not
 *    repeat an n-gram (default 4 tokens) of the buffer or the completion; 0 is plain greedy.
 * Then, like an editor plugin, every message received is a new version of the buffer: the KV
 * file keeps the tokens the new version shares with the old one (kv_truncate to the common
 * prefix) and only the edit is prefilled. Suggestions decode on a fork, so the buffer's KV never
 * holds them. Logs how many prompt tokens each request reused. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "symphony.h"

#define MAX_IDS 8192
#define MAX_TEXT (1 << 16)
#define CANDIDATES 8
#define HEAL_CANDIDATES 64

static int32_t buffer_ids[MAX_IDS]; /* the tokens the buffer's KV file holds */
static int32_t history[2 * MAX_IDS]; /* prompt tokens, then the completion's */
static char prompt[MAX_TEXT];
static char text[MAX_TEXT];
static char piece[256];

/* Copies src into dst (cap bytes), turning the escapes \n and \t into characters. */
static void unescape(const char *src, char *dst, int cap) {
    int j = 0;
    for (int i = 0; src[i] && j < cap - 1; i++) {
        if (src[i] == '\\' && (src[i + 1] == 'n' || src[i + 1] == 't')) {
            dst[j++] = src[++i] == 'n' ? '\n' : '\t';
        } else {
            dst[j++] = src[i];
        }
    }
    dst[j] = 0;
}

/* Has the text left its block: a blank line, then a line starting at column 0? Returns where
 * to cut it (the blank line's start), or -1. */
static int block_end(const char *s, int len) {
    for (int i = 0; i + 2 < len; i++)
        if (s[i] == '\n' && s[i + 1] == '\n' && s[i + 2] != '\n' && s[i + 2] != ' ' && s[i + 2] != '\t')
            return i;
    return -1;
}

/* Would appending `token` to history[0..n) repeat an n-gram of `ngram` tokens seen before? */
static int repeats(const int32_t *hist, int n, int32_t token, int ngram) {
    if (ngram <= 0 || n < ngram) return 0;
    const int32_t *tail = hist + n - (ngram - 1); /* the last ngram-1 tokens, then `token` */
    for (int start = 0; start + ngram <= n; start++) {
        if (hist[start + ngram - 1] != token) continue;
        if (memcmp(hist + start, tail, sizeof(int32_t) * (ngram - 1)) == 0) return 1;
    }
    return 0;
}

/* The best of `count` candidates (most likely first) that repeats no n-gram, else the first. */
static int32_t pick(const int32_t *candidates, int count, const int32_t *hist, int n, int ngram) {
    for (int i = 0; i < count; i++)
        if (!repeats(hist, n, candidates[i], ngram)) return candidates[i];
    return candidates[0];
}

/* The most likely of the top candidates whose text starts with `heal_text` (token healing). */
static int32_t heal(const int32_t *candidates, int count, const char *heal_text, int heal_len, int32_t fallback) {
    for (int i = 0; i < count; i++) {
        int len = sym_detokenize(&candidates[i], 1, piece, sizeof piece);
        if (len >= heal_len && len <= (int)sizeof piece && memcmp(piece, heal_text, heal_len) == 0)
            return candidates[i];
    }
    return fallback;
}

/* Completes the buffer `prompt`; sends the completion; returns 0 or a negative error. */
static int complete(sym_kv buffer, int *buffer_len, int max_tokens, int ngram) {
    int n = sym_tokenize_prompt(prompt, history, MAX_IDS);
    if (n >= 0 && n < 2) {  /* an empty buffer (an editor cleared it): nothing to complete */
        sym_send("\n", 1);
        return 0;
    }
    if (n < 0 || n + max_tokens > MAX_IDS) return n < 0 ? n : SYM_EINVAL;
    /* Token healing: the buffer's KV holds all but the last prompt token. */
    int32_t healed = history[--n];
    char heal_text[256];
    int heal_len = sym_detokenize(&healed, 1, heal_text, sizeof heal_text);
    if (heal_len < 0 || heal_len > (int)sizeof heal_text) return heal_len < 0 ? heal_len : SYM_EINVAL;

    int common = 0;
    while (common < *buffer_len && common < n && buffer_ids[common] == history[common]) common++;
    if (common == n) common--; /* pred needs at least one new token to answer */
    int rc = sym_kv_truncate(buffer, common);
    if (rc < 0) return rc;
    fprintf(stderr, "complete_code: %d prompt tokens, %d reused from the previous request\n", n + 1, common);
    int32_t top[HEAL_CANDIDATES];
    float logprobs[HEAL_CANDIDATES];
    int got = sym_pred_topk(buffer, history + common, NULL, n - common, HEAL_CANDIDATES, top, logprobs);
    if (got <= 0) return got < 0 ? got : SYM_EINTERNAL;
    memcpy(buffer_ids, history, n * sizeof(int32_t));
    *buffer_len = n;
    int32_t token = heal(top, got, heal_text, heal_len, healed);

    sym_kv branch = sym_kv_fork(buffer);
    if (branch < 0) return branch;
    /* The text shown starts after the healed token's text, which the user already has. */
    int generated = 0, sent = heal_len, len = heal_len, cut = -1;
    while (!sym_is_eos(token) && generated < max_tokens) {
        history[n + generated++] = token;
        len = sym_detokenize(history + n, generated, text, MAX_TEXT);
        if (len < 0 || len >= MAX_TEXT) {
            len = sent;
            break;
        }
        cut = block_end(text, len);
        if (cut >= 0 && cut < sent) cut = sent; /* the block ended before the completion began */
        /* Hold back a trailing newline or partial character until the next token says more. */
        int ready = cut >= 0 ? cut : len;
        while (ready > sent && (text[ready - 1] == '\n' || (text[ready - 1] & 0xC0) == 0x80 ||
                                (text[ready - 1] & 0xC0) == 0xC0))
            ready--;
        if (ready > sent) {
            sym_send(text + sent, ready - sent);
            sent = ready;
        }
        if (cut >= 0 || generated >= max_tokens) break;
        got = sym_pred_topk(branch, &token, NULL, 1, CANDIDATES, top, logprobs);
        if (got <= 0) {
            token = got < 0 ? got : SYM_EINTERNAL;
            break;
        }
        token = pick(top, got, history, n + generated, ngram);
    }
    int end = cut >= 0 ? cut : len;
    if (end > sent) sym_send(text + sent, end - sent);
    sym_send("\n", 1);
    sym_kv_close(branch);
    return token < 0 ? token : 0;
}

int main(int argc, char **argv) {
    int max_tokens = argc > 2 ? atoi(argv[2]) : 64;
    int ngram = argc > 3 ? atoi(argv[3]) : 4;
    unescape(argc > 1 ? argv[1] : "import os\\n\\n\\ndef list_files(path):\\n", prompt, MAX_TEXT);
    sym_kv buffer = sym_kv_create();
    if (buffer < 0) return 1;
    int buffer_len = 0;
    char message[MAX_TEXT];
    for (;;) {
        sym_send(prompt, (int)strlen(prompt));
        int rc = complete(buffer, &buffer_len, max_tokens, ngram);
        if (rc < 0) {
            fprintf(stderr, "complete_code: failed with %d\n", rc);
            return 1;
        }
        int got = sym_recv(message, MAX_TEXT - 1);
        if (got < 0) break; /* the user closed the input: done */
        message[got] = 0;
        unescape(message, prompt, MAX_TEXT);
    }
    sym_kv_close(buffer);
    return 0;
}
