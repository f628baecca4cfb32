"""The application factory: the lifespan builds the engine, the cache and the upstream client once."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response

from statestore import __version__
from statestore.api import health, messages
from statestore.api.deps import Resources
from statestore.auth import PassthroughOwners
from statestore.config import Settings
from statestore.errors import InvalidRequest, MethodNotAllowed, NotFound, StatestoreError
from statestore.metrics import Metrics
from statestore.middleware import BodySizeLimitMiddleware, RequestContextMiddleware, request_id_of
from statestore.store.cache import create_cache
from statestore.store.engine import create_engine
from statestore.store.migrate import pending_revision
from statestore.store.repository import ThreadRepository
from statestore.threads.policy import Policy
from statestore.threads.service import ThreadService
from statestore.upstream.client import UpstreamClient

log = logging.getLogger(__name__)


def _error_response(request: Request, error: StatestoreError) -> Response:
    request_id = request_id_of(request.scope)
    return Response(
        error.body(request_id),
        status_code=error.status,
        media_type="application/json",
        headers={**error.headers, "request-id": request_id},
    )


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or Settings()
    metrics = Metrics()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine = create_engine(settings.database_url, pool_size=settings.database_pool_size)
        pending = await pending_revision(engine)
        if pending is not None:
            await engine.dispose()
            raise RuntimeError(f"{pending}; run `statestore migrate` first")
        secret = settings.owner_secret.get_secret_value().encode() if settings.owner_secret else b""
        if len(secret) < 16:
            await engine.dispose()
            raise RuntimeError("STATESTORE_OWNER_SECRET must be set (at least 16 characters)")
        cache = create_cache(settings.redis_url, settings.redis_prefix)
        upstream = UpstreamClient(
            settings.upstream_url,
            connect_timeout=settings.upstream_connect_timeout,
            read_timeout=settings.upstream_read_timeout,
            max_connections=settings.upstream_max_connections,
            metrics=metrics,
        )
        threads = ThreadService(
            repository=ThreadRepository(engine),
            cache=cache,
            upstream=upstream,
            owners=PassthroughOwners(secret),
            policy=Policy.from_settings(settings),
            lease_seconds=settings.lease_seconds,
            metrics=metrics,
        )
        app.state.resources = Resources(
            settings=settings, engine=engine, cache=cache, upstream=upstream, threads=threads
        )
        log.info(
            "statestore ready",
            extra={
                "database": engine.dialect.name,
                "cache": cache.kind,
                "upstream": settings.upstream_url,
                "version": __version__,
            },
        )
        try:
            yield
        finally:
            await upstream.aclose()
            await cache.aclose()
            await engine.dispose()

    app = FastAPI(
        title="statestore",
        version=__version__,
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
        openapi_url="/openapi.json",
    )
    app.state.metrics = metrics
    app.include_router(health.router)
    app.include_router(messages.router)

    @app.exception_handler(StatestoreError)
    async def statestore_error(request: Request, exc: StatestoreError) -> Response:
        return _error_response(request, exc)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        if exc.status_code == 405:
            return _error_response(request, MethodNotAllowed(f"{request.method} is not allowed on {request.url.path}"))
        if exc.status_code == 404:
            return _error_response(request, NotFound(f"no route {request.method} {request.url.path}"))
        return _error_response(request, InvalidRequest(str(exc.detail)))

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> Response:
        first = exc.errors()[0] if exc.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ()))
        return _error_response(request, InvalidRequest(f"{where}: {first.get('msg', 'invalid value')}"))

    app.add_middleware(BodySizeLimitMiddleware, max_bytes=settings.max_body_bytes)
    app.add_middleware(RequestContextMiddleware, metrics=metrics)
    return app
