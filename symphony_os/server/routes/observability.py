"""For probes and scrapers, without a token: server-wide totals only, nothing per tenant.

    GET    /health, /metrics (Prometheus: metrics.py), /version
"""
from __future__ import annotations

import importlib.metadata
import time

from fastapi import APIRouter
from fastapi.responses import PlainTextResponse, Response

from ..metrics import CONTENT_TYPE
from ..state import StateDep

router = APIRouter(tags=["observability"])


@router.get("/health")
async def health(state: StateDep) -> dict:
    pool = state.engine.pool.stats()
    return {"status": "ok", "model": state.engine.loaded.name,
            "uptime_s": round(time.time() - state.started_at, 3),
            "processes": state.table.counts_by_state(), "kv_pages_used": pool.used, "kv_pages_total": pool.total}


@router.get("/version")
async def version() -> dict:
    return {"version": package_version()}


def package_version() -> str:
    try:
        return importlib.metadata.version("symphony-os")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown"


@router.get("/metrics", response_class=PlainTextResponse)
async def metrics(state: StateDep) -> Response:
    return Response(state.metrics.render(), media_type=CONTENT_TYPE)
