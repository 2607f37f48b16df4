"""The checks every request to `symphony serve` passes before a route reads a byte of its body:
an ASGI middleware in front of the whole app.

1. Where the request may come from. A server without a tenants file trusts whoever reaches it,
   so it answers only requests whose `Host` is one of its own names (loopback names, the address
   it is bound to, `--allowed-host`): a rebound DNS name is refused. A request that carries an
   `Origin` (a browser sends one with every cross-site request, and with WebSocket handshakes)
   must come from a page of the server itself or an `--allowed-origin`: a web page elsewhere can
   neither call the API with "simple" POSTs nor attach to a process's stream. With a tenants file
   the bearer token is what protects the API, so neither check applies unless configured.
2. Who sends it. With a tenants file, a request to any path but the public ones (health,
   metrics, the API's description) needs a known bearer token, checked from the headers alone:
   401 before the body is read (FastAPI reads and parses a body before it resolves a route's
   dependencies, so a stranger's body of any size cost the server its memory).
3. How big its body is. Each route has a limit (`body_limit`): a larger `Content-Length` is
   answered 413 at once, and a body sent without one is read only up to the limit. Uploads read
   their own body as it streams (server.py bounds it); every other body is read here, whole, and
   handed to the route.

Refusals under /v1 are answered in OpenAI's error shape, the others as FastAPI's
(`{"detail": ...}`); a refused WebSocket handshake gets HTTP 403.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from urllib.parse import urlsplit

from .tenants import Tenants

PUBLIC_PATHS = frozenset({"/health", "/metrics", "/version", "/docs", "/docs/oauth2-redirect", "/redoc",
                          "/openapi.json"})
LOOPBACK_HOSTS = frozenset({"localhost", "127.0.0.1", "::1"})
JSON_BODY_BYTES = 1 * 2**20  # a route's JSON body (launch arguments are at most 64 KiB of text)
OPENAI_BODY_BYTES = 4 * 2**20  # a completion's: a long prompt, or its token ids
STREAMED_BODY_PATHS = ("/programs",)  # routes that read (and bound) their body as it streams


def body_limit(path: str) -> int | None:
    """The most bytes a request body to `path` may have (None: the route bounds it itself)."""
    if path in STREAMED_BODY_PATHS:
        return None
    return OPENAI_BODY_BYTES if openai_path(path) else JSON_BODY_BYTES


def openai_path(path: str) -> bool:
    """Is `path` one of the OpenAI-compatible routes (with vLLM's /tokenize and /detokenize)?"""
    return path.startswith("/v1/") or path in ("/tokenize", "/detokenize")


@dataclass(frozen=True)
class Origins:
    """The names an open server answers to: `Host` values (without a port) and `Origin`s (a
    scheme, a host and maybe a port, or a host alone for any scheme and port). '*' allows all."""

    hosts: frozenset[str]
    origins: frozenset[str]

    @classmethod
    def for_server(cls, bind_host: str | None = None, hosts=(), origins=()) -> "Origins":
        own = set(LOOPBACK_HOSTS)
        if bind_host and bind_host not in ("0.0.0.0", "::", ""):
            own.add(bind_host.strip("[]").lower())
        return cls(frozenset(own | {h.strip("[]").lower() for h in hosts}),
                   frozenset(o.rstrip("/").lower() for o in origins))

    def host_allowed(self, host_header: str | None) -> bool:
        if "*" in self.hosts:
            return True
        if not host_header:
            return False
        host = urlsplit(f"//{host_header}").hostname  # drops the port; an IPv6 address loses its brackets
        return host is not None and host.lower() in self.hosts

    def origin_allowed(self, origin: str) -> bool:
        """A page of one of the server's own names (any scheme and port), or a listed origin."""
        origin = origin.rstrip("/").lower()
        if "*" in self.origins or origin in self.origins:
            return True
        try:
            parts = urlsplit(origin)
        except ValueError:
            return False
        return parts.scheme in ("http", "https") and parts.hostname is not None and (
            parts.hostname in self.hosts or parts.hostname in self.origins)


class RequestGuard:
    """ASGI middleware: origin checks (`origins`, None: none), then the bearer token (`tenants`;
    none needed when they are open access), then the body's size (see the module docstring)."""

    def __init__(self, app, tenants: Tenants, origins: Origins | None):
        self.app = app
        self.tenants = tenants
        self.origins = origins

    async def __call__(self, scope, receive, send):
        if scope["type"] not in ("http", "websocket"):
            return await self.app(scope, receive, send)
        headers = {}
        for name, value in scope.get("headers", ()):
            headers.setdefault(name.decode("latin-1").lower(), value.decode("latin-1"))
        path = scope.get("path", "")
        if self.origins is not None:
            if not self.origins.host_allowed(headers.get("host")):
                return await _refuse(scope, send, 400, f"Host {headers.get('host')!r} is not one of this "
                                     "server's names (symphony serve --allowed-host NAME adds one)")
            origin = headers.get("origin")
            if origin is not None and not self.origins.origin_allowed(origin):
                return await _refuse(scope, send, 403, f"requests from pages of {origin!r} are refused "
                                     "(symphony serve --allowed-origin ORIGIN allows one)")
        if scope["type"] == "websocket":  # the route checks its token (no body to protect)
            return await self.app(scope, receive, send)
        if path not in PUBLIC_PATHS and not self.tenants.open_access:
            if self.tenants.authenticate(bearer_token(headers.get("authorization"))) is None:
                return await _refuse(scope, send, 401, "missing or unknown bearer token",
                                     {"www-authenticate": "Bearer"})
        limit = body_limit(path)
        if limit is None:
            return await self.app(scope, receive, send)
        length = headers.get("content-length")
        if length is not None and (not length.isdigit() or int(length) > limit):
            return await _refuse(scope, send, 413, f"the request body is over {limit} bytes")
        body, more = bytearray(), True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body += message.get("body", b"")
            more = message.get("more_body", False)
            if len(body) > limit:
                return await _refuse(scope, send, 413, f"the request body is over {limit} bytes")
        return await self.app(scope, _replay(bytes(body), receive), send)


def bearer_token(header: str | None) -> str | None:
    if header and header[:7].lower() == "bearer ":
        return header[7:].strip()
    return None


def _replay(body: bytes, receive):
    """A `receive` that gives the app the body read already, then waits on the real one (for
    the client's disconnect)."""
    sent = False

    async def replay():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()
    return replay


async def _refuse(scope, send, status: int, message: str, headers: dict[str, str] | None = None) -> None:
    if scope["type"] == "websocket":
        if "websocket.http.response" in scope.get("extensions", {}):  # the ASGI extension uvicorn offers
            await send({"type": "websocket.http.response.start", "status": status,
                        "headers": [(b"content-type", b"application/json")]})
            await send({"type": "websocket.http.response.body", "body": json.dumps({"detail": message}).encode()})
        else:  # closed before it was accepted: the server answers 403
            await send({"type": "websocket.close", "code": 1008})
        return
    if openai_path(scope.get("path", "")):
        kind, code = ("authentication_error", "invalid_api_key") if status == 401 else ("invalid_request_error", None)
        payload = {"error": {"message": message, "type": kind, "param": None, "code": code}}
    else:
        payload = {"detail": message}
    body = json.dumps(payload).encode()
    response_headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    response_headers += [(k.encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": response_headers})
    await send({"type": "http.response.body", "body": body})

