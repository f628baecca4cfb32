"""Long conversations against llama-server's real window (2,048 tokens, one slot): each context strategy keeps a
thread inside it; a window set too large meets the server's own refusal, which statestore recognises, cuts and sends
once more before the client sees anything; without a managed context that refusal reaches the client unchanged; and
`context_window_tokens: auto` takes the window from the server (docs/protocol.md §9)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import anthropic
import httpx
import pytest
from anthropic.types.beta import BetaMessage

from tests.realbackend.conftest import NARROW, Stack
from tests.realbackend.llama import MODEL_NAME
from tests.support.admin_api import THREADS_BETA, AdminApi, policy

TURNS = 36


def words(turn: int) -> str:
    """About a hundred tokens of the Qwen2 vocabulary, different every turn."""
    return f"Turn {turn}: " + " ".join(f"w{turn}x{index}" for index in range(30))


def prompt_tokens(message: BetaMessage) -> int:
    return message.usage.input_tokens + (message.usage.cache_read_input_tokens or 0)


@dataclass
class Conversation:
    sdk: anthropic.Anthropic
    previous: str | None = None
    prompts: list[int] = field(default_factory=list)
    moves: list[tuple[int, str]] = field(default_factory=list)  # (turn, statestore-context)

    def send(self, text: str) -> BetaMessage:
        thread: Any = (
            {"type": "continue", "previous_message_id": self.previous} if self.previous else {"type": "create"}
        )
        raw = self.sdk.beta.messages.with_raw_response.create(
            model=MODEL_NAME,
            max_tokens=8,
            messages=[{"role": "user", "content": text}],
            thread=thread,
            betas=[THREADS_BETA],
        )
        message = raw.parse()
        if "statestore-context" in raw.headers:
            self.moves.append((len(self.prompts), raw.headers["statestore-context"]))
        self.prompts.append(prompt_tokens(message))
        self.previous = message.id
        return message


@pytest.fixture
def conversation(narrow_stack: Stack, api_key: str) -> Any:
    with anthropic.Anthropic(base_url=narrow_stack.statestore.url, api_key=api_key, max_retries=0, timeout=120) as sdk:
        yield Conversation(sdk)


@pytest.mark.parametrize("strategy", ["truncate", "summarize"])
def test_each_strategy_keeps_a_thread_inside_the_servers_window(
    strategy: str, narrow_stack: Stack, conversation: Conversation
) -> None:
    narrow_stack.set_policy(context_strategy=strategy, context_window_tokens=NARROW)
    for turn in range(TURNS):
        conversation.send(words(turn))
    action = "truncated" if strategy == "truncate" else "summarized"
    assert conversation.moves, "the context never moved"
    assert {name for _, name in conversation.moves} == {action}
    assert max(conversation.prompts) < NARROW
    for turn, _ in conversation.moves:
        before, after = conversation.prompts[turn - 1], conversation.prompts[turn]
        assert after < before and after < 0.8 * NARROW, repr((conversation.prompts, conversation.moves))
        if strategy == "truncate":
            # One step down to the target: the turn after a move sends about half the window.
            assert after <= 0.5 * NARROW + 200
        else:
            # The summary is budgeted at its max_tokens (256); this model's gibberish re-tokenises to more tokens
            # than it was generated in, so the context after it sits above the target by that much
            # (docs/real-backends.md).
            assert after <= 0.5 * NARROW + 200 + 300


def test_a_window_set_too_large_meets_the_servers_refusal_which_is_cut_and_sent_once_more(
    narrow_stack: Stack, conversation: Conversation
) -> None:
    """The policy claims 100,000 tokens, so statestore's estimate never reaches its trigger; the server refuses the
    turn that outgrows its 2,048 (`exceed_context_size_error`), statestore cuts the context to the target of the
    window the refusal states and sends it once more: the client sees a truncated turn, never the refusal."""
    narrow_stack.set_policy(context_strategy="truncate", context_window_tokens=100_000)
    for turn in range(TURNS):
        conversation.send(words(turn))
    assert conversation.moves, "no refusal was met"
    first, action = conversation.moves[0]
    assert action == "truncated"
    assert conversation.prompts[first - 1] + 100 > 0.7 * NARROW  # it took the server's own limit to move it
    assert conversation.prompts[first] <= 0.5 * NARROW + 200  # cut to the target of the stated window


def test_without_a_managed_context_the_servers_refusal_reaches_the_client_unchanged(
    narrow_stack: Stack, conversation: Conversation
) -> None:
    narrow_stack.set_policy()
    with pytest.raises(anthropic.BadRequestError) as refused:
        for turn in range(TURNS):
            conversation.send(words(turn))
    error = refused.value.body["error"]  # type: ignore[index]
    assert error["type"] == "exceed_context_size_error"
    assert error["n_ctx"] == NARROW and error["n_prompt_tokens"] >= NARROW
    # Nothing of the refused turn was stored: the thread still ends at the last reply.
    assert conversation.previous is not None
    info = httpx.get(
        f"{narrow_stack.statestore.url}/statestore/v1/threads/{thread_of(conversation.previous)}",
        headers={"x-api-key": conversation.sdk.api_key or ""},
        timeout=30,
    ).json()
    assert info["message_count"] == 2 * len(conversation.prompts)


def test_an_auto_window_is_the_one_the_server_states(narrow_stack: Stack, conversation: Conversation) -> None:
    with AdminApi(narrow_stack.statestore.url) as admin:
        shown = admin.ok("PUT", "/policies/default", policy(context_strategy="truncate", context_window_tokens="auto"))
        assert shown["policy"]["context_window_tokens"] == "auto"
        assert admin.ok("GET", "/policies/default")["policy"]["context_window_tokens"] == "auto"
    for turn in range(TURNS):
        conversation.send(words(turn))
    assert conversation.moves
    # The trigger is 0.8 of the 2,048 /props states: no prompt came near the server's limit (a refusal would have).
    assert max(conversation.prompts) <= 0.8 * NARROW + 150


def thread_of(response_id: str) -> str:
    from statestore.threads.ids import thread_of_response

    thread = thread_of_response(response_id)
    assert thread is not None
    return thread
