"""The one retry a refusal as too long earns (statestore/core/refusal_retry.py), as each door calls it: the Messages
door (a 200 is a reply; Anthropic's "prompt is too long") and the Responses door (any 2xx; OpenAI's
`context_length_exceeded`). A turn is cut and sent once more at most, the stated window is learned either way, and
whatever the door cannot cut comes back as the backend said it."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from statestore.api.threaded import _is_ok as messages_ok
from statestore.core.refusal_retry import Refused, send_turn
from statestore.core.windows import Windows
from statestore.responses.refusal_retry import _is_ok as responses_ok
from statestore.upstream.refusals import Refusal

ANTHROPIC_REFUSAL = orjson.dumps(
    {
        "type": "error",
        "error": {"type": "invalid_request_error", "message": "prompt is too long: 5000 tokens > 4096 maximum"},
    }
)
OPENAI_REFUSAL = orjson.dumps(
    {
        "error": {
            "message": "This model's maximum context length is 4096 tokens. However, your messages resulted in 5000 "
            "tokens. Please reduce the length of the messages.",
            "type": "invalid_request_error",
            "param": "messages",
            "code": "context_length_exceeded",
        }
    }
)
DOORS = [
    pytest.param(messages_ok, ANTHROPIC_REFUSAL, id="messages"),
    pytest.param(responses_ok, OPENAI_REFUSAL, id="responses"),
]


class _Response:
    def __init__(self, status: int, body: bytes) -> None:
        self.status = status
        self.headers = [(b"content-type", b"application/json")]
        self.body = body
        self.closed = False

    async def read(self) -> bytes:
        return self.body

    async def aclose(self) -> None:
        self.closed = True


class _Backend:
    """Answers the turn's sends in order; the windows it is asked about state nothing."""

    base_url = "http://backend"

    def __init__(self, *answers: tuple[int, bytes]) -> None:
        self.answers = list(answers)
        self.sent: list[Any] = []

    async def send_turn(self) -> Any:
        response = _Response(*self.answers.pop(0))
        self.sent.append(response)
        return response

    async def send(self, method: str, path: str, headers: list[tuple[bytes, bytes]], body: bytes) -> Any:
        return _Response(404, b"{}")

    async def aclose(self) -> None:
        return None


def _cutter(result: bool) -> tuple[list[Refusal], Any]:
    cuts: list[Refusal] = []

    async def cut(refusal: Refusal) -> bool:
        cuts.append(refusal)
        return result

    return cuts, cut


@pytest.mark.parametrize(("accepted", "refusal"), DOORS)
async def test_a_refused_turn_is_cut_once_and_sent_again(accepted: Any, refusal: bytes) -> None:
    backend = _Backend((400, refusal), (200, b"reply"))
    windows = Windows(backend)
    cuts, cut = _cutter(True)
    sent = await send_turn(backend.send_turn, accepted, windows=windows, model="m", cut=cut)
    first, second = backend.sent
    assert first.closed and not second.closed
    assert sent is second
    assert [(c.prompt_tokens, c.window_tokens) for c in cuts] == [(5000, 4096)]
    assert await windows.window("m", []) == 4096  # learned from the refusal; the backend itself states nothing


@pytest.mark.parametrize(("accepted", "refusal"), DOORS)
async def test_a_second_refusal_is_handed_back_as_the_backend_said_it(accepted: Any, refusal: bytes) -> None:
    backend = _Backend((400, refusal), (400, refusal), (200, b"never sent"))
    cuts, cut = _cutter(True)
    sent = await send_turn(backend.send_turn, accepted, windows=None, model="m", cut=cut)
    assert sent == Refused(400, [(b"content-type", b"application/json")], refusal)
    assert len(cuts) == 1 and len(backend.sent) == 2 and all(response.closed for response in backend.sent)


@pytest.mark.parametrize(("accepted", "refusal"), DOORS)
async def test_a_turn_the_door_cannot_cut_is_not_sent_again(accepted: Any, refusal: bytes) -> None:
    backend = _Backend((400, refusal), (200, b"never sent"))
    windows = Windows(backend)
    cuts, cut = _cutter(False)
    sent = await send_turn(backend.send_turn, accepted, windows=windows, model="m", cut=cut)
    assert isinstance(sent, Refused) and sent.body == refusal and len(cuts) == 1 and len(backend.sent) == 1
    assert await windows.window("m", []) == 4096  # the stated window is learned all the same


@pytest.mark.parametrize(("accepted", "refusal"), DOORS)
async def test_an_error_that_is_no_refusal_is_never_cut(accepted: Any, refusal: bytes) -> None:
    backend = _Backend((500, b'{"error": "down"}'), (200, b"never sent"))
    cuts, cut = _cutter(True)
    sent = await send_turn(backend.send_turn, accepted, windows=None, model="m", cut=cut)
    assert sent == Refused(500, [(b"content-type", b"application/json")], b'{"error": "down"}') and cuts == []


def test_each_door_says_what_it_relays_as_a_reply() -> None:
    """The Messages door relays only a 200 as a reply; the Responses door any 2xx (kept as each door had it)."""
    assert messages_ok(200) and not messages_ok(201) and not messages_ok(400)
    assert responses_ok(200) and responses_ok(201) and not responses_ok(300)
