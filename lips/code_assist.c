/* code_assist: code completion with an application-chosen KV policy (the paper's Challenge 1).
 * Usage: code_assist [UNDO_MS] [DOC_KEEP_MS]; then one command per message (recv):
 *   open NAME TEXT    the document's KV becomes the named file doc/NAME (prefilled once; opened
 *                     again, only what the new text does not share with the old is redone)
 *   complete NAME N   fork doc/NAME, decode N tokens greedily: the suggestion
 *   undo NAME         bring back the previous suggestion (Ctrl+Z), if still kept
 *   delete NAME       the file was deleted: drop its KV now
 * A prompt server would keep all of this under one LRU policy. Here the program decides:
 * a replaced suggestion's KV stays alive UNDO_MS milliseconds (undo restores it with no
 * recomputation; after that it is closed, and it was marked low priority meanwhile);
 * documents are named files hinted keep-for DOC_KEEP_MS so they outlive the session for the
 * next one; a deleted document's name is removed and its pages freed at once. Each command
 * gets one reply line. */
#include <time.h>
#include "gallery.h"

#define MAX_DOCS 16

typedef struct {
    char name[64];
    sym_kv doc;           /* doc/NAME */
    sym_kv suggestion, previous;
    text_t *text, *previous_text;  /* each begins with the document's ids */
    int known;            /* how many of those ids doc/NAME's KV holds (-1: not known yet) */
    long long previous_until_ms;
} doc_t;

static doc_t docs[MAX_DOCS];
static text_t texts[2 * MAX_DOCS];
static char message[1 << 15], reply[1 << 15], path[96];
static int undo_ms = 5000, doc_keep_ms = 60000;

static long long now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (long long)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static void respond(const char *fmt, const char *a, const char *b) {
    int len = snprintf(reply, sizeof reply, fmt, a, b);
    sym_send(reply, len > (int)sizeof reply - 1 ? (int)sizeof reply - 1 : len);
}

static doc_t *find(const char *name, int create) {
    doc_t *free_slot = NULL;
    for (int i = 0; i < MAX_DOCS; i++) {
        if (docs[i].doc > 0 && !strcmp(docs[i].name, name)) return &docs[i];
        if (docs[i].doc <= 0 && !free_slot) free_slot = &docs[i];
    }
    if (!create || !free_slot) return NULL;
    snprintf(free_slot->name, sizeof free_slot->name, "%s", name);
    free_slot->known = -1;
    free_slot->text = &texts[2 * (free_slot - docs)];
    free_slot->previous_text = &texts[2 * (free_slot - docs) + 1];
    return free_slot;
}

static void close_previous(doc_t *d) {
    if (d->previous > 0) sym_kv_close(d->previous);
    d->previous = 0;
}

/* The undo window ends: the previous suggestion's KV goes. */
static void expire(void) {
    for (int i = 0; i < MAX_DOCS; i++)
        if (docs[i].previous > 0 && now_ms() >= docs[i].previous_until_ms) close_previous(&docs[i]);
}

/* doc/NAME's marker, doc/NAME.ids-HASH-N, is an empty named file (no pages) named after the ids
 * its KV holds: a later session reuses the KV only if its document still begins with them.
 * (A document that changed between sessions leaves its old marker behind: its name is not
 * known then. It holds no pages; `symphony kv rm` removes it.) */
static const char *marker_of(const char *name, const int32_t *ids, int n) {
    static char marker[160];
    unsigned long long h = 1469598103934665603ULL;  /* FNV-1a over the ids' bytes */
    const unsigned char *bytes = (const unsigned char *)ids;
    for (size_t i = 0; i < (size_t)n * sizeof *ids; i++) h = (h ^ bytes[i]) * 1099511628211ULL;
    snprintf(marker, sizeof marker, "doc/%s.ids-%016llx-%d", name, h, n);
    return marker;
}

static void open_doc(const char *name, const char *text) {
    static int32_t ids[TEXT_MAX_IDS];
    int n = check(sym_tokenize_prompt(text, ids, TEXT_MAX_IDS), "tokenize");
    if (n + 1 > TEXT_MAX_IDS) { respond("error: %s is over %s tokens\n", name, "4095"); return; }
    doc_t *d = find(name, 1);
    if (!d) { respond("error: too many documents%s%s\n", "", ""); return; }
    snprintf(path, sizeof path, "doc/%s", name);
    if (d->doc <= 0) d->doc = check(sym_kv_open(path, SYM_KV_CREATE), "kv_open");
    /* Documents outlive this session for DOC_KEEP_MS, and go after suggestions (priority 1). */
    check(sym_kv_hint(d->doc, 0, doc_keep_ms, 1), "kv_hint");
    /* The KV kept is what the old text shares with the new one, token for token: this
     * session knows the ids it prefilled; an earlier session's file is kept whole if its
     * marker says it holds the start of this text, else redone. */
    int have = check(sym_kv_len(d->doc), "kv_len"), keep = 0;
    const char *old_marker = NULL;
    if (d->known == have) {
        while (keep < have && keep < n - 1 && d->text->ids[keep] == ids[keep]) keep++;
        old_marker = marker_of(name, d->text->ids, have);
    } else if (have < n) {
        sym_kv found = sym_kv_open(old_marker = marker_of(name, ids, have), 0);
        if (found > 0) keep = have, sym_kv_close(found);
        else old_marker = NULL;
    }
    if (keep < have) check(sym_kv_truncate(d->doc, keep), "kv_truncate");
    /* The last token stays out: each suggestion feeds it into its own fork. */
    if (n - 1 > keep) check(sym_pred_sample(d->doc, ids + keep, NULL, n - 1 - keep, NULL), "prefill");
    if (keep != have || keep != n - 1 || !old_marker) {  /* the marker follows the KV */
        if (old_marker) sym_kv_remove(old_marker);
        check(sym_kv_close(check(sym_kv_open(marker_of(name, ids, n - 1), SYM_KV_CREATE), "kv_open")), "kv_close");
    }
    d->known = n - 1;
    /* Suggestions were for the old text. */
    close_previous(d);
    if (d->suggestion > 0) sym_kv_close(d->suggestion);
    d->suggestion = 0;
    d->text->n = 0;
    text_push(d->text, ids, n);
    char count[32];
    snprintf(count, sizeof count, "%d", n - 1 - keep);
    respond("opened %s: %s tokens prefilled\n", name, count);
}

static void complete(const char *name, int max_tokens) {
    doc_t *d = find(name, 0);
    if (!d) { respond("error: %s is not open%s\n", name, ""); return; }
    int doc_tokens = check(sym_kv_len(d->doc), "kv_len") + 1;
    /* The current suggestion becomes the undo candidate: kept UNDO_MS, evicted first. */
    close_previous(d);
    if (d->suggestion > 0) {
        d->previous = d->suggestion;
        text_t *swap = d->previous_text; d->previous_text = d->text; d->text = swap;
        check(sym_kv_hint(d->previous, 0, undo_ms, -1), "kv_hint");
        d->previous_until_ms = now_ms() + undo_ms;
        memcpy(d->text->ids, d->previous_text->ids, sizeof(int32_t) * doc_tokens);
    }
    text_t *t = d->text;
    t->n = doc_tokens;
    d->suggestion = check(sym_kv_fork(d->doc), "kv_fork");
    int fed = doc_tokens - 1;
    for (int i = 0; i < max_tokens; i++) {
        int32_t token = check(sym_pred_sample(d->suggestion, t->ids + fed, NULL, t->n - fed, NULL), "pred");
        fed = t->n;
        if (sym_is_eos(token) || text_push(t, &token, 1) < 0) break;
    }
    static char suggestion[1 << 14];
    int len = sym_detokenize(t->ids + doc_tokens, t->n - doc_tokens, suggestion, sizeof suggestion - 1);
    suggestion[len < 0 ? 0 : (len > (int)sizeof suggestion - 1 ? (int)sizeof suggestion - 1 : len)] = 0;
    respond("suggestion %s: %s\n", name, suggestion);
}

static void undo(const char *name) {
    doc_t *d = find(name, 0);
    if (!d || d->previous <= 0) { respond("undo %s: nothing kept%s\n", name, ""); return; }
    sym_kv current = d->suggestion;
    d->suggestion = d->previous;
    d->previous = current;
    text_t *swap = d->text; d->text = d->previous_text; d->previous_text = swap;
    check(sym_kv_hint(d->suggestion, 0, -1, 0), "kv_hint");
    check(sym_kv_hint(d->previous, 0, undo_ms, -1), "kv_hint");
    d->previous_until_ms = now_ms() + undo_ms;
    char count[32];
    snprintf(count, sizeof count, "%d", check(sym_kv_len(d->suggestion), "kv_len"));
    respond("undo %s: restored %s tokens, none recomputed\n", name, count);
}

static void delete_doc(const char *name) {
    doc_t *d = find(name, 0);
    snprintf(path, sizeof path, "doc/%s", name);
    if (d) {
        if (d->known >= 0) sym_kv_remove(marker_of(name, d->text->ids, d->known));
        close_previous(d);
        if (d->suggestion > 0) sym_kv_close(d->suggestion);
        /* Drop on close: the pages go with the last handle, not when the pool needs them. */
        sym_kv_hint(d->doc, SYM_HINT_DROP_ON_CLOSE, -1, 0);
        sym_kv_close(d->doc);
        memset(d, 0, sizeof *d);
    }
    int removed = sym_kv_remove(path);
    respond(removed == 0 || removed == SYM_ENOENT ? "deleted %s%s\n" : "error: cannot delete %s%s\n", name, "");
}

int main(int argc, char **argv) {
    if (argc > 1) undo_ms = atoi(argv[1]);
    if (argc > 2) doc_keep_ms = atoi(argv[2]);
    for (;;) {
        int len = sym_recv(message, sizeof message - 1);
        if (len == SYM_ECLOSED) break;
        check(len, "recv");
        message[len] = 0;
        expire();
        char command[16], name[64];
        int consumed = 0;
        if (sscanf(message, "%15s %63s %n", command, name, &consumed) < 2) {
            respond("error: expected COMMAND NAME ...%s%s\n", "", "");
            continue;
        }
        const char *rest = message + consumed;
        if (!strcmp(command, "open")) open_doc(name, rest);
        else if (!strcmp(command, "complete")) complete(name, atoi(rest));
        else if (!strcmp(command, "undo")) undo(name);
        else if (!strcmp(command, "delete")) delete_doc(name);
        else respond("error: unknown command %s%s\n", command, "");
    }
    /* Documents stay (named, keep-for hinted) for the next session; everything else goes. */
    for (int i = 0; i < MAX_DOCS; i++) {
        if (docs[i].doc <= 0) continue;
        close_previous(&docs[i]);
        if (docs[i].suggestion > 0) sym_kv_close(docs[i].suggestion);
        sym_kv_close(docs[i].doc);
    }
    return 0;
}
