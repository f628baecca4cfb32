"""The typed API: every response of the thread API (/statestore/v1) and the admin API (/admin/v1), as a live server
sends it, validates against the schema the same server publishes at /openapi.json; /docs works with no network;
passthrough mode warns when tenants, keys or tenant policies are created (API and CLI)."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from jsonschema import Draft202012Validator

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
from tests.support.fake_backend import FakeBackend
from tests.support.server import StatestoreServer

TYPED_PREFIXES = ("/statestore/v1/", "/admin/v1/")


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
    checked.call("GET", "/admin/v1/stats", admin)
    checked.call("POST", "/admin/v1/purge", admin)
    checked.call("POST", "/admin/v1/erase", admin, json={"user_id": unique("nobody")})
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
