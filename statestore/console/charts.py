"""Bar charts drawn on the server as inline SVG geometry: no script, nothing fetched, nothing for CSP to allow."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from statestore.admin import day_label

WIDTH = 720
HEIGHT = 160


@dataclass(frozen=True, slots=True)
class Bar:
    x: float
    y: float
    width: float
    height: float
    label: str  # the day and its value, shown as the bar's tooltip


@dataclass(frozen=True, slots=True)
class Chart:
    title: str
    bars: list[Bar]
    peak: str  # the largest value, labelled on the axis
    first_day: str
    last_day: str
    width: int = WIDTH
    height: int = HEIGHT


def bar_chart(title: str, points: Sequence[tuple[int, int]], describe: Callable[[int], str]) -> Chart:
    """(day, value) points, oldest first, as bars scaled to the largest value."""
    peak = max((value for _, value in points), default=0)
    slot = WIDTH / max(len(points), 1)
    bars = []
    for index, (day, value) in enumerate(points):
        height = 0.0 if peak == 0 else (HEIGHT - 4) * value / peak
        bars.append(
            Bar(
                x=round(index * slot + 1, 2),
                y=round(HEIGHT - height, 2),
                width=round(max(slot - 2, 1), 2),
                height=round(height, 2),
                label=f"{day_label(day)}: {describe(value)}",
            )
        )
    return Chart(
        title=title,
        bars=bars,
        peak=describe(peak),
        first_day=day_label(points[0][0]) if points else "",
        last_day=day_label(points[-1][0]) if points else "",
    )
