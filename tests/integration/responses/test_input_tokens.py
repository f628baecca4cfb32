"""`client.responses.input_tokens.count` over stored context (docs/responses.md, "Counting tokens over stored context"):
the turn a request would make, counted over its chain or conversation after the owner's context policy, without
running the model, by the backend's own tokenizer (vLLM's chat `/tokenize`; llama.cpp's `/apply-template` then
`/tokenize`) or statestore's estimator, which a header names.

The fake backends' tokenizers count as their usage does (tests/support/fake_tokenizers.py), so each count is held to
the `input_tokens` of the very turn it counted."""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import openai
import pytest

from tests.integration.responses.conftest import CHAT_PATH, WEATHER, chat_requests, last_chat_request, other_key
from tests.support.admin_api import ADMIN_TOKENS, UPSTREAM_KEY, AdminApi, start_server
from tests.support.fake_backend import FakeBackend, RecordedRequest
from tests.support.server import StatestoreServer

TOKENIZER_PATHS = ("/tokenize", "/apply-template")


def count(client: openai.OpenAI, **fields: Any) -> tuple[int, str]:
    """(input_tokens, the statestore-token-count header) of a count through the SDK."""
    raw = client.responses.input_tokens.with_raw_response.count(**fields)
    counted = raw.parse()
    assert counted.object == "response.input_tokens"
    return counted.input_tokens, raw.headers["statestore-token-count"]


def tokenizer_requests(backend: FakeBackend) -> list[RecordedRequest]:
    return [request for request in backend.requests() if request.path in TOKENIZER_PATHS]


def parent_reads(server: StatestoreServer) -> float:
    """`response_parents_total`, all reads: the Responses continues that read their previous response."""
    text = httpx.get(server.url + "/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith("response_parents_total"))


@dataclass
class Door:
    """statestore in front of a fake Chat Completions backend that has a tokenizer, and how its owners get in."""

    name: str
    server: StatestoreServer
    backend: FakeBackend
    credential: str  # what the backend's tokenizer is asked with: the client's own, or the deployment's

    def client(self) -> openai.OpenAI:
        if self.name.startswith("vllm"):
            with AdminApi(self.server.url) as admin:
                _, key = admin.tenant_with_key()
        else:
            key = f"sk-count-{secrets.token_hex(8)}"
        self.credential = UPSTREAM_KEY if self.name.startswith("vllm") else key
        return openai.OpenAI(base_url=self.server.url + "/v1", api_key=key, max_retries=0)


@pytest.fixture(scope="module")
def vllm_backend() -> Iterator[FakeBackend]:
    with FakeBackend(tokenizer="vllm") as backend:
        yield backend


@pytest.fixture(scope="module")
def llama_backend() -> Iterator[FakeBackend]:
    with FakeBackend(tokenizer="llama.cpp") as backend:
        yield backend


@pytest.fixture(scope="module")
def vllm_server(
    module_db: str, redis_url: str, module_prefix: str, vllm_backend: FakeBackend
) -> Iterator[StatestoreServer]:
    """PostgreSQL + Redis, keys mode: the backend gets the deployment's credential; policies apply at once."""
    env = {
        "STATESTORE_AUTH_MODE": "keys",
        "STATESTORE_UPSTREAM_API_KEY": UPSTREAM_KEY,
        "STATESTORE_ADMIN_TOKENS": ADMIN_TOKENS,
        "STATESTORE_KEY_CACHE_SECONDS": "0",
        "STATESTORE_POLICY_CACHE_SECONDS": "0",
        "STATESTORE_CHAT_UPSTREAM_URL": vllm_backend.url,
    }
    server = start_server(module_db, vllm_backend.url, redis_url, module_prefix, env)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def llama_server(tmp_path_factory: pytest.TempPathFactory, llama_backend: FakeBackend) -> Iterator[StatestoreServer]:
    """The embedded default (SQLite, the in-process cache), passthrough: the backend gets the client's credential."""
    from statestore.store.migrate import upgrade

    url = f"sqlite+aiosqlite:///{tmp_path_factory.mktemp('input-tokens') / 'statestore.db'}"
    upgrade(url)
    server = StatestoreServer(
        database_url=url, upstream_url=llama_backend.url, env={"STATESTORE_CHAT_UPSTREAM_URL": llama_backend.url}
    )
    yield server
    server.stop()


@pytest.fixture(params=["vllm-postgres", "llama.cpp-sqlite"])
def door(request: pytest.FixtureRequest) -> Door:
    name: str = request.param
    backend: FakeBackend = request.getfixturevalue("vllm_backend" if name.startswith("vllm") else "llama_backend")
    server: StatestoreServer = request.getfixturevalue("vllm_server" if name.startswith("vllm") else "llama_server")
    backend.reset()
    return Door(name, server, backend, "")


def test_a_count_over_a_chain_is_the_input_of_the_turn_it_counts(door: Door) -> None:
    with door.client() as client:
        turn: dict[str, Any] = {"model": "echo-1", "instructions": "Be brief.", "tools": [WEATHER]}
        first = client.responses.create(input="what is the weather in Paris?", **turn)
        door.backend.reset()
        parents = parent_reads(door.server)
        tokens, source = count(client, input="and in Rome?", previous_response_id=first.id, **turn)
        assert source == "backend"
        asked = tokenizer_requests(door.backend)
        assert parent_reads(door.server) == parents  # a count is no turn: the turns' metrics leave it out
        second = client.responses.create(input="and in Rome?", previous_response_id=first.id, **turn)
        assert second.usage is not None and second.usage.input_tokens == tokens
        if door.name.startswith("vllm"):  # chain heads are read from Redis there, and the turn's read is counted
            assert parent_reads(door.server) == parents + 1
        # The tokenizer read the very request the turn then sent, with the credential the turn's request carried.
        sent = last_chat_request(door.backend)
        chat = sent.json()
        if door.name.startswith("vllm"):
            [tokenized] = asked
            assert tokenized.path == "/tokenize"
            wanted = {"model": "echo-1", "messages": chat["messages"], "tools": chat["tools"]}
            assert tokenized.json() == {**wanted, "add_generation_prompt": True}
        else:
            *_, templated, tokenized = asked
            assert templated.path == "/apply-template"
            assert templated.json() == {k: v for k, v in chat.items() if k not in ("stream", "stream_options")}
            assert tokenized.json()["content"].startswith('[{"role":"system","content":"Be brief."}')
            assert tokenized.json()["add_special"] is True
        for request in asked:
            assert request.header("authorization") == f"Bearer {door.credential}"


def test_a_count_over_a_conversation_is_its_next_turn_s_input_and_changes_nothing(door: Door) -> None:
    with door.client() as client:
        conversation = client.conversations.create(items=[{"role": "user", "content": "remember 42"}])
        client.responses.create(model="echo-1", input="and 7", conversation=conversation.id)
        items = [item.id for item in client.conversations.items.list(conversation.id)]
        tokens, source = count(client, model="echo-1", input="sum them", conversation={"id": conversation.id})
        assert source == "backend"
        assert [item.id for item in client.conversations.items.list(conversation.id)] == items
        went_on = client.responses.create(model="echo-1", input="sum them", conversation=conversation.id)
        assert went_on.usage is not None and went_on.usage.input_tokens == tokens


def test_the_tokenizer_found_is_remembered(door: Door) -> None:
    """After the first count has found what the backend offers, each count makes only the requests it needs:
    one `/tokenize` on vLLM; `/apply-template` and `/tokenize` on llama.cpp."""
    with door.client() as client:
        count(client, input="warm up")
        door.backend.reset()
        for text in ("one", "two", "three"):
            count(client, model="echo-1", input=text)
        paths = [request.path for request in tokenizer_requests(door.backend)]
        each = ["/tokenize"] if door.name.startswith("vllm") else ["/apply-template", "/tokenize"]
        assert paths == each * 3
        assert [r for r in door.backend.requests() if r.path == CHAT_PATH] == []  # the model never ran


def test_a_count_is_refused_as_the_turn_would_be(door: Door) -> None:
    with door.client() as client, door.client() as other:
        first = client.responses.create(model="echo-1", input="mine")
        conversation = client.conversations.create()
        door.backend.reset()
        for previous in (first.id, "resp_unknown0000000000000000", "not-an-id"):
            with pytest.raises(openai.BadRequestError) as refused:
                count(other, model="echo-1", input="x", previous_response_id=previous)
            assert refused.value.code == "previous_response_not_found"
            assert refused.value.param == "previous_response_id"
        for conversation_id in (conversation.id, "conv_unknown0000000000000000"):
            with pytest.raises(openai.NotFoundError) as missing:
                count(other, model="echo-1", input="x", conversation=conversation_id)
            assert missing.value.param == "conversation"
        with pytest.raises(openai.BadRequestError) as both:
            count(client, input="x", previous_response_id=first.id, conversation=conversation.id)
        assert both.value.code == "invalid_value"
        with pytest.raises(openai.BadRequestError) as unknown:
            count(client, input="x", extra_body={"temperature": 0.5})
        assert unknown.value.code == "unknown_parameter"
        assert door.backend.requests() == []


# == the owner's context policy ========================================================================================


def test_counts_with_truncation_auto_are_what_the_policy_sends(
    vllm_server: StatestoreServer, vllm_backend: FakeBackend
) -> None:
    with AdminApi(vllm_server.url) as admin:
        tenant, key = admin.tenant_with_key()
        admin.put_policy(tenant["id"], context_strategy="truncate", context_window_tokens=1024)
    words = "word " * 200
    moved = 0
    with openai.OpenAI(base_url=vllm_server.url + "/v1", api_key=key, max_retries=0) as client:
        previous = client.responses.create(model="echo-1", input=f"0 {words}", truncation="auto").id
        for turn in range(1, 5):
            fields: dict[str, Any] = {"model": "echo-1", "input": f"{turn} {words}", "previous_response_id": previous}
            auto, source = count(client, truncation="auto", **fields)
            whole, _ = count(client, **fields)
            assert source == "backend"
            raw = client.responses.with_raw_response.create(truncation="auto", **fields)
            reply = raw.parse()
            assert reply.usage is not None and reply.usage.input_tokens == auto
            if raw.headers.get("statestore-context") == "truncated":
                moved += 1
                assert auto < whole
                assert len(chat_requests(vllm_backend)[-1]["messages"]) < 2 * turn + 1
            previous = reply.id
    assert moved, "no turn passed the trigger"


# == a backend without a tokenizer: the estimate (both storage set-ups) ================================================


def test_without_a_tokenizer_the_estimate_answers(any_openai_client: openai.OpenAI, backend: FakeBackend) -> None:
    client = any_openai_client
    first = client.responses.create(model="echo-1", input="tell me about tokens " * 40)
    estimates = []
    for text in ("short", "a much longer question about counting " * 30):
        tokens, source = count(client, model="echo-1", input=text, previous_response_id=first.id)
        assert source == "estimate"
        estimates.append(tokens)
    assert estimates[1] > estimates[0]
    # Without a model, nothing is asked of a tokenizer anyway.
    assert count(client, input="no model named")[1] == "estimate"
    second = client.responses.create(model="echo-1", input=text, previous_response_id=first.id)
    # The chain's own tokens per byte, measured from the backend's usage, make the estimate close.
    assert second.usage is not None
    assert abs(estimates[1] - second.usage.input_tokens) <= 0.1 * second.usage.input_tokens
    with pytest.raises(openai.BadRequestError) as refused:
        count(client, input="x", previous_response_id=first.id.replace("resp_", "resp_x"))
    assert refused.value.code == "previous_response_not_found"
    with pytest.raises(openai.NotFoundError):
        count(client, input="x", conversation="conv_unknown0000000000000000")
    with (
        openai.OpenAI(base_url=str(client.base_url), api_key=other_key(), max_retries=0) as other,
        pytest.raises(openai.BadRequestError),
    ):
        count(other, input="x", previous_response_id=first.id)
