"""The campaign's modes. `make test` runs the short campaign; `make campaign` (STATESTORE_CAMPAIGN=full) the default
one. STATESTORE_CAMPAIGN_SEED replays a run's schedule of faults and operations."""

from __future__ import annotations

import os

import pytest

from tests.campaign.campaign import Plan

SHORT = Plan(
    seed=1515,
    clients=16,
    min_ops=1200,
    min_faults=12,
    min_seconds=35,
    max_seconds=50,
    mean_gap=1.2,
    mean_hold=0.8,
    commit_gap=6.0,
)
FULL = Plan(
    seed=2026,
    clients=32,
    min_ops=20_000,
    min_faults=50,
    min_seconds=60,
    max_seconds=480,
    mean_gap=2.5,
    mean_hold=1.2,
    commit_gap=4.0,
)


@pytest.fixture(scope="session")
def campaign_plan() -> Plan:
    plan = FULL if os.environ.get("STATESTORE_CAMPAIGN") == "full" else SHORT
    seed = os.environ.get("STATESTORE_CAMPAIGN_SEED")
    return Plan(**{**plan.__dict__, "seed": int(seed)}) if seed else plan
