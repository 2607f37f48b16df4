/* symphony.h: the C SDK for Symphony LLM Inference Programs (LIPs).
 *
 * A LIP is a WASI preview-1 command (`int main(int argc, char **argv)`) compiled to wasm32:
 *     python -m ziglang cc --target=wasm32-wasi -O2 -I guest_sdk/c prog.c -o prog.wasm
 * It drives generation through the system calls below, imported from module "symphony" and
 * described in wit/symphony.wit. Every call returns a negative SYM_E* code on failure.
 * Header-only: nothing to link. WASI gives args, env, clocks, random, sleep (the process
 * waits, suspended; the others run) and stdout/stderr (the process's log).
 */
#ifndef SYMPHONY_H
#define SYMPHONY_H

#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#ifdef __cplusplus
extern "C" {
#endif

/* ---- error codes (wit/symphony.wit, interface errors) ---- */
#define SYM_EINVAL -1          /* invalid-argument */
#define SYM_EBADHANDLE -2      /* bad-handle */
#define SYM_EREADONLY -3       /* read-only */
#define SYM_EEXIST -4          /* file-exists */
#define SYM_ENOENT -5          /* file-not-found */
#define SYM_EPERM -6           /* permission-denied */
#define SYM_EPOSITION -7       /* position-error */
#define SYM_ENOSPACE -8        /* pool-exhausted */
#define SYM_EBUSY -9           /* file-busy */
#define SYM_EFAULT -10         /* bad-pointer */
#define SYM_ETOOSMALL -11      /* buffer-too-small */
#define SYM_ELIMIT -12         /* limit-exceeded */
#define SYM_EUNSUPPORTED -13   /* unsupported */
#define SYM_EINTERNAL -14      /* internal */
#define SYM_ECLOSED -15        /* closed */

/* kv_open flags */
#define SYM_KV_CREATE 1
#define SYM_KV_EXCLUSIVE 2
#define SYM_KV_READ_ONLY 4

/* kv_hint flags */
#define SYM_HINT_PINNED 1
#define SYM_HINT_DROP_ON_CLOSE 2

/* pred kinds */
#define SYM_PRED_DIST 0
#define SYM_PRED_TOPK 1
#define SYM_PRED_SAMPLE 2
#define SYM_PRED_GREEDY_EACH 3
#define SYM_PRED_SCORE_EACH 4

typedef int32_t sym_kv;      /* a KV file handle (> 0), or a negative error */
typedef int32_t sym_ticket;  /* a pred in flight (> 0), or a negative error */

/* How the host samples a token (48 bytes; the layout is part of the ABI). */
typedef struct sym_sampling {
    float temperature;          /* 0: greedy, any finite value > 0 (however small) samples */
    float top_p;                /* 1: off */
    int32_t top_k;              /* 0: off */
    int32_t has_seed;           /* bits: SYM_SAMPLING_SEED (use seed), SYM_SAMPLING_MORE (a sym_sampling_more follows) */
    uint64_t seed;
    const int32_t *allowed;     /* allowed token ids (constrained decoding), or NULL */
    int32_t n_allowed;
    const int32_t *bias_ids;    /* logit bias: ids ... */
    const float *bias_values;   /* ... and values added to their logits */
    int32_t n_bias;
    int32_t grammar;            /* a grammar handle (sym_grammar_new) the draw keeps to, or 0 */
} sym_sampling;

_Static_assert(sizeof(sym_sampling) == 48, "sym_sampling is 48 bytes");

/* What may follow a sym_sampling (its has_seed holding SYM_SAMPLING_MORE): min-p, a repetition
 * penalty (vLLM's: a penalized token's positive logit is divided by it, a negative one
 * multiplied; list the prompt's and the output's tokens) and log-probabilities: with logprobs 1,
 * the pred's wait (or sym_pred's buffer) also gets the drawn token's log-probability (f32), then
 * top_logprobs ids (i32) and their log-probabilities (f32), most likely first: the model's own
 * (log-softmax of its logits, before temperature, penalty, bias or masks). Its cap counts
 * 1 + 2 * top_logprobs values. 24 bytes, part of the ABI. */
typedef struct sym_sampling_more {
    float min_p;                /* 0 (off), or keep the tokens at least min_p times as likely as the best */
    float repetition_penalty;   /* 1 (off), or any value > 0 */
    const int32_t *penalized;   /* the ids it applies to (repeats allowed) */
    int32_t n_penalized;
    int32_t logprobs;           /* 0 or 1 */
    int32_t top_logprobs;       /* 0..32, with logprobs */
} sym_sampling_more;

_Static_assert(sizeof(sym_sampling_more) == 24, "sym_sampling_more is 24 bytes");

#define SYM_SAMPLING_SEED 1
#define SYM_SAMPLING_MORE 2

/* A sym_sampling with what follows it: set `.base.has_seed |= SYM_SAMPLING_MORE` and pass
 * &its.base to sym_pred_sample / sym_pred_submit_sample. */
typedef struct sym_sampling_ext {
    sym_sampling base;
    sym_sampling_more more;
} sym_sampling_ext;

#define SYM_IMPORT(name) __attribute__((import_module("symphony"), import_name(#name)))

/* ---- raw system calls (wit/symphony.wit) ---- */
SYM_IMPORT(vocab_size) int32_t __sym_vocab_size(void);
SYM_IMPORT(eos_ids) int32_t __sym_eos_ids(int32_t *out, int32_t cap);
SYM_IMPORT(bos_id) int32_t __sym_bos_id(void);
SYM_IMPORT(model_name) int32_t __sym_model_name(char *out, int32_t cap);
SYM_IMPORT(tokenize) int32_t __sym_tokenize(const char *text, int32_t len, int32_t flags, int32_t *out, int32_t cap);
SYM_IMPORT(detokenize) int32_t __sym_detokenize(const int32_t *ids, int32_t n, char *out, int32_t cap);
SYM_IMPORT(chat_template) int32_t __sym_chat_template(const char *messages, int32_t messages_len, int32_t flags, char *out,
                                                     int32_t cap);
SYM_IMPORT(kv_create) int32_t __sym_kv_create(void);
SYM_IMPORT(kv_open) int32_t __sym_kv_open(const char *path, int32_t len, int32_t flags);
SYM_IMPORT(kv_fork) int32_t __sym_kv_fork(int32_t kv);
SYM_IMPORT(kv_extract) int32_t __sym_kv_extract(int32_t kv, int32_t start, int32_t end);
SYM_IMPORT(kv_merge) int32_t __sym_kv_merge(int32_t first, int32_t second);
SYM_IMPORT(kv_len) int32_t __sym_kv_len(int32_t kv);
SYM_IMPORT(kv_truncate) int32_t __sym_kv_truncate(int32_t kv, int32_t len);
SYM_IMPORT(kv_close) int32_t __sym_kv_close(int32_t kv);
SYM_IMPORT(kv_remove) int32_t __sym_kv_remove(const char *path, int32_t len);
SYM_IMPORT(kv_hint) int32_t __sym_kv_hint(int32_t kv, int32_t flags, int32_t keep_for_ms, int32_t priority);
SYM_IMPORT(kv_open_prefix) int32_t __sym_kv_open_prefix(const int32_t *ids, int32_t n);
SYM_IMPORT(kv_cache_prefix) int32_t __sym_kv_cache_prefix(int32_t kv);
SYM_IMPORT(pred_submit) int32_t __sym_pred_submit(int32_t kv, const int32_t *ids, const int32_t *pos, int32_t n, int32_t kind, int32_t arg);
SYM_IMPORT(pred_wait) int32_t __sym_pred_wait(int32_t ticket, void *out, int32_t cap);
SYM_IMPORT(pred) int32_t __sym_pred(int32_t kv, const int32_t *ids, const int32_t *pos, int32_t n, int32_t kind, int32_t arg, void *out, int32_t cap);
SYM_IMPORT(grammar_new) int32_t __sym_grammar_new(int32_t kind, const char *source, int32_t source_len);
SYM_IMPORT(grammar_fork) int32_t __sym_grammar_fork(int32_t grammar);
SYM_IMPORT(grammar_accept) int32_t __sym_grammar_accept(int32_t grammar, const int32_t *ids, int32_t n);
SYM_IMPORT(grammar_rollback) int32_t __sym_grammar_rollback(int32_t grammar, int32_t n);
SYM_IMPORT(grammar_state) int32_t __sym_grammar_state(int32_t grammar);
SYM_IMPORT(grammar_close) int32_t __sym_grammar_close(int32_t grammar);
SYM_IMPORT(send) int32_t __sym_send(const char *msg, int32_t len);
SYM_IMPORT(recv) int32_t __sym_recv(char *buf, int32_t cap);
SYM_IMPORT(tool) int32_t __sym_tool(const char *name, int32_t name_len, const char *input, int32_t input_len, char *out, int32_t cap);

/* ---- the SDK ---- */

/* Model */
static inline int sym_vocab_size(void) { return __sym_vocab_size(); }
/* The first end-of-sequence id. */
static inline int32_t sym_eos(void) { int32_t id = -1; int n = __sym_eos_ids(&id, 1); return n > 0 ? id : (n < 0 ? n : SYM_EUNSUPPORTED); }
/* Whether `token` ends a sequence: any of the model's end-of-sequence ids (read once; a model
   may have more than fit the first buffer). */
static inline int sym_is_eos(int32_t token) {
    static int32_t first[64];
    static int32_t *ids = first;
    static int n = -1;
    if (n < 0) {
        n = __sym_eos_ids(first, 64);
        if (n < 0) n = 0; /* no list: nothing ends a sequence */
        if (n > 64) {
            int32_t *all = (int32_t *)malloc(sizeof(int32_t) * (size_t)n);
            int got = all ? __sym_eos_ids(all, n) : -1;
            if (got >= 0 && got <= n) ids = all, n = got;
            else free(all), n = 64; /* the first 64 */
        }
    }
    for (int i = 0; i < n; i++) if (ids[i] == token) return 1;
    return 0;
}
static inline int32_t sym_bos(void) { return __sym_bos_id(); }
static inline int sym_model_name(char *out, int cap) { return __sym_model_name(out, cap); }

/* Tokens. Both return the full count (ids or bytes); at most `cap` are written. */
static inline int sym_tokenize(const char *text, int32_t *out, int cap) { return __sym_tokenize(text, (int32_t)strlen(text), 0, out, cap); }
/* Tokenize with the model's special tokens (BOS), as a prompt's start. */
static inline int sym_tokenize_prompt(const char *text, int32_t *out, int cap) { return __sym_tokenize(text, (int32_t)strlen(text), 1, out, cap); }
static inline int sym_detokenize(const int32_t *ids, int n, char *out, int cap) { return __sym_detokenize(ids, n, out, cap); }
/* The conversation `messages_json` (a JSON list of {"role": ..., "content": ...}) rendered with
   the model's own chat template, ending with the start of the assistant's turn: the full length
   in bytes (at most `cap` written), or a negative error (SYM_ERR_UNSUPPORTED: no template).
   Tokenize the text with sym_tokenize (no BOS): the template writes its own special tokens. */
static inline int sym_chat_template(const char *messages_json, char *out, int cap) {
    return __sym_chat_template(messages_json, (int32_t)strlen(messages_json), 1, out, cap);
}

/* Grammars (constrained decoding): a handle from a JSON schema, a regex or a Lark grammar; put
 * it in a sym_sampling's `grammar` and sym_pred_sample draws only what it allows next. */
#define SYM_GRAMMAR_JSON_SCHEMA 0
#define SYM_GRAMMAR_REGEX 1
#define SYM_GRAMMAR_LARK 2
#define SYM_GRAMMAR_MAY_END 1  /* sym_grammar_state bits */
#define SYM_GRAMMAR_MUST_END 2
static inline int32_t sym_grammar_new(int kind, const char *source) {
    return __sym_grammar_new(kind, source, (int32_t)strlen(source));
}
static inline int32_t sym_grammar_fork(int32_t grammar) { return __sym_grammar_fork(grammar); }
static inline int32_t sym_grammar_accept(int32_t grammar, const int32_t *ids, int n) { return __sym_grammar_accept(grammar, ids, n); }
static inline int32_t sym_grammar_rollback(int32_t grammar, int n) { return __sym_grammar_rollback(grammar, n); }
static inline int32_t sym_grammar_state(int32_t grammar) { return __sym_grammar_state(grammar); }
static inline int32_t sym_grammar_close(int32_t grammar) { return __sym_grammar_close(grammar); }
/* For streaming: the bytes of decoded text `text[0..len)` that are settled. A character whose
   tokens have not all come yet decodes as U+FFFD (EF BF BD), one per byte so far, and becomes
   itself once complete: hold such a tail back until it does. */
static inline int __sym_replacement_at(const char *text) { return memcmp(text, "\xEF\xBF\xBD", 3) == 0; }
static inline int sym_text_settled(const char *text, int len) {
    while (len >= 3 && __sym_replacement_at(text + len - 3)) len -= 3;
    return len;
}

/* KV files */
static inline sym_kv sym_kv_create(void) { return __sym_kv_create(); }
static inline sym_kv sym_kv_open(const char *path, int flags) { return __sym_kv_open(path, (int32_t)strlen(path), flags); }
static inline sym_kv sym_kv_fork(sym_kv kv) { return __sym_kv_fork(kv); }
static inline sym_kv sym_kv_extract(sym_kv kv, int start, int end) { return __sym_kv_extract(kv, start, end); }
static inline sym_kv sym_kv_merge(sym_kv first, sym_kv second) { return __sym_kv_merge(first, second); }
static inline int sym_kv_len(sym_kv kv) { return __sym_kv_len(kv); }
static inline int sym_kv_truncate(sym_kv kv, int len) { return __sym_kv_truncate(kv, len); }
static inline int sym_kv_close(sym_kv kv) { return __sym_kv_close(kv); }
static inline int sym_kv_remove(const char *path) { return __sym_kv_remove(path, (int32_t)strlen(path)); }
static inline int sym_kv_hint(sym_kv kv, int flags, int keep_for_ms, int priority) { return __sym_kv_hint(kv, flags, keep_for_ms, priority); }
/* Automatic prefix reuse: a new file with the longest cached prefix of ids (sym_kv_len says how
   long); after appending to it, sym_kv_cache_prefix offers its whole pages to the cache. */
static inline sym_kv sym_kv_open_prefix(const int32_t *ids, int n) { return __sym_kv_open_prefix(ids, n); }
static inline int sym_kv_cache_prefix(sym_kv kv) { return __sym_kv_cache_prefix(kv); }

/* Prediction, in flight: submit several, then wait for each; they share a batch.
   `pos` may be NULL to continue the file's positions. */
static inline sym_ticket sym_pred_submit(sym_kv kv, const int32_t *ids, const int32_t *pos, int n) {
    return __sym_pred_submit(kv, ids, pos, n, SYM_PRED_DIST, 0);
}
static inline sym_ticket sym_pred_submit_sample(sym_kv kv, const int32_t *ids, const int32_t *pos, int n, const sym_sampling *s) {
    return __sym_pred_submit(kv, ids, pos, n, SYM_PRED_SAMPLE, (int32_t)(intptr_t)s);
}
static inline sym_ticket sym_pred_submit_topk(sym_kv kv, const int32_t *ids, const int32_t *pos, int n, int k) {
    return __sym_pred_submit(kv, ids, pos, n, SYM_PRED_TOPK, k);
}
/* Distribution tickets: writes vocab_size floats into dist; returns vocab_size. */
static inline int sym_pred_wait(sym_ticket t, float *dist, int cap) { return __sym_pred_wait(t, dist, cap); }
/* Sample tickets: returns the token. */
static inline int32_t sym_pred_wait_sample(sym_ticket t) { return __sym_pred_wait(t, NULL, 0); }
/* A top-k answer comes as k ids then k log-probabilities in one buffer: on the stack up to k = 64,
   else from malloc (SYM_ELIMIT when the process's memory is short). */
#define SYM_TOPK_ON_STACK 64
static inline int32_t *__sym_topk_buffer(int k, int32_t *small) {
    if (k <= 0 || k > (1 << 24)) return NULL;
    return k <= SYM_TOPK_ON_STACK ? small : (int32_t *)malloc(sizeof(int32_t) * 2 * (size_t)k);
}
static inline int __sym_topk_split(int got, int32_t *buf, int32_t *small, int32_t *ids, float *logprobs) {
    if (got >= 0) {
        memcpy(ids, buf, sizeof(int32_t) * got);
        memcpy(logprobs, buf + got, sizeof(float) * got);
    }
    if (buf != small) free(buf);
    return got;
}
/* Top-k tickets: writes k ids and k log-probabilities (most likely first); returns k. */
static inline int sym_pred_wait_topk(sym_ticket t, int32_t *ids, float *logprobs, int k) {
    int32_t small[2 * SYM_TOPK_ON_STACK];
    int32_t *buf = __sym_topk_buffer(k, small);
    if (!buf) return k <= 0 || k > (1 << 24) ? SYM_EINVAL : SYM_ELIMIT;
    return __sym_topk_split(__sym_pred_wait(t, buf, 2 * k), buf, small, ids, logprobs);
}

/* Speculative verification: append n tokens and get the greedy next token after each of them
   (out[i] follows ids[i]; cap >= n); returns n. One forward pass checks a whole draft. */
static inline int sym_pred_greedy_each(sym_kv kv, const int32_t *ids, const int32_t *pos, int n, int32_t *out, int cap) {
    return __sym_pred(kv, ids, pos, n, SYM_PRED_GREEDY_EACH, 0, out, cap);
}

/* Scoring (an echoed prompt's log-probabilities): append n >= 2 tokens and get, for each one
   after the first, its log-probability given those before it (the model's own), then the k most
   likely there: out holds n - 1 floats, then (n - 1) * k ids, then (n - 1) * k floats (cap counts
   those (n - 1) * (1 + 2k) values). Returns n - 1. */
static inline int sym_pred_score_each(sym_kv kv, const int32_t *ids, int n, int k, void *out, int cap) {
    return __sym_pred(kv, ids, 0, n, SYM_PRED_SCORE_EACH, k, out, cap);
}

/* Prediction, blocking: append n tokens to kv and write the next-token distribution over the
   vocabulary into dist (cap floats); returns the vocabulary size.
   One host call (`pred`); a cap too small for the vocabulary fails before anything runs.
   After an error (< 0) the contents of dist are unspecified. */
static inline int sym_pred(sym_kv kv, const int32_t *ids, const int32_t *pos, int n, float *dist, int cap) {
    return __sym_pred(kv, ids, pos, n, SYM_PRED_DIST, 0, dist, cap);
}
/* The same, with the token sampled on the host; greedy when s is NULL. */
static inline int32_t sym_pred_sample(sym_kv kv, const int32_t *ids, const int32_t *pos, int n, const sym_sampling *s) {
    return __sym_pred(kv, ids, pos, n, SYM_PRED_SAMPLE, (int32_t)(intptr_t)s, NULL, 0);
}
/* The same, with the k most likely tokens and their log-probabilities (most likely first). */
static inline int sym_pred_topk(sym_kv kv, const int32_t *ids, const int32_t *pos, int n, int k, int32_t *out_ids, float *out_logprobs) {
    int32_t small[2 * SYM_TOPK_ON_STACK];
    int32_t *buf = __sym_topk_buffer(k, small);
    if (!buf) return k <= 0 || k > (1 << 24) ? SYM_EINVAL : SYM_ELIMIT;
    return __sym_topk_split(__sym_pred(kv, ids, pos, n, SYM_PRED_TOPK, k, buf, 2 * k), buf, small, out_ids, out_logprobs);
}

/* The index of the largest of dist[0..n) (the first one, on ties; the first NaN, if any), as
   torch.argmax. With wasm SIMD (-msimd128): the maximum, sixteen floats a step in four
   independent lanes (pmax is one x86 maxps; NaNs are tracked beside it), then the first element
   equal to it. Measured on 24,576 floats: 5-9 us (by where the maximum sits), against 22 for a
   one-pass index-tracking loop (its select chain is latency-bound) and 96 for the plain loop. */
#ifdef __wasm_simd128__
#include <wasm_simd128.h>
#endif
static inline int32_t sym_argmax(const float *dist, int n) {
    int i = 0;
    if (n <= 0) return SYM_EINVAL;
#ifdef __wasm_simd128__
    if (n >= 16) {
        v128_t m0 = wasm_v128_load(dist), m1 = wasm_v128_load(dist + 4);
        v128_t m2 = wasm_v128_load(dist + 8), m3 = wasm_v128_load(dist + 12);
        v128_t nan = wasm_v128_or(wasm_v128_or(wasm_f32x4_ne(m0, m0), wasm_f32x4_ne(m1, m1)),
                                  wasm_v128_or(wasm_f32x4_ne(m2, m2), wasm_f32x4_ne(m3, m3)));
        for (i = 16; i + 16 <= n; i += 16) {
            v128_t v0 = wasm_v128_load(dist + i), v1 = wasm_v128_load(dist + i + 4);
            v128_t v2 = wasm_v128_load(dist + i + 8), v3 = wasm_v128_load(dist + i + 12);
            m0 = wasm_f32x4_pmax(m0, v0), m1 = wasm_f32x4_pmax(m1, v1);
            m2 = wasm_f32x4_pmax(m2, v2), m3 = wasm_f32x4_pmax(m3, v3);
            nan = wasm_v128_or(nan, wasm_v128_or(wasm_v128_or(wasm_f32x4_ne(v0, v0), wasm_f32x4_ne(v1, v1)),
                                                 wasm_v128_or(wasm_f32x4_ne(v2, v2), wasm_f32x4_ne(v3, v3))));
        }
        int has_nan = wasm_v128_any_true(nan);
        m0 = wasm_f32x4_pmax(wasm_f32x4_pmax(m0, m1), wasm_f32x4_pmax(m2, m3));
        float lanes[4], top;
        wasm_v128_store(lanes, m0);
        top = lanes[0];
        for (int lane = 1; lane < 4; lane++)
            if (lanes[lane] > top) top = lanes[lane];
        for (; i < n; i++) {
            if (dist[i] > top) top = dist[i];
            has_nan |= dist[i] != dist[i];
        }
        i = 0;
        if (has_nan) {
            while (dist[i] == dist[i]) i++;
            return i;
        }
        v128_t target = wasm_f32x4_splat(top);
        for (; i + 16 <= n; i += 16) {
            v128_t hit = wasm_v128_or(
                wasm_v128_or(wasm_f32x4_eq(wasm_v128_load(dist + i), target),
                             wasm_f32x4_eq(wasm_v128_load(dist + i + 4), target)),
                wasm_v128_or(wasm_f32x4_eq(wasm_v128_load(dist + i + 8), target),
                             wasm_f32x4_eq(wasm_v128_load(dist + i + 12), target)));
            if (wasm_v128_any_true(hit)) break;
        }
        while (dist[i] != top) i++;
        return i;
    }
#endif
    int32_t best = 0;
    for (i = 0; i < n; i++) {
        if (dist[i] != dist[i]) return i;
        if (dist[i] > dist[best]) best = i;
    }
    return best;
}

/* I/O with the process's user */
static inline int sym_send(const char *msg, int len) { return __sym_send(msg, len); }
static inline int sym_send_str(const char *msg) { return __sym_send(msg, (int32_t)strlen(msg)); }

/* Streaming text as tokens come (TextStream in the Python and Rust SDKs). Each push decodes the
   tokens from a recent one on (`prefix`: the context that gives a token its spaces and byte
   pieces, at the cost of a few tokens, not of the whole text) and sends the settled bytes not
   sent yet. Every SYM_STREAM_WINDOW tokens the prefix moves up to a token that starts a
   character. `text` (cap bytes) is the caller's buffer for the decodes. */
#define SYM_STREAM_WINDOW 8
typedef struct { int prefix, mark, sent, now, cap; char *text; } sym_stream;

/* Start after ids[0..n) (a prompt, already shown): the stream sends only what follows. */
static inline int sym_stream_start(sym_stream *s, const int32_t *ids, int n, char *text, int cap) {
    s->text = text, s->cap = cap, s->prefix = n;
    /* The latest of the last few tokens that starts a character (a decode from a byte token
       inside a character would begin with U+FFFD, and garble a character that continues it). */
    for (int k = n - 1; k >= 0 && k >= n - SYM_STREAM_WINDOW; k--) {
        int len = sym_detokenize(ids + k, n - k, text, cap);
        if (len < 0) return len;
        s->prefix = k;
        if (!(len >= 3 && len <= cap && __sym_replacement_at(text))) break;
    }
    s->mark = s->prefix;
    s->sent = s->now = sym_detokenize(ids + s->prefix, n - s->prefix, text, cap);
    return s->sent < 0 ? s->sent : 0;
}

/* Send the decoded text from what was sent up to `upto`. A byte token can turn earlier text into
   U+FFFD: what was sent stays sent; go on from a character's start, never from inside one. */
static inline int __sym_stream_send(sym_stream *s, int upto) {
    while (s->sent < upto && (s->text[s->sent] & 0xC0) == 0x80) s->sent++;
    if (upto <= s->sent) return 0;
    int rc = sym_send(s->text + s->sent, upto - s->sent);
    if (rc < 0) return rc;
    s->sent = upto;
    return 0;
}

/* ids[0..total) now: send what is new and settled. */
static inline int sym_stream_push(sym_stream *s, const int32_t *ids, int total) {
    s->now = sym_detokenize(ids + s->prefix, total - s->prefix, s->text, s->cap);
    if (s->now < 0) return s->now;
    if (s->now > s->cap) return SYM_ETOOSMALL;
    int settled = sym_text_settled(s->text, s->now), rc = __sym_stream_send(s, settled);
    if (rc < 0) return rc;
    if (settled == s->now) { /* whole: a character starts at ids[total] */
        if (total - s->prefix >= 2 * SYM_STREAM_WINDOW) {
            s->prefix = s->mark;
            s->sent = s->now = sym_detokenize(ids + s->prefix, total - s->prefix, s->text, s->cap);
            if (s->now < 0) return s->now;
        }
        s->mark = total;
    }
    return 0;
}

/* The end: send what was held back (a character whose tokens never all came). */
static inline int sym_stream_finish(sym_stream *s, const int32_t *ids, int total) {
    s->now = sym_detokenize(ids + s->prefix, total - s->prefix, s->text, s->cap);
    if (s->now < 0 || s->now > s->cap) return s->now < 0 ? s->now : SYM_ETOOSMALL;
    return __sym_stream_send(s, s->now);
}
/* Blocks for the next message; returns its length, SYM_ETOOSMALL (kept) or SYM_ECLOSED. */
static inline int sym_recv(char *buf, int cap) { return __sym_recv(buf, cap); }

/* Tools the operator registered (e.g. "calculator", "docs"), run inside the server. Writes up
   to cap bytes of the output; returns its full length, SYM_EUNSUPPORTED (no such tool) or
   SYM_EINVAL (the tool refused the input). */
static inline int sym_tool(const char *name, const char *input, char *out, int cap) {
    return __sym_tool(name, (int32_t)strlen(name), input, (int32_t)strlen(input), out, cap);
}

#ifdef __cplusplus
}
#endif
#endif /* SYMPHONY_H */
