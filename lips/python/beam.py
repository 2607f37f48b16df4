"""beam, in Python: beam search with forks, result for result like beam.c.
Usage: beam PROMPT [WIDTH] [STEPS]
Each beam is a KV file; every step submits one top-k pred per beam before waiting on any (they
share a batch), keeps the WIDTH best continuations by total log-probability, and forks the
parents' KV files for them (pages shared, copy-on-write). Prints the best beam and its score."""
import symphony
from symphony import Greedy, Kv, TopK


def main(args: list[str]) -> int:
    prompt = args[0] if args else "Once upon a time"
    width = int(args[1]) if len(args) > 1 else 3
    steps = int(args[2]) if len(args) > 2 else 12
    ids = symphony.tokenize(prompt, prompt=True)
    # A beam: (its KV file holding every token but the last, its tokens, its score).
    first = Kv.create()
    if len(ids) > 1:
        first.next_token(ids[:-1], Greedy())
    beams = [(first, ids, 0.0)]
    for _ in range(steps):
        tickets = [kv.submit(tokens[-1:], TopK(width)) for kv, tokens, _ in beams]
        candidates = [(score + logprob, parent, token)
                      for parent, ((_, _, score), ticket) in enumerate(zip(beams, tickets))
                      for token, logprob in ticket.wait()]
        # Best first; sorted() is stable, so ties keep the parent's order and its ranking.
        best = sorted(candidates, key=lambda candidate: -candidate[0])[:width]
        survivors = [(beams[parent][0].fork(), beams[parent][1] + [token], score) for score, parent, token in best]
        for kv, _, _ in beams:
            kv.close()
        beams = survivors
    _, tokens, score = beams[0]
    symphony.send(symphony.detokenize(tokens))
    symphony.send(f"\nscore {score:.4f}\n")
    for kv, _, _ in beams:
        kv.close()
    return 0


WitWorld = symphony.program(main)
