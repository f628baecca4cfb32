"""The reference pages against the code. docs/configuration.md's settings table names every setting the server reads,
and only those: a setting added without a row, or a row left behind by a removed setting, fails here (a row may shorten
a sibling setting to its tail: `STATESTORE_DEFAULT_TTL_SECONDS` / `_MAX_TTL_SECONDS`). Every metric
docs/observability.md names is served with the labels it gives, and every served metric is named there."""

from __future__ import annotations

import re
from pathlib import Path

from statestore.config import Settings
from statestore.metrics import DECLARED

DOCS = Path(__file__).resolve().parents[2] / "docs"
CONFIGURATION = DOCS / "configuration.md"
OBSERVABILITY = DOCS / "observability.md"
# Read by the commands rather than the server's settings (statestore/cli.py, store/migrate.py, metrics.py).
COMMAND_SETTINGS = {
    "STATESTORE_HOST",
    "STATESTORE_PORT",
    "STATESTORE_MIGRATIONS_DIR",
    "STATESTORE_ECHO_CONTEXT_WINDOW",
    "PROMETHEUS_MULTIPROC_DIR",
}
# Read by the tests' clock only, never set in a deployment.
TEST_ONLY = {"STATESTORE_CLOCK_OFFSET_FILE"}


def table_rows() -> list[str]:
    text = CONFIGURATION.read_text()
    section = text.split("Everything comes from `STATESTORE_*` environment variables", 1)[1]
    return [line for line in section.splitlines()[:80] if line.startswith("| `")]


def documented() -> tuple[set[str], set[str]]:
    """The names each row writes in full, and those it also names by a tail (`_MAX_TTL_SECONDS`)."""
    full: set[str] = set()
    shortened: set[str] = set()
    for row in table_rows():
        cell = row.split("|")[1]
        names = re.findall(r"`([A-Z][A-Z0-9_]+)`", cell)
        full.update(names)
        for tail in re.findall(r"`(_[A-Z0-9_]+)`", cell):
            for name in names:
                heads = [name[:i] for i, char in enumerate(name) if char == "_"] + [name]
                shortened.update(head + tail for head in heads)
    return full, shortened


def test_every_setting_has_a_row() -> None:
    full, shortened = documented()
    settings = {"STATESTORE_" + name.upper() for name in Settings.model_fields} - TEST_ONLY
    missing = sorted(name for name in settings | COMMAND_SETTINGS if name not in full | shortened)
    assert missing == []


def test_every_row_names_a_setting() -> None:
    full, _ = documented()
    settings = {"STATESTORE_" + name.upper() for name in Settings.model_fields}
    assert sorted(full - settings - COMMAND_SETTINGS) == []
    assert table_rows(), "the configuration table was not found"


def test_every_metric_the_docs_name_is_served_with_its_labels() -> None:
    """Each `name{labels}` docs/observability.md writes (a counter's `name_total`, a histogram's `name_seconds`, a
    gauge's own name) is a series /metrics serves, with exactly those labels; and every series is named there."""
    served = {
        (declared.name if declared.buckets or declared.gauge else declared.name + "_total"): set(declared.labels)
        for declared in DECLARED
    }
    named = {
        name: {label.strip() for label in labels.split(",")}
        for name, labels in re.findall(r"`([a-z_]+)\{([a-z_, ]+)\}", OBSERVABILITY.read_text())
    }
    assert {name: labels for name, labels in named.items() if served.get(name) != labels} == {}
    assert sorted(set(served) - set(named)) == []
