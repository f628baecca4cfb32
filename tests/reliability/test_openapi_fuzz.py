"""Schemathesis over statestore's own OpenAPI (the thread API and the admin API) against a running server with valid
credentials: whatever it generates, valid (positive) or not (negative), the answer is never a 5xx, and every 4xx has
Anthropic's error shape with a `request-id` header (docs/protocol.md §4).

The operations are listed at collection from the app's OpenAPI (no server needed), one test per operation and mode,
and the test fetches the served `/openapi.json` and checks it describes the same operations. Examples are few (see
EXAMPLES) and Hypothesis does not shrink here: every failing example found is reported at once, not the smallest one.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import orjson
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis import GenerationMode

from statestore.app import create_app
from statestore.config import Settings
from tests.reliability.proof_support import (
    ADMIN_TOKEN,
    Database,
    check_error_shape,
    create_body,
    new_key,
    servers_on,
    thread_headers,
    user,
)
from tests.support.fake_backend import FakeBackend
from tests.support.server import StatestoreServer

EXAMPLES = {GenerationMode.POSITIVE: 20, GenerationMode.NEGATIVE: 20}
FUZZED_PREFIXES = ("/statestore/v1/threads", "/statestore/v1/sessions", "/admin/v1/")


def _spec_operations(spec: dict[str, Any]) -> list[tuple[str, str, bool]]:
    """(METHOD, path, can be given invalid input) of every fuzzed operation of an OpenAPI document."""
    found = []
    for path, item in spec["paths"].items():
        if not path.startswith(FUZZED_PREFIXES):
            continue
        for method, operation in item.items():
            parameters = operation.get("parameters", [])
            # Schemathesis cannot make a string path parameter invalid (any string is one), so an operation that
            # takes nothing else has no negative data.
            takes_input = "requestBody" in operation or any(
                p["in"] != "path" or p.get("schema", {}).get("type") != "string" for p in parameters
            )
            found.append((method.upper(), path, takes_input))
    return sorted(found)


_APP_SPEC = create_app(Settings(owner_secret="collection-only-secret-0123456789")).openapi()
OPERATIONS = _spec_operations(_APP_SPEC)
PARAMS = [
    pytest.param(method, path, mode, id=f"{mode.value}-{method}-{path}")
    for method, path, takes_input in OPERATIONS
    for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)
    if takes_input or mode is GenerationMode.POSITIVE
]


@pytest.fixture(scope="module")
def fuzz_target(database: Database, redis_url: str, backend_process: FakeBackend) -> Iterator[tuple[str, str]]:
    """(server URL, the owner's key). The owner has a thread, a session, and there is a tenant with a key, so valid
    requests find something."""
    with servers_on(database, redis_url, backend_process) as servers:
        server: StatestoreServer = servers.start()
        key = new_key()
        with httpx.Client(base_url=server.url, timeout=15) as http:
            for name in ("fuzz-session", None):
                headers = thread_headers(key, **({"statestore-session-id": name} if name else {}))
                created = http.post("/v1/messages", headers=headers, content=orjson.dumps(create_body([user("hi")])))
                assert created.status_code == 200, created.text
            admin = {"authorization": f"Bearer {ADMIN_TOKEN}"}
            assert http.post("/admin/v1/tenants", headers=admin, json={"name": "fuzz"}).status_code == 201
            assert http.post("/admin/v1/tenants/fuzz/keys", headers=admin, json={}).status_code == 201
        yield server.url, key


@pytest.fixture(scope="module")
def served_schema(fuzz_target: tuple[str, str]) -> schemathesis.BaseSchema:
    url, _ = fuzz_target
    spec = httpx.get(url + "/openapi.json", timeout=10).json()
    assert _spec_operations(spec) == OPERATIONS, "the served OpenAPI differs from the app's"
    return schemathesis.openapi.from_dict(spec)


def _problems(response: schemathesis.Response) -> list[str]:
    status = response.status_code
    if status >= 500:
        return [f"{status}: {response.content[:300]!r}"]
    if status >= 400:
        # schemathesis keeps every value of a header: {name: [values]}.
        headers = {name.lower(): values[0] for name, values in response.headers.items() if values}
        problems: list[str] = check_error_shape(status, headers, response.content)["problems"]
        return problems
    try:
        orjson.loads(response.content)
    except orjson.JSONDecodeError:
        return [f"{status} with a body that is not JSON: {response.content[:200]!r}"]
    return []


@pytest.mark.parametrize(("method", "path", "mode"), PARAMS)
def test_generated_requests_never_get_a_server_error(
    method: str,
    path: str,
    mode: GenerationMode,
    served_schema: schemathesis.BaseSchema,
    fuzz_target: tuple[str, str],
) -> None:
    url, key = fuzz_target
    operation = served_schema[path][method]
    # Both credentials on every request: the thread API takes x-api-key, the admin API the bearer token.
    credentials = {"x-api-key": key, "authorization": f"Bearer {ADMIN_TOKEN}"}
    failures: dict[str, str] = {}
    sent = 0

    @settings(
        max_examples=EXAMPLES[mode],
        deadline=None,
        database=None,
        derandomize=True,
        phases=[Phase.explicit, Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(case=operation.as_strategy(generation_mode=mode))
    def run(case: schemathesis.Case[Any]) -> None:
        nonlocal sent
        response = case.call(base_url=url, headers=credentials, timeout=15)
        sent += 1
        for problem in _problems(response):
            failures.setdefault(problem.split(":", 1)[0], f"{case.as_curl_command()}\n    -> {problem}")

    run()
    assert sent > 0
    assert not failures, "\n".join(failures.values())


@pytest.mark.parametrize(("method", "path"), [pytest.param(m, p, id=f"{m}-{p}") for m, p, _ in OPERATIONS])
def test_boundary_requests_never_get_a_server_error(
    method: str, path: str, served_schema: schemathesis.BaseSchema, fuzz_target: tuple[str, str]
) -> None:
    """Schemathesis' coverage phase: a fixed set of boundary and type-confusion cases per operation (limits at and
    past their bounds, missing and unknown fields, wrong JSON types, methods the route does not take)."""
    url, key = fuzz_target
    operation = served_schema[path][method]
    credentials = {"x-api-key": key, "authorization": f"Bearer {ADMIN_TOKEN}"}
    cases = list(
        served_schema.iter_coverage_cases(
            operation,
            generation_modes=[GenerationMode.POSITIVE, GenerationMode.NEGATIVE],
            generation_config=served_schema.config.generation_for(operation=operation),
        )
    )
    assert cases
    failures = []
    for case in cases:
        response = case.call(base_url=url, headers=credentials, timeout=15)
        failures += [f"{case.as_curl_command()}\n    -> {problem}" for problem in _problems(response)]
    assert not failures, "\n".join(failures)
