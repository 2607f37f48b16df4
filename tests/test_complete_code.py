"""lips/complete_code on the bundled default model: its completions are what the engine's Python
API computes with the same decoding (token healing, then greedy over the top 8 without repeated
n-grams, cut at the end of the block), and a new version of the buffer reuses the KV of the
tokens it shares with the last one."""
import re

import pytest
from guests import lip

from symphony_os.engine.loop import Engine
from symphony_os.engine.sampling import TopK
from symphony_os.lip.runtime import Runtime
from symphony_os.model.loader import DEFAULT_MODEL_DIR


def repeats(history: list[int], token: int, ngram: int) -> bool:
    if ngram <= 0 or len(history) < ngram:
        return False
    tail = history[len(history) - ngram + 1:] + [token]
    return any(history[i:i + ngram] == tail for i in range(len(history) - ngram + 1))


def block_end(text: str) -> int:
    match = re.search(r"\n\n[^\n \t]", text)
    return match.start() if match else -1


def completion_via_api(engine: Engine, prompt: str, max_tokens: int, ngram: int) -> tuple[str, list[int]]:
    """(the completion's text, the tokens decoded for it)."""
    ids = engine.tokenize(prompt)
    healed = ids.pop()
    heal_text = engine.detokenize([healed]).encode()
    session = engine.session()
    buffer = session.create()
    first = engine.pred(session, buffer, ids, want=TopK(64)).top_ids
    token = next((t for t in first if engine.detokenize([t]).encode().startswith(heal_text)), healed)
    branch = session.fork(buffer)
    history, out = list(ids), []
    while token not in engine.loaded.eos_token_ids and len(out) < max_tokens:
        out.append(token)
        history.append(token)
        text = engine.detokenize(out).encode()
        cut = block_end(text.decode("utf-8", "replace"))
        if cut >= 0 or len(out) >= max_tokens:
            break
        top = engine.pred(session, branch, [token], want=TopK(8)).top_ids
        token = next((t for t in top if not repeats(history, t, ngram)), top[0])
    session.close_all()
    text = engine.detokenize(out).encode()
    cut = block_end(text.decode("utf-8", "replace"))
    end = max(cut, len(heal_text)) if cut >= 0 else len(text)
    return text[len(heal_text):end].decode(), out


def run_complete_code(engine: Engine, buffers: list[str], max_tokens: int, ngram: int) -> tuple[str, str]:
    """complete_code's output and log, for the first buffer then each later version."""
    out, log = [], []
    with Runtime(engine) as runtime:
        process = runtime.spawn(runtime.load(lip("complete_code")),
                                [buffers[0].replace("\n", "\\n"), str(max_tokens), str(ngram)],
                                on_output=out.append, on_log=log.append)
        for buffer in buffers[1:]:
            process.deliver(buffer.replace("\n", "\\n").encode())
        process.close_input()
        assert runtime.wait(process, 120) == 0, (process.end_reason, "".join(log))
    return b"".join(out).decode(), "".join(log)


@pytest.mark.parametrize("ngram", [0, 4])
def test_completions_match_the_api_and_edits_reuse_the_buffer_kv(ngram):
    engine = Engine.from_path(DEFAULT_MODEL_DIR, device="cpu", page_size=16, num_pages=256)
    first = "import os\n\n\ndef list_files(path):\n"
    second = "import os\n\n\ndef count_lines(path):\n"
    text, log = run_complete_code(engine, [first, second], 40, ngram)
    assert text.startswith(first) and second in text
    completion_1 = text[len(first):text.index(second)]
    completion_2 = text[text.index(second) + len(second):]
    assert completion_1 == completion_via_api(engine, first, 40, ngram)[0] + "\n"
    assert completion_2 == completion_via_api(engine, second, 40, ngram)[0] + "\n"
    assert completion_1.strip() and completion_2.strip()
    # The second request prefilled only what differs: its KV kept the shared tokens.
    reused = [int(n) for n in re.findall(r"(\d+) reused", log)]
    a, b = engine.tokenize(first)[:-1], engine.tokenize(second)[:-1]
    shared = next(i for i, (x, y) in enumerate(zip(a + [-1], b + [-2])) if x != y)
    assert reused == [0, shared] and shared > 3
    assert engine.pool.stats().used == 0


def repeated_ngrams(tokens: list[int], n: int = 4) -> int:
    grams = [tuple(tokens[i:i + n]) for i in range(len(tokens) - n + 1)]
    return len(grams) - len(set(grams))


def test_no_repeat_rule_stops_the_greedy_loop():
    engine = Engine.from_path(DEFAULT_MODEL_DIR, device="cpu", page_size=16, num_pages=256)
    prompt = "def fibonacci(n):\n"
    (greedy, greedy_tokens), (guarded, guarded_tokens) = (completion_via_api(engine, prompt, 60, n) for n in (0, 4))
    assert repeated_ngrams(guarded_tokens) < repeated_ngrams(greedy_tokens), (greedy, guarded)
    assert run_complete_code(engine, [prompt], 60, 4)[0] == prompt + guarded + "\n"


def test_an_emptied_buffer_gets_an_empty_completion_and_the_session_goes_on():
    """An empty buffer (an editor cleared it) ended the session with exit 1."""
    engine = Engine.from_path(DEFAULT_MODEL_DIR, device="cpu", page_size=16, num_pages=256)
    prompt = "import sys\n"
    text, _ = run_complete_code(engine, ["", prompt], 20, 4)
    assert text == "\n" + prompt + completion_via_api(engine, prompt, 20, 4)[0] + "\n"
