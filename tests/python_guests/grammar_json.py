"""Constrained decoding from Python: decodes greedily under the JSON schema it receives (after a
short prompt) and sends the text; then a line of what the grammar calls answered."""
import symphony
from symphony import Grammar, Kv, Sampler


def main(args: list[str]) -> int:
    grammar = Grammar.json_schema(symphony.recv())
    sampler = Sampler(temperature=0.0, grammar=grammar)
    kv = Kv.create()
    eos = set(symphony.eos_ids())
    tokens: list[int] = []
    token = kv.next_token(symphony.tokenize("Once upon a time"), sampler)
    while token not in eos and len(tokens) < 400:
        tokens.append(token)
        if grammar.must_end:
            break
        token = kv.next_token([token], sampler)
    symphony.send(symphony.detokenize(tokens))
    copy = grammar.fork()
    grammar.rollback(len(tokens))
    grammar.accept(tokens)
    try:
        grammar.accept(tokens[:1])
        refused = "no"
    except symphony.InvalidArgument:
        refused = "yes"
    symphony.send(f"\nmust-end={copy.must_end} again={grammar.must_end} refused={refused}")
    copy.close()
    grammar.close()
    return 0


WitWorld = symphony.program(main)
