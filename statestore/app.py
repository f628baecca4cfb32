"""The application factory: the lifespan builds the engine, the cache and the upstream client once."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from sqlalchemy.exc import DataError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response

from statestore import __version__
from statestore.admin import AdminService
from statestore.api import admin as admin_api
from statestore.api import health, messages
from statestore.api import threads as threads_api
from statestore.api.deps import Resources
from statestore.api.fast_path import MessagesFastPath
from statestore.auth import AdminTokens, Authenticator, KeysAuthenticator, PassthroughAuthenticator
from statestore.clock import clock_from
from statestore.config import Settings
from statestore.errors import InvalidRequest, MethodNotAllowed, NotFound, StatestoreError
from statestore.metrics import Metrics
from statestore.middleware import BodySizeLimitMiddleware, RequestContextMiddleware, request_id_of
from statestore.retention import Retention, run_purger
from statestore.store.admin_repository import AdminRepository
from statestore.store.cache import create_cache
from statestore.store.engine import create_engine
from statestore.store.migrate import pending_revision
from statestore.store.repository import ThreadQueries, ThreadRepository
from statestore.threads.policy import Policy
from statestore.threads.policy_store import PolicyStore
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


def settings_problem(settings: Settings) -> str | None:
    """A reason the server must not start with these settings, or None."""
    if settings.auth_mode == "passthrough":
        secret = settings.owner_secret.get_secret_value() if settings.owner_secret else ""
        if len(secret) < 16:
            return (
                "STATESTORE_OWNER_SECRET must be set to a random string of at least 16 characters: it keys the hash "
                "that ties each thread to its credential. Generate one with\n"
                "  python3 -c 'import secrets; print(secrets.token_urlsafe(32))'\n"
                "and keep it: changing it hides every existing thread from its owner."
            )
    elif settings.upstream_api_key is None and not settings.tenant_upstream_keys:
        return (
            "keys mode needs the backend credential: set STATESTORE_UPSTREAM_API_KEY, or "
            'STATESTORE_TENANT_UPSTREAM_KEYS=\'{"tenant-name": "key", ...}\''
        )
    return None


def build_authenticator(settings: Settings, admin: AdminRepository) -> Authenticator:
    if settings.auth_mode == "keys":
        return KeysAuthenticator(
            admin,
            upstream_key=settings.upstream_api_key.get_secret_value() if settings.upstream_api_key else None,
            tenant_upstream_keys={k: v.get_secret_value() for k, v in settings.tenant_upstream_keys.items()},
            cache_seconds=settings.key_cache_seconds,
        )
    secret = settings.owner_secret.get_secret_value().encode() if settings.owner_secret else b""
    return PassthroughAuthenticator(secret)


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or Settings()
    metrics = Metrics()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine = create_engine(settings)
        single_statements = create_engine(settings, autocommit=True)
        try:
            pending = await pending_revision(engine, allow_newer=settings.allow_newer_schema)
            if pending is not None:
                raise RuntimeError(f"{pending}; run `statestore migrate` first")
            if (problem := settings_problem(settings)) is not None:
                raise RuntimeError(problem)
        except BaseException:
            await engine.dispose()
            raise
        clock = clock_from(settings.clock_offset_file)
        cache = create_cache(settings.redis_url, settings.redis_prefix)
        upstream = UpstreamClient(
            settings.upstream_url,
            connect_timeout=settings.upstream_connect_timeout,
            read_timeout=settings.upstream_read_timeout,
            max_connections=settings.upstream_max_connections,
            metrics=metrics,
        )
        admin_repository = AdminRepository(engine)
        policies = PolicyStore(
            admin_repository, fallback=Policy.from_settings(settings), cache_seconds=settings.policy_cache_seconds
        )
        authenticator = build_authenticator(settings, admin_repository)
        queries = ThreadQueries(engine)
        retention = Retention(
            queries=queries, admin=admin_repository, cache=cache, clock=clock, batch_size=settings.purge_batch_size
        )
        threads = ThreadService(
            repository=ThreadRepository(engine, single_statements),
            cache=cache,
            upstream=upstream,
            policies=policies,
            lease_seconds=settings.lease_seconds,
            metrics=metrics,
            clock=clock,
        )
        app.state.resources = Resources(
            settings=settings,
            engine=engine,
            cache=cache,
            upstream=upstream,
            threads=threads,
            authenticator=authenticator,
            admin_tokens=AdminTokens(settings.admin_token_table()),
            admin=AdminService(
                repository=admin_repository,
                policies=policies,
                retention=retention,
                authenticator=authenticator,
                clock=clock,
            ),
            queries=queries,
            retention=retention,
            clock=clock,
        )
        purger = asyncio.create_task(run_purger(retention, settings.purge_interval_seconds), name="purger")
        log.info(
            "statestore ready",
            extra={
                "database": engine.dialect.name,
                "cache": cache.kind,
                "upstream": settings.upstream_url,
                "auth_mode": settings.auth_mode,
                "version": __version__,
            },
        )
        try:
            yield
        finally:
            purger.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await purger
            await upstream.aclose()
            await cache.aclose()
            await single_statements.dispose()
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
    app.include_router(threads_api.router)
    app.include_router(admin_api.router)
    app.include_router(messages.router)
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

    @app.exception_handler(DataError)
    async def unstorable_value(request: Request, exc: DataError) -> Response:
        # A value the database cannot hold (a NUL in text, a number out of range) is the request's fault.
        return _error_response(request, InvalidRequest("the request holds a value statestore cannot store or look up"))

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> Response:
        first = exc.errors()[0] if exc.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ()))
        return _error_response(request, InvalidRequest(f"{where}: {first.get('msg', 'invalid value')}"))

    app.add_middleware(MessagesFastPath)
    app.add_middleware(BodySizeLimitMiddleware, max_bytes=settings.max_body_bytes)
    app.add_middleware(RequestContextMiddleware, metrics=metrics)
    return app
