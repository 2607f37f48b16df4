"""The chat-template system call: a conversation rendered with the model's own chat template, for
programs (issue 30). Through a C guest (lips/chat.c), a Python guest and hostile arguments."""
from __future__ import annotations

import json

import pytest
from guests import ROOT, lip, wat
from test_python_sdk import build_python

from symphony_os.engine.loop import Engine
from symphony_os.errors import ErrorCode
from symphony_os.lip.runtime import Runtime

TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}</{{ m['role'] }}>{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")


@pytest.fixture
def engine(stories_path):
    engine = Engine.from_path(stories_path, device="cpu", page_size=16, num_pages=512)
    engine.loaded.tokenizer.chat_template = TEMPLATE
    yield engine
    assert engine.pool.stats().used == 0


def run(runtime, program, args: list[str]) -> tuple[int, str, str]:
    out, log = [], []
    process = runtime.spawn(runtime.load(program), args, on_output=out.append, on_log=log.append)
    code = runtime.wait(process, 120)
    return code, b"".join(out).decode(), "".join(log)


def test_a_c_program_asks_in_the_models_chat_format(engine):
    """lips/chat.c renders its question with the call, then answers: the tokens it feeds are the
    rendered text's, special characters of JSON and all."""
    question = 'Say "hi"\\ then\nstop'
    fed = []
    submit = engine.submit_request
    engine.submit_request = lambda session, handle, tokens, *rest: fed.append(list(tokens)) or \
        submit(session, handle, tokens, *rest)
    with Runtime(engine) as runtime:
        code, out, log = run(runtime, lip("chat"), [question, "3"])
    assert code == 0, log
    rendered = engine.chat_template([{"role": "user", "content": question}], add_generation_prompt=True)
    assert rendered == f"<user>{question}</user><assistant>"
    assert fed[0] == engine.tokenize(rendered, add_special_tokens=False) and out.endswith("\n")


def test_a_python_program_renders_pairs(engine):
    with Runtime(engine) as runtime:
        code, out, log = run(runtime, build_python("misbehave", ROOT / "tests" / "python_guests"),
                             ["chat", "system", "Be brief.", "user", "Hello"])
    assert code == 0, log
    assert out == "<system>Be brief.</system><user>Hello</user><assistant>"


def test_no_template_and_hostile_arguments_get_error_codes(engine):
    engine.loaded.tokenizer.chat_template = None
    with Runtime(engine) as runtime:
        code, out, log = run(runtime, build_python("misbehave", ROOT / "tests" / "python_guests"),
                             ["chat", "user", "Hello"])
        assert code == 0 and out == "Unsupported", log
        engine.loaded.tokenizer.chat_template = TEMPLATE
        cases = {
            "not json": b"[{",
            "not a list": b'{"role": "user"}',
            "content not a string": b'[{"role": "user", "content": 3}]',
            "no role": b'[{"content": "x"}]',
            "empty role": b'[{"role": "", "content": "x"}]',
            "nested too deep": b"[" * 100_000,
        }
        for name, data in cases.items():
            assert _call(runtime, data) == ErrorCode.INVALID_ARGUMENT, name
        assert _call(runtime, json.dumps([{"role": "user", "content": "x"}]).encode()) == len("<user>x</user><assistant>")
        assert _call(runtime, b"[]", out_ptr=65536 - 4, cap=100) == ErrorCode.BAD_POINTER  # room past the end


def _call(runtime, data: bytes, out_ptr: int = 1024, cap: int = 512) -> int:
    """What a core module's chat-template call answers for `data` (the messages, at 2048) and the
    given room for the text."""
    length = len(data)
    base = 2048
    pages = (base + length) // 65536 + 1
    escaped = "".join(f"\\{b:02x}" for b in data)
    module = wat(f'''(module
      (import "symphony" "chat_template" (func $chat (param i32 i32 i32 i32 i32) (result i32)))
      (import "symphony" "send" (func $send (param i32 i32) (result i32)))
      (memory (export "memory") {pages})
      (data (i32.const {base}) "{escaped}")
      (func (export "_start")
        (i32.store (i32.const 0) (call $chat (i32.const {base}) (i32.const {length}) (i32.const 1)
                                             (i32.const {out_ptr}) (i32.const {cap})))
        (drop (call $send (i32.const 0) (i32.const 4)))))''')
    out = []
    process = runtime.spawn(runtime.load(module), [], on_output=out.append)
    assert runtime.wait(process, 120) == 0, process.end_reason
    return int.from_bytes(b"".join(out), "little", signed=True)


TOOLS_TEMPLATE = "{% if tools %}<tools>{{ tools | map(attribute='function.name') | join(',') }}</tools>{% endif %}" + TEMPLATE
TOOLS = [{"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}},
         {"type": "function", "function": {"name": "time", "parameters": {"type": "object"}}}]


def test_tools_reach_a_template_that_shows_them_from_c_and_python(engine, tmp_path):
    from guests import build_c

    engine.loaded.tokenizer.chat_template = TOOLS_TEMPLATE
    source = tmp_path / "chat_tools.c"
    messages = json.dumps({"messages": [{"role": "user", "content": "Hi"}], "tools": TOOLS})
    source.write_text('#include "symphony.h"\nstatic char out[4096];\n'
                      'int main(void) { int n = sym_chat_template(' + json.dumps(messages) + ', out, sizeof out);\n'
                      '  if (n < 0) return 1; sym_send(out, n); return 0; }\n')
    with Runtime(engine) as runtime:
        code, out, log = run(runtime, build_c(source, tmp_path / "chat_tools.wasm"), [])
        assert code == 0, log
        assert out == "<tools>weather,time</tools><user>Hi</user><assistant>"
        code, out, log = run(runtime, build_python("misbehave", ROOT / "tests" / "python_guests"),
                             ["chat", "tools=" + json.dumps(TOOLS), "user", "Hi"])
        assert code == 0, log
        assert out == "<tools>weather,time</tools><user>Hi</user><assistant>"
        code, out, _ = run(runtime, build_python("misbehave", ROOT / "tests" / "python_guests"),
                           ["chat", "tools=" + json.dumps({"not": "a list"}), "user", "Hi"])
        assert out == "InvalidArgument"
