"""Python client of `symphony serve`: `AsyncClient` (asyncio) and `Client` (blocking, the same
calls run on a private event loop thread).

    with Client("http://127.0.0.1:8000", token="...") as client:
        program = client.upload("lips/hello.wasm")
        result = client.run(program["sha256"], ["Once upon a time", "20"])
        print(result.output.decode(), result.exit_code)

The server and token default to $SYMPHONY_SERVER and $SYMPHONY_TOKEN. Refusals raise
`ServerError` with the HTTP status and the server's reason.
"""
from __future__ import annotations

import asyncio
import contextlib
import os
import threading
import urllib.parse
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

import httpx
import msgpack
import websockets

DEFAULT_SERVER = "http://127.0.0.1:8000"


class ServerError(Exception):
    """The server refused a request: `status` (HTTP or WebSocket close code) and its reason."""

    def __init__(self, status: int, reason: str):
        super().__init__(f"{status}: {reason}")
        self.status, self.reason = status, reason


@dataclass
class RunResult:
    """Everything a process produced, once it ended."""

    pid: int
    output: bytes
    log: str
    exit_code: int
    state: str
    reason: str


def _check(response: httpx.Response) -> Any:
    if response.status_code >= 400:
        try:
            detail = response.json().get("detail", response.text)
        except ValueError:
            detail = response.text
        raise ServerError(response.status_code, detail if isinstance(detail, str) else str(detail))
    return response.json()


class ProcessStream:
    """A WebSocket attached to one process: iterate its frames (dicts with "type" output / log /
    exit; iteration stops after exit), send it messages, detach or kill it."""

    def __init__(self, ws):
        self._ws = ws
        self.ended = False

    def __aiter__(self) -> "ProcessStream":
        return self

    async def __anext__(self) -> dict:
        if self.ended:
            raise StopAsyncIteration
        try:
            frame = msgpack.unpackb(await self._ws.recv())
        except websockets.ConnectionClosed as closed:
            if closed.rcvd is not None and closed.rcvd.code >= 4000:
                raise ServerError(closed.rcvd.code - 4000, closed.rcvd.reason) from None
            raise StopAsyncIteration from None
        self.ended = frame.get("type") == "exit"
        return frame

    async def send(self, data: bytes | str) -> None:
        await self._ws.send(msgpack.packb({"type": "input", "data": data.encode() if isinstance(data, str) else data}))

    async def close_input(self) -> None:
        await self._ws.send(msgpack.packb({"type": "close_input"}))

    async def kill(self) -> None:
        await self._ws.send(msgpack.packb({"type": "kill"}))

    async def detach(self) -> None:
        """Leave the process running (it is not killed after the grace period)."""
        await self._ws.send(msgpack.packb({"type": "detach"}))
        await self._ws.close()

    async def close(self) -> None:
        """Drop the connection (the server then treats the client as vanished)."""
        await self._ws.close()


class AsyncClient:
    def __init__(self, server: str | None = None, token: str | None = None, timeout_s: float = 120.0):
        self.server = (server or os.environ.get("SYMPHONY_SERVER") or DEFAULT_SERVER).rstrip("/")
        self.token = token if token is not None else os.environ.get("SYMPHONY_TOKEN")
        headers = {"Authorization": f"Bearer {self.token}"} if self.token else {}
        self._http = httpx.AsyncClient(base_url=self.server, headers=headers, timeout=timeout_s)

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()

    async def upload(self, program: str | Path | bytes, name: str | None = None) -> dict:
        """Upload a .wasm (a path or its bytes); returns {"sha256", "name", "size", ...}."""
        if isinstance(program, (bytes, bytearray)):
            data, name = bytes(program), name or "program"
        else:
            data, name = Path(program).read_bytes(), name or Path(program).stem
        return _check(await self._http.post("/programs", params={"name": name}, content=data,
                                            headers={"Content-Type": "application/wasm"}))

    async def programs(self) -> list[dict]:
        return _check(await self._http.get("/programs"))

    async def launch(self, program: str, args: Iterable[str] = (), env: dict[str, str] | None = None,
                     detached: bool = False) -> dict:
        """Start a process of an uploaded program (its sha256); returns its description."""
        return _check(await self._http.post("/processes", json={"program": program, "args": list(args),
                                                                "env": env or {}, "detached": detached}))

    async def ps(self, all: bool = False) -> list[dict]:
        return _check(await self._http.get("/processes", params={"all": str(all).lower()}))

    async def inspect(self, pid: int) -> dict:
        return _check(await self._http.get(f"/processes/{pid}"))

    async def kill(self, pid: int) -> dict:
        return _check(await self._http.delete(f"/processes/{pid}"))

    async def attach(self, pid: int) -> ProcessStream:
        url = "ws" + self.server[4:] + f"/processes/{pid}/stream"
        headers = {"Authorization": f"Bearer {self.token}"} if self.token else {}
        ws = await websockets.connect(url, additional_headers=headers, max_size=2**26)
        return ProcessStream(ws)

    async def run(self, program: str, args: Iterable[str] = (), env: dict[str, str] | None = None,
                  messages: Iterable[bytes | str] = ()) -> RunResult:
        """Launch, send `messages` to its recv then close its input, and collect everything."""
        pid = (await self.launch(program, args, env))["pid"]
        stream = await self.attach(pid)
        try:
            # The process may end before it reads them all (then the server closes the socket).
            with contextlib.suppress(websockets.ConnectionClosed):
                for message in messages:
                    await stream.send(message)
                await stream.close_input()
            output, log, end = [], [], {}
            async for frame in stream:
                if frame["type"] == "output":
                    output.append(frame["data"])
                elif frame["type"] == "log":
                    log.append(frame["text"])
                elif frame["type"] == "exit":
                    end = frame
        finally:
            await stream.close()
        return RunResult(pid, b"".join(output), "".join(log), end.get("code", -1), end.get("state", "unknown"),
                         end.get("reason", "the connection closed before the process ended"))

    async def kv_ls(self, prefix: str = "") -> list[dict]:
        return _check(await self._http.get("/kv", params={"prefix": prefix}))

    async def kv_rm(self, path: str) -> dict:
        # Quoted: a name holding ?, # or % is a name, not a query, a fragment or an escape; a
        # segment . or .. too, or the URL's normalisation would name another file.
        segments = [urllib.parse.quote(part, safe="@").replace(".", "%2E") if part in (".", "..")
                    else urllib.parse.quote(part, safe="@") for part in path.split("/")]
        return _check(await self._http.delete("/kv/" + "/".join(segments)))

    async def kv_share(self, path: str, tenants: list[str]) -> dict:
        return _check(await self._http.post("/kv/share", json={"path": path, "tenants": tenants}))

    async def health(self) -> dict:
        return _check(await self._http.get("/health"))


class SyncProcessStream:
    """ProcessStream, blocking."""

    def __init__(self, stream: ProcessStream, call):
        self._stream, self._call = stream, call

    def __iter__(self) -> "SyncProcessStream":
        return self

    def __next__(self) -> dict:
        try:
            return self._call(self._stream.__anext__())
        except StopAsyncIteration:
            raise StopIteration from None

    def send(self, data: bytes | str) -> None:
        self._call(self._stream.send(data))

    def close_input(self) -> None:
        self._call(self._stream.close_input())

    def kill(self) -> None:
        self._call(self._stream.kill())

    def detach(self) -> None:
        self._call(self._stream.detach())

    def close(self) -> None:
        self._call(self._stream.close())


class Client:
    """The blocking client: AsyncClient's calls, run on a private event loop thread."""

    def __init__(self, server: str | None = None, token: str | None = None, timeout_s: float = 120.0):
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="symphony-client", daemon=True)
        self._thread.start()
        self._async = self._call(self._make(server, token, timeout_s))
        self.server, self.token = self._async.server, self._async.token

    @staticmethod
    async def _make(server, token, timeout_s) -> AsyncClient:
        return AsyncClient(server, token, timeout_s)

    def _call(self, coroutine):
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self._call(self._async.aclose())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()

    def upload(self, program: str | Path | bytes, name: str | None = None) -> dict:
        return self._call(self._async.upload(program, name))

    def programs(self) -> list[dict]:
        return self._call(self._async.programs())

    def launch(self, program: str, args: Iterable[str] = (), env: dict[str, str] | None = None,
               detached: bool = False) -> dict:
        return self._call(self._async.launch(program, args, env, detached))

    def ps(self, all: bool = False) -> list[dict]:
        return self._call(self._async.ps(all))

    def inspect(self, pid: int) -> dict:
        return self._call(self._async.inspect(pid))

    def kill(self, pid: int) -> dict:
        return self._call(self._async.kill(pid))

    def attach(self, pid: int) -> SyncProcessStream:
        return SyncProcessStream(self._call(self._async.attach(pid)), self._call)

    def run(self, program: str, args: Iterable[str] = (), env: dict[str, str] | None = None,
            messages: Iterable[bytes | str] = ()) -> RunResult:
        return self._call(self._async.run(program, args, env, list(messages)))

    def kv_ls(self, prefix: str = "") -> list[dict]:
        return self._call(self._async.kv_ls(prefix))

    def kv_rm(self, path: str) -> dict:
        return self._call(self._async.kv_rm(path))

    def kv_share(self, path: str, tenants: list[str]) -> dict:
        return self._call(self._async.kv_share(path, tenants))

    def health(self) -> dict:
        return self._call(self._async.health())
