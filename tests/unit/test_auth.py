"""Passthrough owners (docs/protocol.md §8): a keyed hash of the credential, the same on every request, remembered for
the credentials seen lately without ever mixing two credentials up."""

from __future__ import annotations

import pytest

from statestore.auth import PassthroughAuthenticator
from statestore.errors import AuthenticationFailed


async def test_one_credential_one_owner_and_two_credentials_two_owners() -> None:
    auth = PassthroughAuthenticator(b"secret-of-this-deployment-0123456789")
    first = await auth.authenticate([(b"x-api-key", b"sk-one")])
    assert (await auth.authenticate([(b"authorization", b"Bearer sk-one")])).owner == first.owner
    other = await auth.authenticate([(b"x-api-key", b"sk-two")])
    assert other.owner != first.owner and other.owner.startswith("p:")
    elsewhere = PassthroughAuthenticator(b"another-deployment-secret-987654321")
    assert (await elsewhere.authenticate([(b"x-api-key", b"sk-one")])).owner != first.owner
    with pytest.raises(AuthenticationFailed):
        await auth.authenticate([(b"x-api-key", b"")])


async def test_remembering_stays_bounded_and_owners_survive_a_clear() -> None:
    auth = PassthroughAuthenticator(b"secret-of-this-deployment-0123456789")
    owners = {}
    for n in range(PassthroughAuthenticator._REMEMBERED + 10):
        credential = f"sk-{n}".encode()
        owners[credential] = (await auth.authenticate([(b"x-api-key", credential)])).owner
    assert len(auth._principals) <= PassthroughAuthenticator._REMEMBERED
    for credential in (b"sk-0", b"sk-4100"):
        assert (await auth.authenticate([(b"x-api-key", credential)])).owner == owners[credential]
    assert len(set(owners.values())) == len(owners)
