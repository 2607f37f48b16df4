/* complete: text completion as a LIP. The OpenAI-compatible endpoints (/v1/completions,
 * /v1/chat/completions) run this program; symphony_os/completion.py speaks its protocol.
 *
 * Input, one message (little-endian):
 *   header { i32 n_prompt, max_tokens, n, logprobs (-1: none, else top-k 0..20);
 *            f32 temperature, top_p; i32 has_seed, n_stop; u64 seed }   40 bytes
 *   i32 prompt[n_prompt]; then n_stop times { i32 len; len bytes };
 *   then { i32 grammar_kind (-1: none), i32 len; len bytes }: a grammar every token keeps to
 *   (grammar-new's kinds; each branch a fork of it), its text ending once the grammar must end;
 *   then { i32 top_k (0: off), flags (bit 0: ignore EOS; bit 1: score the prompt), min_tokens;
 *          f32 presence_penalty, frequency_penalty, min_p (0: off), repetition_penalty (1: off);
 *          i32 n_bias } and
 *   n_bias times { i32 id; f32 value }: logit biases, to which each branch adds its own
 *   penalties (presence: once a token occurred in the branch, frequency: for each time) and,
 *   before min_tokens, an EOS bias of -FLT_MAX: OpenAI's penalties as logit biases the program
 *   computes, applied on the host with the draw. min-p and the repetition penalty (vLLM's: on
 *   the tokens of the prompt and of the branch so far) go to the host in a sym_sampling_more.
 * Output, one message per event (i32 words):
 *   FRAME_PROMPT  { tag, n_prompt, cached }          prompt tokens and how many came from the cache
 *   FRAME_PROMPT_SCORES { tag, first, count, k, count times { f32 logprob, i32 ids[k], f32 logprobs[k] } }
 *                 with flag bit 1: prompt tokens first.. scored (each given those before it, the
 *                 top k = max(logprobs, 0) there), before any token; the whole prompt is computed
 *                 (no cached prefix)
 *   FRAME_TOKEN   { tag, branch, token, f32 logprob, k, i32 ids[k], f32 logprobs[k] }
 *   FRAME_FINISH  { tag, branch, reason, text_end }  reason 0 stop (EOS or stop string), 1 length;
 *                                                    text_end: bytes of the branch's text to keep, -1 all
 * The prompt's KV starts from the longest cached prefix (kv_open_prefix); the prompt's whole
 * pages, and at the end the completion's, are offered back to the cache (kv_cache_prefix).
 * n > 1 forks the prompt once per branch and decodes all branches in the same batches.
 * Tokens are sampled on the host, with their log-probabilities when asked for (the model's
 * own: before temperature, penalties, biases or a grammar's mask).
 * Exit codes: 0 done, 1 a host call failed, 2 malformed request, 3 a host call was refused by
 * a limit or quota (LIMIT_EXCEEDED; the server answers 403). */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include "symphony.h"

enum { FRAME_PROMPT = 1, FRAME_TOKEN = 2, FRAME_FINISH = 3, FRAME_PROMPT_SCORES = 4 };
#define SCORES_PER_FRAME 256
enum { FINISH_STOP = 0, FINISH_LENGTH = 1 };
enum { EXIT_FAILED = 1, EXIT_MALFORMED = 2, EXIT_LIMIT = 3 };
#define MAX_REQUEST (4 << 20)
#define MAX_BRANCHES 16
#define MAX_TOP 20
#define MAX_STOPS 8

typedef struct {
    int32_t n_prompt, max_tokens, n, logprobs;
    float temperature, top_p;
    int32_t has_seed, n_stop;
    uint64_t seed;
} request;
_Static_assert(sizeof(request) == 40, "request header is 40 bytes");

typedef struct {
    sym_kv kv;
    int32_t *ids;     /* generated tokens; ids[-1] is the prompt's last token (context_token) */
    int len;
    int done;
    char *text;       /* detokenized ids, when stop strings are checked */
    int text_cap;
} branch;

static request req;
static const char *stops[MAX_STOPS];
static int stop_lens[MAX_STOPS];
static int32_t grammar_kind = -1, grammar_len;
static const char *grammar_source;
static int32_t top_k, ignore_eos, score_prompt, min_tokens, n_bias;
static float presence_penalty, frequency_penalty, min_p, repetition_penalty;
static const char *bias_entries;  /* n_bias { i32 id; f32 value } */
static int vocab;
/* The prompt's last token and its text: a branch's text is decoded after it and without it, so
   a first token keeps its leading space (decoded alone, a sentencepiece token loses it).
   symphony_os/completion.py's BranchText takes the text the same way. */
static int32_t context_token;
static char context_text[1 << 16];
static int context_len = -1; /* -1: decode branches alone */

static void send_words(const int32_t *words, int n) { sym_send((const char *)words, 4 * n); }

static void finish(int b, int reason, int text_end) {
    int32_t f[4] = {FRAME_FINISH, b, reason, text_end};
    send_words(f, 4);
}

/* Report a failed host call; the exit code tells a refusal by a limit from other failures. */
static int failed(const char *what, int code) {
    fprintf(stderr, "complete: %s failed with %d\n", what, code);
    return code == SYM_ELIMIT ? EXIT_LIMIT : EXIT_FAILED;
}

/* A drawn token's frame: with log-probabilities, the host's answer (the token's, then the top
 * req.logprobs ids and theirs: the model's own, sampling.Sample.logprobs). */
typedef struct {
    float logprob;
    int32_t top[2 * MAX_TOP];  /* k ids, then their k log-probabilities (f32), packed */
} scored_answer;

static void send_token(int b, int32_t token, const scored_answer *answer) {
    static int32_t frame[5 + 2 * MAX_TOP];
    int k = req.logprobs >= 0 ? req.logprobs : 0;
    float logprob = req.logprobs >= 0 ? answer->logprob : 0;
    memcpy(&frame[5], answer->top, sizeof(int32_t) * 2 * (size_t)k);
    frame[0] = FRAME_TOKEN;
    frame[1] = b;
    frame[2] = token;
    memcpy(&frame[3], &logprob, 4);
    frame[4] = k;
    send_words(frame, 5 + 2 * k);
}

/* Decode ids[0..n) into br->text, growing it; the length, or -1 (-2 out of memory). */
static int decode_into(branch *br, const int32_t *ids, int n) {
    int len = sym_detokenize(ids, n, br->text, br->text_cap - 1);
    if (len < 0) return -1;
    if (len >= br->text_cap) {
        char *grown = realloc(br->text, len + 4096);
        if (!grown) return -2;
        br->text_cap = len + 4096;
        br->text = grown;
        len = sym_detokenize(ids, n, br->text, br->text_cap - 1);
        if (len < 0) return -1;
    }
    br->text[len] = 0;
    return len;
}

/* Where the first stop string starts in the branch's text (decoded after the prompt's last
   token, which is not part of it), or -1; -2 when memory ran out. */
static int find_stop(branch *br) {
    int base = 0, len = -1;
    if (context_len >= 0) {
        len = decode_into(br, br->ids - 1, br->len + 1);
        if (len >= context_len && memcmp(br->text, context_text, context_len) == 0) base = context_len;
        else if (len != -2) len = -1; /* the context merged with what follows: decode alone */
    }
    if (len == -1) len = decode_into(br, br->ids, br->len);
    if (len < 0) return len == -2 ? -2 : -1;
    int first = -1;
    for (int s = 0; s < req.n_stop; s++) {
        for (int at = base; at + stop_lens[s] <= len; at++) {
            if (memcmp(br->text + at, stops[s], stop_lens[s]) == 0) {
                if (first < 0 || at - base < first) first = at - base;
                break;
            }
        }
    }
    return first;
}

static int out_of_memory(void) {
    fprintf(stderr, "complete: out of memory (the process's memory limit)\n");
    return EXIT_LIMIT;
}

static int read_request(char *buf) {
    int got = sym_recv(buf, MAX_REQUEST);
    if (got < (int)sizeof req) return -1;
    memcpy(&req, buf, sizeof req);
    if (req.n_prompt < 1 || req.n < 1 || req.n > MAX_BRANCHES || req.max_tokens < 0 || req.logprobs > MAX_TOP
        || req.n_stop < 0 || req.n_stop > MAX_STOPS || (size_t)got < sizeof req + 4 * (size_t)req.n_prompt)
        return -1;
    size_t at = sizeof req + 4 * (size_t)req.n_prompt;
    for (int s = 0; s < req.n_stop; s++) {
        int32_t len;
        if (at + 4 > (size_t)got) return -1;
        memcpy(&len, buf + at, 4);
        at += 4;
        if (len < 1 || at + (size_t)len > (size_t)got) return -1;
        stops[s] = buf + at;
        stop_lens[s] = len;
        at += len;
    }
    if (at + 8 > (size_t)got) return -1;
    memcpy(&grammar_kind, buf + at, 4);
    memcpy(&grammar_len, buf + at + 4, 4);
    at += 8;
    if (grammar_len < 0 || at + (size_t)grammar_len > (size_t)got) return -1;
    grammar_source = buf + at;
    at += (size_t)grammar_len;
    int32_t extras[8];
    if (at + sizeof extras > (size_t)got) return -1;
    memcpy(extras, buf + at, sizeof extras);
    at += sizeof extras;
    top_k = extras[0];
    ignore_eos = extras[1] & 1;
    score_prompt = (extras[1] >> 1) & 1;
    min_tokens = extras[2];
    memcpy(&presence_penalty, &extras[3], 4);
    memcpy(&frequency_penalty, &extras[4], 4);
    memcpy(&min_p, &extras[5], 4);
    memcpy(&repetition_penalty, &extras[6], 4);
    n_bias = extras[7];
    if (top_k < 0 || min_tokens < 0 || n_bias < 0 || n_bias > (1 << 18) || at + 8 * (size_t)n_bias > (size_t)got)
        return -1;
    bias_entries = buf + at;
    return 0;
}

/* A branch's logit biases for its next draw (`bias` below): the request's, its penalties, and
 * EOS held back before min_tokens. Dense scratch of the vocabulary's size, reset after use. */
static float *scratch;
static uint8_t *touched;
static int32_t *bias_ids;
static float *bias_values;
static int32_t **counts;  /* per branch, per token: times generated (penalties only) */

static int biases_wanted(void) {
    return n_bias || min_tokens || presence_penalty != 0 || frequency_penalty != 0;
}

static int bias(int b, const int32_t *ids, int len, int32_t *out_ids, float *out_values) {
    int n = 0;
#define TOUCH(t) do { if (!touched[t]) { touched[t] = 1; out_ids[n++] = (t); } } while (0)
    for (int i = 0; i < n_bias; i++) {
        int32_t id;
        float value;
        memcpy(&id, bias_entries + 8 * i, 4);
        memcpy(&value, bias_entries + 8 * i + 4, 4);
        if (id < 0 || id >= vocab) continue;  /* (the server checked them) */
        TOUCH(id);
        scratch[id] += value;
    }
    if (presence_penalty != 0 || frequency_penalty != 0) {
        for (int i = 0; i < len; i++) {
            int32_t t = ids[i];
            if (t < 0 || t >= vocab || touched[t] == 2) continue;
            if (!touched[t]) out_ids[n++] = t;
            touched[t] = 2;  /* its penalty taken once however often it occurs */
            scratch[t] -= presence_penalty + frequency_penalty * (float)counts[b][t];
        }
    }
    if (len < min_tokens) {
        int32_t eos[64];
        int n_eos = __sym_eos_ids(eos, 64);
        for (int i = 0; i < n_eos && i < 64; i++)
            if (eos[i] >= 0 && eos[i] < vocab) { TOUCH(eos[i]); scratch[eos[i]] = -FLT_MAX; }
    }
#undef TOUCH
    for (int i = 0; i < n; i++) {
        out_values[i] = scratch[out_ids[i]];
        scratch[out_ids[i]] = 0;
        touched[out_ids[i]] = 0;
    }
    return n;
}

/* The tokens a branch's repetition penalty applies to: the prompt's and the branch's own, each
 * once (vLLM's). */
static int32_t *penalized[MAX_BRANCHES];
static int n_penalized[MAX_BRANCHES];
static uint8_t *penalized_seen[MAX_BRANCHES];

static void penalize(int b, int32_t token) {
    if (token >= 0 && token < vocab && !penalized_seen[b][token]) {
        penalized_seen[b][token] = 1;
        penalized[b][n_penalized[b]++] = token;
    }
}

int main(void) {
    static char buf[MAX_REQUEST];
    if (read_request(buf) < 0) {
        fprintf(stderr, "complete: malformed request\n");
        return EXIT_MALFORMED;
    }
    const int32_t *prompt = (const int32_t *)(buf + sizeof req);
    vocab = sym_vocab_size();
    context_token = prompt[req.n_prompt - 1];
    int got = sym_detokenize(&context_token, 1, context_text, sizeof context_text - 1);
    if (got >= 0 && got < (int)sizeof context_text) context_len = got;

    sym_kv root = score_prompt ? sym_kv_create() : sym_kv_open_prefix(prompt, req.n_prompt);
    int cached = root < 0 ? root : sym_kv_len(root);
    if (root < 0 || cached < 0) return failed("kv_open_prefix", root < 0 ? root : cached);
    int32_t head[3] = {FRAME_PROMPT, req.n_prompt, cached};
    send_words(head, 3);
    /* Echo with log-probabilities: the prompt scored token by token (every token's logits are
       needed: no cached prefix), then the file cut back before its last token, which the
       decoding below feeds again as usual. */
    if (score_prompt && req.n_prompt >= 2) {
        int k = req.logprobs >= 0 ? req.logprobs : 0;
        size_t per = 1 + 2 * (size_t)k, n = (size_t)req.n_prompt - 1;
        int32_t *scores = malloc(4 * per * n);
        int32_t *frame = malloc(4 * (4 + per * SCORES_PER_FRAME));
        if (!scores || !frame) return out_of_memory();
        int got = sym_pred_score_each(root, prompt, req.n_prompt, k, scores, (int)(per * n));
        if (got < 0) return failed("score_each", got);
        for (size_t first = 0; first < n; first += SCORES_PER_FRAME) {
            size_t count = n - first < SCORES_PER_FRAME ? n - first : SCORES_PER_FRAME;
            frame[0] = FRAME_PROMPT_SCORES;
            frame[1] = (int32_t)first + 1;  /* the first token has no score */
            frame[2] = (int32_t)count;
            frame[3] = k;
            for (size_t i = 0; i < count; i++) {  /* SYM_PRED_SCORE_EACH's arrays, a position at a time */
                int32_t *at = frame + 4 + i * per;
                at[0] = scores[first + i];
                memcpy(at + 1, scores + n + (first + i) * k, 4 * (size_t)k);
                memcpy(at + 1 + k, scores + n + n * k + (first + i) * k, 4 * (size_t)k);
            }
            send_words(frame, 4 + (int)(per * count));
        }
        free(scores);
        free(frame);
        int cut = sym_kv_truncate(root, req.n_prompt - 1);
        if (cut < 0) return failed("kv_truncate", cut);
        cached = req.n_prompt - 1;
    }

    /* One branch: it feeds the rest of the prompt into the root file itself. Several: the
       prompt but its last token goes into the root, each branch forks it and feeds that token. */
    if (biases_wanted()) {
        if (vocab <= 0 || vocab > (1 << 18)) return failed("vocab_size", vocab < 0 ? vocab : -1);
        scratch = calloc((size_t)vocab, sizeof(float));
        touched = calloc((size_t)vocab, 1);
        bias_ids = malloc(sizeof(int32_t) * ((size_t)vocab + 1));
        bias_values = malloc(sizeof(float) * ((size_t)vocab + 1));
        counts = calloc(MAX_BRANCHES, sizeof(int32_t *));
        if (!scratch || !touched || !bias_ids || !bias_values || !counts) return out_of_memory();
        for (int b = 0; b < req.n; b++)
            if (!(counts[b] = calloc((size_t)vocab, sizeof(int32_t)))) return out_of_memory();
    }
    /* a sym_sampling_more goes with each draw */
    int more = min_p != 0 || repetition_penalty != 1 || req.logprobs >= 0;
    static scored_answer answers[MAX_BRANCHES];
    if (repetition_penalty != 1) {
        if (vocab <= 0 || vocab > (1 << 18)) return failed("vocab_size", vocab < 0 ? vocab : -1);
        for (int b = 0; b < req.n; b++) {
            penalized[b] = malloc(sizeof(int32_t) * (size_t)vocab);
            penalized_seen[b] = calloc((size_t)vocab, 1);
            if (!penalized[b] || !penalized_seen[b]) return out_of_memory();
            for (int i = 0; i < req.n_prompt; i++) penalize(b, prompt[i]);
        }
    }
    int32_t grammars[MAX_BRANCHES] = {0};
    if (grammar_kind >= 0) {
        grammars[0] = __sym_grammar_new(grammar_kind, grammar_source, grammar_len);
        if (grammars[0] < 0) return failed("grammar_new", grammars[0]);
        for (int b = 1; b < req.n; b++)
            if ((grammars[b] = sym_grammar_fork(grammars[0])) < 0) return failed("grammar_fork", grammars[b]);
    }
    branch br[MAX_BRANCHES];
    const int32_t *feed[MAX_BRANCHES];
    int feed_len[MAX_BRANCHES];
    int rest = req.n_prompt - cached;
    if (req.n > 1 && rest > 1) {
        sym_ticket t = sym_pred_submit_sample(root, prompt + cached, NULL, rest - 1, NULL);
        int32_t r = t < 0 ? t : sym_pred_wait_sample(t);
        if (r < 0) return failed("prefill", r);
        sym_kv_cache_prefix(root);
        cached = req.n_prompt - 1;
        rest = 1;
    }
    for (int b = 0; b < req.n; b++) {
        br[b].kv = req.n == 1 ? root : sym_kv_fork(root);
        if (br[b].kv < 0) return failed("fork", br[b].kv);
        int32_t *ids = malloc(sizeof(int32_t) * (req.max_tokens + 2));
        if (!ids) return out_of_memory();
        ids[0] = context_token;
        br[b].ids = ids + 1;
        br[b].len = 0;
        br[b].done = req.max_tokens == 0;
        br[b].text_cap = req.n_stop ? 4096 : 0;
        br[b].text = req.n_stop ? malloc(br[b].text_cap) : NULL;
        if (req.n_stop && !br[b].text) return out_of_memory();
        feed[b] = prompt + cached;
        feed_len[b] = rest;
        if (br[b].done) finish(b, FINISH_LENGTH, -1);
    }

    sym_ticket tickets[MAX_BRANCHES];
    for (int step = 0; step < req.max_tokens; step++) {
        int live = 0;
        for (int b = 0; b < req.n; b++) {
            if (br[b].done) continue;
            uint64_t seed = req.seed + (uint64_t)b * (uint64_t)req.max_tokens + (uint64_t)step;
            int biased = biases_wanted() ? bias(b, br[b].ids, br[b].len, bias_ids, bias_values) : 0;
            sym_sampling_ext s = {{req.temperature, req.top_p, top_k, req.has_seed | (more ? SYM_SAMPLING_MORE : 0),
                                   seed, NULL, 0, biased ? bias_ids : NULL, biased ? bias_values : NULL, biased,
                                   grammars[b]},
                                  {min_p, repetition_penalty, penalized[b], n_penalized[b], req.logprobs >= 0,
                                   req.logprobs >= 0 ? req.logprobs : 0}};
            tickets[b] = sym_pred_submit_sample(br[b].kv, feed[b], NULL, feed_len[b], &s.base);
            live++;
        }
        if (!live) break;
        for (int b = 0; b < req.n; b++) {
            if (br[b].done) continue;
            int32_t token = req.logprobs >= 0 ? __sym_pred_wait(tickets[b], &answers[b], 1 + 2 * req.logprobs)
                                              : sym_pred_wait_sample(tickets[b]);
            if (token < 0) return failed("pred", token);
            if (step == 0 && b == 0 && req.n == 1) sym_kv_cache_prefix(root);
            if (sym_is_eos(token) && !ignore_eos) {
                br[b].done = 1;
                finish(b, FINISH_STOP, -1);
                continue;
            }
            if (counts) counts[b][token]++;
            if (penalized[b]) penalize(b, token);
            br[b].ids[br[b].len++] = token;
            send_token(b, token, &answers[b]);
            int stop_at = req.n_stop ? find_stop(&br[b]) : -1;
            if (stop_at == -2) return out_of_memory();
            if (stop_at >= 0) {
                br[b].done = 1;
                finish(b, FINISH_STOP, stop_at);
            } else if (grammars[b] && (sym_grammar_state(grammars[b]) & SYM_GRAMMAR_MUST_END)) {
                br[b].done = 1;  /* the grammar is complete: nothing but the end could follow */
                finish(b, FINISH_STOP, -1);
            } else if (br[b].len == req.max_tokens) {
                br[b].done = 1;
                finish(b, FINISH_LENGTH, -1);
            }
            feed[b] = &br[b].ids[br[b].len - 1];
            feed_len[b] = 1;
        }
    }
    if (req.n == 1) sym_kv_cache_prefix(root);
    return 0;
}
