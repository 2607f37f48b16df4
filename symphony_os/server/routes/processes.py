"""Processes: launched for a tenant from its programs, listed, inspected, killed, and streamed
to one client at a time (process_table.py).

    POST   /processes               launch {"program", "args", "env", "detached"}
    GET    /processes[?all=true]    the tenant's processes;  GET /processes/{pid};  DELETE kills
    WS     /processes/{pid}/stream  msgpack frames (process_table.py); the client sends
                                    {"type": "input", "data": b}, "close_input", "detach" or "kill"
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import msgpack
from fastapi import APIRouter, HTTPException, WebSocket
from pydantic import BaseModel, Field

from ...errors import InputClosed, LimitExceeded
from ...lip.process import INBOX_BYTES
from ..guard import bearer_token
from ..logs import event
from ..process_table import AlreadyAttached, FrameBuffer, ProcessTable, ServedProcess
from ..state import ServerState, StateDep, TenantDep
from ..tenants import QuotaExceeded, Tenant

log = logging.getLogger("symphony.server")
router = APIRouter(tags=["processes"])
INPUT_RETRY_S = 0.01  # how often a message for a full inbox looks again
MAX_ARGS = 256
MAX_ARG_BYTES = 64 * 1024


class LaunchRequest(BaseModel):
    program: str = Field(description="sha256 of a program this tenant uploaded")
    args: list[str] = Field(default_factory=list, max_length=MAX_ARGS)
    env: dict[str, str] = Field(default_factory=dict)
    detached: bool = Field(False, description="keep running when no client is attached")


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


@router.post("/processes", status_code=201)
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


@router.get("/processes")
async def list_processes(tenant: TenantDep, state: StateDep, all: bool = False) -> list[dict]:
    """Running processes (`all=true`: ended ones still remembered too)."""
    return [r.info() for r in state.table.list(tenant.name, include_ended=all)]


@router.get("/processes/{pid}")
async def inspect(pid: int, tenant: TenantDep, state: StateDep) -> dict:
    return _process_or_404(state, tenant, pid).info()


@router.delete("/processes/{pid}")
async def kill(pid: int, tenant: TenantDep, state: StateDep) -> dict:
    record = _process_or_404(state, tenant, pid)
    was_running = record.running
    state.table.kill(record, "killed by its tenant")
    event(log, "kill requested", pid=pid, tenant=tenant.name)
    return {**record.info(), "was_running": was_running}


@router.websocket("/processes/{pid}/stream")
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
