"""The resources the lifespan built, reached by the routes through one dependency."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from statestore.resources import Resources


async def get_resources(request: Request) -> Resources:
    # async: FastAPI would run a plain function in a worker thread on every request.
    resources: Resources = request.app.state.resources
    return resources


ResourcesDep = Annotated[Resources, Depends(get_resources)]
