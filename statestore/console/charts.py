"""Bar charts drawn on the server as inline SVG geometry: no script, nothing fetched, nothing for CSP to allow. Each
day's bar is stacked by front door, so both doors' share of the day can be read off it."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from statestore.admin import day_label
from statestore.doors import DOORS, Door

WIDTH = 720
HEIGHT = 160
# How each door is named beside the chart (and in its bars' tooltips).
DOOR_NAMES: dict[Door, str] = {
    "messages": "Messages API (threads, sessions)",
    "responses": "Responses API (responses, conversations)",
}


@dataclass(frozen=True, slots=True)
class Bar:
    x: float
    y: float
    width: float
    height: float
    door: Door  # its colour (console.css) and legend entry
    label: str  # the day, the door and its value, shown as the bar's tooltip


@dataclass(frozen=True, slots=True)
class Chart:
    title: str
    bars: list[Bar]
    days: int
    peak: str  # the largest day's total, labelled on the axis
    first_day: str
    last_day: str
    legend: list[tuple[Door, str]]
    width: int = WIDTH
    height: int = HEIGHT


def bar_chart(title: str, points: Sequence[tuple[int, Mapping[Door, int]]], describe: Callable[[int], str]) -> Chart:
    """(day, value by door) points, oldest first, as bars stacked by door (in DOORS order, the first at the bottom)
    and scaled to the largest day's total. Every door has a bar each day, of height 0 when it saw nothing."""
    peak = max((sum(values.values()) for _, values in points), default=0)
    slot = WIDTH / max(len(points), 1)
    bars = []
    for index, (day, values) in enumerate(points):
        top = float(HEIGHT)
        for door in DOORS:
            value = values.get(door, 0)
            height = 0.0 if peak == 0 else (HEIGHT - 4) * value / peak
            top -= height
            bars.append(
                Bar(
                    x=round(index * slot + 1, 2),
                    y=round(top, 2),
                    width=round(max(slot - 2, 1), 2),
                    height=round(height, 2),
                    door=door,
                    label=f"{day_label(day)}, {DOOR_NAMES[door]}: {describe(value)}",
                )
            )
    return Chart(
        title=title,
        bars=bars,
        days=len(points),
        peak=describe(peak),
        first_day=day_label(points[0][0]) if points else "",
        last_day=day_label(points[-1][0]) if points else "",
        legend=[(door, DOOR_NAMES[door]) for door in DOORS],
    )
