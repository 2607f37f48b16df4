/* swarm: SWARM-style agents handing a conversation to each other, inside the server.
 * Usage: swarm setup "AGENT 0 IDS" "AGENT 1 IDS" ...
 *        swarm TURNS TOKENS "USER IDS"
 * `setup` computes each agent's instructions once into a named, pinned KV file swarm/agentN.
 * A conversation starts with agent 0 (triage); each turn the active agent's KV (a fork of its
 * instructions, kept for the whole conversation) gets the conversation history it has not seen
 * yet and writes TOKENS; the turn's tokens pick the next agent (sum of ids modulo the number
 * of agents), a handoff decided by the program, not by a client. A prompt-API client sends the
 * agent's instructions plus the whole history every turn. Sends one line of ids per turn. */
#include "bench_lip.h"

#define MAX_AGENTS 16
#define MAX_HISTORY 8192

static int32_t ids[SEQ_MAX_PENDING], history[MAX_HISTORY];

static int setup(int argc, char **argv) {
    for (int a = 0; a + 2 < argc && a < MAX_AGENTS; a++) {
        char name[64];
        snprintf(name, sizeof name, "swarm/agent%d", a);
        sym_kv_remove(name);
        seq_t *s = seq_new(check(sym_kv_open(name, SYM_KV_CREATE | SYM_KV_EXCLUSIVE), "kv_open"));
        check(sym_kv_hint(s->kv, SYM_HINT_PINNED, 0, 0), "kv_hint");
        seq_push(s, ids, parse_ids(argv[a + 2], ids, SEQ_MAX_PENDING));
        seq_flush(s);
        seq_close(s);
    }
    return 0;
}

int main(int argc, char **argv) {
    if (argc >= 3 && strcmp(argv[1], "setup") == 0) return setup(argc, argv);
    if (argc != 4) {
        fprintf(stderr, "usage: swarm setup \"AGENT IDS\" ... | swarm TURNS TOKENS \"USER IDS\"\n");
        return 2;
    }
    int turns = atoi(argv[1]), tokens = atoi(argv[2]), agents = 0;
    for (; agents < MAX_AGENTS; agents++) {  /* how many agents were set up */
        char name[64];
        snprintf(name, sizeof name, "swarm/agent%d", agents);
        sym_kv probe = sym_kv_open(name, SYM_KV_READ_ONLY);
        if (probe < 0) break;
        sym_kv_close(probe);
    }
    if (!agents) { fprintf(stderr, "swarm: run `swarm setup` first\n"); return 1; }
    seq_t *conv[MAX_AGENTS] = {0};
    int seen[MAX_AGENTS] = {0};
    int n_history = parse_ids(argv[3], history, MAX_HISTORY), agent = 0;
    for (int turn = 0; turn < turns; turn++) {
        if (!conv[agent]) {
            char name[64];
            snprintf(name, sizeof name, "swarm/agent%d", agent);
            sym_kv instructions = check(sym_kv_open(name, SYM_KV_READ_ONLY), "kv_open");
            conv[agent] = seq_new(check(sym_kv_fork(instructions), "kv_fork"));
            sym_kv_close(instructions);
        }
        seq_t *s = conv[agent];
        seq_push(s, history + seen[agent], n_history - seen[agent]);
        generate_one(s, tokens);
        send_ids(s->out, s->n_out);
        if (n_history + s->n_out > MAX_HISTORY) return 1;
        memcpy(history + n_history, s->out, sizeof(int32_t) * s->n_out);
        n_history += s->n_out;
        seen[agent] = n_history;
        long sum = 0;
        for (int i = 0; i < s->n_out; i++) sum += s->out[i];
        agent = (int)(sum % agents);
    }
    for (int a = 0; a < agents; a++) if (conv[a]) seq_close(conv[a]);
    return 0;
}
