"""Unit tests need no live service: the fixtures that reach PostgreSQL or Redis (tests/conftest.py) fail here, so a
test that needs one is written under tests/integration/ instead."""

from __future__ import annotations

from typing import NoReturn

import pytest


def _no_service(name: str) -> NoReturn:
    pytest.fail(f"a unit test asked for {name}, a live service: it belongs in tests/integration/", pytrace=False)


@pytest.fixture(scope="session")
def postgres_admin_url() -> NoReturn:
    _no_service("PostgreSQL")


@pytest.fixture(scope="session")
def redis_url() -> NoReturn:
    _no_service("Redis")
