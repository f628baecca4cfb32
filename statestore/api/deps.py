"""What the lifespan builds once, reached by the routes through one dependency."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, Request
from sqlalchemy.ext.asyncio import AsyncEngine

from statestore.config import Settings
from statestore.store.cache import HistoryCache
from statestore.threads.service import ThreadService
from statestore.upstream.client import UpstreamClient


@dataclass(frozen=True, slots=True)
class Resources:
    settings: Settings
    engine: AsyncEngine
    cache: HistoryCache
    upstream: UpstreamClient
    threads: ThreadService


def get_resources(request: Request) -> Resources:
    resources: Resources = request.app.state.resources
    return resources


ResourcesDep = Annotated[Resources, Depends(get_resources)]
