"""Long conversations (docs/protocol.md §9): the context a thread sends, apart from its archive.

Each rule of §9 has a test named after it. The conversations run through the official SDK against a real server on
PostgreSQL + Redis, and a fake backend that keeps a 20,000-token window (a request over it gets the API's "prompt is
too long"), honours `compact_20260112` edits, and logs, for every turn, the tokens it read and whether its body
starts with the previous turn's (the prefix a prompt cache reuses). The servers of this module run on a database of
their own, since the tests change the default policy.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import anthropic
import pytest

from tests.support.admin_api import ADMIN_TOKENS, THREADS_BETA, AdminApi, cli, cli_env, error_of, policy, start_server
from tests.support.fake_backend import FakeBackend
from tests.support.long_context import (
    COMPACT_EDIT,
    MODEL,
    SUMMARY_MARKER,
    TURN_BYTES,
    TURNS,
    WINDOW,
    Conversation,
    OneServer,
    Servers,
    managed,
    words,
)
from tests.support.server import StatestoreServer


@pytest.fixture(scope="module")
def servers(module_db: str, redis_url: str, module_prefix: str, fake_backend_process: FakeBackend) -> Iterator[Servers]:
    started = Servers(module_db, fake_backend_process.url, redis_url, module_prefix)
    yield started
    started.current.stop()


@pytest.fixture
def conversation(servers: Servers, backend: FakeBackend, api_key: str) -> Conversation:
    del backend  # reset: no script, no recorded requests, no context window
    return Conversation(servers, api_key)


# == the 1,000-turn conversations ======================================================================================


@pytest.mark.timeout(900)
@pytest.mark.parametrize("strategy", ["truncate", "summarize", "compaction"])
def test_a_conversation_outlives_its_window_moving_the_base_in_one_step_down_to_the_target(
    strategy: str, servers: Servers, conversation: Conversation, fake_backend_process: FakeBackend
) -> None:
    """§9: 1,000 turns against a 20,000-token window never fail and never send more than the window; between two
    moves every request's prefix is byte-identical to the previous one's; a Redis flush and a restart mid-way change
    nothing."""
    backend = fake_backend_process
    backend.watch_context(window=WINDOW, summary_marker=SUMMARY_MARKER)
    if strategy == "compaction":
        servers.set_policy(policy())
        conversation.context_management = COMPACT_EDIT
    else:
        servers.set_policy(managed(strategy))
    started = time.monotonic()
    for turn in range(TURNS):
        if turn == TURNS // 3:
            assert servers.flush_redis() > 0
        if turn == 2 * TURNS // 3:
            servers.restart()
        conversation.send_fast(words(turn, TURN_BYTES))
    elapsed = time.monotonic() - started

    log = backend.context_log()
    turns = log["turns"]
    assert len(turns) == TURNS
    assert all(entry["status"] == 200 for entry in turns)
    assert max(entry["input_tokens"] for entry in turns) <= WINDOW
    action = {"truncate": "truncated", "summarize": "summarized", "compaction": "compacted"}[strategy]
    moved = conversation.moves(action)
    assert len(moved) >= 5, f"the base moved {len(moved)} times"
    assert all(not headers or headers.get("statestore-context") == action for headers in conversation.headers)
    # A truncate or summary moves the base before the turn it names; a compaction reply after its own turn.
    changed = set(moved) if strategy != "compaction" else {turn + 1 for turn in moved}
    broken = [turn for turn in range(1, TURNS) if turn not in changed and not turns[turn]["extends_previous"]]
    assert broken == [], f"prefix changed without a move at turns {broken[:10]}"
    assert all(not turns[turn]["extends_previous"] for turn in changed if turn < TURNS)
    if strategy != "compaction":
        # One step down to the target: the turn after a move sends at most target x window (and a bit of its own).
        for turn in moved:
            assert turns[turn]["input_tokens"] <= 0.5 * WINDOW + 200
    if strategy == "summarize":
        assert log["summaries"] == len(moved)

    info = conversation.info()
    assert info["message_count"] == 2 * TURNS, "the archive keeps every message"
    context = info["context"]
    assert context[action] == len(moved)
    assert 0 < context["base_position"] < 2 * TURNS
    assert 0 < context["tokens"] <= WINDOW
    archive, view = conversation.view("archive"), conversation.view("context")
    assert len(archive["messages"]) == 2 * TURNS
    assert len(view["messages"]) == context["message_count"] < 2 * TURNS
    if strategy == "summarize":
        assert view["messages"][0]["content"][0]["text"].startswith("Summary of the earlier part")
    if strategy == "compaction":
        assert view["messages"][0]["role"] == "assistant"
        assert view["messages"][0]["content"][0]["type"] == "compaction"
    print(f"\n{strategy}: {TURNS} turns in {elapsed:.1f}s, {len(moved)} moves")


# == the rules, one at a time ==========================================================================================


def _until_moved(conversation: Conversation, *, size: int, limit: int = 200) -> int:
    """Send turns of `size` bytes until one carries a statestore-context header; its index."""
    for turn in range(limit):
        conversation.send(words(turn, size))
        if conversation.headers[-1]:
            return turn
    raise AssertionError(f"no move in {limit} turns")


def test_summary_failure_falls_back_to_truncate_and_says_so(
    servers: Servers, conversation: Conversation, fake_backend_process: FakeBackend
) -> None:
    fake_backend_process.watch_context(window=WINDOW, summary_marker=SUMMARY_MARKER, fail_summaries=True)
    servers.set_policy(managed("summarize"))
    turn = _until_moved(conversation, size=2000)
    assert conversation.headers[turn] == {
        "statestore-context": "truncated",
        "statestore-context-fallback": "summary_failed",
    }
    assert fake_backend_process.context_log()["summaries"] == 1
    context = conversation.info()["context"]
    assert (context["truncated"], context["summarized"]) == (1, 0)
    assert conversation.view("context")["messages"][0]["role"] == "user"


def test_a_turn_larger_than_the_window_gets_the_backends_error_and_stores_nothing(
    servers: Servers, conversation: Conversation, fake_backend_process: FakeBackend
) -> None:
    fake_backend_process.watch_context(window=WINDOW)
    servers.set_policy(managed("truncate"))
    conversation.send("hello")
    before = conversation.info()
    with pytest.raises(anthropic.BadRequestError) as caught:
        conversation.send("x" * (WINDOW * 5))
    assert caught.value.status_code == 400
    error = cast(dict[str, Any], caught.value.body)["error"]
    assert error["type"] == "invalid_request_error"
    assert error["message"].startswith("prompt is too long: ")
    after = conversation.info()
    assert (after["message_count"], after["context"]) == (before["message_count"], before["context"])
    conversation.send("still here")  # the same id is still continuable
    assert conversation.info()["message_count"] == 4


def test_a_window_set_too_large_meets_the_backends_prompt_is_too_long_which_is_cut_and_sent_once_more(
    servers: Servers, conversation: Conversation, fake_backend_process: FakeBackend
) -> None:
    """§9, real backends refuse in their own words: the policy claims ten times the backend's window, so the estimate
    never reaches the trigger; the turn the backend refuses ("prompt is too long: N tokens > M maximum") is cut to the
    target of the stated window and sent once more, and the client sees a truncated turn, never the refusal."""
    backend = fake_backend_process
    backend.watch_context(window=WINDOW)
    servers.set_policy(managed("truncate", context_window_tokens=10 * WINDOW))
    for turn in range(80):
        conversation.send_fast(words(turn, size=2000))  # each answered 200, or the helper fails
    turns = backend.context_log()["turns"]
    refused = [index for index, entry in enumerate(turns) if entry["status"] == 400]
    assert refused, "the backend never refused"
    moved = conversation.moves("truncated")
    assert moved
    # Each refusal was followed at once by the cut request, which fitted: one retry, then a 200.
    for index in refused:
        assert turns[index + 1]["status"] == 200
        assert turns[index + 1]["input_tokens"] <= 0.5 * WINDOW + 1000
    assert len(refused) == len(moved)


def test_policy_changes_apply_from_the_next_turn(
    servers: Servers, conversation: Conversation, fake_backend_process: FakeBackend
) -> None:
    """With `none` the rebuilt request is forwarded as it is, past the trigger; the next turn after the policy turns
    to truncate moves the base, and `?view=context` then shows exactly what the following turn sends."""
    fake_backend_process.watch_context(window=WINDOW, record_bodies=True)
    servers.set_policy(managed("none"))
    for turn in range(25):  # about 17,000 tokens (the echo repeats each turn): past 0.8 x window, under the window
        conversation.send(words(turn, 1600))
    assert not any(conversation.headers)
    assert conversation.info()["context"]["tokens"] > 0.8 * WINDOW
    servers.set_policy(managed("truncate"))
    conversation.send("now truncate")
    assert conversation.headers[-1] == {"statestore-context": "truncated"}
    assert fake_backend_process.context_log()["turns"][-1]["input_tokens"] <= 0.5 * WINDOW + 100
    view = conversation.view("context")
    conversation.send("next")
    sent = fake_backend_process.requests()[-1].json()
    assert sent["messages"][:-1] == view["messages"]
    assert conversation.headers[-1] == {}


def test_compaction_reply_moves_the_base_and_limits_count_what_a_rebuild_sends(
    servers: Servers, conversation: Conversation, fake_backend_process: FakeBackend
) -> None:
    fake_backend_process.watch_context(window=WINDOW, record_bodies=True)
    # A thread may send at most 40 messages: compaction keeps what is sent below that, the archive grows past it.
    servers.set_policy(policy(max_messages=40))
    conversation.context_management = COMPACT_EDIT
    compactions = 0
    for turn in range(60):
        conversation.send(words(turn, 3000))
        compactions += conversation.headers[-1] == {"statestore-context": "compacted"}
    assert compactions >= 2
    info = conversation.info()
    assert info["message_count"] == 120 and info["context"]["compacted"] == compactions
    last = fake_backend_process.requests()[-1].json()
    assert last["messages"][0]["content"][0]["type"] == "compaction"
    assert len(last["messages"]) < 40


def test_sessions_get_the_context_policy_too(
    servers: Servers, backend: FakeBackend, api_key: str, fake_backend_process: FakeBackend
) -> None:
    fake_backend_process.watch_context(window=WINDOW)
    servers.set_policy(managed("truncate"))
    conversation = Conversation(servers, api_key, session="long-session")
    turn = _until_moved(conversation, size=2000)
    assert conversation.headers[turn] == {"statestore-context": "truncated"}
    assert conversation.info()["context"]["truncated"] == 1
    assert conversation.info()["session_id"] == "long-session"


HOSTILE = [
    ("context_strategy", "drop-everything"),
    ("context_strategy", None),
    ("context_window_tokens", -1),
    ("context_window_tokens", 0),
    ("context_window_tokens", 2**40),
    ("context_window_tokens", "20000"),
    ("context_window_tokens", 20000.5),
    ("context_trigger_ratio", 1.5),
    ("context_trigger_ratio", -0.1),
    ("context_trigger_ratio", "0.8"),
    ("context_target_ratio", 0.9),  # not below the trigger
    ("context_target_ratio", True),
    ("summary_model", "m" * 201),
    ("summary_model", 7),
    ("summary_instructions", ""),
    ("summary_instructions", "x\u0000y"),
]


@pytest.mark.parametrize(("name", "value"), HOSTILE, ids=[f"{n}={str(v)[:12]}" for n, v in HOSTILE])
def test_hostile_policy_values_are_refused_with_400_naming_the_field(servers: Servers, name: str, value: Any) -> None:
    with AdminApi(servers.current.url) as admin:
        before = admin.ok("GET", "/policies/default")
        body = managed("truncate", **{name: value})
        message = error_of(admin.call("PUT", "/policies/default", body), 400, "invalid_request_error")["message"]
        assert name in message
        assert admin.ok("GET", "/policies/default") == before


def test_a_managed_strategy_needs_a_window(servers: Servers) -> None:
    with AdminApi(servers.current.url) as admin:
        body = policy(context_strategy="summarize")
        message = error_of(admin.call("PUT", "/policies/default", body), 400, "invalid_request_error")["message"]
        assert "context_window_tokens" in message


def test_policy_fields_are_served_as_data_and_set_from_the_cli(servers: Servers, module_db: str) -> None:
    with AdminApi(servers.current.url) as admin:
        fields = {item["name"]: item for item in admin.ok("GET", "/policy-fields")["data"]}
        assert fields["context_strategy"]["choices"] == ["none", "truncate", "summarize"]
        assert fields["context_trigger_ratio"]["default"] == 0.8
        done = cli(
            cli_env(module_db),
            "admin",
            "policy",
            "set",
            "default",
            "--context-strategy",
            "summarize",
            "--context-window-tokens",
            "50000",
            "--summary-model",
            "claude-small",
        )
        assert done.returncode == 0, done.stderr
        stored = admin.ok("GET", "/policies/default")["policy"]
        assert (stored["context_strategy"], stored["context_window_tokens"], stored["summary_model"]) == (
            "summarize",
            50000,
            "claude-small",
        )
        done = cli(cli_env(module_db), "admin", "policy", "set", "default", "--summary-model", "none")
        assert done.returncode == 0, done.stderr
        assert admin.ok("GET", "/policies/default")["policy"]["summary_model"] is None
        refused = cli(cli_env(module_db), "admin", "policy", "set", "default", "--context-target-ratio", "0.9")
        assert refused.returncode != 0 and "context_target_ratio" in refused.stderr + refused.stdout
        entries = admin.ok("GET", "/audit", limit=5)["data"]
        assert any(entry["action"] == "policy.put" and "context_strategy" in str(entry["after"]) for entry in entries)


def test_the_embedded_default_truncates_the_same_way(
    tmp_path: Path, backend: FakeBackend, api_key: str, fake_backend_process: FakeBackend
) -> None:
    """SQLite and the in-process cache: the same base moves, through SQLAlchemy Core instead of asyncpg."""
    from statestore.store.migrate import upgrade

    url = f"sqlite+aiosqlite:///{tmp_path / 'statestore.db'}"
    upgrade(url)
    server = StatestoreServer(
        database_url=url, upstream_url=fake_backend_process.url, env={"STATESTORE_ADMIN_TOKENS": ADMIN_TOKENS}
    )
    try:
        with AdminApi(server.url) as admin:
            admin.ok("PUT", "/policies/default", managed("truncate"))
        fake_backend_process.watch_context(window=WINDOW)
        conversation = Conversation(OneServer(server), api_key)
        moved = _until_moved(conversation, size=2000)
        assert conversation.headers[moved] == {"statestore-context": "truncated"}
        for turn in range(5):
            conversation.send(words(turn))
        turns = fake_backend_process.context_log()["turns"]
        assert all(entry["extends_previous"] for entry in turns[moved + 1 :])
        assert all(entry["input_tokens"] <= WINDOW for entry in turns)
        context = conversation.info()["context"]
        assert context["truncated"] == 1
        assert len(conversation.view("context")["messages"]) == context["message_count"]
    finally:
        server.stop()


SHORT_LEASE_SECONDS = 1


def test_a_summary_slower_than_the_lease_keeps_the_head_and_is_stored(
    module_db: str, redis_url: str, module_prefix: str, fake_backend_process: FakeBackend, api_key: str
) -> None:
    """The summary request runs under the turn's lease, renewed while it runs: a summary that takes three lease
    lengths keeps the thread head (every rival continue meanwhile is refused), and the turn commits with it."""
    backend = fake_backend_process
    backend.reset()
    server = start_server(
        module_db,
        backend.url,
        redis_url,
        module_prefix,
        {"STATESTORE_ADMIN_TOKENS": ADMIN_TOKENS, "STATESTORE_LEASE_SECONDS": str(SHORT_LEASE_SECONDS)},
    )
    try:
        with AdminApi(server.url) as admin:
            admin.ok("PUT", "/policies/default", managed("summarize"))
        backend.watch_context(window=WINDOW, summary_marker=SUMMARY_MARKER)
        backend.script({"kind": "echo", "match": SUMMARY_MARKER, "delay_seconds": 3 * SHORT_LEASE_SECONDS})
        conversation = Conversation(OneServer(server), api_key)
        outcome: dict[str, object] = {}

        def drive() -> None:
            try:
                outcome["moved"] = _until_moved(conversation, size=2000)
            except Exception as exc:  # asserted below, with what the rivals got
                outcome["error"] = exc

        runner = threading.Thread(target=drive)
        runner.start()
        deadline = time.monotonic() + 60
        while backend.context_log()["summaries"] == 0:
            assert runner.is_alive() and time.monotonic() < deadline, "no summary was asked for"
            time.sleep(0.05)
        summary_started = time.monotonic()
        head = conversation.previous_id  # the turn waiting on the summary continues this one
        assert head is not None
        rivals: list[tuple[float, int]] = []
        with anthropic.Anthropic(base_url=server.url, api_key=api_key, max_retries=0) as rival:
            while runner.is_alive():
                try:
                    rival.beta.messages.create(
                        model=MODEL,
                        max_tokens=16,
                        messages=[{"role": "user", "content": "rival"}],
                        thread={"type": "continue", "previous_message_id": head},
                        betas=[THREADS_BETA],
                    )
                    status = 200
                except anthropic.APIStatusError as exc:
                    status = exc.status_code
                    assert (
                        cast(dict[str, Any], exc.body)["error"]["details"]["error_code"] == "thread_continue_in_flight"
                    )
                rivals.append((time.monotonic() - summary_started, status))
                if status == 200:
                    break
                runner.join(timeout=0.2)
        runner.join(timeout=30)

        assert [status for _, status in rivals] == [400] * len(rivals), f"a rival took the head: {rivals}"
        assert any(after > 1.5 * SHORT_LEASE_SECONDS for after, _ in rivals), "no rival came after the first lease"
        assert "error" not in outcome, f"the turn failed: {outcome['error']!r}"
        moved = cast(int, outcome["moved"])
        assert conversation.headers[moved] == {"statestore-context": "summarized"}
        assert conversation.info()["context"]["summarized"] == 1
        opening = conversation.view("context")["messages"][0]["content"][0]["text"]
        assert opening.startswith("Summary of the earlier part")
    finally:
        server.stop()
