"""What a threaded turn reads from its headers, and which of the client's headers reach the backend
(statestore/threads/turn.py, statestore/upstream/client.py, and the Responses door's credential,
statestore/responses/backend.py): each read once per request, so each rule is pinned here."""

from __future__ import annotations

from typing import Any

import pytest

from statestore.auth import Principal
from statestore.errors import InvalidRequest
from statestore.responses.backend import backend_headers
from statestore.threads.turn import read_turn
from statestore.upstream.client import THREADS_BETA, request_headers_for_upstream, response_headers_for_client

BETA = THREADS_BETA.encode()
CONTINUE: dict[str, Any] = {
    "model": "m",
    "max_tokens": 8,
    "thread": {"type": "continue", "previous_message_id": "msg_1"},
    "messages": [{"role": "user", "content": "hi"}],
}


@pytest.mark.parametrize(
    "betas",
    [
        [BETA],
        [b"files-api-2025-04-14, " + BETA + b" ,other"],
        [b"files-api-2025-04-14", BETA],  # in a second header line
    ],
)
def test_the_threads_beta_is_found_alone_in_a_list_or_on_a_later_line(betas: list[bytes]) -> None:
    headers = [(b"x-api-key", b"k"), *[(b"anthropic-beta", value) for value in betas]]
    turn = read_turn(CONTINUE, headers)
    assert turn is not None and turn.mode == "continue"
    assert turn.anthropic_beta == betas[0].decode()  # the first line, as sent


@pytest.mark.parametrize("betas", [[], [b"files-api-2025-04-14"], [BETA + b"-not", b"x" + BETA]])
def test_a_thread_without_the_beta_is_refused(betas: list[bytes]) -> None:
    with pytest.raises(InvalidRequest, match="anthropic-beta"):
        read_turn(CONTINUE, [(b"anthropic-beta", value) for value in betas])


def test_the_first_of_a_repeated_header_wins() -> None:
    session = {key: value for key, value in CONTINUE.items() if key != "thread"}
    headers = [
        (b"statestore-session-id", b"first"),
        (b"statestore-ttl", b"60"),
        (b"statestore-session-id", b"second"),
        (b"statestore-ttl", b"90"),
    ]
    turn = read_turn(session, headers)
    assert turn is not None and (turn.mode, turn.session, turn.ttl_header) == ("session", "first", b"60")


def test_the_backend_gets_the_clients_headers_but_ours_hop_by_hop_and_the_threads_beta() -> None:
    headers = [
        (b"host", b"statestore"),
        (b"content-length", b"12"),
        (b"connection", b"keep-alive"),
        (b"x-api-key", b"client-key"),
        (b"anthropic-version", b"2023-06-01"),
        (b"anthropic-beta", BETA),
        (b"anthropic-beta", b"files-api-2025-04-14," + BETA),
        (b"x-stainless-lang", b"python"),
        (b"statestore-ttl", b"60"),
        (b"accept-encoding", b"gzip"),
    ]
    assert request_headers_for_upstream(headers, threaded=True) == [
        (b"x-api-key", b"client-key"),
        (b"anthropic-version", b"2023-06-01"),
        (b"anthropic-beta", b"files-api-2025-04-14"),
        (b"x-stainless-lang", b"python"),
        (b"accept-encoding", b"identity"),
    ]
    relayed = request_headers_for_upstream(headers, threaded=False, credential=(b"x-api-key", b"ours"))
    assert (b"x-api-key", b"client-key") not in relayed and relayed[-1] == (b"x-api-key", b"ours")
    assert (b"accept-encoding", b"gzip") in relayed


def test_the_client_gets_the_backends_headers_but_hop_by_hop_and_date() -> None:
    headers = [
        (b"date", b"today"),
        (b"transfer-encoding", b"chunked"),
        (b"content-length", b"5"),
        (b"request-id", b"req_1"),
    ]
    assert response_headers_for_client(headers, keep_length=False) == [(b"request-id", b"req_1")]
    assert response_headers_for_client(headers, keep_length=True) == [
        (b"content-length", b"5"),
        (b"request-id", b"req_1"),
    ]


PASSTHROUGH = Principal(owner="p:1", tenant_id=None, upstream_credential=None)


@pytest.mark.parametrize(
    ("headers", "sent"),
    [
        ([(b"authorization", b"Bearer sk-1")], b"Bearer sk-1"),
        ([(b"x-api-key", b"sk-2")], b"Bearer sk-2"),
        ([(b"accept", b"*/*"), (b"authorization", b"Bearer a"), (b"x-api-key", b"k")], b"Bearer a"),  # the first
        ([(b"x-api-key", b"k"), (b"accept", b"*/*"), (b"authorization", b"Bearer a")], b"Bearer k"),
        ([(b"authorization", b"Bearer a"), (b"authorization", b"Bearer b")], b"Bearer a"),
        ([(b"accept", b"*/*")], None),
    ],
)
def test_the_responses_door_sends_the_first_credential_of_the_request_as_a_bearer(
    headers: list[tuple[bytes, bytes]], sent: bytes | None
) -> None:
    fixed = [(b"content-type", b"application/json"), (b"accept-encoding", b"identity")]
    assert backend_headers(headers, PASSTHROUGH) == fixed + ([(b"authorization", sent)] if sent else [])
    keys_mode = Principal(owner="t:1", tenant_id="t", upstream_credential=(b"x-api-key", b"sk-deploy"))
    assert backend_headers(headers, keys_mode) == [*fixed, (b"authorization", b"Bearer sk-deploy")]
