"""What the lifespan builds once, reached by the routes through one dependency."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, Request
from sqlalchemy.ext.asyncio import AsyncEngine

from statestore.admin import AdminService
from statestore.auth import AdminTokens, Authenticator
from statestore.clock import Clock
from statestore.config import Settings
from statestore.retention import Retention
from statestore.store.cache import HistoryCache
from statestore.store.repository import ThreadQueries
from statestore.threads.service import ThreadService
from statestore.upstream.client import UpstreamClient


@dataclass(frozen=True, slots=True)
class Resources:
    settings: Settings
    engine: AsyncEngine
    cache: HistoryCache
    upstream: UpstreamClient
    threads: ThreadService
    authenticator: Authenticator
    admin_tokens: AdminTokens
    admin: AdminService
    queries: ThreadQueries
    retention: Retention
    clock: Clock

    async def relay_credential(self, headers: list[tuple[bytes, bytes]]) -> tuple[bytes, bytes] | None:
        """keys mode: every request needs a statestore key, and the backend gets the configured credential.
        passthrough: the client's own credential goes through, and the backend judges it."""
        if self.settings.auth_mode != "keys":
            return None
        return (await self.authenticator.authenticate(headers)).upstream_credential


async def get_resources(request: Request) -> Resources:
    # async: FastAPI would run a plain function in a worker thread on every request.
    resources: Resources = request.app.state.resources
    return resources


ResourcesDep = Annotated[Resources, Depends(get_resources)]
