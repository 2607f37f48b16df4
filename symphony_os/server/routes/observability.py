"""For probes and scrapers, without a token: server-wide totals only, nothing per tenant.

    GET    /health, /metrics        (Prometheus text)
"""
from __future__ import annotations

import time

from fastapi import APIRouter
from fastapi.responses import PlainTextResponse

from ..metrics import render_metrics
from ..state import StateDep

router = APIRouter(tags=["observability"])


@router.get("/health")
async def health(state: StateDep) -> dict:
    pool = state.engine.pool.stats()
    return {"status": "ok", "model": state.engine.loaded.name,
            "uptime_s": round(time.time() - state.started_at, 3),
            "processes": state.table.counts_by_state(), "kv_pages_used": pool.used, "kv_pages_total": pool.total}


@router.get("/metrics", response_class=PlainTextResponse)
async def metrics(state: StateDep) -> PlainTextResponse:
    return PlainTextResponse(render_metrics(state), media_type="text/plain; version=0.0.4")
