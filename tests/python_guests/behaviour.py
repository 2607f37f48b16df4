"""The system-call behaviour table (tests/test_system_calls.py), through the component ABI: the
same calls, in the same order, as tests/c_guests/behaviour.c makes through the core-module ABI.
Sends one line `label=value` per step: a call's result, or its (negative) error code."""
import symphony
from symphony import Kv, TopK


def report(label: str, value) -> None:
    symphony.send(f"{label}={value}\n")


def outcome(call):
    try:
        return call()
    except symphony.SymphonyError as error:
        return error.code


def main(args: list[str]) -> int:
    report("vocab-size", symphony.vocab_size())
    report("bos-id", symphony.bos_id())
    report("model-name", symphony.model_name())
    ids = symphony.tokenize("Once upon a time")
    report("tokenize", len(ids))
    report("detokenize", symphony.detokenize(ids))
    report("detokenize-bad-id", outcome(lambda: symphony.detokenize([-1])))

    kv = Kv.create()
    report("kv-len-new", len(kv))
    token = kv.next_token(ids)
    report("pred-greedy", token)
    report("kv-len", len(kv))
    fork = kv.fork()
    report("kv-fork-len", len(fork))
    part = kv.extract(0, 3)
    report("kv-extract-len", len(part))
    report("kv-extract-outside", outcome(lambda: kv.extract(2, 1000)))
    merged = part.merge(part)
    report("kv-merge-len", len(merged))
    report("kv-truncate", outcome(lambda: fork.truncate(2)) or 0)
    report("kv-truncated-len", len(fork))
    handle = fork.handle
    report("kv-close", outcome(fork.close) or 0)
    report("kv-len-closed", outcome(lambda: len(Kv(handle))))
    report("kv-close-again", outcome(Kv(handle).close) or 0)
    report("pred-closed", outcome(lambda: Kv(handle).next_token(ids[:1])))
    report("kv-open-create", int(outcome(lambda: Kv.open("table/doc", create=True).handle) > 0))
    report("kv-open-exclusive", outcome(lambda: Kv.open("table/doc", create=True, exclusive=True)))
    report("kv-remove", outcome(lambda: Kv.remove("table/doc")) or 0)
    report("kv-open-missing", outcome(lambda: Kv.open("table/doc")))
    report("kv-open-dot-dot", outcome(lambda: Kv.open("../x", create=True)))
    report("kv-remove-foreign", outcome(lambda: Kv.remove("@bob/secret")))
    report("kv-hint-bad-flags", outcome(lambda: symphony._check(symphony._kv.kv_hint, kv.handle, 4, -1, 0)))
    report("kv-hint", outcome(lambda: kv.hint(pinned=True, keep_for_ms=1000, priority=1)) or 0)
    report("kv-truncate-past-end", outcome(lambda: kv.truncate(1000)))

    ticket = kv.submit([token], TopK(3))
    top = ticket.wait()
    report("pred-wait-top-k", len(top))
    report("top-k-first", top[0][0])
    report("pred-wait-again", outcome(ticket.wait))
    report("pred-wait-unknown", outcome(symphony.Ticket(999).wait))
    report("pred-bad-token", outcome(lambda: kv.next_token([1 << 20])))
    report("pred-position-gap", outcome(lambda: symphony._check(symphony.inference.pred, kv.handle, [token], [5000],
                                                               symphony.Greedy().want()).value))
    report("pred-after-errors", int(kv.next_token([token]) >= 0))
    penalized = symphony.Kv.create()
    second = penalized.next_token(ids, symphony.Sampler(temperature=0.0, repetition_penalty=1e6, penalized=[token]))
    report("pred-penalized", second)
    report("pred-min-p-one", penalized.next_token([second], symphony.Sampler(temperature=1.0, seed=1, min_p=1.0)))
    report("pred-no-penalty", outcome(lambda: penalized.next_token([second], symphony.Sampler(
        temperature=0.0, repetition_penalty=0.0, penalized=[token]))))
    scored = penalized.next_token([second], symphony.Sampler(temperature=0.0, logprobs=True, top_logprobs=2))
    report("pred-logprobs", scored.token)
    report("pred-logprob-milli", round(scored.logprob * 1000))
    report("pred-top-logprob-ids", scored.top[0][0] * 100000 + scored.top[1][0])
    waited = penalized.submit([second], symphony.Sampler(temperature=0.0, logprobs=True, top_logprobs=2)).wait()
    report("pred-wait-logprobs", waited.token)
    report("pred-wait-logprob-milli", round(waited.logprob * 1000))
    scores = symphony.Kv.create().score(ids[:4], 2)
    report("pred-score-each", len(scores))
    report("score-last-milli", round(scores[2].logprob * 1000))
    report("score-last-top", scores[2].top[0][0])
    report("score-each-one-token", outcome(lambda: symphony.Kv.create().score(ids[:1], 2)))

    report("tool", symphony.tool("calculator", "6*7"))
    report("tool-unknown", outcome(lambda: symphony.tool("format-disk", "now")))
    report("recv", symphony.recv())
    message = symphony.recv()
    report("recv-closed", -15 if message is None else message)  # the SDK's None is the ABI's `closed`
    return 0


WitWorld = symphony.program(main)
