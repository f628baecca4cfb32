"""Where a chained response's items go in the runs, and when a read of the runs is its path (store/response_runs.py)."""

from __future__ import annotations

from statestore.store.response_runs import Placement, Runs, decode, path_fingerprint, place, segments_of


def _rows(*responses: tuple[str, int]) -> list[tuple[str, str, bytes]]:
    return [(rid, "message", f"{rid}/{n}".encode()) for rid, count in responses for n in range(count)]


def test_a_root_starts_a_run_and_a_child_may_continue_it_or_start_its_own() -> None:
    root = place(None, is_root=True, response_id="r0", count=2)
    assert root.extend_run is None and root.new_run is not None and root.started is not None
    assert decode(root.started) == Runs(path_fingerprint(["r0"]), 2, ((root.new_run, 2),))
    child = place(root.started, is_root=False, response_id="r1", count=3)
    assert (child.extend_run, child.extend_from) == (root.new_run, 2)
    assert child.extended is not None and child.started is not None and child.new_run is not None
    fingerprint = path_fingerprint(["r0", "r1"])
    assert decode(child.extended) == Runs(fingerprint, 5, ((root.new_run, 5),))
    assert decode(child.started) == Runs(fingerprint, 5, ((root.new_run, 2), (child.new_run, 3)))
    # Below a branch (two runs on its path), only the last run is extended, and a new one goes after both.
    grandchild = place(child.started, is_root=False, response_id="r2", count=1)
    assert (grandchild.extend_run, grandchild.extend_from) == (child.new_run, 3)
    assert grandchild.extended is not None and grandchild.started is not None and grandchild.new_run is not None
    fingerprint = path_fingerprint(["r0", "r1", "r2"])
    assert decode(grandchild.extended) == Runs(fingerprint, 6, ((root.new_run, 2), (child.new_run, 4)))
    runs = ((root.new_run, 2), (child.new_run, 3), (grandchild.new_run, 1))
    assert decode(grandchild.started) == Runs(fingerprint, 6, runs)


def test_no_run_below_a_response_without_runs_or_without_items() -> None:
    assert place(None, is_root=False, response_id="r1", count=2) == Placement()
    assert place(None, is_root=True, response_id="r0", count=0) == Placement()


def test_a_read_is_used_only_when_it_is_exactly_the_path() -> None:
    runs = Runs(path_fingerprint(["a", "b", "c"]), 5, ((1, 3), (2, 2)))
    exact = _rows(("a", 2), ("b", 1), ("c", 2))
    found = segments_of(runs, exact, 2)
    assert found is not None and [len(s) for s in found] == [2, 1, 2]
    assert segments_of(runs, _rows(("a", 2), ("x", 1), ("c", 2)), 2) is None  # another response in b's place
    assert segments_of(runs, _rows(("a", 2), ("c", 2)), 2) is None  # one missing
    assert segments_of(runs, _rows(("a", 2), ("b", 1), ("b2", 1), ("c", 2)), 2) is None  # a run taken twice
