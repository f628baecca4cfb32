"""The `openai-agents` SDK's Responses model against statestore: a multi-turn agent with a function tool, chained by
previous_response_id and by a conversation; the backend sees the whole translated history on every turn."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import openai
import pytest
from agents import Agent, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled

from tests.integration.responses.conftest import chat_requests
from tests.support.fake_backend import FakeBackend

INSTRUCTIONS = "You report the weather."


@pytest.fixture(autouse=True)
def _no_tracing() -> Iterator[None]:
    set_tracing_disabled(True)  # tracing would post to api.openai.com
    yield


@function_tool
def get_weather(city: str) -> str:
    """The weather in a city."""
    return "sunny"


def _agent(client: openai.AsyncOpenAI) -> Agent[Any]:
    return Agent(
        name="weather",
        instructions=INSTRUCTIONS,
        tools=[get_weather],
        model=OpenAIResponsesModel("echo-1", client),
    )


def _conversation_so_far(call_id: str, arguments: str) -> list[dict[str, Any]]:
    return [
        {"role": "user", "content": "please call get_weather"},
        {"role": "assistant", "content": "echo: please call get_weather"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": call_id, "type": "function", "function": {"name": "get_weather", "arguments": arguments}}
            ],
        },
        {"role": "tool", "tool_call_id": call_id, "content": "sunny"},
        {"role": "assistant", "content": "echo: sunny"},
    ]


def _check_turns(backend: FakeBackend) -> None:
    sent = chat_requests(backend)
    assert len(sent) == 3
    call = sent[1]["messages"][3]["tool_calls"][0]
    history = _conversation_so_far(call["id"], call["function"]["arguments"])
    system = {"role": "system", "content": INSTRUCTIONS}
    assert sent[0]["messages"] == [system, history[0]]
    assert sent[1]["messages"] == [system, *history[:4]]
    assert sent[2]["messages"] == [system, *history, {"role": "user", "content": "and tomorrow?"}]
    assert all(r["tools"][0]["function"]["name"] == "get_weather" for r in sent)


async def test_an_agent_chained_by_previous_response_id(
    async_openai_client: openai.AsyncOpenAI, backend: FakeBackend
) -> None:
    agent = _agent(async_openai_client)
    first = await Runner.run(agent, "please call get_weather", auto_previous_response_id=True)
    assert first.final_output == "echo: sunny"
    second = await Runner.run(agent, "and tomorrow?", previous_response_id=first.last_response_id)
    assert second.final_output == "echo: and tomorrow?"
    _check_turns(backend)


async def test_an_agent_on_a_conversation(async_openai_client: openai.AsyncOpenAI, backend: FakeBackend) -> None:
    agent = _agent(async_openai_client)
    conversation = await async_openai_client.conversations.create()
    first = await Runner.run(agent, "please call get_weather", conversation_id=conversation.id)
    assert first.final_output == "echo: sunny"
    second = await Runner.run(agent, "and tomorrow?", conversation_id=conversation.id)
    assert second.final_output == "echo: and tomorrow?"
    _check_turns(backend)
    items = await async_openai_client.conversations.items.list(conversation.id, order="asc")
    assert [i.type for i in items.data] == [
        "message", "message", "function_call", "function_call_output", "message", "message", "message",
    ]  # fmt: skip
