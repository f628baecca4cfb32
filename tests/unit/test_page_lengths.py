"""The two first pages stay short: README.md is a newcomer's page, bench/README.md how to run, what each arm measures
and the current figures (their history lives in git history). A page past its length is a reference or a diary again:
move the reference into docs/, replace stale figures instead of adding beside them."""

from __future__ import annotations

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(("page", "most"), [("README.md", 400), ("bench/README.md", 600)])
def test_a_first_page_stays_within_its_length(page: str, most: int) -> None:
    lines = (REPO / page).read_text(encoding="utf-8").count("\n")
    assert lines <= most, f"{page} has {lines} lines, more than {most}"
