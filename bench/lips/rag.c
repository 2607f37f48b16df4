/* rag: retrieval-augmented answering with the application's own KV policy.
 * Usage: rag DOC_NAME PRIORITY MAX_TOKENS "DOC IDS" "QUESTION IDS"
 *
 * Each document's KV is a named file, rag/DOC_NAME, computed once and kept across processes;
 * each query forks it and appends only the question. The client passes PRIORITY, how often the
 * document was asked for so far: set as the file's eviction priority on every use, KVFS then
 * evicts the least popular documents first (LFU, least recently used among equals), where the
 * OpenAI path's automatic prefix cache can only evict the least recently used pages.
 *
 * Concurrent queries for a missing document: the first to create the file fills it (with its
 * question, in the one pred a prompt would take, then cuts it back to the document); a file
 * is complete once its pinned, empty marker rag/DOC_NAME.ready exists (looking both up
 * involves no blocking call, so no other process runs in between). A query that finds the
 * file still being filled computes the document on its own, as a prompt would.
 * Sends the answer's ids as one line; logs "rag: hit", "rag: filled" or "rag: private". */
#include "bench_lip.h"

static int32_t doc[SEQ_MAX_PENDING], question[SEQ_MAX_PENDING];

int main(int argc, char **argv) {
    if (argc != 6) {
        fprintf(stderr, "usage: rag DOC_NAME PRIORITY MAX_TOKENS \"DOC IDS\" \"QUESTION IDS\"\n");
        return 2;
    }
    char name[128], marker[140];
    snprintf(name, sizeof name, "rag/%s", argv[1]);
    snprintf(marker, sizeof marker, "%s.ready", name);
    int priority = atoi(argv[2]), max_tokens = atoi(argv[3]);
    int n_doc = parse_ids(argv[4], doc, SEQ_MAX_PENDING), n_question = parse_ids(argv[5], question, SEQ_MAX_PENDING);
    if (n_doc < 1 || n_question < 1 || n_doc > SEQ_MAX_PENDING || n_question > SEQ_MAX_PENDING) return 2;

    seq_t *query;
    sym_kv file = sym_kv_open(name, 0);
    sym_kv ready = file >= 0 ? sym_kv_open(marker, 0) : SYM_ENOENT;
    if (file >= 0 && ready >= 0) {  /* a complete document: fork it */
        sym_kv_close(ready);
        check(sym_kv_hint(file, 0, -1, priority), "kv_hint");  /* -1: no keep-for window */
        query = seq_new(check(sym_kv_fork(file), "kv_fork"));
        fprintf(stderr, "rag: hit\n");
    } else if (file < 0 && (sym_kv_remove(marker), file = sym_kv_open(name, SYM_KV_CREATE | SYM_KV_EXCLUSIVE)) >= 0) {
        /* Ours to fill. Document and question go in one pred, as in a prompt (a second pred
           would cost a second batch step); then a fork keeps the question for this query, the
           file is cut back to the document, and the marker says it is complete. */
        check(sym_kv_hint(file, 0, -1, priority), "kv_hint");  /* -1: no keep-for window */
        static int32_t both[2 * SEQ_MAX_PENDING];
        memcpy(both, doc, sizeof(int32_t) * n_doc);
        memcpy(both + n_doc, question, sizeof(int32_t) * n_question);
        int32_t first = check(sym_pred_sample(file, both, NULL, n_doc + n_question, NULL), "prefill");
        query = seq_new(check(sym_kv_fork(file), "kv_fork"));
        check(sym_kv_truncate(file, n_doc), "kv_truncate");
        sym_kv mark = check(sym_kv_open(marker, SYM_KV_CREATE), "kv_open marker");
        check(sym_kv_hint(mark, SYM_HINT_PINNED, 0, 0), "kv_hint marker");
        sym_kv_close(mark);
        sym_kv_close(file);
        fprintf(stderr, "rag: filled\n");
        if (sym_is_eos(first) || max_tokens < 1) {
            send_ids(NULL, 0);
        } else {
            seq_push(query, &first, 1);
            generate_one(query, max_tokens - 1);
            memmove(query->out + 1, query->out, sizeof(int32_t) * query->n_out);
            query->out[0] = first;
            send_ids(query->out, query->n_out + 1);
        }
        seq_close(query);
        return 0;
    } else {  /* being filled by another query: compute it here */
        query = seq_new(check(sym_kv_create(), "kv_create"));
        seq_push(query, doc, n_doc);
        fprintf(stderr, "rag: private\n");
    }
    if (file >= 0) sym_kv_close(file);
    seq_push(query, question, n_question);
    generate_one(query, max_tokens);
    send_ids(query->out, query->n_out);
    seq_close(query);
    return 0;
}
