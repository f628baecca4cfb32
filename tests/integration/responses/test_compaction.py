"""Compaction on the Responses door (docs/responses.md, "Compaction"), on real processes through the `openai` SDK: a
long chain compacted past its threshold against a backend with a small window, `responses.compact` and a stateless
client continuing from its output, sealed `encrypted_content` (tampered, another owner's, rotated keys), and a
streamed compaction assembled by the SDK as the JSON call returns it."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import orjson
import pytest

from statestore.core.planner import DEFAULT_SUMMARY_INSTRUCTIONS, SUMMARY_PREFIX
from statestore.sealing import new_key_text
from tests.integration.responses.conftest import Rows, chat_requests, other_key
from tests.support.fake_backend import FakeBackend
from tests.support.server import StatestoreServer

# The default summary instructions end every summary request: the fake backend tells them apart by this.
MARKER = DEFAULT_SUMMARY_INSTRUCTIONS[:40]
WINDOW = 800  # the backend's window, in its tokens (a token per four bytes)
THRESHOLD = 600  # compaction's, below it


def _compaction(threshold: int = THRESHOLD) -> Any:
    return [{"type": "compaction", "compact_threshold": threshold}]


def _is_summary(request: dict[str, Any]) -> bool:
    return MARKER in str(request["messages"][-1]["content"])


def _item(item: Any) -> dict[str, Any]:
    """An output item as a client sends it back."""
    # The SDK types compact's output as output items: its user messages hold input_text (as OpenAI's do).
    dumped: dict[str, Any] = item.model_dump(exclude_none=True, warnings=False)
    return dumped


def test_a_long_chain_compacts_past_its_threshold_and_never_fails(
    openai_client: openai.OpenAI, backend: FakeBackend
) -> None:
    backend.watch_context(window=WINDOW, summary_marker=MARKER, record_bodies=True)
    previous: str | None = None
    compacted: list[int] = []
    ids: list[str] = []
    for turn in range(300):
        raw = openai_client.responses.with_raw_response.create(
            model="echo-1",
            input=f"turn {turn}: tell me more",
            previous_response_id=previous,
            context_management=_compaction(),
        )
        response: Any = raw.parse()  # the SDK's output items are a wide union
        previous = response.id
        ids.append(previous)
        kinds = [item.type for item in response.output]
        if kinds[0] == "compaction":
            compacted.append(turn)
            assert raw.headers["statestore-context"] == "compacted"
            assert kinds == ["compaction", "message"]
            item = response.output[0]
            assert item.id.startswith("cmp_") and item.created_by == "statestore"
            assert "Summarise" not in item.encrypted_content and "echo" not in item.encrypted_content
        else:
            assert kinds == ["message"] and "statestore-context" not in raw.headers
        assert response.output[-1].content[0].text == f"echo: turn {turn}: tell me more"
    log = backend.context_log()
    assert all(t["status"] == 200 for t in log["turns"]), "a turn went over the backend's window"
    assert len(log["turns"]) == 300 and log["summaries"] == len(compacted)
    assert len(compacted) >= 10, compacted
    # Between two compactions every turn's request extends the one before it, byte for byte (the prompt cache's).
    for turn, logged in enumerate(log["turns"][1:], start=1):
        assert logged["extends_previous"] == (turn not in compacted), turn

    sent = [r for r in chat_requests(backend) if not _is_summary(r)]
    for turn in compacted:
        messages = sent[turn]["messages"]
        # The user messages that fit, then the summary, then the turn's input; no assistant message is left.
        assert messages[-1] == {"role": "user", "content": f"turn {turn}: tell me more"}
        assert messages[-2]["role"] == "user" and messages[-2]["content"].startswith(SUMMARY_PREFIX)
        users = messages[:-2]
        assert users and all(m["role"] == "user" and m["content"].startswith("turn ") for m in users)
        assert users[-1]["content"] == f"turn {turn - 1}: tell me more"
    # The summary request summarised what the turn before sent and answered (its summary included, if any).
    summaries = [r for r in chat_requests(backend) if _is_summary(r)]
    second = summaries[1]["messages"]
    assert any(str(m["content"]).startswith(SUMMARY_PREFIX) for m in second[:-1])

    # A compacted response reads back as it was returned; a branch from before the last compaction still works.
    stored = openai_client.responses.retrieve(ids[compacted[-1]])
    assert stored.output[0].type == "compaction"
    branch = ids[compacted[-1] - 1]
    openai_client.responses.create(
        model="echo-1", input="a branch", previous_response_id=branch, context_management=_compaction()
    )
    assert backend.context_log()["turns"][-1]["status"] == 200


def test_a_failed_summary_truncates_and_says_so(openai_client: openai.OpenAI, backend: FakeBackend) -> None:
    backend.watch_context(window=None, summary_marker=MARKER, fail_summaries=True)
    previous: str | None = None
    for turn in range(40):
        raw = openai_client.responses.with_raw_response.create(
            model="echo-1",
            input=f"turn {turn}: " + "x" * 200,
            previous_response_id=previous,
            context_management=_compaction(),
        )
        previous = raw.parse().id
        if raw.headers.get("statestore-context"):
            assert raw.headers["statestore-context"] == "truncated"
            assert raw.headers["statestore-context-fallback"] == "summary_failed"
            assert [item.type for item in raw.parse().output] == ["message"]
            break
    else:
        pytest.fail("no turn passed the threshold")
    assert backend.context_log()["summaries"] == 1


def test_compact_then_continue_with_no_state(openai_client: openai.OpenAI, backend: FakeBackend, rows: Rows) -> None:
    previous: str | None = None
    for turn in range(3):
        previous = openai_client.responses.create(
            model="echo-1", input=f"question {turn}", previous_response_id=previous
        ).id
    api_key = openai_client.api_key
    before = asyncio.run(rows.counts(api_key))
    compacted: Any = openai_client.responses.compact(
        model="echo-1", previous_response_id=previous, input="and one more"
    )
    assert compacted.object == "response.compaction" and compacted.usage.total_tokens > 0
    kinds = [item.type for item in compacted.output]
    assert kinds == ["message"] * 4 + ["compaction"]
    assert [item.content[0].text for item in compacted.output[:4]] == [
        "question 0",
        "question 1",
        "question 2",
        "and one more",
    ]
    assert asyncio.run(rows.counts(api_key)) == before, "compact stores nothing"
    summary_request = chat_requests(backend)[-1]
    assert _is_summary(summary_request) and summary_request["messages"][0]["content"] == "question 0"

    sent_back: Any = [*(_item(item) for item in compacted.output), {"role": "user", "content": "go on"}]
    continued: Any = openai_client.responses.create(
        model="echo-1",
        input=sent_back,
        store=False,
    )
    assert continued.output[-1].content[0].text == "echo: go on"
    messages = chat_requests(backend)[-1]["messages"]
    assert [m["content"] for m in messages[:4]] == ["question 0", "question 1", "question 2", "and one more"]
    assert messages[4]["role"] == "user" and messages[4]["content"].startswith(SUMMARY_PREFIX + "echo: ")
    assert messages[5] == {"role": "user", "content": "go on"}


def _sealed(client: openai.OpenAI) -> Any:
    compacted = client.responses.compact(model="echo-1", input="remember the number 42")
    return _item(compacted.output[-1])


def _refused(client: openai.OpenAI, item: Any) -> openai.BadRequestError:
    sent: Any = [item, {"role": "user", "content": "what number?"}]
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(model="echo-1", input=sent, store=False)
    return refused.value


def test_a_tampered_or_foreign_compaction_item_is_a_400_naming_the_input(
    openai_client: openai.OpenAI, responses_server: StatestoreServer, backend: FakeBackend
) -> None:
    item = _sealed(openai_client)
    sealed = item["encrypted_content"]
    cut = len(sealed) // 2
    flipped = sealed[:cut] + ("A" if sealed[cut] != "A" else "B") + sealed[cut + 1 :]
    for value in (flipped, sealed[:-4], sealed + "A", "k9." + sealed.partition(".")[2], "plain text"):
        error = _refused(openai_client, {**item, "encrypted_content": value})
        assert error.status_code == 400
        assert error.body["param"] == "input" and error.body["code"] == "invalid_encrypted_content"  # type: ignore[index]
    with openai.OpenAI(base_url=responses_server.url + "/v1", api_key=other_key(), max_retries=0) as other:
        assert _refused(other, item).body["param"] == "input"  # type: ignore[index]
    # Its owner's own value opens (and no refused request reached the backend).
    requests = len(chat_requests(backend))
    sent: Any = [item, {"role": "user", "content": "what number?"}]
    openai_client.responses.create(model="echo-1", input=sent, store=False)
    assert len(chat_requests(backend)) == requests + 1


def test_a_streamed_compaction_assembles_as_the_json_one(openai_client: openai.OpenAI, backend: FakeBackend) -> None:
    """Two identical chains; the second turn of each passes a low threshold: one as JSON, one streamed."""
    finals: list[Any] = []
    for streamed in (False, True):
        first = openai_client.responses.create(model="echo-1", input="first " + "y" * 400)
        fields: Any = {
            "model": "echo-1",
            "input": "second",
            "previous_response_id": first.id,
            "context_management": _compaction(50),
        }
        if not streamed:
            finals.append(openai_client.responses.create(**fields))
            continue
        with openai_client.responses.stream(**fields) as stream:
            events = [event.type for event in stream]
            finals.append(stream.get_final_response())
        assert events[:5] == [
            "response.created",
            "response.in_progress",
            "response.output_item.added",
            "response.compaction.compacting",
            "response.output_item.done",
        ]
        assert events[-1] == "response.completed"
    plain, streamed_final = finals

    def shape(response: Any) -> Any:
        dumped = response.model_dump()
        for item in dumped["output"]:
            item.pop("id")
            item.pop("encrypted_content", None)
            for part in item.get("content") or ():
                part.pop("parsed", None)  # the stream's ParsedResponse adds it
        return [dumped["status"], dumped["output"]]

    assert shape(plain) == shape(streamed_final)
    assert [item.type for item in streamed_final.output] == ["compaction", "message"]
    assert streamed_final.output[0].encrypted_content and streamed_final.output[0].created_by == "statestore"
    assert openai_client.responses.retrieve(streamed_final.id).output[0].id == streamed_final.output[0].id


@pytest.fixture(scope="module")
def ring() -> dict[str, str]:
    return {"k1": new_key_text(), "k2": new_key_text()}


def _keyed(
    keys: str, responses_pg_url: str, redis_url: str, responses_redis_prefix: str, backend: FakeBackend
) -> StatestoreServer:
    return StatestoreServer(
        database_url=responses_pg_url,
        upstream_url=backend.url,
        redis_url=redis_url,
        redis_prefix=responses_redis_prefix,
        env={"STATESTORE_CHAT_UPSTREAM_URL": backend.url, "STATESTORE_COMPACTION_KEYS": keys},
    )


@pytest.fixture(scope="module")
def rotation_servers(
    ring: dict[str, str],
    responses_pg_url: str,
    redis_url: str,
    responses_redis_prefix: str,
    fake_backend_process: FakeBackend,
) -> Iterator[dict[str, StatestoreServer]]:
    """Before the rotation (k1), after it (k2 seals, k1 still opens), and after k1 is retired (k2 only)."""
    spelled = {name: f"{name}:{key}" for name, key in ring.items()}
    servers = {
        "before": _keyed(spelled["k1"], responses_pg_url, redis_url, responses_redis_prefix, fake_backend_process),
        "after": _keyed(
            f"{spelled['k2']},{spelled['k1']}",
            responses_pg_url,
            redis_url,
            responses_redis_prefix,
            fake_backend_process,
        ),
        "retired": _keyed(spelled["k2"], responses_pg_url, redis_url, responses_redis_prefix, fake_backend_process),
    }
    yield servers
    for server in servers.values():
        server.stop()


def test_keys_rotate_a_value_sealed_under_the_older_key_still_opens(
    rotation_servers: dict[str, StatestoreServer], api_key: str, backend: FakeBackend
) -> None:
    def client(name: str) -> openai.OpenAI:
        return openai.OpenAI(base_url=rotation_servers[name].url + "/v1", api_key=api_key, max_retries=0)

    with client("before") as before, client("after") as after, client("retired") as retired:
        old = _sealed(before)
        assert old["encrypted_content"].startswith("k1.")
        new = _sealed(after)
        assert new["encrypted_content"].startswith("k2.")
        for item in (old, new):
            sent: Any = [item, {"role": "user", "content": "go on"}]
            after.responses.create(model="echo-1", input=sent, store=False)
            assert chat_requests(backend)[-1]["messages"][0]["content"].startswith(SUMMARY_PREFIX)
        assert _refused(retired, old).body["code"] == "invalid_encrypted_content"  # type: ignore[index]
        assert _refused(before, new).status_code == 400


def test_the_openapi_document_has_compaction(responses_server: StatestoreServer) -> None:
    document = httpx.get(responses_server.url + "/openapi.json", timeout=10).json()
    assert "post" in document["paths"]["/v1/responses/compact"]
    schemas = document["components"]["schemas"]
    assert "context_management" in schemas["ResponseCreateRequest"]["properties"]
    assert {"CompactedResponse", "CompactionItem", "ResponseCompactRequest"} <= set(schemas)
    assert "response.compaction.compacting" in orjson.dumps(schemas["ResponseStreamEvent"]).decode()


def test_compaction_is_refused_on_a_conversation(openai_client: openai.OpenAI) -> None:
    conversation = openai_client.conversations.create()
    with pytest.raises(openai.BadRequestError) as refused:
        openai_client.responses.create(
            model="echo-1", input="hi", conversation=conversation.id, context_management=_compaction()
        )
    assert refused.value.body["param"] == "context_management"  # type: ignore[index]
