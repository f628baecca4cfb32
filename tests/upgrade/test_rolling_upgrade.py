"""`make upgrade-drill` (and its short form in `make test`): a rolling upgrade from the earlier release under load,
and a rollback, with no acknowledged turn lost and no context served wrong (drill.py says what is checked).
STATESTORE_DRILL=full runs the full form (old and new side by side for over a minute each way)."""

from __future__ import annotations

import asyncio
import os
import subprocess
from collections.abc import Iterator

import pytest

from tests.support.fake_backend import FakeBackend
from tests.upgrade.drill import FULL, SHORT, Drill, check_contexts, check_failures, check_present, run_drill
from tests.upgrade.release import REPO, Release, release_at

pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module")
def release() -> Release:
    return release_at()


@pytest.fixture
def backend() -> Iterator[FakeBackend]:
    with FakeBackend() as fake:
        yield fake


async def test_a_rolling_upgrade_and_a_rollback_lose_no_turn(
    release: Release, fresh_pg_url: str, redis_url: str, redis_prefix: str, backend: FakeBackend
) -> None:
    timing = FULL if os.environ.get("STATESTORE_DRILL") == "full" else SHORT
    drill = Drill(release, fresh_pg_url, redis_url, redis_prefix, backend, timing)

    def migrate_old() -> None:
        environment = {k: v for k, v in os.environ.items() if not k.startswith("STATESTORE_")}
        subprocess.run(
            [*release.command(), "migrate"],
            env={**environment, **release.env(), "STATESTORE_DATABASE_URL": fresh_pg_url},
            cwd=REPO,
            check=True,
            capture_output=True,
        )

    try:
        load = await run_drill(drill, migrate_old)
        present = await check_present(load, drill.live()[0])
    finally:
        await asyncio.to_thread(drill.stop_all)
    summary = (
        f"{load.acknowledged} turns acknowledged in {len(load.conversations)} conversations, "
        f"{len(load.failures)} failed ({[f.error for f in load.failures][:5]}); " + "; ".join(drill.log)
    )
    print(summary)
    assert load.acknowledged >= 100, summary
    assert {turn.replica for c in load.conversations for turn in c.turns} >= {r.server.url for r in drill.retired}
    assert check_failures(load, drill) == [], summary
    assert present == [], summary
    assert check_contexts(load, backend.requests()) == [], summary
