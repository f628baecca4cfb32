"""Token counts over stored context against llama.cpp's server (docs/protocol.md §11, docs/responses.md): its own
tokenizer counts what a turn would send (the Responses door through `/apply-template` and `/tokenize`, the Messages door
through its `/v1/messages/count_tokens`), and each count is the prompt the server then counted for that very turn."""

from __future__ import annotations

import anthropic
import httpx
import openai
from anthropic.types.beta import BetaMessageParam, BetaThreadContinueParams

from tests.realbackend.conftest import Stack
from tests.realbackend.llama import MODEL_NAME
from tests.support.admin_api import THREADS_BETA

MAX_OUTPUT = 8


def test_a_count_over_a_chain_is_the_prompt_llama_cpp_then_reads(gpt: openai.OpenAI, stack: Stack) -> None:
    first = gpt.responses.create(
        model=MODEL_NAME, input="Hello there.", instructions="Be brief.", max_output_tokens=MAX_OUTPUT
    )
    raw = gpt.responses.input_tokens.with_raw_response.count(
        model=MODEL_NAME, input="And what now?", instructions="Be brief.", previous_response_id=first.id
    )
    assert raw.headers["statestore-token-count"] == "backend"
    counted = raw.parse().input_tokens
    second = gpt.responses.create(
        model=MODEL_NAME,
        input="And what now?",
        instructions="Be brief.",
        previous_response_id=first.id,
        max_output_tokens=MAX_OUTPUT,
    )
    assert second.usage is not None
    assert second.usage.input_tokens == counted
    # The same prompt, tokenized by the server's own route for it (the chat request as the turn sent it).
    direct = httpx.post(
        f"{stack.llama.url}/v1/chat/completions/input_tokens",
        json={
            "model": MODEL_NAME,
            "messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Hello there."},
                {"role": "assistant", "content": first.output_text},
                {"role": "user", "content": "And what now?"},
            ],
        },
        timeout=60,
    )
    assert direct.status_code == 200, direct.text
    assert direct.json()["input_tokens"] == counted


def test_a_count_over_a_thread_is_the_prompt_llama_cpp_then_reads(claude: anthropic.Anthropic) -> None:
    first = claude.beta.messages.create(
        model=MODEL_NAME,
        max_tokens=MAX_OUTPUT,
        system="Answer briefly.",
        messages=[{"role": "user", "content": "Hello there."}],
        thread={"type": "create"},
        betas=[THREADS_BETA],
    )
    thread: BetaThreadContinueParams = {"type": "continue", "previous_message_id": first.id}
    turn: list[BetaMessageParam] = [{"role": "user", "content": "What is a thread?"}]
    raw = claude.beta.messages.with_raw_response.count_tokens(
        model=MODEL_NAME, messages=turn, betas=[THREADS_BETA], extra_body={"thread": thread}
    )
    assert raw.headers["statestore-token-count"] == "backend"
    counted = raw.parse().input_tokens
    second = claude.beta.messages.create(
        model=MODEL_NAME, max_tokens=MAX_OUTPUT, messages=turn, thread=thread, betas=[THREADS_BETA]
    )
    usage = second.usage
    # The server's prompt: what it read anew and what its cache held.
    assert usage.input_tokens + (usage.cache_read_input_tokens or 0) == counted
