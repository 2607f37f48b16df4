"""Grammars as system calls (engine/grammar.py over llguidance): a C guest decodes under a JSON
schema, a regex and a Lark grammar, and what it writes parses and matches; the calls that move,
copy and step back a grammar answer as the WIT says; hostile grammars get an error, never a hang."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from guests import build_c
from symphony_os.engine import Engine
from symphony_os.engine.grammar import MAX_GRAMMAR_BYTES
from symphony_os.engine.sampling import Sample
from symphony_os.errors import ErrorCode as E
from symphony_os.errors import InvalidArgument
from symphony_os.lip.runtime import Runtime

GUEST = Path(__file__).resolve().parent / "c_guests" / "grammar.c"

SCHEMAS = {
    "nested object with required fields": {
        "type": "object", "additionalProperties": False, "required": ["name", "pet"],
        "properties": {"name": {"type": "string", "maxLength": 8},
                       "pet": {"type": "object", "additionalProperties": False, "required": ["kind", "age"],
                               "properties": {"kind": {"enum": ["cat", "dog", "bird"]},
                                              "age": {"type": "integer", "minimum": 0, "maximum": 30}}}}},
    "enum and boolean": {
        "type": "object", "additionalProperties": False, "required": ["mood", "happy"],
        "properties": {"mood": {"enum": ["glad", "sad", "calm"]}, "happy": {"type": "boolean"}}},
    "array of bounded items": {
        "type": "object", "additionalProperties": False, "required": ["tags"],
        "properties": {"tags": {"type": "array", "minItems": 1, "maxItems": 3,
                                "items": {"type": "string", "maxLength": 6}}}},
}


def conforms(value, schema: dict) -> bool:
    """A check of what these schemas use (no jsonschema dependency for it)."""
    if "enum" in schema:
        return value in schema["enum"]
    kind = schema.get("type")
    if kind == "object":
        return (isinstance(value, dict) and set(schema["required"]) <= set(value)
                and set(value) <= set(schema["properties"])
                and all(conforms(value[key], schema["properties"][key]) for key in value))
    if kind == "array":
        return (isinstance(value, list) and schema.get("minItems", 0) <= len(value) <= schema.get("maxItems", 1 << 30)
                and all(conforms(item, schema["items"]) for item in value))
    if kind == "string":
        return isinstance(value, str) and len(value) <= schema.get("maxLength", 1 << 30)
    if kind == "integer":
        return (isinstance(value, int) and not isinstance(value, bool)
                and schema.get("minimum", -1 << 60) <= value <= schema.get("maximum", 1 << 60))
    if kind == "boolean":
        return isinstance(value, bool)
    raise AssertionError(f"no check for {schema}")


@pytest.fixture(scope="module")
def engine(stories_path):
    engine = Engine.from_path(stories_path, device="cpu", page_size=16, num_pages=256)
    yield engine
    engine.stop()


@pytest.fixture(scope="module")
def guest(tmp_path_factory):
    return build_c(GUEST, tmp_path_factory.mktemp("grammar") / "grammar.wasm")


def run(engine: Engine, program: Path, kind: int, source: str, args=()) -> str:
    out = []
    with Runtime(engine) as runtime:
        process = runtime.spawn(runtime.load(program), args=list(args), on_output=out.append)
        process.deliver(str(kind).encode())
        process.deliver(source.encode())
        process.close_input()
        assert runtime.wait(process, 300) == 0, (process.end_reason, process.log[-3:])
    return b"".join(out).decode()


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_a_program_decodes_json_that_its_schema_accepts(engine, guest, name):
    schema = SCHEMAS[name]
    text = run(engine, guest, 0, json.dumps(schema), ["400"])
    assert conforms(json.loads(text), schema), text


def test_a_regex_and_a_lark_grammar(engine, guest):
    text = run(engine, guest, 1, r"(cat|dog)s? [0-9]{2}", ["40"])
    assert re.fullmatch(r"(cat|dog)s? [0-9]{2}", text), text
    lark = 'start: "The " ANIMAL " is " COLOR "."\nANIMAL: "cat" | "dog"\nCOLOR: "red" | "blue"\n'
    text = run(engine, guest, 2, lark, ["40"])
    assert re.fullmatch(r"The (cat|dog) is (red|blue)\.", text), text


def test_the_grammar_calls_answer_as_the_wit_says(engine, guest):
    schema = json.dumps(SCHEMAS["enum and boolean"])
    answers = dict(line.split("=") for line in run(engine, guest, 0, schema, ["0", "calls"]).splitlines())
    assert {key: int(value) for key, value in answers.items()} == {
        "new": 1, "decoded": 1, "state-after": 3,  # a complete object: may end, must end
        "fork": 1, "rollback": 0, "state-rolled-back": 0, "accept-all": 0, "state-accepted": 1,
        "accept-refused": E.INVALID_ARGUMENT, "rollback-too-far": E.INVALID_ARGUMENT, "close": 0,
        "state-closed": E.BAD_HANDLE, "close-fork": 0, "bad-kind": E.INVALID_ARGUMENT,
        "not-a-schema": E.INVALID_ARGUMENT, "bad-handle-in-sampling": E.BAD_HANDLE}


def test_hostile_grammars_get_an_error_or_an_end_never_a_hang(engine, guest):
    # More than the limit: refused before llguidance sees it.
    big = json.dumps({"type": "object", "description": "x" * MAX_GRAMMAR_BYTES})
    with pytest.raises(InvalidArgument, match="at most"):
        engine.grammar(0, big)
    # A regex whose automaton blows up, and one that never ends: decoding stops at the token
    # budget (or the matcher's error), and the host goes on.
    for regex in (r"(a|aa)*(a|aa)*(a|aa)*b{1000}", r"(x[ab]*)+", r"a{0,65535}{0,65535}"):
        text = run(engine, guest, 1, regex, ["30"])
        assert len(text) < 2000
    # A grammar that derives nothing: refused when made or at its first token, as invalid-argument.
    assert re.fullmatch(r"(grammar-new|decode)=-1\n", run(engine, guest, 2, "start: start", ["5"]))


def test_a_grammar_in_flight_is_not_touched_and_the_engine_api_takes_one(engine):
    grammar = engine.grammar(1, "[0-9]{3}")
    session = engine.session()
    handle = session.create()
    ids = engine.tokenize("Once upon a time", add_special_tokens=False)
    tokens = [engine.pred(session, handle, ids, want=Sample(grammar=grammar)).token]
    while not grammar.stopped:
        tokens.append(engine.pred(session, handle, [tokens[-1]], want=Sample(grammar=grammar)).token)
    session.close_all()
    assert re.fullmatch(r"[0-9]{3}", engine.detokenize(tokens)), engine.detokenize(tokens)


def test_both_sampling_paths_keep_to_a_grammar_and_move_it_on(engine):
    """The host reference and the batched kernel (the GPU's path, here under TRITON_INTERPRET)
    draw only what the grammar allows, and each row's grammar takes its token; a failed
    grammar fails its row alone."""
    import torch

    from symphony_os.engine.sampling import process_logits_batched, process_logits_reference

    vocab = engine.loaded.config.vocab_size
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(0))
    for process in (process_logits_reference, process_logits_batched):
        digits, letters = engine.grammar(1, "[0-9]+"), engine.grammar(1, "[a-z]+")
        wants = [Sample(grammar=digits), Sample(temperature=1.0, seed=3, grammar=letters), Sample()]
        results = process(logits, wants, torch.Generator().manual_seed(0))
        assert re.fullmatch("[0-9]+", engine.detokenize([results[0].token]).strip()), results[0]
        assert re.fullmatch("[a-z]+", engine.detokenize([results[1].token]).strip()), results[1]
        assert results[2].token == int(logits[2].argmax())
        digits.rollback(1)  # each took its token: one to step back
        letters.rollback(1)
        with pytest.raises(InvalidArgument):
            digits.rollback(1)


def test_a_python_guest_decodes_under_a_grammar_too(engine):
    from test_python_sdk import build_python

    schema = SCHEMAS["nested object with required fields"]
    program = build_python("grammar_json", Path(__file__).resolve().parent / "python_guests")
    out = []
    with Runtime(engine) as runtime:
        process = runtime.spawn(runtime.load(program), on_output=out.append)
        process.deliver(json.dumps(schema).encode())
        process.close_input()
        assert runtime.wait(process, 300) == 0, (process.end_reason, process.log[-3:])
    text, _, calls = b"".join(out).decode().rpartition("\n")
    assert conforms(json.loads(text), schema), text
    assert calls == "must-end=True again=True refused=yes"


def test_the_engine_computes_grammar_masks_while_the_forward_runs(engine, monkeypatch):
    """The mask of a row sampled under a grammar is computed on a thread of its own during the
    forward pass, not after it: here the forward waits until the mask is there."""
    import threading

    from symphony_os.engine.grammar import Grammar

    computed = threading.Event()
    real_mask, real_run = Grammar.allowed_bitmask, engine.runner.run

    def mask(self, out):
        real_mask(self, out)
        computed.set()

    def run(seqs):
        assert computed.wait(timeout=60), "no mask was computed while the forward ran"
        return real_run(seqs)

    monkeypatch.setattr(Grammar, "allowed_bitmask", mask)
    monkeypatch.setattr(engine.runner, "run", run)
    grammar = engine.grammar(1, "[0-9]{2}")
    session = engine.session()
    handle = session.create()
    token = engine.pred(session, handle, engine.tokenize("Once upon a time", add_special_tokens=False),
                        want=Sample(grammar=grammar)).token
    session.close_all()
    assert re.fullmatch("[0-9]", engine.detokenize([token]).strip())
