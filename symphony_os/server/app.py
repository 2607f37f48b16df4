"""`symphony serve`: the shared server. One process holds the model, the KV pool, both
schedulers (the runtime's workers and batch driver) and this HTTP + WebSocket API:

    POST   /programs?name=N         upload a .wasm (the body); validated, stored by sha256, compiled once
    GET    /programs                the tenant's programs;  GET/DELETE /programs/{sha256}
    POST   /processes               launch {"program", "args", "env", "detached"}
    GET    /processes[?all=true]    the tenant's processes;  GET /processes/{pid};  DELETE kills
    WS     /processes/{pid}/stream  msgpack frames (process_table.py); the client sends
                                    {"type": "input", "data": b}, "close_input", "detach" or "kill"
    GET    /kv[?prefix=P]           the tenant's KV files;  DELETE /kv/{path};  POST /kv/share
    GET    /v1/models, POST /v1/completions, /v1/chat/completions   (openai_api.py)
    GET    /health, /metrics        (Prometheus text)

A bearer token (`Authorization: Bearer T`, on the WebSocket handshake too: never in the URL,
where logs would keep it) names the tenant (tenants.py). Another tenant's programs, processes and files answer 404 as if they did not
exist; a request over quota answers 403; each with a reason in `detail`.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import tempfile
import time
from pathlib import Path

import msgpack
from fastapi import FastAPI, HTTPException, Query, Request, WebSocket
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, Field

from ..engine.loop import Engine
from ..errors import FileNotFound, InputClosed, InvalidArgument, LimitExceeded, PermissionDenied
from ..lip.process import INBOX_BYTES
from ..lip.runtime import Runtime
from ..wasm.program import ProgramError
from .builtin_lips import builtin_lip
from .completion import CompletionCounters
from .guard import Origins, RequestGuard, bearer_token
from .logs import event, redact_tokens_in_uvicorn_logs
from .metrics import render_metrics
from .openai_api import router as openai_router
from .process_table import AlreadyAttached, FrameBuffer, ProcessTable, ServedProcess
from .program_store import ProgramStore, StoredProgram
from .state import UPLOADS_IN_PROGRESS_PER_TENANT, ServerConfig, ServerState, StateDep, TenantDep
from .tenants import QuotaExceeded, Tenant, Tenants

log = logging.getLogger("symphony.server")
INPUT_RETRY_S = 0.01  # how often a message for a full inbox looks again

MAX_ARGS = 256
MAX_ARG_BYTES = 64 * 1024


class LaunchRequest(BaseModel):
    program: str = Field(description="sha256 of a program this tenant uploaded")
    args: list[str] = Field(default_factory=list, max_length=MAX_ARGS)
    env: dict[str, str] = Field(default_factory=dict)
    detached: bool = Field(False, description="keep running when no client is attached")


class ShareRequest(BaseModel):
    path: str
    tenants: list[str] = Field(description="tenants that may open it read-only ('*': all); [] un-shares")


def _launch_arguments_problem(args: list[str], env: dict[str, str]) -> str | None:
    """Why a process cannot get these args and env (None: it can): they become C strings of
    UTF-8 in the guest's memory (argv, environ), at most MAX_ARG_BYTES of them."""
    strings = [*args, *env, *env.values()]
    try:
        size = sum(len(s.encode()) for s in strings)
    except UnicodeEncodeError:  # JSON may escape a lone UTF-16 surrogate ("\ud800")
        return "args and env must be text: a lone UTF-16 surrogate is not"
    if size > MAX_ARG_BYTES:
        return f"args and env take at most {MAX_ARG_BYTES} bytes of UTF-8, these take {size}"
    if any("\0" in s for s in strings) or any("=" in k for k in env):
        return "args and env must not contain NUL bytes, env names no '='"
    return None


def _process_or_404(state: ServerState, tenant: Tenant, pid: int) -> ServedProcess:
    record = state.table.get(tenant.name, pid)
    if record is None:
        raise HTTPException(404, f"no process {pid} of tenant {tenant.name!r}")
    return record


def _file_json(stat, tenant: str) -> dict:
    shown = stat.name if stat.owner == tenant else f"@{stat.owner}/{stat.name}"
    return {"path": shown, "owner": stat.owner, "tokens": stat.length, "pages": stat.pages,
            "swapped_pages": stat.swapped_pages, "open_handles": stat.open_handles,
            "shared_with": list(stat.shared_with), "idle_s": round(stat.idle_s, 3)}


def create_app(engine: Engine, tenants: Tenants | None = None, config: ServerConfig | None = None) -> FastAPI:
    """The ASGI app; the runtime starts and stops with it (lifespan)."""
    tenants = tenants or Tenants.single()
    config = config or ServerConfig()
    redact_tokens_in_uvicorn_logs()

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        with contextlib.ExitStack() as stack:
            data_dir = config.data_dir or Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="symphony-")))
            runtime = Runtime(engine, workers=config.workers, limits=config.limits).start()
            stack.callback(runtime.close)
            for tenant in tenants.by_name.values():
                if tenant.quotas.max_kv_pages is not None:
                    engine.kvfs.page_quota[tenant.name] = int(tenant.quotas.max_kv_pages)
                if tenant.quotas.max_kv_files is not None:
                    engine.kvfs.file_quota[tenant.name] = int(tenant.quotas.max_kv_files)
            completion_path = await asyncio.to_thread(builtin_lip, "complete")
            completion_program = runtime.load(completion_path)
            table = ProcessTable(runtime, asyncio.get_running_loop(), config.grace_s, config.retention_s)
            app.state.symphony = ServerState(
                engine, tenants, config, runtime, ProgramStore(runtime.wasm_engine, data_dir, config.compile_time_s), table,
                completion_program, StoredProgram(completion_program.sha256, "complete (built-in)",
                                                  completion_program.size, time.time()), time.time(),
                CompletionCounters())
            reaper = asyncio.create_task(table.reap_forever())
            event(log, "server started", model=engine.loaded.name, tenants=sorted(tenants.by_name),
                  data_dir=str(data_dir))
            try:
                yield
            finally:
                reaper.cancel()
                table.kill_all("server shut down")

    app = FastAPI(title="Symphony", version="0.1.0", lifespan=lifespan,
                  description="Serve LLM inference programs (WebAssembly LIPs), not prompts.")
    app.include_router(openai_router)
    checks_origins = tenants.open_access or config.allowed_hosts or config.allowed_origins
    app.add_middleware(RequestGuard, tenants=tenants, origins=Origins.for_server(
        config.bind_host, config.allowed_hosts, config.allowed_origins) if checks_origins else None)

    # ---- programs ----

    @app.post("/programs", status_code=201, tags=["programs"])
    async def upload(request: Request, tenant: TenantDep, state: StateDep,
                     name: str = Query("program", max_length=128)) -> dict:
        """Upload a WebAssembly module (the request body)."""
        cap = state.config.max_upload_bytes
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > cap:
            raise HTTPException(413, f"module is {length} bytes; the limit is {cap}")
        remaining = state.store.remaining(tenant.name, tenant.quotas.max_upload_bytes)
        if length is not None and length.isdigit() and remaining is not None and int(length) > remaining:
            raise HTTPException(403, f"upload quota: {remaining} of {tenant.quotas.max_upload_bytes} bytes left, "
                                     f"this program is {length} bytes; delete programs first")
        # Bodies are held in memory until compiled: a tenant's uploads in progress hold at most
        # a few modules' worth (many at once, each up to the cap, had no bound but the host's).
        budget, chunks, size = UPLOADS_IN_PROGRESS_PER_TENANT * cap, [], 0
        try:
            async for chunk in request.stream():
                size += len(chunk)
                state.uploading[tenant.name] = state.uploading.get(tenant.name, 0) + len(chunk)
                if size > cap:
                    raise HTTPException(413, f"module is over the limit of {cap} bytes")
                if state.uploading[tenant.name] > budget:
                    raise HTTPException(429, f"tenant {tenant.name!r} has over {budget} bytes of uploads in "
                                             "progress; send this one when they are done")
                chunks.append(chunk)
            async with state.tenant_compiles.setdefault(tenant.name, asyncio.Lock()), state.compiles:
                stored = await asyncio.to_thread(state.store.add, tenant.name, b"".join(chunks), name,
                                                 tenant.quotas.max_upload_bytes)
        except ProgramError as error:
            raise HTTPException(400, f"not a program Symphony can run: {error}") from None
        except QuotaExceeded as error:
            raise HTTPException(403, str(error)) from None
        finally:
            if size:
                state.uploading[tenant.name] -= size
        event(log, "program uploaded", tenant=tenant.name, sha256=stored.sha256, size=stored.size, name=name)
        return stored.to_json()

    @app.get("/programs", tags=["programs"])
    async def list_programs(tenant: TenantDep, state: StateDep) -> list[dict]:
        return [p.to_json() for p in state.store.list(tenant.name)]

    @app.get("/programs/{sha256}", tags=["programs"])
    async def get_program(sha256: str, tenant: TenantDep, state: StateDep) -> dict:
        stored = state.store.get(tenant.name, sha256)
        if stored is None:
            raise HTTPException(404, f"no program {sha256} uploaded by tenant {tenant.name!r}")
        return stored.to_json()

    @app.delete("/programs/{sha256}", tags=["programs"])
    async def delete_program(sha256: str, tenant: TenantDep, state: StateDep) -> dict:
        if not state.store.remove(tenant.name, sha256):
            raise HTTPException(404, f"no program {sha256} uploaded by tenant {tenant.name!r}")
        return {"deleted": sha256}

    # ---- processes ----

    @app.post("/processes", status_code=201, tags=["processes"])
    async def launch(body: LaunchRequest, tenant: TenantDep, state: StateDep) -> dict:
        """Launch a process of an uploaded program; stream it at /processes/{pid}/stream."""
        program = state.store.program(tenant.name, body.program)
        if program is None:
            raise HTTPException(404, f"no program {body.program} uploaded by tenant {tenant.name!r}")
        problem = _launch_arguments_problem(body.args, body.env)
        if problem is not None:
            raise HTTPException(400, problem)
        try:
            record = state.table.launch(tenant, program, state.store.get(tenant.name, body.program),
                                        body.args, body.env, body.detached)
        except QuotaExceeded as error:
            raise HTTPException(403, str(error)) from None
        return record.info()

    @app.get("/processes", tags=["processes"])
    async def list_processes(tenant: TenantDep, state: StateDep, all: bool = False) -> list[dict]:
        """Running processes (`all=true`: ended ones still remembered too)."""
        return [r.info() for r in state.table.list(tenant.name, include_ended=all)]

    @app.get("/processes/{pid}", tags=["processes"])
    async def inspect(pid: int, tenant: TenantDep, state: StateDep) -> dict:
        return _process_or_404(state, tenant, pid).info()

    @app.delete("/processes/{pid}", tags=["processes"])
    async def kill(pid: int, tenant: TenantDep, state: StateDep) -> dict:
        record = _process_or_404(state, tenant, pid)
        was_running = record.running
        state.table.kill(record, "killed by its tenant")
        event(log, "kill requested", pid=pid, tenant=tenant.name)
        return {**record.info(), "was_running": was_running}

    @app.websocket("/processes/{pid}/stream")
    async def stream(ws: WebSocket, pid: int):
        state: ServerState = ws.app.state.symphony
        tenant = state.tenants.authenticate(bearer_token(ws.headers.get("authorization")))
        await ws.accept()
        if tenant is None:
            await ws.close(4401, "missing or unknown bearer token (send it in the Authorization header)")
            return
        record = state.table.get(tenant.name, pid)
        if record is None:
            await ws.close(4404, f"no process {pid} of tenant {tenant.name!r}")
            return
        try:
            frames = state.table.attach(record)
        except AlreadyAttached as error:
            await ws.close(4409, str(error))
            return
        await _stream_process(ws, state.table, record, frames, state.config.input_wait_s)

    # ---- KV files ----

    @app.get("/kv", tags=["kv"])
    async def kv_list(tenant: TenantDep, state: StateDep, prefix: str = "") -> list[dict]:
        """Named KV files of the tenant, and those other tenants share with it (`@owner/name`)."""
        return [_file_json(s, tenant.name) for s in state.engine.kvfs.session(tenant.name).list(prefix)]

    @app.delete("/kv/{path:path}", tags=["kv"])
    async def kv_remove(path: str, tenant: TenantDep, state: StateDep) -> dict:
        try:
            state.engine.kvfs.session(tenant.name).remove(path)
        except FileNotFound as error:
            raise HTTPException(404, str(error)) from None
        except PermissionDenied as error:
            raise HTTPException(403, str(error)) from None
        except InvalidArgument as error:
            raise HTTPException(400, str(error)) from None
        return {"removed": path}

    @app.post("/kv/share", tags=["kv"])
    async def kv_share(body: ShareRequest, tenant: TenantDep, state: StateDep) -> dict:
        """Share one of the tenant's KV files read-only (others open it as `@owner/path`)."""
        try:
            state.engine.kvfs.session(tenant.name).share(body.path, body.tenants)
        except FileNotFound as error:
            raise HTTPException(404, str(error)) from None
        except InvalidArgument as error:
            raise HTTPException(400, str(error)) from None
        return {"path": body.path, "shared_with": sorted(body.tenants)}

    # ---- observability ----

    @app.get("/health", tags=["observability"])
    async def health(state: StateDep) -> dict:
        pool = state.engine.pool.stats()
        return {"status": "ok", "model": state.engine.loaded.name,
                "uptime_s": round(time.time() - state.started_at, 3),
                "processes": state.table.counts_by_state(), "kv_pages_used": pool.used, "kv_pages_total": pool.total}

    @app.get("/metrics", response_class=PlainTextResponse, tags=["observability"])
    async def metrics(state: StateDep) -> PlainTextResponse:
        return PlainTextResponse(render_metrics(state), media_type="text/plain; version=0.0.4")

    return app


async def _deliver(process, data: bytes, wait_s: float) -> None:
    """Give `data` to the process's recv. While its inbox is full, wait for it to read (up to
    `wait_s`: meanwhile this client's frames are not read, which holds its sender back), then
    raise LimitExceeded; a message larger than the whole inbox is refused at once."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            return process.deliver(data)
        except LimitExceeded:
            if len(data) > INBOX_BYTES or time.monotonic() >= deadline:
                raise
        await asyncio.sleep(INPUT_RETRY_S)


async def _stream_process(ws: WebSocket, table: ProcessTable, record: ServedProcess, frames: FrameBuffer,
                          input_wait_s: float) -> None:
    """Frames out until the process's exit frame; client frames in until it leaves."""
    async def pump() -> None:
        while True:
            frame = await frames.peek()
            try:
                await ws.send_bytes(msgpack.packb(frame))
            except asyncio.CancelledError:
                # The client left while the socket drained: uvicorn's websockets had written it.
                delivered(frame)
                raise
            delivered(frame)  # not before: a send that failed (the client vanished) keeps it
            if frame["type"] == "exit":
                return

    def delivered(frame: dict) -> None:
        frames.pop(frame)
        if frame["type"] == "exit":  # a client attaching later gets it again (ProcessTable.attach)
            table.delivered_exit(record)

    async def receive() -> bool:
        """Client frames; returns True when the client detached on purpose."""
        while True:
            message = await ws.receive()
            if message["type"] == "websocket.disconnect":
                return False
            try:
                frame = msgpack.unpackb(message.get("bytes") or b"")
                kind = frame.get("type") if isinstance(frame, dict) else None
            except Exception:
                kind = frame = None
            if kind == "input" and isinstance(frame.get("data"), (bytes, str)):
                data = frame["data"]
                try:
                    await _deliver(record.process, data.encode() if isinstance(data, str) else data, input_wait_s)
                except (InputClosed, LimitExceeded) as error:
                    frames.push({"type": "error", "message": f"input refused: {error}"})
            elif kind == "close_input":
                record.process.close_input()
            elif kind == "detach":
                return True
            elif kind == "kill":
                table.kill(record, "killed by its client")
            else:
                frames.push({"type": "error", "message": "expected a msgpack map with type input (and data), "
                                                         "close_input, detach or kill"})

    pumping, receiving = asyncio.create_task(pump()), asyncio.create_task(receive())
    try:
        done, _ = await asyncio.wait({pumping, receiving}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (pumping, receiving):
            task.cancel()
        await asyncio.gather(pumping, receiving, return_exceptions=True)
    if pumping in done and pumping.exception() is None:
        table.detach(record, on_purpose=False)
        with contextlib.suppress(Exception):
            await ws.close(1000, record.process.end_reason or "ended")
        return
    on_purpose = receiving in done and not receiving.cancelled() and receiving.exception() is None \
        and receiving.result()
    table.detach(record, on_purpose=on_purpose)
    if on_purpose:
        with contextlib.suppress(Exception):
            await ws.close(1000, "detached")
