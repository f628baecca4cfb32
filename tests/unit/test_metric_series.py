"""The series counted in this process render as prometheus_client's own metrics would, sample for sample."""

from __future__ import annotations

import random
import re

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from statestore.metric_series import Declared, Family, InProcess, Maker, Shared, Timing
from statestore.metrics import DECLARED, DURATION_BUCKETS

_CREATED = re.compile(r"^(\S+_created\{.*\}) \S+$", re.M)


def _rendered(registry: CollectorRegistry) -> str:
    # the time a series was created is each series' own; every other value must match
    return _CREATED.sub(r"\1 <created>", generate_latest(registry).decode())


def _fill(make: Maker, seed: int) -> None:
    draw = random.Random(seed)
    for declared in DECLARED:
        values = [[f"{label}-{n}" for n in range(3)] for label in declared.labels]
        if declared.buckets:
            timing = make.histogram(declared)
            # each bound itself, just above it, past the last, and zero
            amounts = [*DURATION_BUCKETS, *(b * 1.0001 for b in DURATION_BUCKETS), 61.0, 1e9, 0.0]
            for _ in range(200):
                timing.labels(*(draw.choice(v) for v in values)).observe(draw.choice(amounts))
        else:
            counting = make.counter(declared)
            for _ in range(200):
                counting.labels(*(draw.choice(v) for v in values)).inc()


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_in_process_series_render_as_prometheus_clients_own(seed: int) -> None:
    ours, theirs = CollectorRegistry(auto_describe=True), CollectorRegistry(auto_describe=True)
    _fill(InProcess(ours), seed)
    _fill(Shared(theirs), seed)
    rendered = _rendered(ours)
    assert rendered == _rendered(theirs)
    assert 'le="+Inf"' in rendered
    assert "<created>" in rendered


def test_a_duration_on_a_bound_is_in_that_bucket() -> None:
    registry = CollectorRegistry()
    timing: Family[Timing] = InProcess(registry).histogram(Declared("d", "Durations.", ("route",), (0.5, 1.0)))
    for amount in (0.5, 0.75, 1.0, 1.5):
        timing.labels("/r").observe(amount)
    text = generate_latest(registry).decode()
    assert 'd_bucket{le="0.5",route="/r"} 1.0' in text
    assert 'd_bucket{le="1.0",route="/r"} 3.0' in text
    assert 'd_bucket{le="+Inf",route="/r"} 4.0' in text
    assert 'd_sum{route="/r"} 3.75' in text
