"""Each system call means one thing whichever ABI reaches it (lip/syscalls.py): the same table
of calls, normal and refused, through a C guest (core-module ABI: pointers) and a Python guest
(component ABI: values), gives the same answers, and the ones this table says."""
from __future__ import annotations

from pathlib import Path

import pytest

from guests import build_c
from symphony_os.engine import Engine
from symphony_os.errors import ErrorCode as E
from symphony_os.lip.runtime import Runtime
from test_python_sdk import build_python

GUESTS = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def engine(stories_path):
    engine = Engine.from_path(stories_path, device="cpu", page_size=16, num_pages=512)
    bob = engine.session("bob")
    bob.close(bob.open("secret", 1))
    yield engine
    engine.stop()


def expected_table(engine: Engine) -> dict[str, str]:
    ids = engine.tokenize("Once upon a time", add_special_tokens=False)
    kv = engine.session()
    handle = kv.create()
    greedy = engine.pred(kv, handle, ids).token
    from symphony_os.engine.sampling import Sample, ScoreEach, TopK
    top = engine.pred(kv, handle, [greedy], want=TopK(3)).top_ids[0]
    penalized = kv.create()
    second = engine.pred(kv, penalized, ids, want=Sample(repetition_penalty=1e6, penalized=(greedy,))).token
    after = engine.pred(kv, penalized, [second]).token
    scored = engine.pred(kv, penalized, [second], want=Sample(logprobs=True, top_logprobs=2))  # (the 2nd `second`)
    waited = engine.pred(kv, penalized, [second], want=Sample(logprobs=True, top_logprobs=2))
    scores = engine.pred(kv, kv.create(), ids[:4], want=ScoreEach(2))
    kv.close_all()
    table = {
        "vocab-size": engine.loaded.config.vocab_size, "bos-id": engine.loaded.bos_token_id,
        "model-name": engine.loaded.name, "tokenize": len(ids), "detokenize": engine.detokenize(ids),
        "detokenize-bad-id": E.INVALID_ARGUMENT,
        "kv-len-new": 0, "pred-greedy": greedy, "kv-len": len(ids), "kv-fork-len": len(ids), "kv-extract-len": 3,
        "kv-extract-outside": E.INVALID_ARGUMENT, "kv-merge-len": 6, "kv-truncate": 0, "kv-truncated-len": 2,
        "kv-close": 0, "kv-len-closed": E.BAD_HANDLE, "kv-close-again": E.BAD_HANDLE, "pred-closed": E.BAD_HANDLE,
        "kv-open-create": 1,
        "kv-open-exclusive": E.FILE_EXISTS, "kv-remove": 0, "kv-open-missing": E.FILE_NOT_FOUND,
        "kv-open-dot-dot": E.INVALID_ARGUMENT, "kv-remove-foreign": E.PERMISSION_DENIED,
        "kv-hint-bad-flags": E.INVALID_ARGUMENT, "kv-hint": 0, "kv-truncate-past-end": E.INVALID_ARGUMENT,
        "pred-wait-top-k": 3, "top-k-first": top, "pred-wait-again": E.BAD_HANDLE,
        "pred-wait-unknown": E.BAD_HANDLE, "pred-bad-token": E.INVALID_ARGUMENT,
        "pred-position-gap": E.POSITION_ERROR, "pred-after-errors": 1,
        # min-p and the repetition penalty: the best token penalized leaves the second; a min-p
        # of 1 keeps the best alone, whatever the temperature; a penalty of 0 is refused
        "pred-penalized": second, "pred-min-p-one": after, "pred-no-penalty": E.INVALID_ARGUMENT,
        "pred-logprobs": scored.token, "pred-logprob-milli": round(scored.logprob * 1000),
        "pred-top-logprob-ids": scored.top_ids[0] * 100000 + scored.top_ids[1],
        "pred-wait-logprobs": waited.token, "pred-wait-logprob-milli": round(waited.logprob * 1000),
        "pred-score-each": 3, "score-last-milli": round(scores.scores[2] * 1000),
        "score-last-top": scores.score_top_ids[2][0], "score-each-one-token": E.INVALID_ARGUMENT,
        "tool": "42", "tool-unknown": E.UNSUPPORTED, "recv": "ping", "recv-closed": E.CLOSED,
    }
    return {label: str(int(value) if isinstance(value, E) else value) for label, value in table.items()}


def run_table(engine: Engine, program: Path) -> dict[str, str]:
    out = []
    with Runtime(engine) as runtime:
        process = runtime.spawn(runtime.load(program), on_output=out.append)
        process.deliver(b"ping")
        process.close_input()
        assert runtime.wait(process, 120) == 0, (process.end_reason, process.log[-3:])
    lines = b"".join(out).decode().splitlines()
    return dict(line.split("=", 1) for line in lines)


def test_a_c_guest_and_a_python_guest_get_the_same_answers(engine, tmp_path):
    c = run_table(engine, build_c(GUESTS / "c_guests" / "behaviour.c", tmp_path / "behaviour.wasm"))
    python = run_table(engine, build_python("behaviour", GUESTS / "python_guests"))
    expected = expected_table(engine)
    assert list(c) == list(expected) and c == expected
    assert python == c
