"""A conversation turn whose reply outlasts the lease keeps the conversation (the lease is renewed while it runs)
and commits; a rival turn meanwhile is refused."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import openai
import pytest

from tests.integration.responses.conftest import chat_requests, texts
from tests.support.fake_backend import FakeBackend
from tests.support.server import StatestoreServer

LEASE_SECONDS = 1


@pytest.fixture(scope="module")
def short_lease_server(responses_pg_url: str, fake_backend_process: FakeBackend) -> Iterator[StatestoreServer]:
    server = StatestoreServer(
        database_url=responses_pg_url,
        upstream_url=fake_backend_process.url,
        env={"STATESTORE_CHAT_UPSTREAM_URL": fake_backend_process.url, "STATESTORE_LEASE_SECONDS": str(LEASE_SECONDS)},
    )
    yield server
    server.stop()


async def test_a_reply_longer_than_the_lease_keeps_the_conversation(
    short_lease_server: StatestoreServer, backend: FakeBackend, api_key: str
) -> None:
    async with openai.AsyncOpenAI(base_url=short_lease_server.url + "/v1", api_key=api_key, max_retries=0) as client:
        conversation = await client.conversations.create()
        # The reply stalls for three lease lengths after its first chunks.
        backend.script(
            {
                "kind": "echo",
                "path": "/v1/chat/completions",
                "stall_after_events": 2,
                "stall_seconds": 3 * LEASE_SECONDS,
            }
        )
        long_turn = asyncio.create_task(
            client.responses.create(model="echo-1", input="slow", conversation=conversation.id, stream=True)
        )
        while not chat_requests(backend):
            await asyncio.sleep(0.02)
        await asyncio.sleep(2 * LEASE_SECONDS)  # past the lease the turn started with
        with pytest.raises(openai.BadRequestError) as rival:
            await client.responses.create(model="echo-1", input="rival", conversation=conversation.id)
        assert rival.value.code == "conversation_locked"
        events = [event async for event in await long_turn]
        assert events[-1].type == "response.completed"
        items = await client.conversations.items.list(conversation.id, order="asc")
        assert texts(items.data) == ["slow", "echo: slow"]
        assert len(chat_requests(backend)) == 1  # the rival never reached the backend
