"""What the server's routes share (routes/): its configuration, its state,
and the request dependencies that find them and the calling tenant."""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated

from fastapi import Depends, HTTPException, Request

from ..engine.loop import Engine
from ..lip.limits import ProcessLimits
from ..lip.runtime import Runtime
from ..wasm.program import MAX_MODULE_BYTES, Program
from .guard import bearer_token
from .metrics import CompletionCounters, ServerMetrics
from .process_table import ProcessTable
from .program_store import ProgramStore, StoredProgram
from .tenants import Tenant, Tenants

MAX_CONCURRENT_COMPILES = 2
# The bytes of one tenant's uploads in progress (each held from its first byte until compiled),
# in max_upload_bytes: past it an upload is answered 429.
UPLOADS_IN_PROGRESS_PER_TENANT = 2


@dataclass
class ServerConfig:
    grace_s: float = 30.0  # a vanished client's process is killed after this
    retention_s: float = 600.0  # an ended detached process is listed this long
    data_dir: Path | None = None  # uploaded programs (None: a temporary directory)
    max_upload_bytes: int = MAX_MODULE_BYTES
    workers: int = 1  # scheduler threads polling LIP processes
    limits: ProcessLimits = ProcessLimits()  # each process's, before its tenant's quotas (tenants.py)
    compile_time_s: float = 30.0  # an upload whose compilation takes longer is refused
    input_wait_s: float = 30.0  # a message for a full inbox waits this long for the process to read
    # Where requests may come from (guard.py): checked on a server without tenants, or
    # when either list is given. bind_host: the address the server listens on, one of its names.
    bind_host: str | None = None
    allowed_hosts: tuple[str, ...] = ()
    allowed_origins: tuple[str, ...] = ()
    # The names the OpenAI-compatible endpoints answer to, the first reported (vLLM's
    # --served-model-name); empty: the model's own name.
    served_model_names: tuple[str, ...] = ()


@dataclass
class ServerState:
    """What the handlers share; built when the app starts."""

    engine: Engine
    tenants: Tenants
    config: ServerConfig
    runtime: Runtime
    store: ProgramStore
    table: ProcessTable
    completion_program: Program
    completion_entry: StoredProgram
    started_at: float
    completions: CompletionCounters
    metrics: ServerMetrics
    # Uploads compiling at once (each takes a thread and a CPU core); more wait their turn, and
    # a tenant compiles one at a time (its queue of slow modules would hold every slot).
    compiles: asyncio.Semaphore = field(default_factory=lambda: asyncio.Semaphore(MAX_CONCURRENT_COMPILES))
    tenant_compiles: dict[str, asyncio.Lock] = field(default_factory=dict)
    uploading: dict[str, int] = field(default_factory=dict)  # tenant -> bytes of its uploads in progress


def state_of(request: Request) -> ServerState:
    return request.app.state.symphony


def tenant_of(request: Request) -> Tenant:
    tenant = state_of(request).tenants.authenticate(bearer_token(request.headers.get("authorization")))
    if tenant is None:
        raise HTTPException(401, "missing or unknown bearer token", headers={"WWW-Authenticate": "Bearer"})
    return tenant


TenantDep = Annotated[Tenant, Depends(tenant_of)]
StateDep = Annotated[ServerState, Depends(state_of)]
