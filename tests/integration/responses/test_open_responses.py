"""The Open Responses compliance tests (`llm-comply`, pinned in pyproject.toml, with the specification of 2026-04-24
it bundles) run as a user runs them, from its command, against statestore in front of the fake backend's Chat
Completions endpoint, on both storage set-ups: every test that applies passes. And what the specification adds that
its tests do not reach: assistant `phase` and items of kinds statestore does not run, stored and returned as sent;
a response stored before the Response object was complete, served complete.

One does not apply: `reasoning-summary` asks for reasoning output with a summary, which a Chat Completions backend's
reply does not carry in a form statestore translates; the tester itself skips it for a model that is not a reasoning
model, and the suite's model (`echo-1`) is none."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from typing import Any

import httpx
import openai
import orjson
import pytest
from jsonschema import Draft202012Validator
from sqlalchemy import text
from sqlalchemy.ext.asyncio import create_async_engine
from sqlalchemy.pool import NullPool

from tests.integration.responses.conftest import chat_requests
from tests.support.fake_backend import FakeBackend
from tests.support.open_responses import response_problems
from tests.support.server import StatestoreServer

DOES_NOT_APPLY = {"reasoning-summary"}
# The tester's thirteen tests: a version that adds or drops one is looked at before it is pinned.
ALL_TESTS = {
    "basic-response",
    "system-prompt",
    "multi-turn",
    "tool-calling",
    "streaming-response",
    "streaming-usage",
    "image-input",
    "assistant-phase",
    "response-output-phase-schema",
    "compact-response",
    "compact-missing-model",
    "reasoning-summary",
    "error-handling",
}


def comply(server: StatestoreServer, api_key: str) -> dict[str, Any]:
    """`llm-comply --json` against the server's `/v1`, as its README runs it; its report."""
    command = [sys.executable, "-m", "llm_comply.cli", "run", "--base-url", server.url + "/v1"]
    ran = subprocess.run(
        [*command, "--api-key", api_key, "--model", "echo-1", "--json", "--timeout", "30"],
        capture_output=True,
        timeout=300,
        check=False,
    )
    report: dict[str, Any] = orjson.loads(ran.stdout)
    # Its exit status says whether any test failed; the report says which, and why.
    assert (ran.returncode == 0) == (report["summary"]["failed"] == 0), ran.stderr.decode()[-2000:]
    return report


@pytest.mark.parametrize("storage", ["responses_server", "responses_sqlite_server"])
def test_every_applicable_open_responses_compliance_test_passes(
    storage: str, request: pytest.FixtureRequest, api_key: str, backend: FakeBackend
) -> None:
    server: StatestoreServer = request.getfixturevalue(storage)
    report = comply(server, api_key)
    results = {result["id"]: result for result in report["results"]}
    assert results.keys() == ALL_TESTS
    problems = {
        name: result.get("errors", []) + result.get("warnings", [])
        for name, result in results.items()
        if name not in DOES_NOT_APPLY and (result["status"] != "passed" or result.get("warnings"))
    }
    assert not problems, problems
    assert {name for name, result in results.items() if result["status"] == "skipped"} == DOES_NOT_APPLY
    assert report["summary"] == {"total": 13, "passed": 12, "failed": 0, "skipped": 1}
    # The tests ran against the backend, not around it: each turn the tester made reached it as Chat Completions.
    chat = [r for r in backend.requests() if r.path == "/v1/chat/completions"]
    assert len(chat) >= 9


def _raw(server: StatestoreServer, api_key: str, path: str) -> Any:
    answer = httpx.get(server.url + path, headers={"authorization": f"Bearer {api_key}"}, timeout=30)
    assert answer.status_code == 200, answer.text
    return answer.json()


# Items of kinds statestore does not run, as a client that ran them (a shell, a patch) sends them back.
SHELL_CALL: Any = {
    "type": "shell_call",
    "call_id": "call_shell",
    "action": {"commands": ["ls"], "timeout_ms": 1000, "max_output_length": None},
    "status": "completed",
}
SHELL_OUTPUT: Any = {
    "type": "shell_call_output",
    "id": "sho_given",
    "call_id": "call_shell",
    "output": [{"stdout": "a.txt\n", "stderr": "", "outcome": {"type": "exit", "exit_code": 0}}],
}
PATCH_CALL: Any = {
    "type": "apply_patch_call",
    "call_id": "call_patch",
    "operation": {"type": "update_file", "path": "a.txt", "diff": "@@\n-a\n+b\n"},
    "status": "completed",
}


@pytest.mark.parametrize("storage", ["responses_server", "responses_sqlite_server"])
def test_phase_and_items_statestore_does_not_run_are_stored_and_returned_as_sent_and_never_sent_on(
    storage: str, request: pytest.FixtureRequest, api_key: str, backend: FakeBackend
) -> None:
    server: StatestoreServer = request.getfixturevalue(storage)
    commentary: Any = {
        "type": "message",
        "role": "assistant",
        "phase": "commentary",
        "content": [{"type": "output_text", "text": "Listing.", "annotations": []}],
    }
    with openai.OpenAI(base_url=server.url + "/v1", api_key=api_key, max_retries=0) as client:
        first = client.responses.create(
            model="echo-1",
            input=[{"role": "user", "content": "list the files"}, commentary, SHELL_CALL, SHELL_OUTPUT],
        )
        second = client.responses.create(model="echo-1", input="and now?", previous_response_id=first.id)
        conversation = client.conversations.create(items=[PATCH_CALL, {"role": "user", "content": "patched"}])
        client.responses.create(model="echo-1", input="go on", conversation=conversation.id)
    kept = _raw(server, api_key, f"/v1/responses/{first.id}/input_items?order=asc")["data"]
    assert kept[1]["phase"] == "commentary" and kept[1]["content"][0]["text"] == "Listing."
    assert kept[2] == {**SHELL_CALL, "id": kept[2]["id"]} and kept[2]["id"].startswith("item_")
    assert kept[3] == SHELL_OUTPUT  # its own id kept
    page = _raw(server, api_key, f"/v1/conversations/{conversation.id}/items?order=asc")
    items = page["data"]
    assert items[0] == {**PATCH_CALL, "id": items[0]["id"]}
    # statestore's own OpenAPI document describes them as it returns them
    document = httpx.get(server.url + "/openapi.json").json()
    item_list = Draft202012Validator({"$ref": "#/components/schemas/ItemList", "components": document["components"]})
    for listed in (page, _raw(server, api_key, f"/v1/responses/{first.id}/input_items")):
        assert not [error.message for error in item_list.iter_errors(listed)]
    # The backend saw the messages of the context, and nothing of the items it has no form for.
    sent = [r["messages"] for r in chat_requests(backend)]
    assert sent[1] == [
        {"role": "user", "content": "list the files"},
        {"role": "assistant", "content": "Listing."},
        {"role": "assistant", "content": "echo: list the files"},
        {"role": "user", "content": "and now?"},
    ]
    assert sent[2] == [
        {"role": "user", "content": "patched"},
        {"role": "user", "content": "go on"},
    ]
    assert second.status == "completed"


def test_a_response_stored_before_the_object_was_complete_is_served_complete(
    responses_server: StatestoreServer, responses_pg_url: str, openai_client: openai.OpenAI, api_key: str
) -> None:
    made = openai_client.responses.create(model="echo-1", input="long ago", temperature=0.4)
    whole = _raw(responses_server, api_key, f"/v1/responses/{made.id}")
    assert not response_problems(whole) and whole["temperature"] == 0.4
    # The row as the version before stored it: no completed_at, sampling fields null unless sent, fewer fields.
    earlier = {k: v for k, v in whole.items() if k not in GAINED} | {"top_p": None}
    asyncio.run(_store_body(responses_pg_url, made.id, orjson.dumps(earlier)))
    served = _raw(responses_server, api_key, f"/v1/responses/{made.id}")
    assert not response_problems(served)
    assert served == whole | {"completed_at": whole["created_at"]}  # when it completed was not kept


GAINED = (
    "completed_at",
    "presence_penalty",
    "frequency_penalty",
    "top_logprobs",
    "max_tool_calls",
    "service_tier",
    "safety_identifier",
    "prompt_cache_key",
)


async def _store_body(url: str, response_id: str, body: bytes) -> None:
    engine = create_async_engine(url, poolclass=NullPool)
    try:
        async with engine.begin() as conn:
            changed = await conn.execute(
                text("UPDATE responses SET body = :body WHERE id = :id"), {"body": body, "id": response_id}
            )
            assert changed.rowcount == 1
    finally:
        await engine.dispose()
