"""hello, in Python: the paper's basic autoregressive decoding, token for token like hello.c.
Usage: hello [PROMPT] [MAX_TOKENS]
Fills a KV file with the prompt, then repeatedly asks for the next-token distribution, takes
its argmax (the distribution stays on the host: only the id crosses), appends it and streams
the text."""
import symphony
from symphony import Kv, TextStream


def main(args: list[str]) -> int:
    prompt = args[0] if args else "Once upon a time"
    max_tokens = int(args[1]) if len(args) > 1 else 32
    ids = symphony.tokenize(prompt, prompt=True)
    eos = set(symphony.eos_ids())
    text = TextStream(ids)
    symphony.send(text.text())
    with Kv.create() as kv:
        feed = ids
        for _ in range(max_tokens):
            best = kv.pred(feed).argmax()
            if best in eos:
                break
            piece = text.push(best)
            if piece:
                symphony.send(piece)
            feed = [best]
    symphony.send(text.finish() + "\n")
    return 0


WitWorld = symphony.program(main)
