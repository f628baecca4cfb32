"""The hot routes (`POST /v1/messages`, `POST /v1/responses`), each registered once: `hot_route` puts the handler
in the router, which gives the OpenAPI document its description and serves a FastAPI app mounted on its own, and in
`HOT_ROUTES`, from which the front door (api/front_door.py) serves it with no router or dependency solving."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import APIRouter, Request
from starlette.responses import Response

from statestore.api.deps import ResourcesDep
from statestore.resources import Resources

Headers = list[tuple[bytes, bytes]]
# (resources, raw headers, query string, body) -> the response, or a StatestoreError raised.
HotHandler = Callable[[Resources, Headers, str, bytes], Awaitable[Response]]

HOT_ROUTES: dict[str, HotHandler] = {}


def hot_route(router: APIRouter, path: str, **openapi: Any) -> Callable[[HotHandler], HotHandler]:
    """Register `handler` for `POST path` on `router` (with `openapi`'s description) and for the front door."""

    def register(handler: HotHandler) -> HotHandler:
        if path in HOT_ROUTES:
            raise ValueError(f"hot route {path} registered twice")

        async def endpoint(request: Request, resources: ResourcesDep) -> Response:
            return await handler(resources, request.headers.raw, request.url.query, await request.body())

        endpoint.__name__ = endpoint.__qualname__ = handler.__name__  # the document's operationId
        endpoint.__doc__ = handler.__doc__
        router.add_api_route(path, endpoint, methods=["POST"], **openapi)
        HOT_ROUTES[path] = handler
        return handler

    return register
