"""The series behind statestore/metrics.py, made one of two ways from the same declarations.

In one process (`InProcess`): plain numbers, counted without a lock (every count comes from the event loop's
thread) and rendered by a collector of the app's registry in the text prometheus_client's own metrics would
write (tests/unit/test_metric_series.py holds the two side by side). With several workers (`Shared`):
prometheus_client's own metrics, whose values live in the multiprocess directory's files.
"""

from __future__ import annotations

import math
import time
from bisect import bisect_left
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from itertools import accumulate
from typing import Any, Generic, Protocol, TypeVar, cast

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.samples import Sample
from prometheus_client.utils import floatToGoString


class Counting(Protocol):
    def inc(self) -> None: ...


class Timing(Protocol):
    def observe(self, amount: float) -> None: ...


S_co = TypeVar("S_co", covariant=True)
L = TypeVar("L")


class Family(Protocol[S_co]):
    """A metric's series, one for each tuple of label values (in the declared order)."""

    def labels(self, *values: str) -> S_co: ...


@dataclass(frozen=True, slots=True)
class Declared:
    name: str
    help: str
    labels: tuple[str, ...]
    buckets: tuple[float, ...] = ()  # a histogram's upper bounds, without +Inf


class Maker(Protocol):
    def counter(self, declared: Declared) -> Family[Counting]: ...

    def histogram(self, declared: Declared) -> Family[Timing]: ...


# -- in one process ------------------------------------------------------------------------------------------------


class Count:
    __slots__ = ("created", "value")

    def __init__(self) -> None:
        self.value = 0.0
        self.created = time.time()

    def inc(self) -> None:
        self.value += 1.0


class Durations:
    __slots__ = ("_bounds", "counts", "created", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self._bounds = bounds
        self.counts = [0] * len(bounds)  # per bucket, not yet cumulative
        self.sum = 0.0
        self.created = time.time()

    def observe(self, amount: float) -> None:
        # each bound is inclusive (`le`), and the last is +Inf: the first bound not below the amount is its bucket
        self.counts[bisect_left(self._bounds, amount)] += 1
        self.sum += amount


class _Local(Generic[L]):
    __slots__ = ("_new", "declared", "series")

    def __init__(self, declared: Declared, new: Callable[[], L]) -> None:
        self.declared = declared
        self.series: dict[tuple[str, ...], L] = {}
        self._new = new

    def labels(self, *values: str) -> L:
        series = self.series.get(values)
        if series is None:
            series = self.series[values] = self._new()
        return series


class InProcess:
    """Makes series kept in this process, and renders them as a collector of `registry`, in the order declared."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self._families: list[Callable[[], Metric]] = []
        registry.register(self)

    def counter(self, declared: Declared) -> Family[Counting]:
        family = _Local(declared, Count)
        self._families.append(lambda: _counter_metric(family))
        return family

    def histogram(self, declared: Declared) -> Family[Timing]:
        bounds = (*declared.buckets, math.inf)
        family = _Local(declared, lambda: Durations(bounds))
        self._families.append(lambda: _histogram_metric(family, bounds))
        return family

    def collect(self) -> Iterator[Metric]:
        for metric in self._families:
            yield metric()


def _counter_metric(family: _Local[Count]) -> Metric:
    declared = family.declared
    metric = CounterMetricFamily(declared.name, declared.help, labels=declared.labels)
    for values, count in family.series.items():
        metric.add_metric(values, count.value, created=count.created)
    return metric


def _histogram_metric(family: _Local[Durations], bounds: tuple[float, ...]) -> Metric:
    declared = family.declared
    metric = HistogramMetricFamily(declared.name, declared.help, labels=declared.labels)
    les = [floatToGoString(bound) for bound in bounds]  # type: ignore[no-untyped-call]
    for values, durations in family.series.items():
        metric.add_metric(values, list(zip(les, accumulate(durations.counts), strict=True)), durations.sum)
        labels = dict(zip(declared.labels, values, strict=True))
        metric.samples.append(Sample(f"{declared.name}_created", labels, durations.created))
    return metric


# -- across worker processes ---------------------------------------------------------------------------------------


class Shared:
    """Makes prometheus_client's own metrics in `registry`: with PROMETHEUS_MULTIPROC_DIR set, their values are
    written to that directory's files, where any worker's `/metrics` reads every worker's."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self._registry = registry

    def counter(self, declared: Declared) -> Family[Counting]:
        return _Resolved(Counter(declared.name, declared.help, declared.labels, registry=self._registry))

    def histogram(self, declared: Declared) -> Family[Timing]:
        metric = Histogram(
            declared.name, declared.help, declared.labels, buckets=declared.buckets, registry=self._registry
        )
        return _Resolved(metric)


class _Resolved(Generic[L]):
    """A prometheus_client metric's children, each resolved once: its `labels()` validates them on every call."""

    __slots__ = ("_children", "_metric")

    def __init__(self, metric: Counter | Histogram) -> None:
        self._metric = metric
        self._children: dict[tuple[str, ...], Any] = {}

    def labels(self, *values: str) -> L:
        child = self._children.get(values)
        if child is None:
            child = self._children[values] = self._metric.labels(*values)
        return cast(L, child)
