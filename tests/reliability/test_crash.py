"""Crashes under load: statestore SIGKILLed (and restarted on the same port and database), and its PostgreSQL stopped
the way a crash stops it (`pg_ctl stop -m immediate`, then WAL recovery on start).

What must hold (docs/guarantees.md invariant 1, docs/protocol.md §2 "All or nothing"): every turn whose end a client
received — a JSON reply, or a stream that delivered `message_stop` — is in the database afterwards; no turn is
half-written (positions contiguous, every user turn followed by its own reply); a lease held by a dead request runs out
after `STATESTORE_LEASE_SECONDS`; while the database is down threaded turns get 503 `api_error` quickly; and statestore
recovers by itself once the database is back.

The clients are the official SDK's thread helper (`client.beta.messages.thread(...)`), alternating `send` and
`stream`, against the fake backend, whose replies are slowed down so that the crash finds turns in flight.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import anthropic
import httpx
import orjson
import pytest
from anthropic.types.beta import BetaMessageParam

from statestore.store.migrate import upgrade
from statestore.threads.ids import thread_of_response
from tests.reliability.support import (
    MODEL,
    PrivatePostgres,
    RawClient,
    StoredThread,
    assert_whole_turns,
    echo,
    error_of,
    held_leases,
    held_until,
    live_claims,
    live_leases,
    private_postgres,
    query,
    running_server,
    sse_data,
    stored_threads,
    user,
    wait_for,
)
from tests.support.fake_backend import FakeBackend

LEASE_SECONDS = 2
CLIENTS = 6
SYSTEM = "You answer in one short sentence."
ENV = {"STATESTORE_LEASE_SECONDS": str(LEASE_SECONDS), "STATESTORE_DATABASE_TIMEOUT_SECONDS": "1.5"}
# A turn's end reached the client, or the turn failed, within this; nothing may hang longer.
TURN_BOUND_SECONDS = 5.0


def now_ms() -> int:
    return time.time_ns() // 1_000_000


@pytest.fixture(scope="module")
def fake_backend() -> Iterator[FakeBackend]:
    with FakeBackend() as backend:
        yield backend


@pytest.fixture
def backend(fake_backend: FakeBackend) -> FakeBackend:
    fake_backend.reset()
    return fake_backend


def slow_replies(backend: FakeBackend, count: int = 600) -> None:
    """Replies that take a while: 0.1 s before answering, or a stream that pauses 0.3 s after its first delta (a JSON
    reply then pauses between its headers and its body)."""
    stalled = {"kind": "echo", "stall_after_events": 4, "stall_seconds": 0.3}
    delayed = {"kind": "echo", "delay_seconds": 0.1}
    backend.script(*[stalled if n % 3 == 0 else delayed for n in range(count)])


# == SDK clients under load ==========================================================================================


@dataclass(frozen=True)
class Ack:
    """A turn whose end the client received: the reply's id and the user turn it answers."""

    response_id: str
    text: str
    streamed: bool
    at: float


@dataclass
class Conversation:
    """One SDK thread helper sending turns in a loop (odd turns streamed) until told to stop; failures are noted and
    the loop goes on, as an application would."""

    number: int
    base_url: str
    stop: threading.Event
    api_key: str = field(default_factory=lambda: f"sk-crash-{secrets.token_hex(8)}")
    acks: list[Ack] = field(default_factory=list)
    # (when it started, the exception's type, its HTTP status if any, how long it took)
    failures: list[tuple[float, str, int | None, float]] = field(default_factory=list)
    in_flight: bool = False
    worker: threading.Thread | None = None

    def start(self) -> None:
        self.worker = threading.Thread(target=self._run, name=f"conversation-{self.number}", daemon=True)
        self.worker.start()

    def join(self) -> None:
        assert self.worker is not None
        self.worker.join(timeout=20)
        assert not self.worker.is_alive(), f"conversation {self.number} did not stop"

    def acks_after(self, moment: float) -> int:
        return sum(ack.at > moment for ack in self.acks)

    def _run(self) -> None:
        with anthropic.Anthropic(base_url=self.base_url, api_key=self.api_key, max_retries=0, timeout=10) as client:
            thread = client.beta.messages.thread(model=MODEL, max_tokens=256, system=SYSTEM)
            turn = 0
            while not self.stop.is_set():
                text = f"c{self.number} t{turn}"
                message: BetaMessageParam = {"role": "user", "content": text}
                streamed = turn % 2 == 1
                turn += 1
                started = time.monotonic()
                self.in_flight = True
                try:
                    if streamed:
                        with thread.stream(message) as stream:
                            for event in stream:
                                if event.type == "message_stop":
                                    # The end of the reply reached the client: the turn must be durable now.
                                    reply_id = stream.current_message_snapshot.id
                                    self.acks.append(Ack(reply_id, text, True, time.monotonic()))
                    else:
                        reply = thread.send(message)
                        self.acks.append(Ack(reply.id, text, False, time.monotonic()))
                except Exception as exc:
                    status = getattr(exc, "status_code", None)
                    self.failures.append((started, type(exc).__name__, status, time.monotonic() - started))
                    time.sleep(0.05)  # the server (or its database) is away; try again shortly
                finally:
                    self.in_flight = False


def run_conversations(base_url: str) -> tuple[list[Conversation], threading.Event]:
    stop = threading.Event()
    conversations = [Conversation(n, base_url, stop) for n in range(CLIENTS)]
    for conversation in conversations:
        conversation.start()
    return conversations, stop


def total_acks(conversations: list[Conversation]) -> int:
    return sum(len(c.acks) for c in conversations)


def assert_acknowledged_turns_stored(conversations: list[Conversation], threads: dict[str, StoredThread]) -> int:
    """Every acknowledged reply is in its thread, right after the user turn it answered. Returns how many."""
    checked = 0
    for conversation in conversations:
        for ack in conversation.acks:
            thread_id = thread_of_response(ack.response_id)
            assert thread_id in threads, f"acknowledged reply {ack.response_id} ({ack.text}): its thread is gone"
            stored = threads[thread_id]
            assert ack.response_id in stored.response_ids, f"acknowledged reply {ack.response_id} ({ack.text}) lost"
            position = stored.response_ids.index(ack.response_id)
            assert stored.messages[position - 1] == user(ack.text)
            assert stored.messages[position] == {"role": "assistant", "content": echo(ack.text)}
            checked += 1
    return checked


def assert_exports_match(base_url: str, conversations: list[Conversation], threads: dict[str, StoredThread]) -> int:
    """The owner's export (`GET /statestore/v1/threads/{id}/messages`) of each thread an acknowledgement names is
    what the database holds. Returns how many threads were compared."""
    compared = 0
    for conversation in conversations:
        raw = RawClient(base_url, conversation.api_key)
        try:
            for thread_id in {thread_of_response(ack.response_id) for ack in conversation.acks}:
                assert thread_id is not None
                exported = raw.export(thread_id)
                assert exported["system"] == SYSTEM
                assert exported["messages"] == threads[thread_id].messages
                compared += 1
        finally:
            raw.close()
    return compared


def owner_key(base_url: str, conversations: list[Conversation], thread_id: str) -> str:
    for conversation in conversations:
        response = httpx.get(
            f"{base_url}/statestore/v1/threads/{thread_id}", headers={"x-api-key": conversation.api_key}
        )
        if response.status_code == 200:
            return conversation.api_key
    raise AssertionError(f"no client owns {thread_id}")


def assert_heads_continue(base_url: str, conversations: list[Conversation], database_url: str) -> int:
    """A raw continue from the head of every live thread succeeds (a dead request's lease has run out by now) and
    sends the backend the whole stored conversation. Returns how many threads were continued."""
    continued = 0
    for thread_id, head in query(
        database_url, "SELECT id, head_message_id FROM threads WHERE head_message_id IS NOT NULL"
    ):
        raw = RawClient(base_url, owner_key(base_url, conversations, thread_id))
        try:
            reply = raw.ok([user("after the crash")], head)
            assert reply["content"] == echo("after the crash")
            continued += 1
        finally:
            raw.close()
    return continued


def check_whole(database_url: str) -> dict[str, StoredThread]:
    threads = stored_threads(database_url)  # contiguous positions, head on the last message, no orphan rows
    for stored in threads.values():
        assert_whole_turns(stored, echo)
    return threads


# == statestore SIGKILLed ============================================================================================


def test_sigkill_under_load_keeps_every_acknowledged_turn(
    fresh_pg_url: str, redis_url: str, redis_prefix: str, backend: FakeBackend
) -> None:
    upgrade(fresh_pg_url)
    slow_replies(backend)
    with running_server(
        database_url=fresh_pg_url, upstream_url=backend.url, redis_url=redis_url, redis_prefix=redis_prefix, env=ENV
    ) as server:
        conversations, stop = run_conversations(server.url)
        try:
            wait_for(lambda: total_acks(conversations) >= 3 * CLIENTS, within=20, what="turns before the crash")
            wait_for(lambda: sum(c.in_flight for c in conversations) >= CLIENTS // 2, within=5, what="turns in flight")
            acked_before = total_acks(conversations)
            server.kill()
            killed_at = time.monotonic()
            killed_ms = now_ms()
            # Leases and claims the dead process held: they must run out by themselves, LEASE_SECONDS after they
            # were taken.
            orphaned = live_leases(fresh_pg_url) + live_claims(redis_url, redis_prefix)
            server.start()  # same port, same database
            assert server.starts == 2

            recovered_after = killed_at + LEASE_SECONDS
            wait_for(
                lambda: all(c.acks_after(recovered_after) >= 2 for c in conversations),
                within=25,
                what="every client going on after the restart",
            )
        finally:
            stop.set()
            for conversation in conversations:
                conversation.join()

        failed_at_kill = [f for c in conversations for f in c.failures if f[0] < killed_at + 0.5]
        assert failed_at_kill, "the kill found no turn in flight"
        assert orphaned, "the kill left no lease held: nothing was in flight at the database"
        assert all(until <= killed_ms + LEASE_SECONDS * 1000 for _, until in orphaned), orphaned
        slow = [f for c in conversations for f in c.failures if f[3] > TURN_BOUND_SECONDS]
        assert not slow, slow

        threads = check_whole(fresh_pg_url)
        acked = assert_acknowledged_turns_stored(conversations, threads)
        assert acked == total_acks(conversations) >= acked_before + 2 * CLIENTS
        assert assert_exports_match(server.url, conversations, threads) >= CLIENTS
        assert not live_leases(fresh_pg_url)
        assert not live_claims(redis_url, redis_prefix)
        backend.reset()
        assert assert_heads_continue(server.url, conversations, fresh_pg_url) == len(
            [t for t in threads.values() if t.head_message_id is not None]
        )
        check_whole(fresh_pg_url)
        print(
            f"acknowledged {acked} turns ({acked_before} before the kill) in {len(threads)} threads; "
            f"{len(failed_at_kill)} turns failed at the kill, {len(orphaned)} leases orphaned; "
            f"failures {Counter(f[1:3] for c in conversations for f in c.failures)}"
        )


def test_sigkill_mid_stream_stores_nothing_and_the_lease_runs_out(
    fresh_pg_url: str, redis_url: str, redis_prefix: str, backend: FakeBackend
) -> None:
    """The server dies while it relays a stream. A second statestore on the same database and cache (as in a
    deployment of several) sees the dead request's lease at once, and takes the head once the lease has run out."""
    upgrade(fresh_pg_url)
    settings = {
        "database_url": fresh_pg_url,
        "upstream_url": backend.url,
        "redis_url": redis_url,
        "redis_prefix": redis_prefix,
        "env": ENV,
    }
    with running_server(**settings) as doomed, running_server(**settings) as standby:
        raw = RawClient(doomed.url, f"sk-crash-{secrets.token_hex(8)}")
        other = RawClient(standby.url, raw.api_key)
        try:
            first = raw.ok([user("one")], system=SYSTEM)
            second = raw.ok([user("two")], first["id"])
            thread_id = thread_of_response(second["id"])
            assert thread_id is not None
            # message_start, ping, content_block_start, a text delta; then the backend pauses with the stream open.
            backend.script({"kind": "echo", "stall_after_events": 4, "stall_seconds": 5})
            received = b""
            taken_ms = now_ms()
            body = orjson.dumps(raw.body([user("three")], second["id"], stream=True))
            with raw.http.stream("POST", "/v1/messages", content=body) as response:
                assert response.status_code == 200
                chunks = response.iter_raw()
                while b"content_block_delta" not in received:
                    received += next(chunks)
                doomed.kill()
                with pytest.raises(httpx.HTTPError):
                    for chunk in chunks:
                        received += chunk
            events = sse_data(received)
            assert [e["type"] for e in events] == [
                "message_start",
                "ping",
                "content_block_start",
                "content_block_delta",
            ]
            partial_id = events[0]["message"]["id"]

            # Nothing of the turn was written; the dead request's hold on the head is there (a claim in Redis, and a
            # lease once the turn ran a third of one), bounded by LEASE_SECONDS.
            [(head, position)] = query(
                fresh_pg_url, "SELECT head_message_id, head_position FROM threads WHERE id = :id", {"id": thread_id}
            )
            assert (head, position) == (second["id"], 4)
            until = held_until(fresh_pg_url, redis_url, redis_prefix, thread_id)
            assert until is not None and taken_ms < until <= now_ms() + LEASE_SECONDS * 1000
            check_whole(fresh_pg_url)
            refused = other.turn([user("three, again")], second["id"])
            assert now_ms() < until, "the test was too slow to see the lease"
            assert (refused.status_code, error_of(refused)["details"]["error_code"]) == (
                400,
                "thread_continue_in_flight",
            )

            def continued() -> bool:
                return other.turn([user("three, again")], second["id"]).status_code == 200

            wait_for(continued, within=LEASE_SECONDS + 1, interval=0.1, what="the head free again")
            assert until <= now_ms() < taken_ms + (LEASE_SECONDS + 1) * 1000
            assert backend.requests()[-1].json()["messages"] == [
                user("one"),
                {"role": "assistant", "content": echo("one")},
                user("two"),
                {"role": "assistant", "content": echo("two")},
                user("three, again"),
            ]
            gone = other.turn([user("four")], partial_id)
            assert (gone.status_code, error_of(gone)["details"]["error_code"]) == (404, "thread_not_found")
            assert len(check_whole(fresh_pg_url)[thread_id].messages) == 6
            assert held_leases(fresh_pg_url) == 0
        finally:
            raw.close()
            other.close()


# == the database crashes ============================================================================================


@pytest.fixture
def crash_pg() -> Iterator[PrivatePostgres]:
    with private_postgres() as pg:
        upgrade(pg.url)
        yield pg


def test_database_crash_under_load_keeps_acknowledged_turns_and_recovers(
    crash_pg: PrivatePostgres, redis_url: str, redis_prefix: str, backend: FakeBackend
) -> None:
    slow_replies(backend)
    with running_server(
        database_url=crash_pg.url, upstream_url=backend.url, redis_url=redis_url, redis_prefix=redis_prefix, env=ENV
    ) as server:
        conversations, stop = run_conversations(server.url)
        try:
            wait_for(lambda: total_acks(conversations) >= 3 * CLIENTS, within=20, what="turns before the crash")
            acked_before = total_acks(conversations)
            crash_pg.crash()
            crashed_at = time.monotonic()
            time.sleep(1.5)  # down for a while, under load
            acked_while_down = sum(c.acks_after(crashed_at + 0.5) for c in conversations)
            crash_pg.start()
            back_at = time.monotonic()
            # The same statestore process, with no restart, serves every client again (after the leases of the turns
            # the crash broke run out).
            wait_for(
                lambda: all(c.acks_after(back_at + LEASE_SECONDS) >= 2 for c in conversations),
                within=25,
                what="every client going on after the database came back",
            )
        finally:
            stop.set()
            for conversation in conversations:
                conversation.join()
        assert server.process is not None and server.process.poll() is None and server.starts == 1
        recovery = min(ack.at for c in conversations for ack in c.acks if ack.at > back_at) - back_at

        during = [f for c in conversations for f in c.failures if crashed_at <= f[0] <= back_at]
        assert during, "no turn was tried while the database was down"
        assert acked_while_down == 0
        # Server errors or broken connections; never a 4xx (the SDK replays thread rejections by itself).
        assert all(f[2] is None or f[2] >= 500 for f in during), during
        slow = [f for c in conversations for f in c.failures if f[3] > TURN_BOUND_SECONDS]
        assert not slow, slow

        threads = check_whole(crash_pg.url)
        acked = assert_acknowledged_turns_stored(conversations, threads)
        assert acked == total_acks(conversations) >= acked_before + 2 * CLIENTS
        assert assert_exports_match(server.url, conversations, threads) >= CLIENTS
        wait_for(lambda: not live_leases(crash_pg.url), within=LEASE_SECONDS + 1, what="leases running out")
        backend.reset()
        continued = assert_heads_continue(server.url, conversations, crash_pg.url)
        assert continued == len([t for t in threads.values() if t.head_message_id is not None])
        check_whole(crash_pg.url)
        print(
            f"acknowledged {acked} turns ({acked_before} before the crash); recovered {recovery:.2f} s after the "
            f"database came back; failures while down {Counter(f[1:3] for f in during)}"
        )


def _probe(raw: RawClient, kind: str, head: str) -> httpx.Response:
    if kind == "create":
        return raw.turn([user("create while down")])
    if kind == "continue":
        return raw.turn([user("continue while down")], head)
    if kind == "stream":
        return raw.turn([user("stream while down")], head, stream=True)
    # A session turn (docs/protocol.md §6).
    body = {"model": MODEL, "max_tokens": 64, "messages": [user("session while down")]}
    return raw.http.post(
        "/v1/messages", content=orjson.dumps(body), headers={"statestore-session-id": "reliability-session"}
    )


def test_database_down_threaded_turns_get_503_quickly(crash_pg: PrivatePostgres, backend: FakeBackend) -> None:
    """docs/protocol.md §4: "database unreachable for a threaded turn → 503 api_error". The first probes meet the
    pool's dead connections, the later ones a refused connect; both must be 503, not 500, and quick."""
    with running_server(database_url=crash_pg.url, upstream_url=backend.url, env=ENV) as server:
        raw = RawClient(server.url, f"sk-crash-{secrets.token_hex(8)}")
        try:
            first = raw.ok([user("one")], system=SYSTEM)
            head = raw.ok([user("two")], first["id"])["id"]
            crash_pg.crash()

            seen: Counter[tuple[str, int, str]] = Counter()
            slowest = 0.0
            for _ in range(3):
                for kind in ("create", "continue", "stream", "session"):
                    started = time.monotonic()
                    response = _probe(raw, kind, head)
                    slowest = max(slowest, time.monotonic() - started)
                    seen[(kind, response.status_code, error_of(response)["type"])] += 1
            ready = httpx.get(server.url + "/readyz", timeout=10)
            relayed = raw.http.post(
                "/v1/messages",
                content=orjson.dumps({"model": MODEL, "max_tokens": 64, "messages": [user("stateless")]}),
            )
            crash_pg.start()
            wait_for(lambda: raw.turn([user("three")], head).status_code == 200, within=5, what="turns served again")

            assert slowest < TURN_BOUND_SECONDS, slowest
            # A stateless relay does not need the database.
            assert relayed.status_code == 200
            assert (ready.status_code, ready.json()["status"], ready.json()["database"]) == (
                503,
                "not_ready",
                "unavailable",
            )
            assert seen == Counter(
                {(kind, 503, "api_error"): 3 for kind in ("create", "continue", "stream", "session")}
            ), f"threaded turns with the database down must be 503 api_error (docs/protocol.md §4); got {dict(seen)}"
        finally:
            raw.close()
        assert httpx.get(server.url + "/readyz", timeout=10).status_code == 200
        threads = check_whole(crash_pg.url)
        thread_id = thread_of_response(head)
        assert thread_id is not None
        assert [m["content"] for m in threads[thread_id].messages[::2]] == ["one", "two", "three"]


def test_database_hung_threaded_turns_fail_within_a_bound(crash_pg: PrivatePostgres, backend: FakeBackend) -> None:
    """A database that accepts connections and never answers (SIGSTOP: a partition, a stuck disk): threaded turns must
    still end, as 503 api_error, and /readyz must say not ready, within a bound rather than hang."""
    with running_server(database_url=crash_pg.url, upstream_url=backend.url, env=ENV) as server:
        raw = RawClient(server.url, f"sk-crash-{secrets.token_hex(8)}", timeout=TURN_BOUND_SECONDS + 1)
        try:
            head = raw.ok([user("one")], system=SYSTEM)["id"]
            outcomes: dict[str, str] = {}

            def probe(name: str, call: Callable[[], httpx.Response]) -> None:
                started = time.monotonic()
                try:
                    response = call()
                    outcomes[name] = f"{response.status_code} after {time.monotonic() - started:.1f} s"
                except httpx.TimeoutException:
                    outcomes[name] = f"no answer within {TURN_BOUND_SECONDS + 1} s"

            pids = crash_pg.pause()
            try:
                probes = [
                    threading.Thread(target=probe, args=("continue", lambda: raw.turn([user("two")], head))),
                    threading.Thread(target=probe, args=("create", lambda: raw.turn([user("new")]))),
                    threading.Thread(
                        target=probe,
                        args=("readyz", lambda: httpx.get(server.url + "/readyz", timeout=TURN_BOUND_SECONDS + 1)),
                    ),
                ]
                for thread in probes:
                    thread.start()
                for thread in probes:
                    thread.join()
            finally:
                crash_pg.resume(pids)
            statuses = {name: outcome.split(" ", 1)[0] for name, outcome in outcomes.items()}
            assert statuses == {"continue": "503", "create": "503", "readyz": "503"}, outcomes
        finally:
            raw.close()


def test_database_down_thread_and_admin_api_get_503(crash_pg: PrivatePostgres, backend: FakeBackend) -> None:
    """Found by the fault campaign: while the database was down, the thread API and the admin erasure answered 500
    (the outage's exception reached the catch-all) where a threaded turn answers 503. Every route that needs the
    database must answer 503 `api_error`, which a client may retry, and serve again once the database is back."""
    admin_token = "adm-" + "c4m" * 8
    env = {**ENV, "STATESTORE_ADMIN_TOKENS": f"root:{admin_token}"}
    with running_server(database_url=crash_pg.url, upstream_url=backend.url, env=env) as server:
        raw = RawClient(server.url, f"sk-crash-{secrets.token_hex(8)}")
        admin = {"authorization": f"Bearer {admin_token}"}
        try:
            reply = raw.ok([user("one")], metadata={"user_id": "crash-user"})
            thread_id = thread_of_response(reply["id"])
            assert thread_id is not None
            calls: dict[str, Callable[[], httpx.Response]] = {
                "list": lambda: raw.http.get("/statestore/v1/threads"),
                "info": lambda: raw.http.get(f"/statestore/v1/threads/{thread_id}"),
                "export": lambda: raw.http.get(f"/statestore/v1/threads/{thread_id}/messages"),
                "session": lambda: raw.http.get("/statestore/v1/sessions/some-session"),
                "delete": lambda: raw.http.delete(f"/statestore/v1/threads/{thread_id}"),
                "erase": lambda: raw.http.post("/admin/v1/erase", json={"user_id": "crash-user"}, headers=admin),
            }
            crash_pg.crash()
            seen = {}
            for _ in range(2):  # the pool's dead connections first, then refused connects
                for name, call in calls.items():
                    response = call()
                    seen[name] = (response.status_code, error_of(response)["type"])
                    assert "Traceback" not in response.text
            crash_pg.start()
            assert seen == dict.fromkeys(calls, (503, "api_error")), seen
            wait_for(
                lambda: raw.http.get(f"/statestore/v1/threads/{thread_id}").status_code == 200,
                within=10,
                what="the thread API served again",
            )
        finally:
            raw.close()
