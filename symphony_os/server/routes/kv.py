"""The tenant's KV files, by name: listed (its own, and those others share with it), removed,
and shared read-only with other tenants.

    GET    /kv[?prefix=P]           the tenant's KV files;  DELETE /kv/{path};  POST /kv/share
"""
from __future__ import annotations

from fastapi import APIRouter, HTTPException
from pydantic import BaseModel, Field

from ...errors import FileNotFound, InvalidArgument, PermissionDenied
from ..state import StateDep, TenantDep

router = APIRouter(tags=["kv"])


class ShareRequest(BaseModel):
    path: str
    tenants: list[str] = Field(description="tenants that may open it read-only ('*': all); [] un-shares")


def _file_json(stat, tenant: str) -> dict:
    shown = stat.name if stat.owner == tenant else f"@{stat.owner}/{stat.name}"
    return {"path": shown, "owner": stat.owner, "tokens": stat.length, "pages": stat.pages,
            "swapped_pages": stat.swapped_pages, "open_handles": stat.open_handles,
            "shared_with": list(stat.shared_with), "idle_s": round(stat.idle_s, 3)}


@router.get("/kv")
async def kv_list(tenant: TenantDep, state: StateDep, prefix: str = "") -> list[dict]:
    """Named KV files of the tenant, and those other tenants share with it (`@owner/name`)."""
    return [_file_json(s, tenant.name) for s in state.engine.kvfs.session(tenant.name).list(prefix)]


@router.delete("/kv/{path:path}")
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


@router.post("/kv/share")
async def kv_share(body: ShareRequest, tenant: TenantDep, state: StateDep) -> dict:
    """Share one of the tenant's KV files read-only (others open it as `@owner/path`)."""
    try:
        state.engine.kvfs.session(tenant.name).share(body.path, body.tenants)
    except FileNotFound as error:
        raise HTTPException(404, str(error)) from None
    except InvalidArgument as error:
        raise HTTPException(400, str(error)) from None
    return {"path": body.path, "shared_with": sorted(body.tenants)}
