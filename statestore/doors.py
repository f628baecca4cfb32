"""The two front doors a turn can come through, as every count an operator sees labels them (daily usage, purge
results, stats, metrics): "messages", the Messages API's threads and sessions; "responses", the Responses API's
responses and conversations."""

from __future__ import annotations

from typing import Literal

Door = Literal["messages", "responses"]
# In this order wherever doors are listed (a table's columns, a chart's series).
DOORS: tuple[Door, ...] = ("messages", "responses")
