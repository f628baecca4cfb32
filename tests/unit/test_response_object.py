"""The Response object as the Open Responses specification (2026-04-24) types it: built whole for every status, its
sampling fields the values the backend was sent (else the defaults, when it was sent none), a response stored by an
earlier version completed as it is served; assistant `phase` kept; items of kinds statestore does not run kept as
they came and never rendered for the backend."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from statestore.responses.background_events import with_status
from statestore.responses.errors import BadRequest
from statestore.responses.items import join_rendered, normalise_input, stored
from statestore.responses.replay import replayed_frames
from statestore.responses.request import read_turn
from statestore.responses.request_schemas import ConversationItemsRequest
from statestore.responses.response_object import completed, response_object
from statestore.responses.validation import read_body
from tests.support.open_responses import event_problems, response_problems

MESSAGE = {
    "type": "message",
    "id": "msg_1",
    "status": "completed",
    "role": "assistant",
    "content": [{"type": "output_text", "text": "hi", "annotations": [], "logprobs": []}],
}
USAGE = {
    "input_tokens": 3,
    "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
    "output_tokens": 1,
    "output_tokens_details": {"reasoning_tokens": 0},
    "total_tokens": 4,
}


def _turn(**fields: Any) -> Any:
    return read_turn(orjson.dumps({"model": "m", "input": "hi", **fields}))


def _response(status: str, **fields: Any) -> dict[str, Any]:
    finished = status in ("completed", "incomplete")
    return response_object(
        "resp_1",
        _turn(**fields),
        created_at=1_700_000_000,
        status=status,
        output=[MESSAGE] if finished else [],
        usage=USAGE if finished else None,
        incomplete_details={"reason": "max_output_tokens"} if status == "incomplete" else None,
    )


@pytest.mark.parametrize("status", ["completed", "incomplete", "in_progress", "queued", "failed", "cancelled"])
def test_a_response_of_any_status_is_whole_and_typed(status: str) -> None:
    response = _response(status)
    assert not response_problems(response)
    # completed_at is set when it completed, and only then (as the SDK documents it)
    assert (response["completed_at"] is not None) == (status == "completed")
    assert list(response)[:4] == ["id", "object", "created_at", "completed_at"]


def test_sampling_fields_say_what_the_backend_was_sent_else_the_defaults() -> None:
    sent = _turn(temperature=0.3, top_p=0.5, presence_penalty=-1.5, frequency_penalty=2, max_output_tokens=40)
    assert {k: sent.chat_params[k] for k in ("temperature", "top_p", "presence_penalty", "frequency_penalty")} == {
        "temperature": 0.3,
        "top_p": 0.5,
        "presence_penalty": -1.5,
        "frequency_penalty": 2,
    }
    assert sent.chat_params["max_tokens"] == 40
    echoed = _response("completed", temperature=0.3, top_p=0.5, presence_penalty=-1.5, frequency_penalty=2)
    assert (echoed["temperature"], echoed["top_p"], echoed["presence_penalty"], echoed["frequency_penalty"]) == (
        0.3,
        0.5,
        -1.5,
        2,
    )
    unsent = _turn()
    assert unsent.chat_params == {"model": "m"}  # the backend is sent none of them
    defaults = _response("completed")
    assert (
        defaults["temperature"],
        defaults["top_p"],
        defaults["presence_penalty"],
        defaults["frequency_penalty"],
    ) == (
        1.0,
        1.0,
        0.0,
        0.0,
    )
    assert (defaults["top_logprobs"], defaults["max_tool_calls"], defaults["service_tier"]) == (0, None, "default")


def test_fields_no_backend_field_does_are_echoed_and_never_sent() -> None:
    fields = {
        "top_logprobs": 5,
        "max_tool_calls": 3,
        "safety_identifier": "user-1",
        "prompt_cache_key": "k",
        "service_tier": "flex",
    }
    turn = _turn(**fields)
    assert turn.chat_params == {"model": "m"}
    response = _response("completed", **fields)
    assert {k: response[k] for k in fields} == {**fields, "service_tier": "default"}
    assert not response_problems(response)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("presence_penalty", 2.5),
        ("frequency_penalty", -3),
        ("top_logprobs", 21),
        ("max_tool_calls", 0),
        ("safety_identifier", "x" * 65),
        ("prompt_cache_key", 7),
    ],
)
def test_out_of_range_fields_are_refused_by_name(field: str, value: object) -> None:
    with pytest.raises(BadRequest) as refused:
        _turn(**{field: value})
    assert refused.value.param == field


def test_a_json_schema_format_is_echoed_whole_and_sent_as_given() -> None:
    fmt = {"type": "json_schema", "name": "reply", "schema": {"type": "object"}}
    turn = _turn(text={"format": fmt})
    assert turn.chat_params["response_format"] == {
        "type": "json_schema",
        "json_schema": {k: fmt[k] for k in ("name", "schema")},
    }
    assert turn.echo["text"] == {"format": {**fmt, "description": None, "strict": False}}
    strict = _turn(text={"format": {**fmt, "strict": True, "description": "d"}})
    assert strict.echo["text"]["format"]["strict"] is True and strict.echo["text"]["format"]["description"] == "d"


# A Response as statestore stored it before the object was complete.
EARLIER: dict[str, Any] = {
    "id": "resp_1",
    "object": "response",
    "created_at": 1_700_000_000,
    "status": "completed",
    "background": False,
    "error": None,
    "incomplete_details": None,
    "instructions": None,
    "max_output_tokens": None,
    "model": "m",
    "output": [MESSAGE],
    "parallel_tool_calls": True,
    "previous_response_id": None,
    "conversation": None,
    "reasoning": {"effort": None, "summary": None},
    "store": True,
    "temperature": None,
    "text": {"format": {"type": "json_schema", "name": "n", "schema": {"type": "object"}}},
    "tool_choice": "auto",
    "tools": [],
    "top_p": 0.5,
    "truncation": "disabled",
    "usage": USAGE,
    "metadata": {},
}


def test_a_response_stored_before_the_object_was_complete_is_served_complete() -> None:
    served = orjson.loads(completed(orjson.dumps(EARLIER)))
    assert not response_problems(served)
    assert served["completed_at"] == EARLIER["created_at"]  # when it completed was not kept
    assert (served["temperature"], served["top_p"]) == (1.0, 0.5)  # null: the backend was sent none
    assert served["text"]["format"]["strict"] is False
    assert {k: served[k] for k in EARLIER if k not in ("temperature", "text")} == {
        k: v for k, v in EARLIER.items() if k not in ("temperature", "text")
    }
    unfinished = orjson.loads(with_status(orjson.dumps({**EARLIER, "status": "queued", "output": []}), "cancelled"))
    assert unfinished["status"] == "cancelled" and unfinished["completed_at"] is None
    assert not response_problems(unfinished)
    # its events, told again from storage as served (a resumed stream whose events are gone), are whole too
    for frame in replayed_frames(completed(orjson.dumps({**EARLIER, "background": True})), after=-1):
        event = orjson.loads(frame.split(b"\ndata: ", 1)[1])
        assert not event_problems(event), event


def test_a_whole_response_is_served_as_stored() -> None:
    body = orjson.dumps(_response("completed", temperature=0.2))
    assert completed(body) is body
    assert orjson.loads(completed(orjson.dumps(_response("failed")))) == _response("failed") | {"completed_at": None}


def test_an_assistant_phase_is_kept_and_renders_as_any_assistant_message() -> None:
    items = normalise_input(
        read_body(
            ConversationItemsRequest,
            orjson.dumps(
                {
                    "items": [
                        {"role": "assistant", "phase": "commentary", "content": "checking"},
                        {"role": "assistant", "content": [{"type": "output_text", "text": "four"}]},
                    ]
                }
            ),
        ).items
    )
    assert items[0]["phase"] == "commentary" and "phase" not in items[1]
    assert [stored(item).rendered for item in items] == [
        b'{"role":"assistant","content":"checking"}',
        b'{"role":"assistant","content":"four"}',
    ]
    with pytest.raises(BadRequest) as refused:
        _turn(input=[{"role": "assistant", "phase": "aside", "content": "x"}])
    assert refused.value.param == "input[0].phase"


# Items of kinds statestore does not run, as the `openai` SDK sends them.
NOT_RUN: list[dict[str, Any]] = [
    {"type": "shell_call", "id": "sh_1", "call_id": "c1", "action": {"commands": ["ls"]}, "status": "completed"},
    {"type": "shell_call_output", "call_id": "c1", "output": [{"stdout": "a\n", "stderr": "", "outcome": {}}]},
    {
        "type": "apply_patch_call",
        "call_id": "c2",
        "operation": {"type": "delete_file", "path": "x"},
        "status": "completed",
    },
    {"type": "apply_patch_call_output", "call_id": "c2", "status": "completed", "output": None},
    {"type": "tool_search_call", "arguments": {"q": "w"}, "execution": "client", "call_id": None},
    {"type": "additional_tools", "role": "developer", "tools": [{"type": "function", "name": "f"}]},
]


def test_items_statestore_does_not_run_are_kept_as_they_came_and_never_sent() -> None:
    kept = _turn(input=[*NOT_RUN, {"role": "user", "content": "go on"}]).input
    for given, item in zip(NOT_RUN, kept, strict=False):
        assert item == {**given, "id": item["id"]}
        assert list(item)[: len(given)] == list(given)  # nothing moved, nothing dropped
    assert kept[0]["id"] == "sh_1" and kept[1]["id"].startswith("item_")
    rendered = [stored(item) for item in kept]
    assert [r.kind for r in rendered[:-1]] == ["none"] * len(NOT_RUN)
    assert join_rendered((r.kind, r.rendered) for r in rendered) == b'{"role":"user","content":"go on"}'
    assert orjson.loads(rendered[2].body) == kept[2]


@pytest.mark.parametrize(
    "item",
    [
        {"type": "item_reference", "id": "msg_1"},  # a reference statestore would have to resolve
        {"type": "compaction_trigger"},  # asks for a compaction: `context_management` does that here
        {"type": "configuration_update", "text": {"format": {"type": "text"}}},  # asks later turns to change
        {"type": "telepathy_call"},
        {"type": "shell_call", "id": ""},
    ],
)
def test_items_that_ask_for_something_or_are_unknown_are_refused(item: dict[str, Any]) -> None:
    with pytest.raises(BadRequest) as refused:
        _turn(input=[item])
    assert refused.value.param == "input[0]"
