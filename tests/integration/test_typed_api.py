"""The typed API: every response of the thread API (/statestore/v1) and the admin API (/admin/v1), as a live server
sends it, validates against the schema the same server publishes at /openapi.json; so does every request the `openai`
SDK sends to the Responses and Conversations routes (/v1/responses, /v1/conversations), and every response and
stream event it receives, whose Response objects (and compactions, and the events the specification defines) also
validate against the Open Responses specification's document; /docs works with no network; passthrough mode warns
when tenants, keys or tenant policies are created (API and CLI)."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from typing import Any

import httpx
import httpx2
import openai
import pytest
from jsonschema import Draft202012Validator

from tests.integration.responses.conftest import WEATHER
from tests.support.admin_api import (
    ADMIN_TOKENS,
    UPSTREAM_KEY,
    AdminApi,
    Api,
    cli,
    cli_env,
    cli_json,
    created,
    policy,
    start_server,
    unique,
)
from tests.support.fake_backend import FakeBackend, chat_action, error_action
from tests.support.open_responses import event_problems, problems, response_problems
from tests.support.server import StatestoreServer

TYPED_PREFIXES = ("/statestore/v1/", "/admin/v1/")
OPENAI_PREFIXES = ("/v1/responses", "/v1/conversations")


def _server(db: str, backend: FakeBackend, redis_url: str, prefix: str, **env: str) -> StatestoreServer:
    return start_server(db, backend.url, redis_url, prefix, {"STATESTORE_ADMIN_TOKENS": ADMIN_TOKENS, **env})


@pytest.fixture(scope="module")
def keys_server(
    module_db: str, redis_url: str, module_prefix: str, fake_backend_process: FakeBackend
) -> Iterator[StatestoreServer]:
    server = _server(
        module_db,
        fake_backend_process,
        redis_url,
        module_prefix,
        STATESTORE_AUTH_MODE="keys",
        STATESTORE_UPSTREAM_API_KEY=UPSTREAM_KEY,
        STATESTORE_KEY_CACHE_SECONDS="0",
        STATESTORE_POLICY_CACHE_SECONDS="0",
        STATESTORE_CHAT_UPSTREAM_URL=fake_backend_process.url,
    )
    yield server
    server.stop()


@pytest.fixture(scope="module")
def passthrough_server(
    module_db: str, redis_url: str, module_prefix: str, fake_backend_process: FakeBackend
) -> Iterator[StatestoreServer]:
    server = _server(module_db, fake_backend_process, redis_url, module_prefix)
    yield server
    server.stop()


class Checked:
    """Requests whose responses are validated against the served OpenAPI document, by route template."""

    def __init__(self, base_url: str, spec: dict[str, Any]) -> None:
        self.base_url = base_url
        self.spec = spec
        self.seen: set[tuple[str, str, int]] = set()

    def call(
        self, method: str, template: str, headers: dict[str, str], *, json: Any = None, **path: str
    ) -> httpx.Response:
        url = self.base_url + template.format(**path)
        response = httpx.request(method, url, headers=headers, json=json, timeout=30)
        operation = self.spec["paths"][template][method.lower()]
        documented = operation["responses"].get(str(response.status_code))
        assert documented is not None, f"{method} {template}: {response.status_code} is not documented"
        schema = documented["content"]["application/json"]["schema"]
        errors = sorted(
            Draft202012Validator({**schema, "components": self.spec["components"]}).iter_errors(response.json()),
            key=str,
        )
        assert not errors, f"{method} {template} {response.status_code}: {[e.message for e in errors[:5]]}"
        self.seen.add((method, template, response.status_code))
        return response


def test_every_operation_documents_its_success_response() -> None:
    from statestore.app import create_app
    from statestore.config import Settings

    spec = create_app(Settings(owner_secret="schema-only-secret-0123456789")).openapi()
    operations = [
        (path, method, operation)
        for path, item in spec["paths"].items()
        if path.startswith(TYPED_PREFIXES)
        for method, operation in item.items()
    ]
    assert len(operations) >= 20
    for path, method, operation in operations:
        success = next(status for status in operation["responses"] if status.startswith("2"))
        schema = operation["responses"][success]["content"]["application/json"]["schema"]
        assert "$ref" in schema, f"{method.upper()} {path}: {success} has no response model ({schema})"
        assert "404" in operation["responses"] and "400" in operation["responses"]


def test_live_responses_match_the_published_schema(keys_server: StatestoreServer) -> None:
    spec = httpx.get(keys_server.url + "/openapi.json").json()
    stats_fields = spec["components"]["schemas"]["Stats"]["properties"]
    assert stats_fields["purger_last_run_ms"]["deprecated"] is True
    assert "deprecated" not in stats_fields["purger_last_run_at"]
    checked = Checked(keys_server.url, spec)
    admin = {"authorization": f"Bearer {ADMIN_TOKENS.split(',')[0].split(':')[1]}"}

    tenant = checked.call("POST", "/admin/v1/tenants", admin, json={"name": unique("typed")}).json()
    assert "warning" not in tenant  # keys mode: tenants work
    checked.call("GET", "/admin/v1/tenants", admin)
    checked.call("GET", "/admin/v1/tenants/{tenant}", admin, tenant=tenant["id"])
    checked.call("GET", "/admin/v1/tenants/{tenant}", admin, tenant="no-such-tenant")
    checked.call("POST", "/admin/v1/tenants/{tenant}/disable", admin, tenant=tenant["id"])
    checked.call("POST", "/admin/v1/tenants/{tenant}/enable", admin, tenant=tenant["id"])
    key = checked.call("POST", "/admin/v1/tenants/{tenant}/keys", admin, json={"label": "t"}, tenant=tenant["id"])
    secret = key.json()["secret"]
    checked.call("GET", "/admin/v1/tenants/{tenant}/keys", admin, tenant=tenant["id"])
    checked.call("PUT", "/admin/v1/policies/{scope}", admin, json=policy(), scope=tenant["id"])
    checked.call("PUT", "/admin/v1/policies/{scope}", admin, json={"threads_enabled": "no"}, scope=tenant["id"])
    checked.call("GET", "/admin/v1/policies/{scope}", admin, scope=tenant["id"])
    checked.call("DELETE", "/admin/v1/policies/{scope}", admin, scope=tenant["id"])
    checked.call("GET", "/admin/v1/audit", admin)
    stats = checked.call("GET", "/admin/v1/stats", admin).json()
    assert {"purger_last_run_at", "expired_responses_awaiting_purge"} <= stats.keys()
    purged = checked.call("POST", "/admin/v1/purge", admin).json()
    assert purged.keys() == {"purged_threads", "purged_responses", "purged_conversations"}
    # A purge an admin runs is the purger's last run: given as a time, and (deprecated) as epoch milliseconds.
    last_run = checked.call("GET", "/admin/v1/stats", admin).json()
    assert last_run["purger_last_run_at"] is not None and last_run["purger_last_run_ms"] > 0
    usage = checked.call("GET", "/admin/v1/usage", admin).json()["data"]
    assert usage[-1]["doors"].keys() == {"messages", "responses"}
    erasure = checked.call("POST", "/admin/v1/erase", admin, json={"user_id": unique("nobody")}).json()
    checked.call("GET", "/admin/v1/erasures/{erasure_id}", admin, erasure_id=erasure["id"])
    checked.call("GET", "/admin/v1/erasures/{erasure_id}", admin, erasure_id="erasure_nope")
    checked.call("GET", "/admin/v1/stats", {})

    owner = {"x-api-key": secret}
    with Api(keys_server.url, secret) as api:
        session = unique("typed-session")
        thread_id, _ = created(api.create("typed", session=session))
    checked.call("GET", "/statestore/v1/threads", owner)
    checked.call("GET", "/statestore/v1/threads/{thread_id}", owner, thread_id=thread_id)
    checked.call("GET", "/statestore/v1/threads/{thread_id}/messages", owner, thread_id=thread_id)
    checked.call("GET", "/statestore/v1/sessions/{session_id}", owner, session_id=session)
    checked.call("GET", "/statestore/v1/threads", owner | {"x-api-key": "ssk_unknown"})
    checked.call("DELETE", "/statestore/v1/threads/{thread_id}", owner, thread_id=thread_id)
    checked.call("GET", "/statestore/v1/threads/{thread_id}", owner, thread_id=thread_id)
    checked.call("DELETE", "/admin/v1/keys/{key_id}", admin, key_id=key.json()["id"])

    statuses = {status for _, _, status in checked.seen}
    assert {200, 201, 400, 401, 404} <= statuses


# -- the Responses and Conversations routes ---------------------------------------------------------------------------


def _validator(spec: dict[str, Any], schema: dict[str, Any]) -> Draft202012Validator:
    return Draft202012Validator({**schema, "components": spec["components"]})


def _problems(spec: dict[str, Any], schema: dict[str, Any], value: Any) -> list[str]:
    return sorted(error.message for error in _validator(spec, schema).iter_errors(value))


def _template(spec: dict[str, Any], path: str) -> str:
    if path in spec["paths"]:
        return path  # a literal route (/v1/responses/compact) before the templates it also matches
    for template in spec["paths"]:
        if template.startswith(OPENAI_PREFIXES) and re.fullmatch(re.sub(r"\{[^}]+\}", "[^/]+", template), path):
            return str(template)
    raise AssertionError(f"{path} matches no documented route")


def _sse_data(body: str) -> list[Any]:
    return [json.loads(line[len("data: ") :]) for line in body.splitlines() if line.startswith("data: ")]


def test_every_responses_and_conversations_operation_documents_its_bodies() -> None:
    from statestore.app import create_app
    from statestore.config import Settings

    spec = create_app(Settings(owner_secret="schema-only-secret-0123456789")).openapi()
    components = spec["components"]["schemas"]
    operations = [
        (method.upper(), path, operation)
        for path, item in spec["paths"].items()
        if path.startswith(OPENAI_PREFIXES)
        for method, operation in item.items()
    ]
    # with POST /v1/responses/compact, /v1/responses/input_tokens and /v1/responses/{response_id}/cancel
    assert len(operations) == 15
    for method, path, operation in operations:
        schema = operation["responses"]["200"]["content"]["application/json"]["schema"]
        assert schema["$ref"].startswith("#/components/schemas/"), f"{method} {path}: no 200 model ({schema})"
        assert schema["$ref"].rsplit("/", 1)[1] in components
        for status in ("400", "404", "default"):
            error = operation["responses"][status]["content"]["application/json"]["schema"]
            assert error == {"$ref": "#/components/schemas/OpenAIError"}, (method, path, status)
        assert "422" not in operation["responses"], f"{method} {path}: statestore never answers FastAPI's 422"
        if method == "POST" and not path.endswith("/cancel"):
            body = operation["requestBody"]["content"]["application/json"]["schema"]
            assert body["$ref"].rsplit("/", 1)[1] in components, f"{method} {path}: {body}"
        else:
            assert "requestBody" not in operation
    streamed = spec["paths"]["/v1/responses"]["post"]["responses"]["200"]["content"]["text/event-stream"]
    assert streamed["schema"] == {"$ref": "#/components/schemas/ResponseStreamEvent"}
    listed = {p["name"] for p in spec["paths"]["/v1/conversations/{conversation_id}/items"]["get"]["parameters"]}
    assert listed == {"conversation_id", "order", "after", "limit"}
    # Every reference in the document resolves.
    for ref in set(re.findall(r'"\$ref": "#/components/schemas/([^"]+)"', json.dumps(spec))):
        assert ref in components, ref


def test_what_the_openai_sdk_sends_and_receives_matches_the_published_schema(
    keys_server: StatestoreServer, backend: FakeBackend
) -> None:
    spec = httpx.get(keys_server.url + "/openapi.json").json()
    exchanges: list[httpx2.Response] = []

    def keep(response: httpx2.Response) -> None:
        response.read()
        exchanges.append(response)

    with AdminApi(keys_server.url) as admin:
        _, secret = admin.tenant_with_key()
    with (
        httpx2.Client(event_hooks={"response": [keep]}, timeout=30) as http,
        openai.OpenAI(base_url=keys_server.url + "/v1", api_key=secret, http_client=http, max_retries=0) as client,
    ):
        first = client.responses.create(
            model="echo-1",
            input="hello",
            instructions="Be brief.",
            metadata={"user_id": "typed-user"},
            temperature=0.5,
            top_p=0.9,
            max_output_tokens=100,
            truncation="auto",
        )
        called = client.responses.create(
            model="echo-1", input="please call get_weather", tools=[WEATHER], previous_response_id=first.id
        )
        call = called.output[-1]
        assert call.type == "function_call"
        answered = client.responses.create(
            model="echo-1",
            previous_response_id=called.id,
            input=[
                {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"},
                {
                    "role": "user",
                    "content": [
                        {"type": "input_text", "text": "and this?"},
                        {"type": "input_image", "image_url": "https://example.com/a.png", "detail": "low"},
                    ],
                },
            ],
            tools=[WEATHER],
            tool_choice={"type": "function", "name": "get_weather"},
            parallel_tool_calls=False,
            text={"format": {"type": "json_schema", "name": "reply", "schema": {"type": "object"}, "strict": True}},
        )
        with client.responses.stream(model="echo-1", input="stream me", previous_response_id=answered.id) as stream:
            streamed = stream.get_final_response()
        backend.script(chat_action({"role": "assistant", "content": "cut"}, finish_reason="length"))
        cut = client.responses.create(model="echo-1", input="long", previous_response_id=streamed.id, store=True)
        assert cut.status == "incomplete"
        client.responses.create(model="echo-1", input="unstored", store=False)
        # Compaction: a turn past a low threshold opens its output with a compaction item; compact's output is sent
        # back by a client holding no state.
        compacting = client.responses.create(
            model="echo-1",
            input="compact now",
            previous_response_id=answered.id,
            context_management=[{"type": "compaction", "compact_threshold": 10}],
        )
        assert compacting.output[0].type == "compaction"
        compacted = client.responses.compact(model="echo-1", previous_response_id=answered.id, input="and this")
        resent_compacted: Any = [item.model_dump(exclude_none=True, warnings=False) for item in compacted.output]
        client.responses.create(
            model="echo-1", input=[*resent_compacted, {"role": "user", "content": "on"}], store=False
        )
        # Background: created queued, streamed again from the start, cancelled once finished (returned as it is).
        queued = client.responses.create(model="echo-1", input="later", background=True)
        assert queued.status == "queued"
        assert [event.type for event in client.responses.retrieve(queued.id, stream=True)][-1] == "response.completed"
        assert client.responses.cancel(queued.id).status == "completed"
        # ... read while it runs, then cancelled; and one its backend fails.
        backend.script(chat_action({"role": "assistant", "content": "slow"}, delay_seconds=5))
        slow = client.responses.create(model="echo-1", input="slowly", background=True)
        assert _polled(client, slow.id, until={"in_progress"}).status == "in_progress"
        assert client.responses.cancel(slow.id).status == "cancelled"
        backend.script({**error_action(500, "server_error", "the model broke"), "path": "/v1/chat/completions"})
        failing = client.responses.create(model="echo-1", input="fail", background=True)
        assert _polled(client, failing.id, until={"failed"}).status == "failed"
        assert client.responses.retrieve(answered.id).id == answered.id
        counted = client.responses.input_tokens.count(
            model="echo-1", input="how long?", previous_response_id=answered.id, tools=[WEATHER], truncation="auto"
        )
        assert counted.input_tokens > 0
        client.responses.input_items.list(answered.id)
        client.responses.input_items.list(answered.id, order="asc", limit=1)

        conversation = client.conversations.create(
            items=[{"type": "message", "role": "user", "content": "hi"}], metadata={"topic": "typed"}
        )
        client.responses.create(model="echo-1", input="in the conversation", conversation=conversation.id)
        client.conversations.retrieve(conversation.id)
        client.conversations.update(conversation.id, metadata={"topic": "renamed"})
        resent: Any = [
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "noted"}]},
            {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "call_1", "output": "rain"},
        ]
        added = client.conversations.items.create(conversation.id, items=resent)
        listed = client.conversations.items.list(conversation.id, order="asc")
        assert len(listed.data) == 6
        client.conversations.items.retrieve(str(added.data[0].id), conversation_id=conversation.id)
        client.conversations.items.delete(str(added.data[1].id), conversation_id=conversation.id)

        with pytest.raises(openai.BadRequestError):
            client.responses.create(model="echo-1", input="x", previous_response_id="resp_unknown0000000000000000")
        with pytest.raises(openai.NotFoundError):
            client.conversations.retrieve("conv_unknown0000000000000000")
        client.responses.delete(cut.id)
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(cut.id)
        client.conversations.delete(conversation.id)
    with (
        httpx2.Client(event_hooks={"response": [keep]}, timeout=30) as http,
        openai.OpenAI(base_url=keys_server.url + "/v1", api_key="ssk_unknown", http_client=http, max_retries=0) as bad,
        pytest.raises(openai.AuthenticationError),
    ):
        bad.responses.retrieve(first.id)

    seen: set[tuple[str, str, int]] = set()
    events = 0
    specified: set[tuple[str, str, str]] = set()  # (method, route, Response status) checked against the specification
    for exchange in exchanges:
        request = exchange.request
        template = _template(spec, request.url.path)
        operation = spec["paths"][template][request.method.lower()]
        where = f"{request.method} {template} {exchange.status_code}"
        if request.content:
            body_schema = operation["requestBody"]["content"]["application/json"]["schema"]
            assert not _problems(spec, body_schema, json.loads(request.content)), where
        documented = operation["responses"].get(str(exchange.status_code), operation["responses"]["default"])
        media = exchange.headers["content-type"].split(";")[0]
        schema = documented["content"][media]["schema"]
        values = _sse_data(exchange.text) if media == "text/event-stream" else [exchange.json()]
        events += len(values) if media == "text/event-stream" else 0
        for value in values:
            found = _problems(spec, schema, value)
            assert not found, f"{where}: {found[:5]} in {value}"
            if media == "text/event-stream":
                assert not event_problems(value), f"{where}: {event_problems(value)[:5]} in {value}"
                response = value.get("response")
            else:
                response = value if value.get("object") == "response" else None
                if value.get("object") == "response.compaction":
                    assert not problems(value, "CompactResource"), f"{where}: {problems(value, 'CompactResource')}"
                    specified.add((request.method, template, "compaction"))
            if response is not None:
                assert not response_problems(response), f"{where}: {response_problems(response)[:5]} in {response}"
                specified.add((request.method, template, response["status"]))
        seen.add((request.method, template, exchange.status_code))

    documented_operations = {
        (method.upper(), path)
        for path, item in spec["paths"].items()
        if path.startswith(OPENAI_PREFIXES)
        for method in item
    }
    assert {(method, path) for method, path, status in seen if status == 200} == documented_operations
    assert {400, 401, 404} <= {status for _, _, status in seen}
    assert events >= 8
    # Every route that returns a Response, and every status a Response takes, was checked against the specification.
    assert {
        ("POST", "/v1/responses", "completed"),
        ("POST", "/v1/responses", "incomplete"),
        ("POST", "/v1/responses", "in_progress"),  # a stream's response.created and response.in_progress
        ("POST", "/v1/responses", "queued"),
        ("POST", "/v1/responses/compact", "compaction"),
        ("GET", "/v1/responses/{response_id}", "completed"),
        ("GET", "/v1/responses/{response_id}", "queued"),
        ("GET", "/v1/responses/{response_id}", "in_progress"),
        ("GET", "/v1/responses/{response_id}", "failed"),
        ("POST", "/v1/responses/{response_id}/cancel", "completed"),
        ("POST", "/v1/responses/{response_id}/cancel", "cancelled"),
    } <= specified, specified

    # The schemas are not vacuous: what the server refuses, they refuse too.
    response_schema = {"$ref": "#/components/schemas/Response"}
    whole = exchanges[0].json()
    assert whole["id"] == first.id
    assert not _problems(spec, response_schema, whole)
    assert _problems(spec, response_schema, {k: v for k, v in whole.items() if k != "usage"})
    assert _problems(spec, response_schema, {**whole, "status": "waiting"})
    request_schema = spec["paths"]["/v1/responses"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    for refused in ({"model": "echo-1", "input": "x", "colour": "blue"}, {"model": "echo-1"}):
        assert _problems(spec, request_schema, refused)
        sent = httpx.post(
            keys_server.url + "/v1/responses", json=refused, headers={"authorization": f"Bearer {secret}"}
        )
        assert sent.status_code == 400, sent.text


def _polled(client: openai.OpenAI, response_id: str, *, until: set[str]) -> Any:
    """The background response, read until its status is one of `until` (10 seconds at most)."""
    deadline = time.monotonic() + 10
    while True:
        response = client.responses.retrieve(response_id)
        if response.status in until or time.monotonic() > deadline:
            return response
        time.sleep(0.05)


def test_docs_work_offline(keys_server: StatestoreServer) -> None:
    page = httpx.get(keys_server.url + "/docs")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    # Every script and stylesheet comes from statestore itself.
    assets = re.findall(r"""(?:src|href)=["']([^"']+)["']""", page.text)
    assert assets and all(asset.startswith("/") for asset in assets), assets
    assert "'/openapi.json'" in page.text or '"/openapi.json"' in page.text
    for asset in assets:
        fetched = httpx.get(keys_server.url + asset)
        assert fetched.status_code == 200 and len(fetched.content) > 100, asset
    bundle = next(asset for asset in assets if asset.endswith("swagger-ui-bundle.js"))
    assert len(httpx.get(keys_server.url + bundle).content) > 500_000


def test_passthrough_mode_warns_when_tenants_keys_or_tenant_policies_are_created(
    passthrough_server: StatestoreServer, module_db: str
) -> None:
    with AdminApi(passthrough_server.url) as admin:
        tenant = admin.create_tenant()
        key = admin.create_key(tenant["id"])
        tenant_policy = admin.put_policy(tenant["id"])
        default_policy = admin.put_policy("default")
        admin.ok("DELETE", "/policies/default")
    for created_thing in (tenant, key, tenant_policy):
        assert "passthrough mode" in created_thing["warning"]
        assert "STATESTORE_AUTH_MODE=keys" in created_thing["warning"]
    assert key["secret"].startswith("ssk_")
    assert "warning" not in default_policy  # the default policy applies in both modes

    passthrough = cli_env(module_db)
    made = cli(passthrough, "admin", "tenants", "create", unique("cli"), "--json")
    assert "warning" in made.stderr and "STATESTORE_AUTH_MODE=keys" in made.stderr
    assert cli_json(made)["name"].startswith("cli")
    keys_mode = cli_env(module_db, auth_mode="keys", upstream_api_key=UPSTREAM_KEY)
    quiet = cli(keys_mode, "admin", "tenants", "create", unique("cli"))
    assert quiet.returncode == 0 and "warning" not in quiet.stderr
