"""symphony serve: upload, launch, stream over WebSocket, ps / kill / detach / re-attach, the
CLI and Python clients, refusing bad uploads, the grace period, /health and /metrics. Every
test talks to a real server on a loopback port (tests/served.py)."""
import asyncio
import logging
import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import msgpack
import pytest
import websockets
from click.testing import CliRunner
from prometheus_client.parser import text_string_to_metric_families
from guests import ECHO, echo_guest, lip, wat
from served import GRACE_S, INPUT_WAIT_S, MAX_UPLOAD_BYTES, TOKENS, served, wait_until  # noqa: F401 (fixture)

from symphony_os.cli import main
from symphony_os.client.client import AsyncClient, Client, ServerError
from symphony_os.errors import InputClosed
from symphony_os.lip.process import INBOX_BYTES, INBOX_MESSAGES
from symphony_os.server.routes.processes import _stream_process
from symphony_os.server.process_table import BUFFER_BYTES, LOG_TAIL_CHARS

# Fills a KV file with 40 tokens (3 pages), says "ready", then waits for a message.
HOLD_KV = wat('''(module
  (import "symphony" "kv_create" (func $create (result i32)))
  (import "symphony" "pred_submit" (func $submit (param i32 i32 i32 i32 i32 i32) (result i32)))
  (import "symphony" "pred_wait" (func $wait (param i32 i32 i32) (result i32)))
  (import "symphony" "send" (func $send (param i32 i32) (result i32)))
  (import "symphony" "recv" (func $recv (param i32 i32) (result i32)))
  (memory (export "memory") 1)
  (data (i32.const 0) "''' + "\\01\\00\\00\\00" * 40 + '''")
  (data (i32.const 256) "ready")
  (func (export "_start")
    (drop (call $wait (call $submit (call $create) (i32.const 0) (i32.const 0) (i32.const 40) (i32.const 2)
                             (i32.const 0)) (i32.const 0) (i32.const 0)))
    (drop (call $send (i32.const 256) (i32.const 5)))
    (drop (call $recv (i32.const 512) (i32.const 64)))))''')

SPIN = wat('(module (memory (export "memory") 1) (func (export "_start") (loop $l (br $l))))')

# Writes 64 KiB to stderr 4 times, then sends 64 KiB 100 times (6.25 MiB in all) and exits.
LOUD = wat('''(module
  (import "symphony" "send" (func $send (param i32 i32) (result i32)))
  (import "wasi_snapshot_preview1" "fd_write" (func $fd_write (param i32 i32 i32 i32) (result i32)))
  (memory (export "memory") 2)
  (func (export "_start") (local $i i32)
    (i32.store (i32.const 0) (i32.const 16))
    (i32.store (i32.const 4) (i32.const 65536))
    (loop $log
      (drop (call $fd_write (i32.const 2) (i32.const 0) (i32.const 1) (i32.const 8)))
      (local.set $i (i32.add (local.get $i) (i32.const 1)))
      (br_if $log (i32.lt_u (local.get $i) (i32.const 4))))
    (local.set $i (i32.const 0))
    (loop $out
      (drop (call $send (i32.const 16) (i32.const 65536)))
      (local.set $i (i32.add (local.get $i) (i32.const 1)))
      (br_if $out (i32.lt_u (local.get $i) (i32.const 100))))))''')

EXAMPLES = {
    "hello": ["Once upon a time", "30"],
    "parallel": ["Once upon a time, there was a cat.", "8", "The cat", "One day", "Tom"],
    "beam": ["Once upon a time", "3", "8"],
    "json_schema": ["Tom is a little boy. He is", "1.0", "7"],
    "watermark": ["Once upon a time", "24", "42", "4.0", "1"],
    "speculative": ["Lily and Tom went to the park. Lily and Tom", "24", "4"],
    "tool_use": ["Tom had <calc>12*7</calc> apples.", "8"],
    "graph_of_thought": ["Lily wanted to find her lost ball.", "3", "6", "6"],
    "react": ["How many legs do three cats have?", "docs:cat", "calculator:3*4"],
}


@pytest.fixture
def alice(served):
    with Client(served.url, TOKENS["alice"]) as client:
        yield client


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_every_example_lip_over_the_server_prints_what_symphony_run_prints(served, alice, stories_path, name):
    local = CliRunner().invoke(main, ["run", "--model", str(stories_path), str(lip(name)), "--", *EXAMPLES[name]])
    assert local.exit_code == 0, local.output
    program = alice.upload(lip(name))
    result = alice.run(program["sha256"], EXAMPLES[name])
    assert (result.exit_code, result.state, result.reason) == (0, "exited", "exit 0")
    assert result.output.decode() == local.stdout
    for f in alice.kv_ls("prefix/"):  # parallel's saved prefix
        alice.kv_rm(f["path"])


def test_messages_reach_recv_and_output_log_and_exit_come_back(alice):
    program = alice.upload(ECHO, "echo")
    assert program["size"] == len(ECHO) and len(program["sha256"]) == 64
    assert [p["sha256"] for p in alice.programs()].count(program["sha256"]) == 1
    result = alice.run(program["sha256"], messages=["hi", b"\x00binary\xff", "a longer message"])
    assert result.output == b"hi\x00binary\xffa longer message"
    assert (result.exit_code, result.reason) == (0, "exit 0")


def test_log_lines_of_a_failing_program_are_streamed(alice):
    program = alice.upload(lip("hello"))
    result = alice.run(program["sha256"], ["Once upon a time", "100000"])
    assert result.exit_code == 1 and "cannot tokenize" in result.log


def test_detach_and_reattach_keep_the_process_and_its_output(served, alice):
    echo = alice.upload(ECHO, "echo")["sha256"]
    pid = alice.launch(echo)["pid"]
    stream = alice.attach(pid)
    stream.send("one")
    assert next(stream) == {"type": "output", "data": b"one"}
    stream.detach()
    assert alice.inspect(pid)["detached"] and alice.inspect(pid)["state"] == "blocked-on-recv"
    outlive_a_grace_period(alice)  # detached on purpose: the grace period does not apply
    assert pid in [p["pid"] for p in alice.ps()]
    stream = alice.attach(pid)
    with pytest.raises(ServerError) as second:  # one client at a time
        next(alice.attach(pid))
    assert second.value.status == 409
    stream.send("two")
    stream.close_input()
    frames = list(stream)
    assert frames[0] == {"type": "output", "data": b"two"}
    assert frames[-1] == {"type": "exit", "code": 0, "state": "exited", "reason": "exit 0"}
    assert pid not in [p["pid"] for p in alice.ps()] and pid in [p["pid"] for p in alice.ps(all=True)]


def outlive_a_grace_period(alice) -> None:
    """Return once a process whose client vanished now has been killed for it: a grace period
    begun before this call is over and the server has reaped what it ended."""
    pid = alice.launch(alice.upload(ECHO, "echo")["sha256"])["pid"]
    stream = alice.attach(pid)
    stream.send("ping")
    assert next(stream) == {"type": "output", "data": b"ping"}
    stream.close()  # vanish without detaching
    # (read once: the ended process is forgotten a grace period after it ended)
    info = wait_until(lambda: (i := alice.inspect(pid))["state"] == "killed" and i, timeout_s=GRACE_S + 60)
    assert "no client attached" in info["end_reason"]


def test_kill_ends_a_running_process(alice):
    echo = alice.upload(ECHO, "echo")["sha256"]
    pid = alice.launch(echo, detached=True)["pid"]
    alice.kill(pid)
    info = wait_until(lambda: (i := alice.inspect(pid))["state"] == "killed" and i)
    assert info["exit_code"] == 137 and info["end_reason"] == "killed by its tenant"


def test_a_vanished_clients_process_and_kv_pages_are_gone_after_the_grace_period(served, alice):
    used_before = served.engine.pool.stats().used
    pid = alice.launch(alice.upload(HOLD_KV, "hold")["sha256"])["pid"]
    stream = alice.attach(pid)
    assert next(stream) == {"type": "output", "data": b"ready"}
    assert served.engine.pool.stats().used >= used_before + 3
    stream.close()  # vanish mid-stream, without detaching
    info = wait_until(lambda: (i := alice.inspect(pid))["state"] == "killed" and i, timeout_s=GRACE_S + 20)
    assert "no client attached" in info["end_reason"]
    assert pid not in [p["pid"] for p in alice.ps()]
    assert served.engine.pool.stats().used == used_before


def test_detached_launch_survives_without_a_client(alice):
    pid = alice.launch(alice.upload(ECHO, "echo")["sha256"], detached=True)["pid"]
    outlive_a_grace_period(alice)
    assert alice.inspect(pid)["state"] == "blocked-on-recv"
    alice.kill(pid)


def test_cli_attach_follows_a_detached_process_to_its_end(served, alice):
    """`symphony attach PID`: the output of a process launched with --detach, what stdin sends
    it, and its exit code."""
    table = served.app.state.symphony.table
    # The ended process stays listed after its exit reached the attached client for the grace
    # period: long enough here that a slow machine cannot make the listing below miss it.
    grace_s, table.grace_s = table.grace_s, 60.0
    try:
        pid = alice.launch(alice.upload(ECHO, "echo")["sha256"], detached=True)["pid"]
        symphony = Path(sys.executable).parent / "symphony"
        env = {**os.environ, "SYMPHONY_SERVER": served.url, "SYMPHONY_TOKEN": TOKENS["alice"]}
        attached = subprocess.run([str(symphony), "attach", str(pid)], input=b"hello\nagain\n", capture_output=True,
                                  env=env, timeout=120)
        assert attached.returncode == 0, attached.stderr.decode()
        assert attached.stdout == b"helloagain" and alice.inspect(pid)["state"] == "exited"  # a message a line
    finally:
        table.grace_s = grace_s
    missing = subprocess.run([str(symphony), "attach", "999999"], capture_output=True, env=env, timeout=120)
    assert missing.returncode == 1 and b"999999" in missing.stderr and b"Traceback" not in missing.stderr


BAD_UPLOADS = {
    "not wasm": (b"#!/bin/sh\necho hi\n", 400, "not a WebAssembly module"),
    "truncated": (lip("hello").read_bytes()[:1000], 400, "invalid WebAssembly"),
    "wrong imports": (wat('(module (import "env" "system" (func)) (memory (export "memory") 1) '
                          '(func (export "_start")))'), 400, "unknown import env.system"),
    "huge": (b"\x00asm\x01\x00\x00\x00" + bytes(MAX_UPLOAD_BYTES), 413, "limit"),
}


@pytest.mark.parametrize("case", sorted(BAD_UPLOADS))
def test_malformed_upload_is_refused_with_a_reason_and_the_server_keeps_serving(alice, case):
    data, status, reason = BAD_UPLOADS[case]
    with pytest.raises(ServerError) as refused:
        alice.upload(data, "bad")
    assert refused.value.status == status and reason in refused.value.reason
    assert alice.run(alice.upload(ECHO, "echo")["sha256"], messages=["still here"]).output == b"still here"


def test_bad_requests_get_clear_errors(served, alice):
    headers = {"Authorization": f"Bearer {TOKENS['alice']}"}
    echo = alice.upload(ECHO, "echo")["sha256"]
    cases = [("post", "/processes", {"json": {"program": "0" * 64}}, 404, "no program"),
             ("post", "/processes", {"json": {"program": echo, "args": [1, 2]}}, 422, "args"),
             ("post", "/processes", {"content": b"{not json"}, 422, ""),
             ("post", "/processes", {"json": {"program": echo, "env": {"A=B": "x"}}}, 400, "env"),
             ("get", "/processes/notanumber", {}, 422, "pid"),
             ("delete", "/kv/bad%20name", {}, 400, "bad KV file name")]
    for method, path, kwargs, status, reason in cases:
        response = getattr(httpx, method)(served.url + path, headers=headers, **kwargs)
        assert response.status_code == status, (path, response.text)
        assert reason in response.text


def test_cli_upload_launch_ps_kill_and_kv(served, alice, tmp_path):
    env = {"SYMPHONY_SERVER": served.url, "SYMPHONY_TOKEN": TOKENS["alice"]}
    runner = CliRunner(env=env)
    uploaded = runner.invoke(main, ["upload", str(lip("hello"))])
    assert uploaded.exit_code == 0, uploaded.output
    sha = uploaded.output.strip()
    launched = runner.invoke(main, ["launch", sha, "--", "Once upon a time", "12"])
    assert launched.exit_code == 0 and launched.stdout.startswith("Once upon a time, there was")
    # A file path is uploaded first; stdin lines reach recv.
    echo_path = tmp_path / "echo.wasm"
    echo_path.write_bytes(ECHO)
    piped = runner.invoke(main, ["launch", str(echo_path)], input="first\nsecond\n")
    assert piped.exit_code == 0 and piped.stdout == "firstsecond"
    # Lines go as bytes, whatever their encoding (one not UTF-8 killed the reader and hung the
    # launch), without \r\n.
    raw = runner.invoke(main, ["launch", str(echo_path)], input=b"first\r\n\xff\xfe\nsecond\n")
    assert raw.exit_code == 0 and raw.stdout_bytes == b"first\xff\xfesecond", raw.output
    detached = runner.invoke(main, ["launch", "--detach", alice.upload(ECHO, "echo")["sha256"]])
    pid = int(detached.stdout)
    listed = runner.invoke(main, ["ps"])
    assert listed.exit_code == 0 and any(line.split()[0] == str(pid) for line in listed.stdout.splitlines()[1:])
    assert runner.invoke(main, ["kill", str(pid)]).exit_code == 0
    assert wait_until(lambda: alice.inspect(pid)["state"] == "killed")
    again = runner.invoke(main, ["kill", str(pid)])
    assert again.exit_code == 0 and again.stdout == f"{pid} had already ended: killed by its tenant\n", again.output
    ended = alice.launch(alice.upload(lip("hello"))["sha256"], ["Once", "2"], detached=True)["pid"]
    assert wait_until(lambda: alice.inspect(ended)["state"] == "exited")
    late = runner.invoke(main, ["kill", str(ended)])
    assert late.exit_code == 0 and late.stdout == f"{ended} had already ended: exit 0\n", late.output
    parallel = runner.invoke(main, ["launch", str(lip("parallel")), "--", "A dog.", "2", "Hi"])
    assert parallel.exit_code == 0, parallel.output
    files = runner.invoke(main, ["kv", "ls", "--json"])
    assert files.exit_code == 0 and '"prefix/' in files.stdout
    path = next(line.split()[-1] for line in runner.invoke(main, ["kv", "ls"]).stdout.splitlines())
    assert runner.invoke(main, ["kv", "rm", path]).exit_code == 0
    missing = runner.invoke(main, ["kv", "rm", path])
    assert missing.exit_code == 1 and "404" in missing.output and "no KV file" in missing.output
    unauthorized = CliRunner(env={**env, "SYMPHONY_TOKEN": "wrong-token"}).invoke(main, ["ps"])
    assert unauthorized.exit_code == 1 and "401" in unauthorized.output


def test_cli_launch_into_a_closed_pipe_kills_the_process_quietly(served, alice):
    """`symphony launch ... | head`: the reader leaves, the client kills the process on the server
    (not left to generate for nobody, nor to the grace period) and exits as SIGPIPE would, with
    no error line."""
    symphony = Path(sys.executable).parent / "symphony"
    env = {**os.environ, "SYMPHONY_SERVER": served.url, "SYMPHONY_TOKEN": TOKENS["alice"]}
    args = ["Once upon a time", "400"]
    launch = subprocess.Popen([str(symphony), "launch", str(lip("hello")), "--", *args],
                              stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    assert launch.stdout.read(4) == b"Once"
    (pid,) = [p["pid"] for p in alice.ps() if p["args"] == args]
    launch.stdout.close()
    ended = wait_until(lambda: (info := alice.inspect(pid))["end_reason"] is not None and info)
    assert ended and ended["state"] == "killed" and ended["end_reason"] == "killed by its client", ended
    _, stderr = launch.communicate(timeout=120)
    assert launch.returncode == 128 + signal.SIGPIPE and stderr == b"", stderr.decode()


def test_cli_launch_detach_into_a_closed_pipe_is_no_server_error(served, alice):
    """`launch --detach ... | true`: the pid has no reader; that is not the server's failure."""
    symphony = Path(sys.executable).parent / "symphony"
    env = {**os.environ, "SYMPHONY_SERVER": served.url, "SYMPHONY_TOKEN": TOKENS["alice"]}
    launch = subprocess.Popen([str(symphony), "launch", "--detach", str(lip("hello")), "--", "Once", "2"],
                              stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    launch.stdout.close()  # before it prints the pid
    _, stderr = launch.communicate(timeout=120)
    assert launch.returncode == 128 + signal.SIGPIPE and b"cannot reach the server" not in stderr, stderr.decode()


def test_health_metrics_and_openapi(served, alice):
    health = httpx.get(served.url + "/health").json()
    assert health["status"] == "ok" and health["model"] == "stories260K"
    alice.run(alice.upload(lip("hello"))["sha256"], ["Once upon a time", "5"])
    text = httpx.get(served.url + "/metrics").text
    samples = {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines()
               if line and not line.startswith("#")}
    assert samples["symphony_batches_total"] > 0 and samples["symphony_tokens_total"] > 0
    assert samples['symphony_kv_pages{kind="total"}'] == 4096
    assert 'symphony_processes{state="exited"}' in samples and "symphony_batch_size_mean" in samples
    paths = httpx.get(served.url + "/openapi.json").json()["paths"]
    assert {"/programs", "/processes", "/processes/{pid}", "/kv", "/v1/chat/completions"} <= set(paths)


def test_reattaching_after_the_exit_was_delivered_gets_the_exit_frame_again(served):
    table = served.app.state.symphony.table
    grace_s, table.grace_s = table.grace_s, 60.0  # keep the ended process listed meanwhile

    async def attach_twice():
        async with AsyncClient(served.url, TOKENS["alice"]) as client:
            pid = (await client.launch((await client.upload(ECHO, "echo"))["sha256"]))["pid"]
            first = await client.attach(pid)
            await first.close_input()
            seen = [frame async for frame in first]
            await first.close()
            second = await client.attach(pid)
            again = await asyncio.wait_for(second.__anext__(), 30)  # waited forever before
            await second.close()
            return seen, again

    try:
        seen, again = asyncio.run(attach_twice())
    finally:
        table.grace_s = grace_s
    assert seen[-1]["type"] == "exit" and again == seen[-1]


def test_a_client_leaving_while_the_exit_frame_is_sent_leaves_it_for_the_next(served, alice):
    """The first client detaches while its socket is still sending the exit frame (the send is
    cancelled after it was written): the exit counts as delivered, so a client attaching next
    gets it again instead of waiting forever for a frame that was gone."""
    table = served.app.state.symphony.table
    grace_s, table.grace_s = table.grace_s, 60.0
    pid = alice.launch(alice.upload(ECHO, "echo")["sha256"], detached=True)["pid"]
    alice.kill(pid)
    assert wait_until(lambda: alice.inspect(pid)["end_reason"] is not None)
    record = table.get("alice", pid)

    class Socket:  # as uvicorn's: the frame is written, then the client's detach cancels the send
        def __init__(self, slow):
            self.slow, self.sent = slow, []

        async def send_bytes(self, data):
            self.sent.append(msgpack.unpackb(data))
            if self.slow:
                await asyncio.sleep(30)

        async def receive(self):
            if self.slow:
                await asyncio.sleep(0.05)
                return {"type": "websocket.receive", "bytes": msgpack.packb({"type": "detach"})}
            await asyncio.Event().wait()

    async def twice():
        first, second = Socket(slow=True), Socket(slow=False)
        await _stream_process(first, table, record, table.attach(record), INPUT_WAIT_S)
        await asyncio.wait_for(_stream_process(second, table, record, table.attach(record), INPUT_WAIT_S), 30)
        return first.sent, second.sent

    try:
        first, second = asyncio.run(twice())
    finally:
        table.grace_s = grace_s
    assert first[-1]["type"] == "exit" and second == [first[-1]]


def test_an_exit_frame_given_again_is_queued_once_however_often_clients_come_and_vanish(served, alice):
    table = served.app.state.symphony.table
    grace_s, table.grace_s = table.grace_s, 60.0
    try:
        pid = alice.launch(alice.upload(ECHO, "echo")["sha256"], detached=True)["pid"]
        alice.kill(pid)
        assert [f["type"] for f in alice.attach(pid)][-1] == "exit"  # taken: delivered
        record = table.get("alice", pid)
        assert wait_until(lambda: not record.attached)  # the server lets that client go after sending its exit
        for _ in range(3):  # a client attaches and vanishes before taking it
            frames = table.attach(record)
            table.detach(record, on_purpose=False)
        assert len(frames) == 1
    finally:
        table.grace_s = grace_s


def test_input_is_refused_past_the_inbox_limit_and_after_the_end(served, alice):
    pid = alice.launch(alice.upload(SPIN, "spin")["sha256"])["pid"]  # never reads its input
    stream = alice.attach(pid)
    for _ in range(INBOX_BYTES // 2**20 + 1):
        stream.send(b"x" * 2**20)
    stream.kill()
    frames = list(stream)
    refused = [f for f in frames if f["type"] == "error"]
    assert len(refused) == 1 and "unread messages" in refused[0]["message"]
    assert frames[-1]["type"] == "exit" and frames[-1]["state"] == "killed"
    process = served.app.state.symphony.table.get("alice", pid).process
    assert process.peek_input() is None  # its inbox went with it
    with pytest.raises(InputClosed):
        process.deliver(b"late")


def test_frames_no_client_took_are_bounded_in_bytes(served, alice):
    pid = alice.launch(alice.upload(LOUD, "loud")["sha256"], detached=True)["pid"]
    info = wait_until(lambda: (i := alice.inspect(pid))["state"] == "exited" and i)
    assert info and len(info["log_tail"]) == LOG_TAIL_CHARS
    frames = list(alice.attach(pid))
    assert frames[0]["type"] == "log" and "frames were dropped" in frames[0]["text"]
    output = sum(len(f["data"]) for f in frames if f["type"] == "output")
    assert 0 < output <= BUFFER_BYTES
    assert frames[-1] == {"type": "exit", "code": 0, "state": "exited", "reason": "exit 0"}


def test_a_tenant_has_a_bounded_number_of_ended_processes_remembered(served):
    table = served.app.state.symphony.table
    remembered, table.ended_per_tenant = table.ended_per_tenant, 2
    try:
        with Client(served.url, TOKENS["dave"]) as dave:
            echo = dave.upload(ECHO, "echo")["sha256"]
            pids = [dave.launch(echo, detached=True)["pid"] for _ in range(3)]
            for pid in pids:
                dave.kill(pid)
            assert wait_until(lambda: pids[0] not in [p["pid"] for p in dave.ps(all=True)])
            assert {pids[1], pids[2]} <= {p["pid"] for p in dave.ps(all=True)}
    finally:
        table.ended_per_tenant = remembered


def test_a_tenants_ended_processes_hold_a_bounded_amount_of_unread_output(served):
    """Each process keeps at most BUFFER_BYTES of frames no client took, but a tenant could end
    detached processes one after another, each leaving its buffer full: 256 of them held 1 GB.
    Past ended_bytes_per_tenant the oldest ended ones are forgotten, as past the count."""
    table = served.app.state.symphony.table
    limit, table.ended_bytes_per_tenant = table.ended_bytes_per_tenant, 3 * 2**20
    loud = wat('''(module (import "symphony" "send" (func $send (param i32 i32) (result i32)))
      (memory (export "memory") 16)
      (func (export "_start") (drop (call $send (i32.const 0) (i32.const 1048576)))))''')  # 1 MiB, then exit
    try:
        with Client(served.url, TOKENS["carol"]) as carol:
            program = carol.upload(loud, "loud")["sha256"]
            pids = []
            for _ in range(5):
                pids.append(carol.launch(program, detached=True)["pid"])
                assert wait_until(lambda: carol.inspect(pids[-1])["end_reason"] is not None)
            kept = [p["pid"] for p in carol.ps(all=True) if p["pid"] in pids]
        assert kept == pids[-2:], (kept, pids)  # three held 3 MiB of output and the frames' overhead
        held = sum(table.get("carol", pid).frames.bytes for pid in kept)
        assert held <= table.ended_bytes_per_tenant
    finally:
        table.ended_bytes_per_tenant = limit


def test_a_token_in_the_websocket_url_is_refused_and_not_logged(served, alice):
    pid = alice.launch(alice.upload(ECHO, "echo")["sha256"], detached=True)["pid"]
    lines = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    uvicorn_log = logging.getLogger("uvicorn.error")
    level = uvicorn_log.level
    uvicorn_log.setLevel(logging.INFO)
    uvicorn_log.addHandler(handler)

    async def connect_with_token_in_url():
        url = "ws" + served.url[4:] + f"/processes/{pid}/stream?token={TOKENS['alice']}"
        async with websockets.connect(url) as ws:
            with pytest.raises(websockets.ConnectionClosed) as closed:
                await asyncio.wait_for(ws.recv(), 30)
            return closed.value.rcvd.code

    try:
        code = asyncio.run(connect_with_token_in_url())
    finally:
        uvicorn_log.removeHandler(handler)
        uvicorn_log.setLevel(level)
        alice.kill(pid)
    assert code == 4401
    assert any("/stream" in line for line in lines) and not any(TOKENS["alice"] in line for line in lines)


def test_metrics_parse_and_a_process_is_measured_as_a_request(served, alice):
    """/metrics through prometheus_client's own parser: a LIP launched through /processes counts
    as a request of source "process" (its first output its first token), the engine's totals are
    whole numbers, and each pred's wait for a batch is a histogram."""
    def families() -> dict:
        response = httpx.get(served.url + "/metrics")
        assert response.headers["content-type"].startswith("text/plain; version=")
        return {f.name: f for f in text_string_to_metric_families(response.text)}

    def value(family, sample_name: str, **labels) -> float:
        return sum(s.value for s in family.samples if s.name == sample_name and labels.items() <= s.labels.items())

    before = families()
    alice.run(alice.upload(lip("hello"))["sha256"], ["Once upon a time", "5"])
    after = families()
    process = {"source": "process", "model_name": "stories260K"}
    for name in ("vllm:time_to_first_token_seconds", "vllm:e2e_request_latency_seconds"):
        assert value(after[name], name + "_count", **process) == value(before[name], name + "_count", **process) + 1
    itl = "vllm:inter_token_latency_seconds"
    assert value(after[itl], itl + "_count", **process) > value(before[itl], itl + "_count", **process)
    success = "vllm:request_success"
    assert value(after[success], success + "_total", finished_reason="exited", **process) == \
        value(before[success], success + "_total", finished_reason="exited", **process) + 1
    tokens = value(after["symphony_tokens"], "symphony_tokens_total")
    assert tokens > 0 and tokens == int(tokens)
    queue = after["symphony_pred_queue_wait_seconds"]
    buckets = [s for s in queue.samples if s.name.endswith("_bucket")]
    assert buckets[-1].labels["le"] == "+Inf" and buckets[-1].value == value(queue, queue.name + "_count") > 0
    assert [b.value for b in buckets] == sorted(b.value for b in buckets)  # cumulative
    pool = served.engine.pool.stats()  # nothing runs now: as it was at the scrape
    assert value(after["vllm:kv_cache_usage_perc"], "vllm:kv_cache_usage_perc") == pool.used / pool.total


# Creates the named KV files "a", "keep" and "demo/b".
NAMED_FILES = wat('''(module
  (import "symphony" "kv_open" (func $open (param i32 i32 i32) (result i32)))
  (memory (export "memory") 1)
  (data (i32.const 0) "akeepdemo/b")
  (func (export "_start")
    (drop (call $open (i32.const 0) (i32.const 1) (i32.const 1)))
    (drop (call $open (i32.const 1) (i32.const 4) (i32.const 1)))
    (drop (call $open (i32.const 5) (i32.const 6) (i32.const 1)))))''')


def test_kv_rm_removes_only_the_file_it_names(alice):
    """The name went into the URL unquoted: `kv rm 'a?b'` removed `a`, 'keep#x' removed `keep`
    and 'demo%2Fb' removed `demo/b`, and . or .. segments were resolved ('x/../keep' removed
    `keep`). Now each is a name of its own, and there is no such file."""
    result = alice.run(alice.upload(NAMED_FILES, "named-files")["sha256"])
    assert result.exit_code == 0, result.reason
    names = {"a", "keep", "demo/b"}
    assert names <= {f["path"] for f in alice.kv_ls()}
    for name in ("a?b", "keep#x", "demo%2Fb", "demo/./b", "x/../keep", "zz/../a"):
        with pytest.raises(ServerError):
            alice.kv_rm(name)
    assert names <= {f["path"] for f in alice.kv_ls()}
    for name in names:
        alice.kv_rm(name)


# Computes for a while, then sends back each message it receives, until its input closes.
SLOW_ECHO = echo_guest(spin=300_000_000)


def test_input_for_a_full_inbox_waits_for_the_program_to_read(alice):
    """More messages than an inbox holds (INBOX_MESSAGES), sent before the program reads any: the
    ones past the limit were refused, and lost (`symphony launch` printed nothing of it). Now the
    server waits for the program to read (reading no more from that client meanwhile)."""
    messages = [f"{i:05d}" for i in range(INBOX_MESSAGES + 500)]
    result = alice.run(alice.upload(SLOW_ECHO, "slow-echo")["sha256"], messages=messages)
    assert (result.exit_code, result.reason) == (0, "exit 0")
    assert result.output.decode() == "".join(messages)
