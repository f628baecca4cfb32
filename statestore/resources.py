"""What the server builds once, and tears down once: the engines, the cache, the upstream clients, and the services on
them. The storage underneath (statestore/storage_setup.py) and the admin's services (statestore/admin_setup.py) are
built by the same functions `statestore admin` calls, so both run the same wiring."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

from sqlalchemy.ext.asyncio import AsyncEngine

from statestore.admin import AdminService
from statestore.admin_setup import build_admin
from statestore.auth import AdminTokens, Authenticator
from statestore.clock import Clock
from statestore.config import Settings
from statestore.content_keys import ContentKeys
from statestore.core.idempotency import Idempotency
from statestore.core.leased_log import LeasedLog
from statestore.core.windows import Windows
from statestore.metrics import Metrics
from statestore.responses.background import BackgroundTurns
from statestore.responses.background_runs import BackgroundRunner
from statestore.responses.compaction_seal import compaction_seal
from statestore.responses.turns import ResponseTurns
from statestore.retention import Retention
from statestore.storage_setup import open_storage
from statestore.store.background_store import BackgroundStore
from statestore.store.cache import HistoryCache
from statestore.store.cache_setup import response_heads, thread_claims
from statestore.store.console_guard import ConsoleGuard
from statestore.store.conversation_store import ConversationStore
from statestore.store.engine import create_engine
from statestore.store.event_log import create_event_log
from statestore.store.lease_statements import LeaseStatements
from statestore.store.pg_hot_path import PgHotPath
from statestore.store.resp import RedisClient
from statestore.store.response_statements import PgResponseStatements
from statestore.store.response_store import ResponseStore
from statestore.store.sealed_events import sealed_event_log
from statestore.store.thread_claims import HeadClaims
from statestore.store.thread_reads import ThreadQueries
from statestore.store.thread_repository import ThreadRepository
from statestore.store.thread_store import ThreadStore
from statestore.threads.service import ThreadService
from statestore.threads.summary import BackendSummaries
from statestore.upstream.client import Upstream, UpstreamClient
from statestore.upstream.token_counts import ChatTokenizer, MessagesCounter

if TYPE_CHECKING:
    from opentelemetry.trace import Tracer


@dataclass(frozen=True, slots=True)
class Resources:
    settings: Settings
    engine: AsyncEngine
    # Where the wrapped data keys live (the content database's engine unless STATESTORE_KEYSTORE_URL is set), and the
    # keys every content byte is sealed and opened through (encryption off: a pass-through).
    keystore_engine: AsyncEngine
    content: ContentKeys
    # The process's one Redis client (None without STATESTORE_REDIS_URL): one pool, one breaker (a Cluster's: per
    # node), shared by the cache, claims, heads and the background events, each call bound by its own kind's timeout.
    redis: RedisClient | None
    cache: HistoryCache
    upstream: Upstream
    threads: ThreadService
    authenticator: Authenticator
    admin_tokens: AdminTokens
    console_guard: ConsoleGuard
    admin: AdminService
    queries: ThreadQueries
    retention: Retention
    clock: Clock
    metrics: Metrics
    # The Responses front door: None when no Chat Completions backend is configured.
    chat_upstream: Upstream
    responses: ResponseTurns | None
    # Background responses (the Responses door's turns that outlive their request): None without that door.
    background: BackgroundTurns | None
    # Writes sent with an Idempotency-Key, on both doors (statestore/core/idempotency.py).
    idempotency: Idempotency

    async def relay_credential(self, headers: list[tuple[bytes, bytes]]) -> tuple[bytes, bytes] | None:
        """keys mode: every request needs a statestore key, and the backend gets the configured credential.
        passthrough: the client's own credential goes through, and the backend judges it."""
        if self.settings.auth_mode != "keys":
            return None
        return (await self.authenticator.authenticate(headers)).upstream_credential


@asynccontextmanager
async def build_resources(
    settings: Settings,
    *,
    metrics: Metrics | None = None,
    pool_size: int | None = None,
    serving: bool = True,
    tracer: Tracer | None = None,
) -> AsyncIterator[Resources]:
    """Everything wired, closed in reverse order on exit. `serving=False`: no prepared statements' pool, and the
    policy cache off so each call reads what is stored now."""
    metrics = metrics or Metrics()
    async with AsyncExitStack() as stack:
        storage = open_storage(settings, stack, pool_size=pool_size)
        engine, content, cache, clock = storage.engine, storage.content, storage.cache, storage.clock
        if settings.database_url.startswith("postgresql"):
            # Cold on PostgreSQL: the same pool, AUTOCOMMIT set on each checkout (a flag of the driver's adapter).
            single_statements = engine.execution_options(isolation_level="AUTOCOMMIT")
        else:
            # SQLite's leases run here: an engine of its own, so a checkout does not switch isolation levels.
            single_statements = create_engine(settings, autocommit=True, pool_size=pool_size)
            stack.push_async_callback(single_statements.dispose)
        upstream: Upstream = UpstreamClient(
            settings.upstream_url,
            connect_timeout=settings.upstream_connect_timeout,
            read_timeout=settings.upstream_read_timeout,
            max_connections=settings.upstream_max_connections,
            pool_timeout=settings.upstream_pool_timeout_seconds,
            metrics=metrics,
        )
        stack.push_async_callback(upstream.aclose)
        chat_upstream: Upstream = UpstreamClient(
            settings.chat_upstream_url or settings.upstream_url,
            connect_timeout=settings.upstream_connect_timeout,
            read_timeout=settings.upstream_read_timeout,
            max_connections=settings.upstream_max_connections,
            pool_timeout=settings.upstream_pool_timeout_seconds,
            metrics=metrics,
        )
        stack.push_async_callback(chat_upstream.aclose)
        pg_hot_path = await PgHotPath.open(settings) if serving else None
        if pg_hot_path is not None:
            stack.push_async_callback(pg_hot_path.aclose)
        # Both doors' turns take, renew, release and commit through one leased log, on the same pools.
        lease_statements = LeaseStatements(engine, single_statements, pg_hot_path, content)
        leased_log = LeasedLog(lease_statements)
        repository: ThreadStore = ThreadRepository(engine, single_statements, pg=pg_hot_path, content=content)
        pg_responses = PgResponseStatements(pg_hot_path) if pg_hot_path is not None else None
        thread_cache: HistoryCache = cache
        claims: HeadClaims | None = thread_claims(settings, cache, pg_hot_path)
        if tracer is not None:
            # Only when tracing is on: the same objects, each call inside a span (statestore/traced.py).
            from statestore.traced import (  # noqa: PLC0415
                TracedCache,
                TracedClaims,
                TracedLog,
                TracedRepository,
                TracedUpstream,
            )

            leased_log = TracedLog(lease_statements, tracer)
            repository = TracedRepository(repository, tracer)
            claims = TracedClaims(claims, tracer) if claims is not None else None
            thread_cache = TracedCache(cache, tracer)
            upstream = TracedUpstream(upstream, tracer)
            chat_upstream = TracedUpstream(chat_upstream, tracer, system="openai")
        admin = build_admin(settings, storage, serving=serving)
        policies, authenticator = admin.policies, admin.authenticator

        async def idempotency_ttl(tenant_id: str | None) -> int:
            return (await policies.for_tenant(tenant_id)).idempotency_ttl_seconds

        responses = (
            ResponseTurns(
                leased_log=leased_log,
                responses=ResponseStore(engine, pg_responses, content),
                conversations=ConversationStore(engine, pg_responses, content),
                cache=cache,
                policies=policies,
                clock=clock,
                lease_seconds=settings.lease_seconds,
                metrics=metrics,
                windows=Windows(chat_upstream),
                tokenizer=ChatTokenizer(chat_upstream),
                seal=compaction_seal(settings),
                heads=response_heads(settings, cache),
            )
            if settings.chat_upstream_url
            else None
        )
        background = None
        if responses is not None:
            kept = create_event_log(storage.redis, settings.redis_prefix, cap=settings.background_events_max)
            stack.push_async_callback(kept.aclose)
            events = sealed_event_log(kept, content)
            background_store = BackgroundStore(engine, single_statements, pg_hot_path, content)
            background = BackgroundTurns(
                turns=responses,
                store=background_store,
                events=events,
                runner=BackgroundRunner(
                    turns=responses,
                    store=background_store,
                    events=events,
                    chat_upstream=chat_upstream,
                    authenticator=authenticator,
                    clock=clock,
                    metrics=metrics,
                    lease_seconds=settings.lease_seconds,
                    workers=settings.background_workers,
                    poll_seconds=settings.background_poll_seconds,
                ),
                clock=clock,
            )
        yield Resources(
            settings=settings,
            engine=engine,
            keystore_engine=storage.keystore_engine,
            content=content,
            redis=storage.redis,
            cache=cache,
            upstream=upstream,
            threads=ThreadService(
                leased_log=leased_log,
                repository=repository,
                cache=thread_cache,
                policies=policies,
                lease_seconds=settings.lease_seconds,
                metrics=metrics,
                summaries=BackendSummaries(upstream),
                windows=Windows(upstream),
                counter=MessagesCounter(upstream),
                clock=clock,
                content=content,
                claims=claims,
            ),
            authenticator=authenticator,
            admin_tokens=AdminTokens(settings.admin_token_table()),
            console_guard=ConsoleGuard(engine),
            admin=admin.admin,
            queries=ThreadQueries(engine, content),
            retention=admin.retention,
            clock=clock,
            metrics=metrics,
            chat_upstream=chat_upstream,
            responses=responses,
            background=background,
            idempotency=Idempotency(
                admin.idempotency_store, clock=clock, claim_seconds=settings.lease_seconds, ttl_for=idempotency_ttl
            ),
        )
