"""Liveness, readiness and metrics."""

from __future__ import annotations

import asyncio

import orjson
from fastapi import APIRouter, Request
from sqlalchemy import text
from starlette.responses import Response

from statestore.api.deps import ResourcesDep

router = APIRouter()
# A probe must answer promptly even when the database hangs.
READY_TIMEOUT_SECONDS = 2.0


@router.get("/healthz")
async def healthz() -> Response:
    return Response(b'{"status":"ok"}', media_type="application/json")


@router.get("/readyz")
async def readyz(resources: ResourcesDep) -> Response:
    """503 when the database is unreachable (threaded turns cannot be served). A Redis outage only makes
    statestore slower (the history is read from the database), so it reports "degraded" and stays in rotation."""
    try:
        async with asyncio.timeout(READY_TIMEOUT_SECONDS), resources.engine.connect() as conn:
            await conn.execute(text("SELECT 1"))
        database = "ok"
    except Exception:  # any failure means not ready; the reason is in the server log, not here
        database = "unavailable"
    cache = "ok" if await resources.cache.ping() else "unavailable"
    status = "not_ready" if database != "ok" else "ready" if cache == "ok" else "degraded"
    body = {"status": status, "database": database, "cache": cache, "cache_kind": resources.cache.kind}
    return Response(orjson.dumps(body), status_code=503 if database != "ok" else 200, media_type="application/json")


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    body, content_type = request.app.state.metrics.render()
    return Response(body, media_type=content_type)
