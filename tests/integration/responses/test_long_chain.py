"""A 1,000-turn chain: the context a continue sends is byte-identical whether it came from the cache (Redis warm)
or was rebuilt from the database (Redis flushed), and branching from an old response rebuilds it exactly."""

from __future__ import annotations

import openai
import orjson
import redis

from tests.integration.responses.conftest import last_chat_request
from tests.support.fake_backend import FakeBackend
from tests.support.redis_keys import drop_prefix

TURNS = 1000


def _messages_bytes(body: bytes) -> bytes:
    """The `messages` array of a backend request, as the bytes sent (statestore splices it in last)."""
    start = body.index(b',"messages":[')
    return body[start:]


def test_a_thousand_turn_chain_rebuilds_byte_identically(
    openai_client: openai.OpenAI, backend: FakeBackend, redis_url: str, responses_redis_prefix: str
) -> None:
    ids = []
    previous = None
    for turn in range(TURNS):
        response = openai_client.responses.create(
            model="echo-1", input=f'turn {turn} ✓ "quoted"', previous_response_id=previous
        )
        ids.append(response.id)
        previous = response.id
    head = ids[-1]
    cached = redis.Redis.from_url(redis_url)
    try:
        assert cached.exists(f"{responses_redis_prefix}{{resp:{head}}}:h")
        # only the chain's head is kept hot
        assert not cached.exists(f"{responses_redis_prefix}{{resp:{ids[-2]}}}:h")
    finally:
        cached.close()

    backend.reset()
    openai_client.responses.create(model="echo-1", input="next", previous_response_id=head)
    warm = last_chat_request(backend).body
    drop_prefix(redis_url, responses_redis_prefix)
    backend.reset()
    openai_client.responses.create(model="echo-1", input="next", previous_response_id=head)
    flushed = last_chat_request(backend).body
    assert _messages_bytes(warm) == _messages_bytes(flushed)

    expected = []
    for turn in range(TURNS):
        said = f'turn {turn} ✓ "quoted"'
        expected += [{"role": "user", "content": said}, {"role": "assistant", "content": f"echo: {said}"}]
    assert orjson.loads(warm)["messages"] == [*expected, {"role": "user", "content": "next"}]

    # branching from the middle of the chain rebuilds that prefix from the database
    backend.reset()
    openai_client.responses.create(model="echo-1", input="branch", previous_response_id=ids[499])
    assert orjson.loads(last_chat_request(backend).body)["messages"] == [
        *expected[:1000],
        {"role": "user", "content": "branch"},
    ]
