"""Sealed values (statestore/sealing.py) and the compaction seal built on them: a value opens only as it was handed
out, for the associated data (the owner) it was sealed for, under a key the ring still holds; rotation keeps older
values open; the settings refuse a malformed ring at start-up."""

from __future__ import annotations

import base64

import pytest
from pydantic import ValidationError

from statestore.config import Settings
from statestore.responses.compaction_seal import DERIVED_KEY_ID, compaction_seal
from statestore.sealing import Sealer, Unsealable, new_key_text, parse_keys

OWNER_SECRET = "unit-owner-secret-0123456789"


def ring(*ids: str) -> str:
    return ",".join(f"{key_id}:{new_key_text()}" for key_id in ids)


def test_a_sealed_value_opens_for_its_associated_data_only() -> None:
    sealer = Sealer(parse_keys(ring("k1")))
    value = sealer.seal(b"the summary", b"owner-a")
    assert b"the summary" not in value.encode() and "summary" not in value
    assert sealer.open(value, b"owner-a") == b"the summary"
    with pytest.raises(Unsealable):
        sealer.open(value, b"owner-b")


def test_two_seals_of_one_text_differ() -> None:
    sealer = Sealer(parse_keys(ring("k1")))
    assert sealer.seal(b"same", b"o") != sealer.seal(b"same", b"o")


@pytest.mark.parametrize("where", [3, 10, -1])
def test_a_tampered_value_does_not_open(where: int) -> None:
    sealer = Sealer(parse_keys(ring("k1")))
    value = sealer.seal(b"a summary long enough to tamper with", b"o")
    flipped = "A" if value[where] != "A" else "B"
    tampered = value[:where] + flipped + (value[where + 1 :] if where != -1 else "")
    with pytest.raises(Unsealable):
        sealer.open(tampered, b"o")


@pytest.mark.parametrize("value", ["", "k1", "k1.", "k1.!!!!", "k1.abc", "nokey.AAAA", "k1.AAAA" * 20 + "!"])
def test_what_is_no_sealed_value_does_not_open(value: str) -> None:
    with pytest.raises(Unsealable):
        Sealer(parse_keys(ring("k1"))).open(value, b"o")


def test_a_character_outside_the_alphabet_is_refused_not_skipped() -> None:
    sealer = Sealer(parse_keys(ring("k1")))
    value = sealer.seal(b"text", b"o")
    with pytest.raises(Unsealable):
        sealer.open(value + "!", b"o")


def test_rotation_seals_with_the_newest_and_opens_with_every_key() -> None:
    old = ring("k1")
    before = Sealer(parse_keys(old))
    sealed_before = before.seal(b"older", b"o")
    after = Sealer(parse_keys(ring("k2") + "," + old))
    assert after.open(sealed_before, b"o") == b"older"
    sealed_after = after.seal(b"newer", b"o")
    assert sealed_after.startswith("k2.")
    with pytest.raises(Unsealable):
        before.open(sealed_after, b"o")  # a replica that does not know k2 yet
    # Once the old key is dropped from the ring, what it sealed no longer opens.
    with pytest.raises(Unsealable):
        Sealer(parse_keys(ring("k2"))).open(sealed_before, b"o")


@pytest.mark.parametrize(
    "raw",
    ["", "k1", "k1:short", "k1:" + base64.urlsafe_b64encode(b"x" * 31).decode(), "bad id:" + new_key_text(), "k1:%%%"],
    ids=["empty", "no key", "short key", "31-byte key", "bad id", "not base64"],
)
def test_a_malformed_ring_is_refused(raw: str) -> None:
    with pytest.raises(ValueError):
        parse_keys(raw)


def test_a_key_id_twice_is_refused() -> None:
    with pytest.raises(ValueError, match="twice"):
        parse_keys(f"k1:{new_key_text()},k1:{new_key_text()}")


def test_the_settings_refuse_a_malformed_ring_and_never_echo_the_key() -> None:
    secret = "k1:" + base64.urlsafe_b64encode(b"s" * 31).decode()
    with pytest.raises(ValidationError) as refused:
        Settings(compaction_keys=secret)
    assert base64.urlsafe_b64encode(b"s" * 31).decode() not in str(refused.value)


def test_the_compaction_seal_binds_the_owner_and_derives_a_stable_key_from_the_owner_secret() -> None:
    derived = compaction_seal(Settings(owner_secret=OWNER_SECRET))
    assert derived is not None
    value = derived.seal("what happened", "p:owner-a")
    assert value.startswith(DERIVED_KEY_ID + ".")
    # Another process with the same secret opens it (a restart, another replica); another owner does not.
    again = compaction_seal(Settings(owner_secret=OWNER_SECRET))
    assert again is not None and again.open(value, "p:owner-a") == "what happened"
    with pytest.raises(Unsealable):
        again.open(value, "p:owner-b")
    # Keys set later seal from then on, and still open what the derived key sealed.
    configured = compaction_seal(Settings(owner_secret=OWNER_SECRET, compaction_keys=ring("k1")))
    assert configured is not None
    assert configured.seal("x", "p:owner-a").startswith("k1.")
    assert configured.open(value, "p:owner-a") == "what happened"
    # Another owner secret derives another key.
    other = compaction_seal(Settings(owner_secret=OWNER_SECRET + "-other"))
    assert other is not None
    with pytest.raises(Unsealable):
        other.open(value, "p:owner-a")


def test_without_keys_or_an_owner_secret_there_is_no_seal() -> None:
    assert compaction_seal(Settings(auth_mode="keys")) is None
    assert compaction_seal(Settings(auth_mode="keys", compaction_keys=ring("k1"))) is not None
