"""Fixtures of the reliability proofs: per module, a fake backend process and a private migrated database."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import pytest

from tests.reliability.proof_support import Database, private_database
from tests.support.fake_backend import FakeBackend


@pytest.fixture(scope="module")
def backend_process() -> Iterator[FakeBackend]:
    with FakeBackend() as backend:
        yield backend


@pytest.fixture(scope="module")
async def database(postgres_admin_url: str) -> AsyncIterator[Database]:
    async with private_database(postgres_admin_url) as db:
        yield db
