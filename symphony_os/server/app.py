"""`symphony serve`: the shared server. One process holds the model, the KV pool, both
schedulers (the runtime's workers and batch driver) and this HTTP + WebSocket API:

    POST   /programs?name=N         upload a .wasm (the body); validated, stored by sha256, compiled once
    GET    /programs                the tenant's programs;  GET/DELETE /programs/{sha256}
    POST   /processes               launch {"program", "args", "env", "detached"}
    GET    /processes[?all=true]    the tenant's processes;  GET /processes/{pid};  DELETE kills
    WS     /processes/{pid}/stream  msgpack frames (process_table.py); the client sends
                                    {"type": "input", "data": b}, "close_input", "detach" or "kill"
    GET    /kv[?prefix=P]           the tenant's KV files;  DELETE /kv/{path};  POST /kv/share
    GET    /v1/models, POST /v1/completions, /v1/chat/completions, POST /tokenize, /detokenize
    GET    /version
    GET    /health, /metrics        (Prometheus, through prometheus_client: metrics.py)

Each resource's routes are a module of routes/; this one builds the app around them: the runtime
and the state they share (state.py), started and stopped with the app, and the checks every
request passes first (guard.py).

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

from fastapi import FastAPI

from ..engine.loop import Engine
from ..lip.runtime import Runtime
from .builtin_lips import builtin_lip
from .guard import Origins, RequestGuard
from .logs import event, redact_tokens_in_uvicorn_logs
from .metrics import CompletionCounters, ServerMetrics
from .process_table import ProcessTable
from .program_store import ProgramStore, StoredProgram
from .routes import kv, observability, openai, processes, programs
from .state import ServerConfig, ServerState
from .tenants import Tenants

log = logging.getLogger("symphony.server")


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
            completions = CompletionCounters()
            metrics = ServerMetrics((config.served_model_names or (engine.loaded.name,))[0], engine, completions)
            table = ProcessTable(runtime, asyncio.get_running_loop(), config.grace_s, config.retention_s, metrics)
            metrics.table = table
            app.state.symphony = ServerState(
                engine, tenants, config, runtime, ProgramStore(runtime.wasm_engine, data_dir, config.compile_time_s), table,
                completion_program, StoredProgram(completion_program.sha256, "complete (built-in)",
                                                  completion_program.size, time.time()), time.time(),
                completions, metrics)
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
    for routes in (programs, processes, kv, observability, openai):
        app.include_router(routes.router)
    app.include_router(openai.tokens_router)
    checks_origins = tenants.open_access or config.allowed_hosts or config.allowed_origins
    app.add_middleware(RequestGuard, tenants=tenants, origins=Origins.for_server(
        config.bind_host, config.allowed_hosts, config.allowed_origins) if checks_origins else None)
    return app
