"""What every request passes before a route reads its body (symphony_os/server/guard.py): on a
server without a tenants file, Host and Origin checks (DNS rebinding, other sites' pages); with
one, the bearer token before the body; on both, a limit on every body."""
from __future__ import annotations

import asyncio
import socket

import httpx
import pytest
import websockets
from guests import ECHO
from served import TOKENS, served, serving  # noqa: F401 (fixture)

from symphony_os.engine.loop import Engine
from symphony_os.server.app import ServerConfig, create_app
from symphony_os.server.guard import JSON_BODY_BYTES, Origins
from symphony_os.server.tenants import Tenants


@pytest.fixture(scope="module")
def open_server(stories_path, tmp_path_factory):
    """`symphony serve` without a tenants file, on loopback, one more origin allowed."""
    engine = Engine.from_path(stories_path, device="cpu", page_size=16, num_pages=256)
    config = ServerConfig(grace_s=5.0, data_dir=tmp_path_factory.mktemp("open") / "programs", bind_host="127.0.0.1",
                          allowed_origins=("https://app.example",))
    with serving(create_app(engine, Tenants.single(), config)) as url:
        yield url


def raw_request(url: str, head: str, body: bytes = b"") -> tuple[int, bytes]:
    """Send a request's head (and `body`, maybe less than its Content-Length says) on a socket
    and return the status and body of the answer, which must come without the rest."""
    port = int(url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=60) as sock:
        sock.sendall(head.replace("\n", "\r\n").encode() + b"\r\n" + body)
        answer = b""
        while b"\r\n\r\n" not in answer or len(answer.partition(b"\r\n\r\n")[2]) < _content_length(answer):
            chunk = sock.recv(65536)
            if not chunk:
                break
            answer += chunk
    status = int(answer.split(b" ", 2)[1])
    return status, answer.partition(b"\r\n\r\n")[2]


def _content_length(answer: bytes) -> int:
    for line in answer.partition(b"\r\n\r\n")[0].split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return int(value)
    return 0


def test_a_strangers_request_is_refused_before_its_body_is_read(served):
    """A body of 256 MiB that never comes: answered 401 from the headers alone (the body was
    read and parsed first, so four such requests cost the server gigabytes)."""
    for path in ("/processes", "/kv/share", "/v1/completions", "/programs"):
        status, body = raw_request(served.url, f"POST {path} HTTP/1.1\nHost: 127.0.0.1\n"
                                   f"Content-Type: application/json\nContent-Length: {256 * 2**20}\n")
        assert status == 401 and b"bearer token" in body, (path, status, body)


def test_every_body_has_a_limit(served):
    """A tenant's body over a route's limit is refused: at once when Content-Length says so,
    after the limit when it is sent without one (chunked)."""
    auth = f"Authorization: Bearer {TOKENS['alice']}\n"
    status, body = raw_request(served.url, f"POST /processes HTTP/1.1\nHost: 127.0.0.1\n{auth}"
                               f"Content-Type: application/json\nContent-Length: {256 * 2**20}\n")
    assert status == 413 and b"over" in body
    chunks = (b"x" * 65536 for _ in range(2 * JSON_BODY_BYTES // 65536))
    response = httpx.post(served.url + "/kv/share", content=chunks, timeout=60,
                          headers={"Authorization": f"Bearer {TOKENS['alice']}"})
    assert response.status_code == 413 and "over" in response.json()["detail"]


def test_launch_arguments_are_counted_in_bytes_and_must_be_text(served):
    """A lone surrogate in an argument was a 500; `env` was counted in characters, so 260 KB of
    it passed the 64 KiB cap."""
    headers = {"Authorization": f"Bearer {TOKENS['alice']}"}
    sha = httpx.post(served.url + "/programs?name=echo", content=ECHO, headers=headers).json()["sha256"]

    def launch(args, env):
        return httpx.post(served.url + "/processes", json={"program": sha, "args": args, "env": env},
                          headers=headers, timeout=60)

    surrogate = httpx.post(served.url + "/processes", headers={**headers, "Content-Type": "application/json"},
                           content=b'{"program": "%s", "args": ["\\ud800"]}' % sha.encode())
    assert surrogate.status_code == 400 and "surrogate" in surrogate.json()["detail"]
    wide = launch([], {"E": "\u20ac" * 30_000})  # 30,000 characters, 90,000 bytes
    assert wide.status_code == 400 and "bytes of UTF-8" in wide.json()["detail"]
    fits = launch(["\u20ac" * 1000], {"E": "\u20ac" * 1000})
    assert fits.status_code == 201, fits.text
    httpx.delete(served.url + f"/processes/{fits.json()['pid']}", headers=headers)


def test_an_open_server_answers_only_to_its_own_names(open_server):
    """DNS rebinding: a page of evil.example, its name pointed at 127.0.0.1, calls the server
    with Host: evil.example."""
    assert httpx.get(open_server + "/processes").status_code == 200
    assert httpx.get(open_server + "/processes", headers={"Host": "localhost"}).status_code == 200
    rebound = httpx.get(open_server + "/processes", headers={"Host": "evil.example:8000"})
    assert rebound.status_code == 400 and "not one of this server's names" in rebound.json()["detail"]
    assert httpx.get(open_server + "/health", headers={"Host": "evil.example"}).status_code == 400


def test_an_open_server_refuses_other_sites_pages(open_server):
    """A page elsewhere sent CORS-simple POSTs (text/plain) that launched processes and ran
    completions, and attached to processes' streams over WebSocket."""
    evil = {"Origin": "http://evil.example", "Content-Type": "text/plain"}
    module = httpx.post(open_server + "/programs?name=echo", content=ECHO, headers=evil)
    assert module.status_code == 403 and "evil.example" in module.json()["detail"]
    completion = httpx.post(open_server + "/v1/completions", headers=evil,
                            content=b'{"model": "stories260K", "prompt": "Once", "max_tokens": 2}')
    assert completion.status_code == 403 and completion.json()["error"]["type"] == "invalid_request_error"
    own = httpx.post(open_server + "/programs?name=echo", content=ECHO,
                     headers={"Origin": open_server.replace("127.0.0.1", "localhost")})
    assert own.status_code == 201, own.text  # a page of the server itself (its /docs)
    pid = httpx.post(open_server + "/processes", json={"program": own.json()["sha256"]},
                     headers={"Origin": "https://app.example"}).json()["pid"]  # an --allowed-origin

    async def attach(origin: str) -> str:
        url = open_server.replace("http", "ws") + f"/processes/{pid}/stream"
        try:
            async with websockets.connect(url, origin=origin) as ws:
                await ws.close()
                return "attached"
        except websockets.InvalidStatus as refused:
            return f"refused {refused.response.status_code}"

    assert asyncio.run(attach("http://evil.example")) == "refused 403"
    assert asyncio.run(attach("https://app.example")) == "attached"
    httpx.delete(open_server + f"/processes/{pid}")


def test_origins_are_matched_by_name_not_by_prefix():
    origins = Origins.for_server("10.0.0.5", hosts=["symphony.internal"], origins=["https://app.example"])
    assert origins.host_allowed("10.0.0.5:8000") and origins.host_allowed("[::1]:80")
    assert origins.host_allowed("SYMPHONY.internal") and not origins.host_allowed("symphony.internal.evil.example")
    assert not origins.host_allowed(None) and not origins.host_allowed("localhost.evil.example")
    assert origins.origin_allowed("http://localhost:3000") and origins.origin_allowed("https://app.example")
    assert not origins.origin_allowed("https://app.example.evil") and not origins.origin_allowed("null")
    assert not origins.origin_allowed("file://localhost")
    assert Origins.for_server(hosts=["*"]).host_allowed("anything")
