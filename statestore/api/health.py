"""Liveness, readiness and metrics."""

from __future__ import annotations

import orjson
from fastapi import APIRouter, Request
from sqlalchemy import text
from starlette.responses import Response

from statestore.api.deps import ResourcesDep

router = APIRouter()


@router.get("/healthz")
async def healthz() -> Response:
    return Response(b'{"status":"ok"}', media_type="application/json")


@router.get("/readyz")
async def readyz(resources: ResourcesDep) -> Response:
    try:
        async with resources.engine.connect() as conn:
            await conn.execute(text("SELECT 1"))
        database = "ok"
    except Exception:  # any failure means not ready; the reason is in the server log, not here
        database = "unavailable"
    cache = "ok" if await resources.cache.ping() else "unavailable"
    ready = database == "ok" and cache == "ok"
    body = {
        "status": "ready" if ready else "not_ready",
        "database": database,
        "cache": cache,
        "cache_kind": resources.cache.kind,
    }
    return Response(orjson.dumps(body), status_code=200 if ready else 503, media_type="application/json")


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    body, content_type = request.app.state.metrics.render()
    return Response(body, media_type=content_type)
