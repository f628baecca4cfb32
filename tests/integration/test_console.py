"""The admin console (/admin/console) in a real browser: Debian's chromium, headless, driven by Selenium.

An admin signs in with an admin token, changes a policy and sees it govern the next turn and appear in the audit log
under the token's name, creates a key and sees it once, revokes it, and erases a user's threads, responses and
conversations after a confirmation that counts them. A bad token, a form without its CSRF token, a form posted from
another site and a tenant name carrying HTML and script are refused or shown as text.

With STATESTORE_CONSOLE_SCREENSHOTS=<folder> the tests save a screenshot of each page there (docs/console/ holds the
ones docs/console.md shows: `make console-screenshots`)."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from datetime import datetime

import httpx
import openai
import pytest
from selenium.webdriver import Chrome
from selenium.webdriver.common.by import By

from statestore.console.sessions import COOKIE
from tests.support.admin_api import (
    ADMIN_TOKEN,
    ADMIN_TOKENS,
    AUDITOR_TOKEN,
    UPSTREAM_KEY,
    AdminApi,
    Api,
    ClockFile,
    created,
    error_of,
    start_server,
    unique,
)
from tests.support.browser import headless_chromium, missing_browser
from tests.support.console_pages import (
    CONSOLE,
    AttackerSite,
    audit_changes,
    audit_rows,
    click_and_wait,
    go,
    lines_of,
    present,
    press,
    screenshot,
    sign_in,
    tenant_names,
    text_of,
)
from tests.support.fake_backend import FakeBackend
from tests.support.redis_keys import own_redis_prefix
from tests.support.server import StatestoreServer


@pytest.fixture(scope="module")
def console_server(module_db: str, redis_url: str, fake_backend_process: FakeBackend) -> Iterator[StatestoreServer]:
    """keys mode, so a key made in the console is a credential a client can use at once."""
    with own_redis_prefix(redis_url) as prefix:
        server = start_server(
            module_db,
            fake_backend_process.url,
            redis_url,
            prefix,
            {
                "STATESTORE_AUTH_MODE": "keys",
                "STATESTORE_UPSTREAM_API_KEY": UPSTREAM_KEY,
                "STATESTORE_ADMIN_TOKENS": ADMIN_TOKENS,
                "STATESTORE_KEY_CACHE_SECONDS": "0",
                "STATESTORE_POLICY_CACHE_SECONDS": "0",
                "STATESTORE_CHAT_UPSTREAM_URL": fake_backend_process.url,
                # Purges only when asked: a purge from the console is then the only run its page can show.
                "STATESTORE_PURGE_INTERVAL_SECONDS": "3600",
            },
        )
        yield server
        server.stop()


@pytest.fixture(scope="module")
def browser() -> Iterator[Chrome]:
    problem = missing_browser()
    if problem is not None:
        pytest.fail(problem)
    with headless_chromium() as driver:
        yield driver


@pytest.fixture
def admin(console_server: StatestoreServer) -> Iterator[AdminApi]:
    with AdminApi(console_server.url) as api:
        yield api


@pytest.fixture
def console(browser: Chrome, console_server: StatestoreServer) -> Chrome:
    """The browser signed in with the "ops" admin token."""
    browser.delete_all_cookies()
    sign_in(browser, console_server, ADMIN_TOKEN)
    assert browser.find_element(By.ID, "actor").text == "ops"
    return browser


# -- sign-in ---------------------------------------------------------------------------------------------------------


def test_a_bad_token_is_refused_and_a_session_is_a_strict_httponly_cookie(
    browser: Chrome, console_server: StatestoreServer
) -> None:
    browser.delete_all_cookies()
    go(browser, console_server, "")
    assert browser.current_url.endswith(CONSOLE + "/sign-in"), "signed out, every page leads to the sign-in"
    screenshot(browser, "sign-in")

    sign_in(browser, console_server, "adm-not-a-real-token-0000")
    assert text_of(browser, "sign-in-error") == "That is not an admin token."
    assert browser.get_cookie(COOKIE) is None
    go(browser, console_server, "/tenants")
    assert browser.current_url.endswith(CONSOLE + "/sign-in")

    sign_in(browser, console_server, ADMIN_TOKEN)
    assert text_of(browser, "actor") == "ops"
    cookie = browser.get_cookie(COOKIE)
    assert cookie is not None
    assert (cookie["httpOnly"], cookie["sameSite"], cookie["secure"], cookie["path"]) == (
        True,
        "Strict",
        False,
        CONSOLE,
    )
    # Script in the page could not read it even if some ran.
    assert COOKIE not in browser.execute_script("return document.cookie")

    press(browser, "sign-out")
    assert browser.current_url.endswith("/sign-in?notice=signed-out")
    assert browser.get_cookie(COOKIE) is None
    go(browser, console_server, "")
    assert browser.current_url.endswith(CONSOLE + "/sign-in")


def test_every_page_carries_a_strict_content_security_policy(console_server: StatestoreServer) -> None:
    with httpx.Client(base_url=console_server.url) as http:
        for path in ("/sign-in", "", "/tenants", "/audit"):
            response = http.get(CONSOLE + path)
            policy = response.headers["content-security-policy"]
            assert "default-src 'none'" in policy and "script-src" not in policy
            assert "form-action 'self'" in policy and "frame-ancestors 'none'" in policy
            assert response.headers["x-frame-options"] == "DENY"
            assert response.headers["cache-control"] == "no-store"
        # A forged cookie is no session.
        http.cookies.set(COOKIE, "b3Bz.9999999999.nonce.0000", path=CONSOLE)
        assert http.get(CONSOLE + "/tenants").headers["location"].endswith(CONSOLE + "/sign-in")


def test_the_console_is_off_without_admin_tokens(pg_server: StatestoreServer) -> None:
    response = httpx.get(pg_server.url + CONSOLE + "/sign-in")
    assert response.status_code == 404
    assert "STATESTORE_ADMIN_TOKENS" in response.text


def test_hostile_input_gets_a_page_never_a_server_error(console_server: StatestoreServer) -> None:
    with httpx.Client(base_url=console_server.url + CONSOLE, timeout=20) as http:
        signed_in = http.post("/sign-in", data={"token": ADMIN_TOKEN})
        assert signed_in.status_code == 303 and COOKIE in http.cookies
        page = http.get("/tenants").text
        csrf = page.split('name="csrf" value="', 1)[1].split('"', 1)[0]
        for method, path, data, status in (
            ("POST", "/erasure/preview", {"csrf": csrf, "user_id": "a\x00b"}, 400),
            ("POST", "/erasure/preview", {"csrf": csrf}, 400),
            ("POST", "/erasure/preview", {"csrf": csrf, "tenant": "no-such-tenant"}, 404),
            ("POST", "/tenants", {"csrf": csrf, "name": "x" * 201}, 400),
            ("POST", "/tenants", {"csrf": csrf, "name": "ten_looks_like_an_id"}, 400),
            ("POST", "/policies/default", {"csrf": csrf, "max_messages": "1" * 40}, 400),
            ("POST", "/keys/key_missing/revoke", {"csrf": csrf}, 404),
            ("GET", "/tenants/no-such-tenant", None, 404),
            ("GET", "/audit?actor=a%00b&action=%00&before=99999999999", None, 200),
            ("GET", "/audit?tenant=no-such-tenant", None, 404),
            ("GET", "/policies?scope=no-such-tenant", None, 404),
        ):
            response = http.request(method, path, data=data)
            assert response.status_code == status, (path, response.text)
            assert response.headers["content-type"].startswith("text/html"), path
        # A form that is not urlencoded is refused.
        assert http.post("/tenants", json={"csrf": csrf, "name": "json"}).status_code == 415


# -- keys ------------------------------------------------------------------------------------------------------------


def test_a_key_is_shown_once_works_and_is_refused_once_revoked(
    console: Chrome, console_server: StatestoreServer
) -> None:
    name = unique("acme")
    go(console, console_server, "/tenants")
    console.find_element(By.ID, "name").send_keys(name)
    press(console, "create-tenant")
    assert text_of(console, "tenant-title") == name
    tenant_url = console.current_url

    console.find_element(By.ID, "label").send_keys("ci runner")
    press(console, "create-key")
    secret = text_of(console, "new-key-secret")
    assert secret.startswith("ssk_")
    screenshot(console, "tenant")
    with Api(console_server.url, secret) as client:
        created(client.create("made with a key from the console"))

    # Shown once: the page again has no trace of it.
    console.get(tenant_url)
    assert not present(console, "new-key")
    assert secret not in console.page_source
    row = console.find_element(By.CSS_SELECTOR, "#keys tbody tr")
    assert row.find_element(By.CLASS_NAME, "key-state").text == "active"
    assert secret[:10] in row.text  # the display prefix only

    click_and_wait(console, row.find_element(By.CLASS_NAME, "revoke"))
    assert "Key revoked" in text_of(console, "notice")
    state = console.find_element(By.CSS_SELECTOR, "#keys tbody tr .key-state").text
    assert state.startswith("revoked")
    with Api(console_server.url, secret) as client:
        error_of(client.create("refused now"), 401, "authentication_error")

    go(console, console_server, f"/audit?tenant={name}&action=key")
    actions = [(r["actor"], r["action"]) for r in audit_rows(console)]
    assert actions == [("ops", "key.revoke"), ("ops", "key.create")]


# -- policies --------------------------------------------------------------------------------------------------------


def test_a_policy_changed_in_the_console_governs_the_next_turn_and_is_audited(
    console: Chrome, console_server: StatestoreServer, admin: AdminApi
) -> None:
    tenant, key = admin.tenant_with_key()
    with Api(console_server.url, key) as client:
        created(client.create("threads are on"))

        go(console, console_server, f"/policies?scope={tenant['id']}")
        assert text_of(console, "scope-name") == tenant["name"]
        assert text_of(console, "policy-source") in ("default", "settings")
        # Every field of the policy, each with the layer it comes from.
        fields = [e.get_attribute("id") for e in console.find_elements(By.CSS_SELECTOR, "#layers tbody tr")]
        policy_now = admin.ok("GET", f"/policies/{tenant['id']}")["policy"]
        assert fields == [f"layer-{name}" for name in policy_now]

        # Refused beside the field, nothing stored.
        ttl = console.find_element(By.ID, "field-default_ttl_seconds")
        ttl.clear()
        ttl.send_keys(str(policy_now["max_ttl_seconds"] + 1))
        press(console, "save-policy")
        assert "must not exceed max_ttl_seconds" in text_of(console, "error-default_ttl_seconds")
        assert console.find_element(By.ID, "field-default_ttl_seconds").get_attribute("value") == str(
            policy_now["max_ttl_seconds"] + 1
        )
        screenshot(console, "policies-invalid")
        assert admin.ok("GET", f"/policies/{tenant['id']}")["source"] != "tenant"

        ttl = console.find_element(By.ID, "field-default_ttl_seconds")
        ttl.clear()
        ttl.send_keys("600")
        checkbox = console.find_element(By.ID, "field-threads_enabled")
        assert checkbox.is_selected()
        checkbox.click()
        press(console, "save-policy")
        assert "Policy saved" in text_of(console, "notice")
        assert text_of(console, "policy-source") == "tenant"
        screenshot(console, "policies")

        # The next turn follows it.
        error_of(client.create("threads are off now"), 400, "invalid_request_error", "thread_unsupported_request")
        assert client.stateless("stateless still works").status_code == 200

    go(console, console_server, f"/audit?action=policy&tenant={tenant['id']}")
    [entry] = audit_rows(console)
    assert (entry["actor"], entry["action"], entry["target"]) == ("ops", "policy.put", tenant["id"])
    # The tenant had no policy of its own before: every field is new.
    changes = audit_changes(console.find_element(By.CSS_SELECTOR, "#audit tr.entry"))
    assert ("threads_enabled", "—", "false") in changes and ("default_ttl_seconds", "—", "600") in changes


# -- erasure ---------------------------------------------------------------------------------------------------------


def test_erasing_a_users_threads_responses_and_conversations_shows_how_many_first(
    console: Chrome, console_server: StatestoreServer, admin: AdminApi
) -> None:
    tenant, key = admin.tenant_with_key()
    user_id, other = unique("user"), unique("user")
    with Api(console_server.url, key) as client:
        for index in range(3):
            created(client.create(f"turn {index}", metadata={"user_id": user_id}))
        created(client.create("someone else's", metadata={"user_id": other}))
    with openai.OpenAI(base_url=console_server.url + "/v1", api_key=key, max_retries=0) as responses:
        first = responses.responses.create(model="echo-1", input="a", metadata={"user_id": user_id})
        second = responses.responses.create(model="echo-1", input="b", previous_response_id=first.id)
        conversation = responses.conversations.create(metadata={"user_id": user_id})
        kept = responses.responses.create(model="echo-1", input="c", metadata={"user_id": other})

        go(console, console_server, "/erasure")
        console.find_element(By.ID, "user_id").send_keys(user_id)
        press(console, "preview-erasure")
        # The whole chain: `second` carries no user_id, but its context is made of `first`.
        shown = [text_of(console, f"erase-{what}") for what in ("count", "responses", "conversations")]
        assert shown == ["3", "2", "1"]
        screenshot(console, "erasure-confirm")
        assert admin.stats(tenant["id"])["live_threads"] == 4, "the confirmation deletes nothing"
        assert responses.responses.retrieve(second.id).id == second.id

        press(console, "confirm-erasure")
        # The erasure's page, reloading itself until the erasure is done.
        assert "/erasure/erasure_" in console.current_url
        deadline = time.monotonic() + 60
        while console.find_element(By.ID, "erasure-status").get_attribute("data-status") == "running":
            assert time.monotonic() < deadline, "the erasure never finished"
            time.sleep(0.2)
            console.refresh()
        assert console.find_element(By.ID, "erasure-status").get_attribute("data-status") == "done"
        shown = [text_of(console, f"erased-{what}") for what in ("count", "responses", "conversations")]
        assert shown == ["3", "2", "1"]
        assert admin.stats(tenant["id"])["live_threads"] == 1
        for gone in (first.id, second.id):
            with pytest.raises(openai.NotFoundError):
                responses.responses.retrieve(gone)
        with pytest.raises(openai.NotFoundError):
            responses.conversations.retrieve(conversation.id)
        assert responses.responses.retrieve(kept.id).id == kept.id

    go(console, console_server, "/audit?action=erase&actor=ops")
    assert f"user_id={user_id}" in audit_rows(console)[0]["target"]


# -- refusals --------------------------------------------------------------------------------------------------------


def test_a_form_without_its_csrf_token_is_refused(
    console: Chrome, console_server: StatestoreServer, admin: AdminApi
) -> None:
    name = unique("no-csrf")
    go(console, console_server, "/tenants")
    console.execute_script("document.querySelector('form.card input[name=csrf]').remove()")
    console.find_element(By.ID, "name").send_keys(name)
    press(console, "create-tenant")
    assert "CSRF token is missing or wrong" in text_of(console, "refusal")
    assert name not in tenant_names(admin)


def test_a_form_posted_from_another_site_is_refused_even_with_a_valid_csrf_token(
    console: Chrome, console_server: StatestoreServer, admin: AdminApi
) -> None:
    go(console, console_server, "/tenants")
    csrf = console.find_element(By.CSS_SELECTOR, "input[name=csrf]").get_attribute("value")
    name = unique("cross-site")
    site = AttackerSite(
        f'<form method="post" action="{console_server.url}{CONSOLE}/tenants">'
        f'<input type="hidden" name="csrf" value="{csrf}"><input type="hidden" name="name" value="{name}">'
        '<button id="go" type="submit">win a prize</button></form>'
    )
    try:
        console.get(site.url)
        press(console, "go")
    finally:
        site.close()
    assert "posted from another site" in text_of(console, "refusal")
    assert name not in tenant_names(admin)


def test_a_tenant_name_carrying_html_and_script_is_shown_as_text(
    console: Chrome, console_server: StatestoreServer, admin: AdminApi
) -> None:
    name = f"<img src=x onerror=\"document.title='owned'\"><script>document.title='owned'</script>{unique('t')}"
    go(console, console_server, "/tenants")
    console.find_element(By.ID, "name").send_keys(name)
    press(console, "create-tenant")
    assert text_of(console, "tenant-title") == name
    assert console.title != "owned"
    assert not console.find_elements(By.CSS_SELECTOR, "main img, main script")
    assert "&lt;script&gt;" in console.page_source

    go(console, console_server, "/tenants")
    assert name in [e.text for e in console.find_elements(By.CLASS_NAME, "tenant-name")]
    go(console, console_server, "/erasure")
    assert console.title != "owned" and not console.find_elements(By.CSS_SELECTOR, "main img, main script")
    assert name in tenant_names(admin)


# -- audit -----------------------------------------------------------------------------------------------------------


def test_the_audit_log_pages_through_a_filter(console: Chrome, console_server: StatestoreServer) -> None:
    prefix = unique("paged")
    with AdminApi(console_server.url, AUDITOR_TOKEN) as auditor:
        made = [auditor.create_tenant(f"{prefix}-{index:02}")["id"] for index in range(51)]
    go(console, console_server, "/audit?actor=auditor&action=tenant.create")
    first = audit_rows(console)
    assert len(first) == 50 and {(r["actor"], r["action"]) for r in first} == {("auditor", "tenant.create")}
    assert not present(console, "newest")
    press(console, "older")
    rest = audit_rows(console)
    assert [r["target"] for r in first + rest][:51] == made[::-1]
    assert not present(console, "older")
    press(console, "newest")
    assert audit_rows(console) == first


def test_the_audit_log_shows_what_changed_with_the_whole_record_on_demand(
    console: Chrome, console_server: StatestoreServer, admin: AdminApi
) -> None:
    tenant = admin.create_tenant()
    admin.put_policy(tenant["id"], default_ttl_seconds=600)
    admin.put_policy(tenant["id"], default_ttl_seconds=600, threads_enabled=False)
    key = admin.create_key(tenant["id"], label="audited")
    admin.ok("DELETE", f"/keys/{key['id']}")
    newest = admin.audit(limit=10)
    console.set_window_size(900, 1000)  # narrow enough that a long time would wrap
    try:
        go(console, console_server, f"/audit?tenant={tenant['id']}")
        rows = console.find_elements(By.CSS_SELECTOR, "#audit tr.entry")
        actions = [r["action"] for r in audit_rows(console)]
        assert actions == ["key.revoke", "key.create", "policy.put", "policy.put", "tenant.create"]
        revoked, _, second, _, _ = rows
        # Only the fields that differ, old → new.
        assert audit_changes(second) == [("threads_enabled", "true", "false")]
        [(field, old, new)] = audit_changes(revoked)
        assert (field, old) == ("revoked_ms", "—") and new.isdigit()
        for row in rows:
            when = row.find_element(By.CSS_SELECTOR, "td.when time")
            assert lines_of(console, when) == 1, when.text
        # The whole record, on demand.
        record = second.find_element(By.CSS_SELECTOR, "details.record")
        assert record.get_attribute("open") is None
        after = record.find_element(By.CSS_SELECTOR, "pre.after")
        assert not after.is_displayed()
        record.find_element(By.TAG_NAME, "summary").click()
        assert after.is_displayed()
        [api_entry] = [e for e in newest if e["action"] == "policy.put" and not e["after"]["threads_enabled"]]
        assert json.loads(after.text) == api_entry["after"]
        assert json.loads(record.find_element(By.CSS_SELECTOR, "pre.before").text) == api_entry["before"]
    finally:
        console.set_window_size(1280, 1000)
    go(console, console_server, f"/audit?tenant={tenant['id']}")
    console.find_elements(By.CSS_SELECTOR, "#audit details.record summary")[2].click()
    screenshot(console, "audit")


# -- the overview ----------------------------------------------------------------------------------------------------


def test_the_overview_counts_both_doors_and_a_purge_from_it_is_a_run(
    console: Chrome, console_server: StatestoreServer, admin: AdminApi
) -> None:
    tenant, key = admin.tenant_with_key()
    with Api(console_server.url, key) as client:
        _, head = created(client.create("a thread"))
        created(client.continue_(head, "goes on"))
    with openai.OpenAI(base_url=console_server.url + "/v1", api_key=key, max_retries=0) as responses:
        first = responses.responses.create(model="echo-1", input="a")
        responses.responses.create(model="echo-1", input="b", previous_response_id=first.id)
        conversation = responses.conversations.create()
        responses.responses.create(model="echo-1", input="c", conversation=conversation.id)
        queued = responses.responses.create(model="echo-1", input="later", background=True)
        while responses.responses.retrieve(queued.id).status != "completed":
            time.sleep(0.05)
        responses.responses.cancel(queued.id)  # finished: returned as it is, and counted completed
    stats, today = admin.stats(), admin.ok("GET", "/usage", days=1)["data"][-1]

    # The tenant's page counts both doors too.
    go(console, console_server, f"/tenants/{tenant['id']}")
    assert text_of(console, "tenant-messages").startswith("Messages API: 1 live threads, 4 messages")
    assert text_of(console, "tenant-responses").startswith("Responses API: 4 live responses, 1 live conversations;")

    go(console, console_server, "")
    assert int(text_of(console, "background-finished")) == stats["background_completed"] >= 1
    for tile, name in (
        ("live-threads", "live_threads"),
        ("live-responses", "live_responses"),
        ("live-conversations", "live_conversations"),
        ("background-queued", "background_queued"),
        ("background-running", "background_running"),
        ("background-failed", "background_failed"),
        ("background-cancelled", "background_cancelled"),
    ):
        assert int(text_of(console, tile)) == stats[name], tile
    # Today's bar of each chart: the Messages door's part at the bottom, the Responses door's on top of it.
    for chart, what in enumerate(("turns", "bytes")):
        bars = console.find_elements(By.CSS_SELECTOR, "figure.chart svg")[chart].find_elements(By.TAG_NAME, "rect")
        messages, on_top = bars[-2:]
        assert (messages.get_attribute("class"), on_top.get_attribute("class")) == ("door-messages", "door-responses")
        y, height = (float(messages.get_attribute(a) or 0) for a in ("y", "height"))
        top_y, top_height = (float(on_top.get_attribute(a) or 0) for a in ("y", "height"))
        assert abs(top_y + top_height - y) < 0.02 and height > 0 and top_height > 0
        ratio = today["doors"]["responses"][what] / today["doors"]["messages"][what]
        assert abs(top_height / height - ratio) < 0.05 * ratio
        if what == "turns":
            title = on_top.find_element(By.TAG_NAME, "title").get_attribute("textContent")
            turns = today["doors"]["responses"]["turns"]
            assert title == f"{today['day']}, Responses API (responses, conversations): {turns} turns"

    press(console, "purge")
    [purge] = [e for e in admin.audit(limit=5) if e["action"] == "purge"][:1]
    done = purge["after"]
    assert text_of(console, "notice") == (
        f"Purged {done['threads']} expired threads, {done['responses']} responses and "
        f"{done['conversations']} conversations."
    )
    # The purge just done is the last run (this server's background purger waits an hour).
    last_run = admin.stats()["purger_last_run_at"]
    assert last_run is not None
    shown = datetime.fromisoformat(last_run).strftime("%Y-%m-%d %H:%M:%S UTC")
    assert text_of(console, "purger-last-run") == shown
    assert abs(datetime.fromisoformat(last_run).timestamp() * 1000 - purge["at_ms"]) < 5_000


# -- every page ------------------------------------------------------------------------------------------------------


def test_every_page_renders_signed_in(console: Chrome, console_server: StatestoreServer, admin: AdminApi) -> None:
    """Last in the module, so the overview has the turns of the tests above to chart."""
    go(console, console_server, "")
    assert int(text_of(console, "live-threads")) == admin.stats()["live_threads"]
    assert int(text_of(console, "live-responses")) == admin.stats()["live_responses"]
    # Two charts of 30 days, each day's bar in two parts (one a door).
    bars = console.find_elements(By.CSS_SELECTOR, "figure.chart rect")
    assert len(bars) == 2 * 30 * 2 and any(float(bar.get_attribute("height") or 0) > 0 for bar in bars)
    press(console, "purge")
    assert text_of(console, "notice").startswith("Purged ")
    screenshot(console, "overview")
    for path, shot in (("/tenants", "tenants"), ("/erasure", "erasure")):
        go(console, console_server, path)
        assert console.find_element(By.TAG_NAME, "h1").text
        screenshot(console, shot)
    go(console, console_server, "/audit?actor=ops")
    assert {row["actor"] for row in audit_rows(console)} == {"ops"}


# -- sign-in throttle and sign-out -----------------------------------------------------------------------------------


@pytest.fixture
def throttled_server(
    tmp_path_factory: pytest.TempPathFactory, fake_backend_process: FakeBackend, clock: ClockFile
) -> Iterator[StatestoreServer]:
    """A console of its own (a fresh SQLite database, so no other test's attempts count) with small limits."""
    from statestore.store.migrate import upgrade

    url = f"sqlite+aiosqlite:///{tmp_path_factory.mktemp('throttle') / 'statestore.db'}"
    upgrade(url)
    server = StatestoreServer(
        database_url=url,
        upstream_url=fake_backend_process.url,
        env={
            "STATESTORE_ADMIN_TOKENS": ADMIN_TOKENS,
            "STATESTORE_CONSOLE_SIGN_IN_FAILURES": "3",
            "STATESTORE_CONSOLE_SIGN_INS_PER_TOKEN": "2",
            "STATESTORE_CLOCK_OFFSET_FILE": str(clock.path),
        },
    )
    yield server
    server.stop()


def _sign_in_from(server: StatestoreServer, address: str, token: str) -> httpx.Response:
    with httpx.Client(
        base_url=server.url + CONSOLE, transport=httpx.HTTPTransport(local_address=address), timeout=20
    ) as http:
        return http.post("/sign-in", data={"token": token})


def test_sign_in_is_throttled_per_address_and_per_token_name(
    browser: Chrome, throttled_server: StatestoreServer, clock: ClockFile
) -> None:
    browser.delete_all_cookies()
    for _ in range(3):
        sign_in(browser, throttled_server, "adm-not-a-real-token-0000")
        assert text_of(browser, "sign-in-error") == "That is not an admin token."
    # Over the limit, the right token is refused too: a throttled address learns nothing about what it sends.
    sign_in(browser, throttled_server, ADMIN_TOKEN)
    assert text_of(browser, "sign-in-error").startswith("Too many sign-in attempts: try again in ")
    assert browser.get_cookie(COOKIE) is None
    refused = _sign_in_from(throttled_server, "127.0.0.1", ADMIN_TOKEN)
    assert refused.status_code == 429 and 0 < int(refused.headers["retry-after"]) <= 900

    # Another address is not held back by the first one's failures; the token's own bound still applies to it.
    assert _sign_in_from(throttled_server, "127.0.0.2", ADMIN_TOKEN).status_code == 303
    assert _sign_in_from(throttled_server, "127.0.0.3", ADMIN_TOKEN).status_code == 303
    assert _sign_in_from(throttled_server, "127.0.0.4", ADMIN_TOKEN).status_code == 429
    assert _sign_in_from(throttled_server, "127.0.0.4", AUDITOR_TOKEN).status_code == 303, "per token name"

    # The counts are per window: once it has passed, the first address signs in.
    clock.advance(16 * 60)
    sign_in(browser, throttled_server, ADMIN_TOKEN)
    assert text_of(browser, "actor") == "ops"


def test_a_signed_out_cookie_opens_nothing_even_copied(browser: Chrome, console_server: StatestoreServer) -> None:
    browser.delete_all_cookies()
    sign_in(browser, console_server, ADMIN_TOKEN)
    cookie = browser.get_cookie(COOKIE)
    assert cookie is not None
    with httpx.Client(base_url=console_server.url + CONSOLE, cookies={COOKIE: cookie["value"]}, timeout=20) as http:
        assert http.get("/tenants").status_code == 200, "the copy works while the session lasts"
        press(browser, "sign-out")
        assert browser.current_url.endswith("/sign-in?notice=signed-out")
        after = http.get("/tenants")
        assert after.status_code == 303 and after.headers["location"].endswith(CONSOLE + "/sign-in")
    # Put back into the browser, it is refused there as well.
    browser.add_cookie({"name": COOKIE, "value": cookie["value"], "path": CONSOLE})
    go(browser, console_server, "/tenants")
    assert browser.current_url.endswith(CONSOLE + "/sign-in")
