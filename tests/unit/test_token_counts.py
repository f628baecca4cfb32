"""What a backend offers to count tokens with (statestore/upstream/token_counts.py), learned from its answers: each
server's dialect recognised from what it says, remembered so that later counts do not probe, and a refusal of one
request (a credential, a model) never taken for a server without a tokenizer."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import orjson
import pytest

from statestore.errors import UpstreamUnreachable
from statestore.upstream.token_counts import RETRY_SECONDS, ChatTokenizer, MessagesCounter

CHAT: dict[str, Any] = {
    "model": "m",
    "messages": [{"role": "user", "content": "hello"}],
    "tools": [{"type": "function", "function": {"name": "f"}}],
    "stream": True,
    "stream_options": {"include_usage": True},
}
Answer = tuple[int, Any]


class _Response:
    def __init__(self, status: int, body: Any) -> None:
        self.status = status
        self.headers = [(b"content-type", b"application/json")]
        self._body = body if isinstance(body, bytes) else orjson.dumps(body)

    async def read(self) -> bytes:
        return self._body

    async def aclose(self) -> None:
        return None


class _Backend:
    """An upstream answering POSTs by path (an answer, or a function of the request's JSON), recording each."""

    base_url = "http://backend"

    def __init__(self, routes: dict[str, Answer | Callable[[Any], Answer]], *, down: bool = False) -> None:
        self.routes = routes
        self.down = down
        self.asked: list[tuple[str, Any]] = []

    async def send(self, method: str, path: str, headers: list[tuple[bytes, bytes]], body: bytes) -> Any:
        self.asked.append((path, orjson.loads(body)))
        if self.down:
            raise UpstreamUnreachable("the model backend could not be reached")
        route = self.routes.get(path, (404, {"detail": "Not Found"}))
        status, answer = route(orjson.loads(body)) if callable(route) else route
        return _Response(status, answer)

    async def aclose(self) -> None:
        return None

    def paths(self) -> list[str]:
        return [path for path, _ in self.asked]


def _llama_tokenize(request: Any) -> Answer:
    content = request.get("content")
    return 200, {"tokens": list(range(len(content.split()))) if isinstance(content, str) else []}


async def test_vllm_counts_a_chat_request_in_one_request() -> None:
    backend = _Backend({"/tokenize": (200, {"count": 17, "max_model_len": 4096, "tokens": [1] * 17})})
    tokenizer = ChatTokenizer(backend)
    assert await tokenizer.count(CHAT, []) == 17
    assert await tokenizer.count(CHAT, []) == 17
    assert tokenizer.dialect == "chat"
    assert backend.paths() == ["/tokenize", "/tokenize"]
    assert backend.asked[0][1] == {
        "model": "m",
        "messages": CHAT["messages"],
        "tools": CHAT["tools"],
        "add_generation_prompt": True,
    }


async def test_llama_cpp_renders_the_template_then_tokenizes_the_prompt() -> None:
    backend = _Backend(
        {"/tokenize": _llama_tokenize, "/apply-template": (200, {"prompt": "<|im_start|>user hello <|im_end|>"})}
    )
    tokenizer = ChatTokenizer(backend)
    assert await tokenizer.count(CHAT, []) == 3
    assert tokenizer.dialect == "template"
    # The probe, then the template and the prompt's tokens; later counts skip the probe.
    assert backend.paths() == ["/tokenize", "/apply-template", "/tokenize"]
    assert await tokenizer.count(CHAT, []) == 3
    assert backend.paths()[3:] == ["/apply-template", "/tokenize"]
    templated = backend.asked[1][1]
    assert "stream" not in templated and "stream_options" not in templated and templated["tools"] == CHAT["tools"]
    assert backend.asked[2][1] == {
        "content": "<|im_start|>user hello <|im_end|>",
        "add_special": True,
        "parse_special": True,
    }


@pytest.mark.parametrize(
    "answer",
    [
        (404, {"detail": "Not Found"}),  # vLLM's FastAPI without the route, or any other server
        (404, {"type": "error", "error": {"type": "not_found_error", "message": "Not found: POST /tokenize"}}),
        (405, b"Method Not Allowed"),
        (400, {"object": "error", "message": "prompt: Field required", "type": "BadRequestError", "code": 400}),
        (422, {"detail": [{"loc": ["body", "prompt"], "msg": "Field required"}]}),  # text only, as SGLang's
        (200, {"ok": True}),
    ],
)
async def test_a_backend_without_a_chat_tokenizer_is_not_asked_again_for_a_while(answer: Answer) -> None:
    now = [0.0]
    backend = _Backend({"/tokenize": answer})
    tokenizer = ChatTokenizer(backend, clock=lambda: now[0])
    assert await tokenizer.count(CHAT, []) is None
    assert await tokenizer.count(CHAT, []) is None
    assert tokenizer.dialect == "none"
    assert backend.paths() == ["/tokenize"]
    now[0] = RETRY_SECONDS + 1  # a restart may have brought one
    backend.routes["/tokenize"] = (200, {"count": 5})
    assert await tokenizer.count(CHAT, []) == 5


@pytest.mark.parametrize(
    "answer",
    [
        (404, {"object": "error", "message": "The model `m` does not exist.", "type": "NotFoundError", "code": 404}),
        (401, {"error": {"message": "Invalid API key", "type": "invalid_request_error"}}),
        (429, {"error": {"message": "slow down"}}),
        (500, {"error": {"message": "boom"}}),
    ],
)
async def test_a_refusal_of_one_request_is_not_learned(answer: Answer) -> None:
    backend = _Backend({"/tokenize": answer})
    tokenizer = ChatTokenizer(backend)
    assert await tokenizer.count(CHAT, []) is None
    assert tokenizer.dialect is None
    assert await tokenizer.count(CHAT, []) is None
    assert backend.paths() == ["/tokenize", "/tokenize"]


async def test_an_unreachable_backend_is_no_count_this_time() -> None:
    backend = _Backend({"/tokenize": (200, {"count": 3})}, down=True)
    tokenizer = ChatTokenizer(backend)
    assert await tokenizer.count(CHAT, []) is None
    backend.down = False
    assert await tokenizer.count(CHAT, []) == 3


async def test_a_route_that_went_away_is_probed_again() -> None:
    backend = _Backend({"/tokenize": (200, {"count": 3})})
    tokenizer = ChatTokenizer(backend)
    assert await tokenizer.count(CHAT, []) == 3
    backend.routes["/tokenize"] = (404, {"detail": "Not Found"})
    assert await tokenizer.count(CHAT, []) is None
    assert tokenizer.dialect is None


async def test_a_messages_backend_counts_or_is_found_without_count_tokens() -> None:
    now = [0.0]
    backend = _Backend({"/v1/messages/count_tokens": (200, {"input_tokens": 12})})
    counter = MessagesCounter(backend, clock=lambda: now[0])
    reply = await counter.count("/v1/messages/count_tokens", [], b'{"messages":[]}')
    assert reply is not None and (reply.status, orjson.loads(reply.body)) == (200, {"input_tokens": 12})
    # A 404 in the API's own shape is the backend judging the request (an unknown model): relayed, not learned.
    unknown = {"type": "error", "error": {"type": "not_found_error", "message": "model: nope"}}
    backend.routes["/v1/messages/count_tokens"] = (404, unknown)
    reply = await counter.count("/v1/messages/count_tokens", [], b"{}")
    assert reply is not None and reply.status == 404 and not counter.has_none
    backend.routes["/v1/messages/count_tokens"] = (404, {"detail": "Not Found"})
    assert await counter.count("/v1/messages/count_tokens", [], b"{}") is None
    assert counter.has_none
    assert await counter.count("/v1/messages/count_tokens", [], b"{}") is None
    assert len(backend.asked) == 3
    now[0] = RETRY_SECONDS + 1
    assert not counter.has_none


async def test_a_messages_backend_that_cannot_be_reached_fails_as_a_relay_does() -> None:
    counter = MessagesCounter(_Backend({}, down=True))
    with pytest.raises(UpstreamUnreachable):
        await counter.count("/v1/messages/count_tokens", [], b"{}")
