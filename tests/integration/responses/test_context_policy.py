"""docs/protocol.md §9 on the Responses door (`truncation: "auto"`): the same context planner as threads, with the Chat
Completions format: tool-safe boundaries, the chain's own tokens per byte from the backend's usage, and `summarize`
with the summary stored so later turns start from it. A server in keys mode whose policies apply at once."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import openai
import pytest

from statestore.core.planner import SUMMARY_PREFIX
from tests.integration.responses.conftest import CHAT_PATH, WEATHER, chat_requests, last_chat_request
from tests.support.admin_api import ADMIN_TOKENS, UPSTREAM_KEY, AdminApi, ClockFile, start_server
from tests.support.fake_backend import FakeBackend, chat_action
from tests.support.server import StatestoreServer


@pytest.fixture(scope="module")
def server(
    module_db: str, redis_url: str, module_prefix: str, clock: ClockFile, fake_backend_process: FakeBackend
) -> Iterator[StatestoreServer]:
    env = {
        "STATESTORE_AUTH_MODE": "keys",
        "STATESTORE_UPSTREAM_API_KEY": UPSTREAM_KEY,
        "STATESTORE_ADMIN_TOKENS": ADMIN_TOKENS,
        "STATESTORE_KEY_CACHE_SECONDS": "0",
        "STATESTORE_POLICY_CACHE_SECONDS": "0",
        "STATESTORE_CHAT_UPSTREAM_URL": fake_backend_process.url,
    }
    running = start_server(module_db, fake_backend_process.url, redis_url, module_prefix, env)
    yield running
    running.stop()


@pytest.fixture(scope="module")
def admin(server: StatestoreServer) -> Iterator[AdminApi]:
    with AdminApi(server.url) as api:
        yield api


def _client(server: StatestoreServer, admin: AdminApi, **policy: Any) -> openai.OpenAI:
    tenant, key = admin.tenant_with_key()
    admin.put_policy(tenant["id"], **policy)
    return openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0)


def _tool_safe(messages: list[dict[str, Any]]) -> str | None:
    """What a Chat Completions backend would refuse in these messages' order, or None: a context that opens with
    anything but a user message (after the system one), a `tool` message that does not follow its call."""
    rest = [m for m in messages if m["role"] != "system"]
    if not rest or rest[0]["role"] != "user":
        return f"the context opens with {rest[0]['role'] if rest else 'nothing'}"
    open_calls: set[str] = set()
    for index, message in enumerate(rest):
        if message["role"] == "tool":
            if message["tool_call_id"] not in open_calls:
                return f"message {index} is a tool result whose call is not before it"
            open_calls.discard(message["tool_call_id"])
        else:
            open_calls = {call["id"] for call in message.get("tool_calls") or ()}
    return None


def test_a_truncated_chain_of_tool_calls_never_opens_with_an_orphan_tool_result(
    server: StatestoreServer, admin: AdminApi, backend: FakeBackend
) -> None:
    """Each round: a user turn the backend answers with a function call, then the call's output. A round is larger
    than the target, so past the trigger the only boundary that fits is none: the context must still keep the user
    message with its call and output, never send the output alone."""
    moved = 0
    with _client(server, admin, context_window_tokens=1024) as client:
        previous: str | None = None
        for turn in range(4):
            asked = client.responses.with_raw_response.create(
                model="echo-1",
                input=f"round {turn}: call get_weather " + "x" * 1000,
                tools=[WEATHER],
                previous_response_id=previous,
                truncation="auto",
            )
            call = next(item for item in asked.parse().output if item.type == "function_call")
            answered = client.responses.with_raw_response.create(
                model="echo-1",
                input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny " + "y" * 1000}],
                tools=[WEATHER],
                previous_response_id=asked.parse().id,
                truncation="auto",
            )
            previous = answered.parse().id
            moved += sum(raw.headers.get("statestore-context") == "truncated" for raw in (asked, answered))
            for sent in chat_requests(backend)[-2:]:
                assert _tool_safe(sent["messages"]) is None, (turn, _tool_safe(sent["messages"]))
        assert moved, "no turn passed the trigger"


def test_the_estimate_uses_the_tokens_per_byte_the_backend_measured(
    server: StatestoreServer, admin: AdminApi, backend: FakeBackend
) -> None:
    """A backend that counts a token a byte (four times the default ratio) makes the next turn pass the trigger
    that the default ratio would not reach; a backend counting as the default does not."""
    with _client(server, admin, context_window_tokens=4096) as client:
        chains = {}
        for dense in (True, False):
            if dense:
                backend.script(
                    chat_action(
                        {"role": "assistant", "content": "noted"},
                        usage={"prompt_tokens": 4000, "completion_tokens": 5, "total_tokens": 4005},
                    )
                )
            first = client.responses.create(model="echo-1", input="a" * 3800, truncation="auto")
            chains[dense] = client.responses.with_raw_response.create(
                model="echo-1", input="and now?", previous_response_id=first.id, truncation="auto"
            )
            sent = last_chat_request(backend).json()["messages"]
            assert len(sent) == (1 if dense else 3), dense
        # 3,800 bytes are about 950 tokens at the default ratio: under the trigger (0.8 x 4096), unless measured.
        assert chains[True].headers.get("statestore-context") == "truncated"
        assert "statestore-context" not in chains[False].headers


def test_a_conversation_measures_its_tokens_per_byte_too(
    server: StatestoreServer, admin: AdminApi, backend: FakeBackend
) -> None:
    with _client(server, admin, context_window_tokens=4096) as client:
        conversation = client.conversations.create()
        backend.script(
            chat_action(
                {"role": "assistant", "content": "noted"},
                usage={"prompt_tokens": 4000, "completion_tokens": 5, "total_tokens": 4005},
            )
        )
        client.responses.create(model="echo-1", input="a" * 3800, conversation=conversation.id, truncation="auto")
        raw = client.responses.with_raw_response.create(
            model="echo-1", input="and now?", conversation=conversation.id, truncation="auto"
        )
        assert raw.headers.get("statestore-context") == "truncated"
        assert last_chat_request(backend).json()["messages"] == [{"role": "user", "content": "and now?"}]


def test_summarize_asks_the_backend_once_and_later_turns_start_from_the_summary(
    server: StatestoreServer, admin: AdminApi, backend: FakeBackend
) -> None:
    instructions = "Summarise the chain so far (summary-marker-1)."
    backend.script(
        chat_action({"role": "assistant", "content": "the user sent long turns"}, match="summary-marker-1"),
    )
    summary = {"role": "user", "content": SUMMARY_PREFIX + "the user sent long turns"}
    policy = {"context_strategy": "summarize", "context_window_tokens": 1024, "summary_instructions": instructions}
    with _client(server, admin, **policy) as client:
        previous: str | None = None
        said: list[str | None] = []
        ids: list[str] = []
        # Until the summary, then two turns under the trigger (each turn is about an eighth of the window).
        while "summarized" not in said[:-2]:
            assert len(said) < 10, "no turn passed the trigger"
            raw = client.responses.with_raw_response.create(
                model="echo-1", input=f"turn {len(said)} " + "x" * 500, previous_response_id=previous, truncation="auto"
            )
            previous = raw.parse().id
            ids.append(previous)
            said.append(raw.headers.get("statestore-context"))
            assert "statestore-context-fallback" not in raw.headers
        requests = chat_requests(backend)
        asked = [r for r in requests if r["messages"][-1]["content"] == instructions]
        assert len(asked) == 1, "one summary request"
        assert asked[0]["max_tokens"] == 256 and asked[0]["messages"][0]["content"].startswith("turn 0 ")
        turns = [r for r in requests if r is not asked[0]]
        summarized = said.index("summarized")
        assert said[summarized + 1 :] == [None, None]
        # The summarised turn opens with the summary; every later one starts from it, its prefix unchanged.
        assert turns[summarized]["messages"][0] == summary
        for before, after in zip(turns[summarized:], turns[summarized + 1 :], strict=False):
            assert after["messages"][: len(before["messages"])] == before["messages"]
        # `disabled` still sends the whole chain; `auto` on a branch after the summary starts from the summary.
        client.responses.create(model="echo-1", input="all", previous_response_id=previous)
        assert len(last_chat_request(backend).json()["messages"]) == 2 * len(said) + 1
        branch = ids[summarized]
        client.responses.create(model="echo-1", input="again", previous_response_id=branch, truncation="auto")
        assert last_chat_request(backend).json()["messages"][:3] == turns[summarized + 1]["messages"][:3]
        assert last_chat_request(backend).json()["messages"][0] == summary


def test_a_failed_summary_truncates_and_says_so(
    server: StatestoreServer, admin: AdminApi, backend: FakeBackend
) -> None:
    instructions = "Summarise (summary-marker-2)."
    backend.script(
        {
            "kind": "error",
            "path": CHAT_PATH,
            "status": 500,
            "error": {"type": "server_error", "message": "down"},
            "match": "summary-marker-2",
        }
    )
    policy = {"context_strategy": "summarize", "context_window_tokens": 1024, "summary_instructions": instructions}
    with _client(server, admin, **policy) as client:
        previous: str | None = None
        for turn in range(8):
            raw = client.responses.with_raw_response.create(
                model="echo-1", input=f"turn {turn} " + "x" * 500, previous_response_id=previous, truncation="auto"
            )
            previous = raw.parse().id
            if raw.headers.get("statestore-context"):
                assert raw.headers["statestore-context"] == "truncated"
                assert raw.headers["statestore-context-fallback"] == "summary_failed"
                assert last_chat_request(backend).json()["messages"][0]["role"] == "user"
                break
        else:
            pytest.fail("no turn passed the trigger")
        assert backend.pending() == 0, "the summary was asked for"


def test_a_window_set_too_large_meets_context_length_exceeded_which_is_cut_and_sent_once_more(
    server: StatestoreServer, admin: AdminApi, backend: FakeBackend
) -> None:
    """§9, a backend's own refusal, on the Responses door as on threads (core/refusal_retry.py): the policy claims ten
    times the backend's window, so the estimate never reaches the trigger; the turn the backend refuses
    (`context_length_exceeded`) is cut to the target of the stated window and sent once more, and the client sees a
    truncated turn, never the refusal."""
    window = 2000
    backend.watch_context(window=window)
    try:
        with _client(server, admin, context_strategy="truncate", context_window_tokens=10 * window) as client:
            previous: str | None = None
            truncated = 0
            for turn in range(30):
                raw = client.responses.with_raw_response.create(
                    model="echo-1", input=f"turn {turn} " + "x" * 1000, previous_response_id=previous, truncation="auto"
                )
                previous = raw.parse().id
                truncated += raw.headers.get("statestore-context") == "truncated"
        turns = backend.context_log()["turns"]
    finally:
        backend.watch_context(window=None)
    refused = [index for index, entry in enumerate(turns) if entry["status"] == 400]
    assert refused, "the backend never refused"
    for index in refused:  # one retry, which fitted
        assert turns[index + 1]["status"] == 200
        assert turns[index + 1]["input_tokens"] <= 0.5 * window + 600
    assert truncated == len(refused)
