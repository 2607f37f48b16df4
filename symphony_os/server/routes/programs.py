"""Programs: a tenant's uploads, validated, stored by sha256 and compiled once (program_store.py).

    POST   /programs?name=N         upload a .wasm (the body)
    GET    /programs                the tenant's programs;  GET/DELETE /programs/{sha256}
"""
from __future__ import annotations

import asyncio
import logging

from fastapi import APIRouter, HTTPException, Query, Request

from ...wasm.program import ProgramError
from ..logs import event
from ..state import UPLOADS_IN_PROGRESS_PER_TENANT, StateDep, TenantDep
from ..tenants import QuotaExceeded

log = logging.getLogger("symphony.server")
router = APIRouter(tags=["programs"])


@router.post("/programs", status_code=201)
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


@router.get("/programs")
async def list_programs(tenant: TenantDep, state: StateDep) -> list[dict]:
    return [p.to_json() for p in state.store.list(tenant.name)]


@router.get("/programs/{sha256}")
async def get_program(sha256: str, tenant: TenantDep, state: StateDep) -> dict:
    stored = state.store.get(tenant.name, sha256)
    if stored is None:
        raise HTTPException(404, f"no program {sha256} uploaded by tenant {tenant.name!r}")
    return stored.to_json()


@router.delete("/programs/{sha256}")
async def delete_program(sha256: str, tenant: TenantDep, state: StateDep) -> dict:
    if not state.store.remove(tenant.name, sha256):
        raise HTTPException(404, f"no program {sha256} uploaded by tenant {tenant.name!r}")
    return {"deleted": sha256}
