"""The audit page's change column (statestore/console/audit_changes.py): only what differs, old → new."""

from __future__ import annotations

from statestore.console.audit_changes import Change, changes, full_record


def test_only_the_fields_that_differ_in_the_newer_records_order() -> None:
    before = {"a": 1, "b": True, "c": "x", "gone": [1, 2]}
    after = {"c": "y", "b": True, "a": 2, "new": None, "added": {"k": 1}}
    assert changes(before, after) == [
        Change("c", "x", "y"),
        Change("a", "1", "2"),
        Change("added", "—", '{"k":1}'),
        Change("gone", "[1,2]", "—"),
    ]


def test_a_created_record_shows_its_values_and_a_deleted_one_what_it_had() -> None:
    record = {"id": "key_1", "label": None, "revoked": False}
    assert changes(None, record) == [Change("id", "—", "key_1"), Change("revoked", "—", "false")]
    assert changes(record, None) == [Change("id", "key_1", "—"), Change("revoked", "false", "—")]
    assert changes(record, dict(record)) == []
    assert changes(None, None) == []


def test_a_record_that_is_not_an_object_is_one_unnamed_change() -> None:
    assert changes(None, 3) == [Change("", "—", "3")]
    assert changes("a", "a") == []


def test_the_full_record_is_indented_json_with_sorted_keys() -> None:
    assert full_record({"b": 1, "a": None}) == '{\n  "a": null,\n  "b": 1\n}'
    assert full_record(None) == ""
