"""The application factory. `create_server_app` is what uvicorn serves: the front door (api/front_door.py) takes
`POST /v1/messages` in one layer, and hands every other request to the FastAPI app `create_app` builds, whose
lifespan builds the resources once (statestore/resources.py)."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi_offline import FastAPIOffline
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response
from starlette.types import ASGIApp

from statestore import __version__, console
from statestore.api import admin as admin_api
from statestore.api import (
    health,
    messages,
    openai_compaction,
    openai_conversations,
    openai_input_tokens,
    openai_responses,
)
from statestore.api import threads as threads_api
from statestore.api.front_door import FrontDoor
from statestore.config import Settings
from statestore.encryption.setup import start_problem
from statestore.errors import InvalidRequest, MethodNotAllowed, NotFound, StatestoreError
from statestore.metrics import Metrics
from statestore.middleware import BodySizeLimitMiddleware, RequestContextMiddleware, error_response
from statestore.resources import build_resources
from statestore.responses.request_schemas import add_components
from statestore.retention import run_purger
from statestore.store.engine import missing_sqlite_database
from statestore.store.migrate import pending_revision
from statestore.tracing import TRACER_NAME, provider_from_environment

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider

log = logging.getLogger(__name__)


def _error_response(request: Request, error: StatestoreError) -> Response:
    return error_response(error, request.scope)


def _describe_raw_bodies(app: FastAPI) -> None:
    """The Responses routes read their bodies themselves, so FastAPI knows nothing of the request models their
    `openapi_extra` names: they are added to the document's components once, when it is first built."""
    build = app.openapi

    def openapi() -> dict[str, Any]:
        fresh = app.openapi_schema is None
        document = build()
        if fresh:
            add_components(document)
        return document

    app.openapi = openapi  # type: ignore[method-assign]


def create_app(settings: Settings | None = None, *, tracer_provider: TracerProvider | None = None) -> FastAPI:
    """The FastAPI app; with `tracer_provider`, the thread service, cache and upstream client are traced (and the
    provider is flushed and shut down with the app)."""
    settings = settings or Settings()
    metrics = Metrics()
    tracer = tracer_provider.get_tracer(TRACER_NAME) if tracer_provider is not None else None

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if (problem := settings.serving_problem()) is not None:
            raise RuntimeError(problem)
        if (missing := missing_sqlite_database(settings.database_url)) is not None:
            raise RuntimeError(missing)
        async with build_resources(settings, metrics=metrics, tracer=tracer) as resources:
            pending = await pending_revision(resources.engine, allow_newer=settings.allow_newer_schema)
            if pending is not None:
                raise RuntimeError(f"{pending}; run `statestore migrate` first")
            if (problem := await start_problem(settings, resources.keystore_engine)) is not None:
                raise RuntimeError(problem)
            app.state.resources = resources
            purger = asyncio.create_task(
                run_purger(resources.retention, settings.purge_interval_seconds), name="purger"
            )
            # Erasures whose process stopped midway (this one, restarted, or another replica) are taken up from now.
            resources.admin.erasures.watch()
            if resources.background is not None and settings.background_workers > 0:
                resources.background.runner.start()
            log.info(
                "statestore ready",
                extra={
                    "database": resources.engine.dialect.name,
                    "cache": resources.cache.kind,
                    "upstream": settings.upstream_url,
                    "auth_mode": settings.auth_mode,
                    "version": __version__,
                },
            )
            # What startup built (modules, routes, schemas, tables: ~160k objects) lives as long as the process.
            # Frozen out of the collector's generations, a full collection walks only what serving made since, not
            # all of it: 85 ms with every request paused, on this stack, when it did.
            gc.collect()
            gc.freeze()
            try:
                yield
            finally:
                gc.unfreeze()  # an app started again in one process (the tests) is collected as before
                purger.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await purger
                await resources.admin.aclose()
                if resources.background is not None:
                    await resources.background.runner.aclose(settings.background_grace_seconds)
                if tracer_provider is not None:
                    await asyncio.to_thread(tracer_provider.shutdown)  # exports what is still batched

    # Interactive docs at /docs with Swagger UI's assets served from the fastapi-offline package: they work with no
    # network, as statestore often runs where no CDN is reachable.
    app = FastAPIOffline(
        docs_url="/docs",
        redoc_url=None,
        static_url="/docs/static",
        title="statestore",
        version=__version__,
        description="statestore's own APIs: the owner's thread API (/statestore/v1) and the admin API (/admin/v1); "
        "the OpenAI Responses and Conversations APIs it serves itself (/v1/responses, /v1/conversations). "
        "POST /v1/messages is the Messages API with threads (see docs/protocol.md).",
        lifespan=lifespan,
        openapi_url="/openapi.json",
    )
    app.state.metrics = metrics
    _describe_raw_bodies(app)
    app.state.settings = settings
    app.include_router(health.router)
    app.include_router(threads_api.router)
    app.include_router(admin_api.router)
    app.include_router(console.router)
    app.include_router(messages.router)
    app.include_router(openai_responses.router)
    app.include_router(openai_compaction.router)
    app.include_router(openai_input_tokens.router)
    app.include_router(openai_conversations.router)
    app.include_router(messages.fallback_router)

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

    # A database or Redis outage, and a value the database cannot hold, are answered by RequestContextMiddleware
    # (statestore/outages.py), for these routes and the front door's alike: one error path.

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> Response:
        first = exc.errors()[0] if exc.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ()))
        return _error_response(request, InvalidRequest(f"{where}: {first.get('msg', 'invalid value')}"))

    app.add_middleware(BodySizeLimitMiddleware, max_bytes=settings.max_body_bytes)
    app.add_middleware(RequestContextMiddleware, metrics=metrics)
    return app


def create_server_app(settings: Settings | None = None, *, tracer_provider: TracerProvider | None = None) -> ASGIApp:
    """What `statestore serve` runs: the front door before the FastAPI app. Traced when the OTEL_* variables ask for
    it (statestore/tracing.py), or with the `tracer_provider` given."""
    settings = settings or Settings()
    provider = tracer_provider or provider_from_environment()
    app = create_app(settings, tracer_provider=provider)
    tracer = provider.get_tracer(TRACER_NAME) if provider is not None else None
    return FrontDoor(
        app,
        metrics=app.state.metrics,
        max_body_bytes=settings.max_body_bytes,
        tracer=tracer,
        socket_max_seconds=settings.socket_max_seconds,
        socket_held_bytes=settings.socket_held_bytes,
        socket_grace_seconds=settings.background_grace_seconds,
    )
