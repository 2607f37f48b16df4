"""self_consistency, in Python: ask once, answer K times under a grammar, vote; like
self_consistency.c (the same draws for the same seed, the same transcript).
Usage: self_consistency QUESTION K [MAX_TOKENS] [TEMPERATURE] [SEED]"""
import symphony
from symphony import Grammar, Kv, Sampler

MAX_BRANCHES, MAX_ANSWER_TOKENS = 16, 24
ANSWER_REGEX = "[A-Za-z0-9][A-Za-z0-9 ]{0,40}"


def main(args: list[str]) -> int:
    question = args[0]
    k = min(max(int(args[1]), 1), MAX_BRANCHES)
    max_tokens = int(args[2]) if len(args) > 2 else 12
    if not 1 <= max_tokens <= MAX_ANSWER_TOKENS:
        max_tokens = MAX_ANSWER_TOKENS
    temperature = float(args[3]) if len(args) > 3 else 1.0
    seed = int(args[4]) if len(args) > 4 else 0
    prompt = symphony.tokenize(question, prompt=True)
    eos = set(symphony.eos_ids())
    root = Kv.create()
    if len(prompt) > 1:
        root.next_token(prompt[:-1])  # the last token comes per branch
    pristine = Grammar.regex(ANSWER_REGEX)
    branches = [root.fork() for _ in range(k)]
    grammars = [pristine.fork() for _ in range(k)]
    answers: list[list[int]] = [[] for _ in range(k)]
    done = [False] * k
    for step in range(max_tokens):
        tickets = {}
        for b in range(k):  # every live branch's pred first: they share the batch
            if done[b]:
                continue
            sampler = Sampler(temperature=temperature, seed=seed + b * 1000003 + step, grammar=grammars[b])
            feed = [prompt[-1]] if step == 0 else answers[b][-1:]
            tickets[b] = branches[b].submit(feed, sampler)
        if not tickets:
            break
        for b, ticket in tickets.items():
            token = ticket.wait()
            if token in eos:
                done[b] = True
                continue
            answers[b].append(token)
            if grammars[b].must_end or len(answers[b]) == max_tokens:
                done[b] = True
    keys = [symphony.detokenize(answer).strip(" ").lower() for answer in answers]
    for b, key in enumerate(keys):
        symphony.send(f"[{b}] {key}\n")
    votes = [keys.count(key) for key in keys]
    best = votes.index(max(votes))
    symphony.send(f"vote: {keys[best]} ({votes[best]} of {k})\n")
    for branch, grammar in zip(branches, grammars):
        branch.close()
        grammar.close()
    pristine.close()
    root.close()
    return 0


WitWorld = symphony.program(main)
