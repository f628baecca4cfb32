"""The console's session cookies and policy form, without a server: forged, expired or orphaned cookies are no
session; the policy form follows the policy's own fields, whatever they are, and files each problem under its field."""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Literal, Optional

import pytest

from statestore import admin
from statestore.auth import AdminTokens
from statestore.console import policy_form
from statestore.console.sessions import csrf_matches, new_session, read_session
from statestore.policy import Policy

TOKENS = AdminTokens({"adm-ops-0123456789abcdef": "ops", "adm-other-0123456789abcdef": "other"})
NOW = 1_800_000_000.0


def _signed_in(name: str = "ops", token: str = "adm-ops-0123456789abcdef") -> str:
    found = TOKENS.identify(token)
    assert found is not None and found[0] == name
    cookie, _ = new_session(*found, now=NOW)
    return cookie


def test_a_session_is_read_back_with_its_csrf_token() -> None:
    cookie = _signed_in()
    session = read_session(TOKENS, cookie, now=NOW + 60)
    assert session is not None and session.actor == "ops"
    assert csrf_matches(session, session.csrf)
    assert not csrf_matches(session, None) and not csrf_matches(session, "0" * 64)
    # Each sign-in has a CSRF token of its own.
    other = read_session(TOKENS, _signed_in(), now=NOW)
    assert other is not None and other.csrf != session.csrf


@pytest.mark.parametrize(
    "tamper",
    [
        lambda c: c[:-1] + ("0" if c[-1] != "0" else "1"),  # the signature
        lambda c: "b3RoZXI" + c[c.index(".") :],  # another token's name ("other")
        lambda c: c.replace(c.split(".")[1], "9999999999"),  # a later expiry
        lambda c: c + ".x",
        lambda c: "",
    ],
)
def test_a_tampered_cookie_is_no_session(tamper: object) -> None:
    assert callable(tamper)
    assert read_session(TOKENS, tamper(_signed_in()), now=NOW) is None


def test_a_session_ends_when_it_expires_or_its_token_is_removed() -> None:
    cookie = _signed_in()
    assert read_session(TOKENS, cookie, now=NOW + 8 * 3600 + 1) is None
    assert read_session(AdminTokens({"adm-new-0123456789abcdef0": "ops"}), cookie, now=NOW) is None
    assert TOKENS.identify("adm-not-configured-000000") is None
    assert TOKENS.digests_named("ops") == [hashlib.sha256(b"adm-ops-0123456789abcdef").digest()]


def _layers(policy: Policy) -> admin.PolicyLayers:
    return admin.PolicyLayers(tenant=None, default=None, settings=policy, effective=policy, source="settings")


POLICY = Policy(
    threads_enabled=True,
    sessions_enabled=True,
    default_ttl_seconds=300,
    max_ttl_seconds=86_400,
    max_thread_bytes=1 << 20,
    max_messages=100,
)
FORM = {
    "threads_enabled": "on",
    "default_ttl_seconds": "600",
    "max_ttl_seconds": "86400",
    "max_thread_bytes": "1048576",
    "max_messages": "100",
    # The context policy's fields (docs/protocol.md §9), as the rendered form submits them: the optional ones left
    # empty.
    "context_strategy": "none",
    "context_trigger_ratio": "0.8",
    "context_target_ratio": "0.5",
    "max_background_turns": "16",
    "idempotency_ttl_seconds": "86400",
}


def test_the_form_reads_every_field_and_an_unticked_box_is_false() -> None:
    policy, _, errors = policy_form.policy_from_form(FORM)
    assert errors == {}
    assert policy == dataclasses.replace(POLICY, sessions_enabled=False, default_ttl_seconds=600)
    assert [row.field.name for row in policy_form.field_rows(_layers(POLICY))] == list(admin.POLICY_FIELDS)


def test_each_problem_is_filed_under_its_field() -> None:
    _, submitted, errors = policy_form.policy_from_form({**FORM, "max_messages": "many"})
    assert errors == {"max_messages": "max_messages must be a whole number"}
    assert submitted["max_messages"] == "many"
    _, _, errors = policy_form.policy_from_form({**FORM, "default_ttl_seconds": "90000"})
    assert list(errors) == ["default_ttl_seconds"] and "must not exceed" in errors["default_ttl_seconds"]


@dataclasses.dataclass(frozen=True, slots=True)
class _WiderPolicy:
    threads_enabled: bool
    label: str | None
    ratio: float
    strategy: Literal["keep", "trim"]
    limit: Optional[int]  # noqa: UP045 - the older spelling must be understood too


def test_a_field_added_to_the_policy_reaches_the_form_unchanged(monkeypatch: pytest.MonkeyPatch) -> None:
    """The form knows no field by name: a policy with other fields gets them, typed from the dataclass."""
    monkeypatch.setattr(admin, "Policy", _WiderPolicy)
    monkeypatch.setattr(admin, "POLICY_FIELDS", tuple(f.name for f in dataclasses.fields(_WiderPolicy)))
    fields = {f.name: (f.kind, f.optional) for f in admin.policy_fields()}
    assert fields == {
        "threads_enabled": ("bool", False),
        "label": ("str", True),
        "ratio": ("float", False),
        "strategy": ("choice", False),
        "limit": ("int", True),
    }
    assert admin.policy_fields()[3].choices == ("keep", "trim")
    monkeypatch.setattr(admin, "validate_policy", lambda values: _WiderPolicy(**values))
    monkeypatch.setattr(policy_form, "validate_policy", lambda values: _WiderPolicy(**values))
    _, _, errors = policy_form.policy_from_form({"ratio": "0.5", "strategy": "drop"})
    assert errors == {"strategy": "strategy must be one of keep, trim"}
    parsed, _, errors = policy_form.policy_from_form({"label": "", "ratio": "0.5", "strategy": "trim", "limit": ""})
    assert errors == {}
    values: object = parsed
    assert values == _WiderPolicy(threads_enabled=False, label=None, ratio=0.5, strategy="trim", limit=None)
