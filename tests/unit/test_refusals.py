"""Each backend's too-long refusal recognised in its own dialect, with the numbers it states; other errors, and the
same words under a status that is not a refusal, are not (docs/protocol.md §9)."""

from __future__ import annotations

import orjson
import pytest

from statestore.upstream.refusals import Refusal, recognise


def _body(value: object) -> bytes:
    return orjson.dumps(value)


def test_anthropic_prompt_is_too_long() -> None:
    body = _body(
        {
            "type": "error",
            "error": {"type": "invalid_request_error", "message": "prompt is too long: 208432 tokens > 200000 maximum"},
        }
    )
    assert recognise(400, body) == Refusal("anthropic", 208432, 200000)


def test_anthropic_other_invalid_request_is_not_a_refusal() -> None:
    body = _body({"type": "error", "error": {"type": "invalid_request_error", "message": "max_tokens: field required"}})
    assert recognise(400, body) is None


def test_openai_context_length_exceeded_with_numbers() -> None:
    message = (
        "This model's maximum context length is 128000 tokens. However, your messages resulted in 130517 tokens. "
        "Please reduce the length of the messages."
    )
    body = _body(
        {
            "error": {
                "message": message,
                "type": "invalid_request_error",
                "param": "messages",
                "code": "context_length_exceeded",
            }
        }
    )
    assert recognise(400, body) == Refusal("openai", 130517, 128000)


def test_openai_context_length_exceeded_without_numbers() -> None:
    message = "Your input exceeds the context window of this model. Please adjust your input and try again."
    body = _body({"error": {"message": message, "type": "invalid_request_error", "code": "context_length_exceeded"}})
    assert recognise(400, body) == Refusal("openai")


def test_vllm_request_has_input_tokens() -> None:
    message = (
        "This model's maximum context length is 4096 tokens. However, your request has 5210 input tokens. "
        "Please reduce the length of the input messages."
    )
    body = _body({"error": {"message": message, "type": "BadRequestError", "param": None, "code": 400}})
    assert recognise(400, body) == Refusal("vllm", 5210, 4096)


def test_vllm_older_shape_you_requested() -> None:
    message = (
        "This model's maximum context length is 8192 tokens. However, you requested 9000 tokens (8800 in the "
        "messages, 200 in the completion). Please reduce the length of the messages or completion."
    )
    body = _body({"object": "error", "message": message, "type": "BadRequestError", "param": None, "code": 400})
    assert recognise(400, body) == Refusal("vllm", 9000, 8192)


def test_vllm_decoder_prompt_longer_than_the_model() -> None:
    message = "The decoder prompt (length 40000) is longer than the maximum model length of 32768."
    body = _body({"error": {"message": message, "type": "BadRequestError", "code": 400}})
    assert recognise(400, body) == Refusal("vllm", 40000, 32768)


def test_llama_cpp_exceed_context_size_error() -> None:
    body = _body(
        {
            "error": {
                "code": 400,
                "message": "request (5120 tokens) exceeds the available context size (4096 tokens), try increasing it",
                "type": "exceed_context_size_error",
                "n_prompt_tokens": 5120,
                "n_ctx": 4096,
            }
        }
    )
    assert recognise(400, body) == Refusal("llama.cpp", 5120, 4096)


@pytest.mark.parametrize("status", [429, 500, 503, 200])
def test_the_same_words_under_another_status_are_not_a_refusal(status: int) -> None:
    body = _body({"error": {"message": "x", "type": "exceed_context_size_error", "n_prompt_tokens": 9, "n_ctx": 4}})
    assert recognise(status, body) is None


@pytest.mark.parametrize(
    "body",
    [b"", b"not json", b"[]", b'{"error": "prompt is too long"}', _body({"error": {"message": 3, "code": "x"}})],
)
def test_bodies_that_state_no_refusal(body: bytes) -> None:
    assert recognise(400, body) is None


def test_the_ratio_of_what_the_backend_counted() -> None:
    assert Refusal("llama.cpp", 1000, 4096).ratio(4000) == 0.25
    assert Refusal("openai").ratio(4000) is None
