"""The tokenizer routes of real model servers, deterministic, for the fake backend (tests/support/fake_backend.py,
`--tokenizer DIALECT`); without one the fake serves neither route (the echo backend's 404, as OpenAI's API has none).

    vllm        POST /tokenize as vLLM serves it: a chat request (`messages`, optional `model`, `tools`,
                `add_generation_prompt`) or `prompt` text -> {"count", "max_model_len", "tokens", "token_strs"};
                neither: 400 in vLLM's error shape
    llama.cpp   POST /apply-template as llama-server serves it: a chat request -> {"prompt": <the rendered prompt>};
                POST /tokenize {"content", "add_special", "parse_special", "with_pieces"} -> {"tokens": [...]}
                (ids, or {"id", "piece"} objects with `with_pieces`); a body without `content` -> {"tokens": []}

Counts agree with the echo backend's usage (statestore/upstream/echo_chat.py), so a test can hold a count to the
`prompt_tokens` of the turn it counted: a token per 4 bytes of the compact JSON of the request's `messages` followed by
that of its `tools`. The fake's chat template renders exactly those bytes (its model adds no BOS token)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import orjson
from starlette.types import Send

from statestore.upstream import echo

DIALECTS = ("vllm", "llama.cpp")
MAX_MODEL_LEN = 32_768
_VOCABULARY = 151_643


def token_ids(text: str) -> list[int]:
    """The fake tokenizer: one token per 4 bytes of UTF-8."""
    data = text.encode()
    return [int.from_bytes(data[i : i + 4], "little") % _VOCABULARY for i in range(0, len(data), 4)]


def rendered(request: Mapping[str, Any]) -> str:
    """The fake chat template: the compact JSON of the messages, then of the tools."""
    return (orjson.dumps(request.get("messages")) + orjson.dumps(request.get("tools") or [])).decode()


def chat_tokens(request: Mapping[str, Any]) -> int:
    """What either dialect counts for a chat request: the echo's `prompt_tokens` of that request."""
    return len(token_ids(rendered(request)))


def _vllm_error(message: str, status: int) -> bytes:
    kind = "NotFoundError" if status == 404 else "BadRequestError"
    return orjson.dumps({"object": "error", "message": message, "type": kind, "param": None, "code": status})


async def serve(dialect: str | None, path: str, body: bytes, send: Send, request_id: str) -> bool:
    """Answer a tokenizer route as `dialect`'s server does; False when that server has no route at `path`."""
    if dialect is None or path not in ("/tokenize", "/apply-template"):
        return False
    try:
        request = orjson.loads(body)
    except orjson.JSONDecodeError:
        request = None
    if not isinstance(request, dict):
        await echo.send_json(send, 400, _vllm_error("the body must be a JSON object", 400), request_id)
        return True
    if dialect == "vllm":
        if path != "/tokenize":
            return False
        if isinstance(request.get("messages"), list):
            ids = token_ids(rendered(request))
        elif isinstance(request.get("prompt"), str):
            ids = token_ids(request["prompt"])
        else:
            await echo.send_json(send, 400, _vllm_error("messages or prompt: Field required", 400), request_id)
            return True
        answer: dict[str, Any] = {"count": len(ids), "max_model_len": MAX_MODEL_LEN, "tokens": ids, "token_strs": None}
    elif path == "/apply-template":
        if not isinstance(request.get("messages"), list):
            refused = {"error": {"code": 400, "message": "'messages' is required", "type": "invalid_request_error"}}
            await echo.send_json(send, 400, orjson.dumps(refused), request_id)
            return True
        answer = {"prompt": rendered(request)}
    else:
        content = request.get("content")
        ids = token_ids(content) if isinstance(content, str) else []
        if request.get("with_pieces") is True and isinstance(content, str):
            data = content.encode()
            pieces = [data[i : i + 4] for i in range(0, len(data), 4)]
            with_pieces = zip(ids, pieces, strict=True)
            answer = {"tokens": [{"id": i, "piece": piece.decode(errors="replace")} for i, piece in with_pieces]}
        else:
            answer = {"tokens": ids}
    await echo.send_json(send, 200, orjson.dumps(answer), request_id)
    return True
