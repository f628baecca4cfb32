"""Losing a replica: SIGKILL in the middle of a run, and SIGTERM (a rolling upgrade, a scale-down) during a slow
stream. Three replicas on one PostgreSQL database behind HAProxy, Redis Cluster, the official SDK through HAProxy."""

from __future__ import annotations

import signal
import threading
import time
from dataclasses import dataclass, field

import httpx
import pytest

from tests.scaleout.clients import (
    MODEL,
    RecordingClient,
    Seen,
    ThreadApi,
    error_code,
    message_text,
    new_api_key,
    user,
)
from tests.scaleout.conftest import StartFleet, query
from tests.scaleout.processes import REPLICA_HEADER, port_refuses, wait_for
from tests.support.fake_backend import FakeBackend

LEASE_SECONDS = 3
WORKERS = 6
TURNS_AFTER_KILL = 3  # each worker goes on this many turns after the kill, then stops
MAX_WORKER_TURNS = 60  # bounds the run if the kill never comes
BACKEND_DELAY_SECONDS = 0.25  # every worker turn is in flight this long, so the kill finds some mid-request
WORKER_RETRIES = 6  # the SDK's own retries: through HAProxy, a retry lands on another replica
STALLED_STREAM_SECONDS = 12  # outlasts the wait for the kill (10 s at most); the fake backend sleeps it out


def _now_ms() -> int:
    return time.time_ns() // 1_000_000


@dataclass
class Worker:
    index: int
    api_key: str
    acknowledged: list[str] = field(default_factory=list)  # the user text of every turn that got its reply
    history: list[tuple[str, str]] = field(default_factory=list)
    head_message_id: str | None = None
    seen: list[Seen] = field(default_factory=list)
    lost_responses: int = 0  # requests that got no HTTP response (connection cut) and were retried by the SDK
    error: BaseException | None = None

    def run(self, base_url: str, killed: threading.Event) -> None:
        """Turns one after another until TURNS_AFTER_KILL turns were acknowledged after the kill."""
        try:
            with RecordingClient(base_url, self.api_key, max_retries=WORKER_RETRIES) as client:
                thread = client.sdk.beta.messages.thread(model=MODEL, max_tokens=256, system="Count along.")
                after_kill = 0
                for turn in range(1, MAX_WORKER_TURNS + 1):
                    if killed.is_set():
                        after_kill += 1
                    if after_kill > TURNS_AFTER_KILL:
                        break
                    text = f"worker {self.index}, turn {turn}"
                    thread.send(user(text))
                    self.acknowledged.append(text)
                self.history = [message_text(m) for m in thread.messages]
                self.head_message_id = thread.previous_message_id
                self.seen = list(client.seen)
                self.lost_responses = client.attempts - len(client.seen)
        except BaseException as exc:
            self.error = exc


def test_sigkill_a_replica_mid_run_loses_no_acknowledged_turn(start_fleet: StartFleet, backend: FakeBackend) -> None:
    fleet = start_fleet(STATESTORE_LEASE_SECONDS=str(LEASE_SECONDS))
    stalled_key = new_api_key("stalled")
    stalled = ThreadApi(fleet.url, stalled_key)
    created = stalled.create("before the crash")
    assert created.status_code == 200, created.text
    stalled_head = created.json()["id"]
    stalled_thread = created.headers["statestore-thread-id"]

    # A stream held open on one replica picks the victim: it will die holding that thread's lease.
    backend.script({"kind": "echo", "stall_after_events": 2, "stall_seconds": STALLED_STREAM_SECONDS})
    lease_taken_at = time.monotonic()
    body = stalled.body(
        [user("during the crash")], {"type": "continue", "previous_message_id": stalled_head}, stream=True
    )
    workers = [Worker(index, new_api_key(f"w{index}")) for index in range(WORKERS)]
    killed = threading.Event()
    threads = [threading.Thread(target=w.run, args=(fleet.url, killed), name=f"worker-{w.index}") for w in workers]
    with stalled.http.stream("POST", "/v1/messages", json=body) as stream:
        assert stream.status_code == 200
        victim = fleet.replica(stream.headers[REPLICA_HEADER])
        lines = stream.iter_lines()
        assert next(lines) == "event: message_start"
        # Every worker turn now waits BACKEND_DELAY_SECONDS at the backend.
        backend.script(*[{"kind": "echo", "delay_seconds": BACKEND_DELAY_SECONDS}] * (WORKERS * MAX_WORKER_TURNS * 2))
        for thread in threads:
            thread.start()
        # Kill while the victim holds the stalled stream and at least two worker turns.
        wait_for(
            "continues in flight on the victim",
            lambda: min(len(w.acknowledged) for w in workers) >= 2 and fleet.haproxy.current_sessions(victim.name) >= 3,
            timeout=10,
        )
        victim.kill()
        killed_at_ms = _now_ms()
        killed.set()

        # Its lease outlives it, until it expires: a continue from the same id is refused as in flight meanwhile.
        probe_started = time.monotonic()
        probe = stalled.continue_(stalled_head, "while the lease is held")
        if probe_started - lease_taken_at < LEASE_SECONDS - 0.5:
            assert probe.status_code == 400, probe.text
            assert error_code(probe) == "thread_continue_in_flight"

        # The client of the stream sees it cut (no message_stop): that turn was never acknowledged.
        rest: list[str] = []
        with pytest.raises(httpx.HTTPError):
            rest.extend(lines)
        assert "event: message_stop" not in rest

    for thread in threads:
        thread.join(timeout=90)
    stalled.close()
    assert not any(t.is_alive() for t in threads), "workers still running after 90 s"
    failures = {w.index: repr(w.error) for w in workers if w.error is not None}
    assert not failures, f"{failures}\n{fleet.logs()}"

    # Every acknowledged turn is in the thread the client now continues from, once, in order.
    for worker in workers:
        turns = len(worker.acknowledged)
        assert turns >= 2 + TURNS_AFTER_KILL
        assert worker.acknowledged == [f"worker {worker.index}, turn {turn}" for turn in range(1, turns + 1)]
        assert worker.head_message_id is not None
        with ThreadApi(fleet.url, worker.api_key) as api:
            info = api.thread_with_head(worker.head_message_id)
            assert info["message_count"] == 2 * turns
            exported = api.export(info["id"])
        assert [message_text(m) for m in exported["messages"]] == worker.history
        assert [text for role, text in worker.history if role == "user"] == worker.acknowledged

    # The kill cut worker turns off mid-request (HAProxy answers 502, or closes the client connection as the replica
    # did); the SDK retried each through HAProxy, on a surviving replica.
    disrupted = sum(w.lost_responses + sum(1 for s in w.seen if s.status >= 500) for w in workers)
    assert disrupted >= 1, fleet.logs()
    # A continue the dead replica held the lease of comes back as thread_continue_in_flight: the SDK then replays the
    # whole history under a new thread. Counted for the report line below; which turns were cut is up to timing.
    replays: dict[int, int] = {}
    for worker in workers:
        with ThreadApi(fleet.url, worker.api_key) as api:
            replays[worker.index] = len(api.threads()) - 1

    # No lease outlives its expiry. The dead replica's leases are the only ones left, each running out at most
    # LEASE_SECONDS after the kill; once they have, every thread is continuable again. The stalled turn holds its head
    # by a claim in Redis (store/thread_claims.py) and takes the database's lease as well only at its first renewal,
    # a third of the lease in, which the kill may come before: its thread is among these leases or not, and its claim,
    # renewed at the latest as the replica died, runs out LEASE_SECONDS after the kill too.
    leases = query(
        fleet.database_url, "SELECT id, head_message_id, lease_expires_ms FROM threads WHERE lease_token IS NOT NULL"
    )
    latest_expiry_ms = max((int(row.lease_expires_ms) for row in leases), default=killed_at_ms)
    assert latest_expiry_ms <= killed_at_ms + LEASE_SECONDS * 1000
    time.sleep(max(0.0, (killed_at_ms + LEASE_SECONDS * 1000 - _now_ms()) / 1000) + 0.2)

    with ThreadApi(fleet.url, stalled_key) as api:
        resumed = api.continue_(stalled_head, "after the lease ran out")
        assert resumed.status_code == 200, resumed.text
        info = api.thread(stalled_thread)
        assert info["message_count"] == 4  # the create and this turn: the cut turn stored nothing
        texts = [text for role, text in map(message_text, api.export(stalled_thread)["messages"]) if role == "user"]
        assert texts == ["before the crash", "after the lease ran out"]
    leased_with_head = {row.id: row.head_message_id for row in leases if row.head_message_id is not None}
    for worker in workers:
        with ThreadApi(fleet.url, worker.api_key) as api:
            for thread_info in api.threads():
                if thread_info["id"] in leased_with_head:
                    again = api.continue_(leased_with_head[thread_info["id"]], "after the lease ran out")
                    assert again.status_code == 200, again.text
    still_leased = "SELECT id FROM threads WHERE lease_token IS NOT NULL AND head_message_id IS NOT NULL"
    assert query(fleet.database_url, still_leased) == []
    print(f"disrupted={disrupted} replays={replays} leases_left_by_the_dead={len(leases)}")


GRACE_SECONDS = 10
STALL_SECONDS = 4.0


def test_sigterm_lets_a_slow_stream_finish_and_refuses_new_connections(
    start_fleet: StartFleet, backend: FakeBackend
) -> None:
    fleet = start_fleet(graceful_timeout=GRACE_SECONDS)
    api_key = new_api_key("graceful")
    with RecordingClient(fleet.url, api_key) as client, ThreadApi(fleet.url, api_key) as api:
        thread = client.sdk.beta.messages.thread(model=MODEL, max_tokens=256)
        first = thread.send(user("first"))
        thread_id = client.turns()[-1].thread_id
        assert thread_id is not None

        backend.script({"kind": "echo", "stall_after_events": 2, "stall_seconds": STALL_SECONDS})
        events: list[str] = []
        with thread.stream(user("a slow one")) as stream:
            iterator = iter(stream)
            events.append(next(iterator).type)
            victim = fleet.replica(stream.response.headers[REPLICA_HEADER])
            victim.terminate()
            terminated_at = time.monotonic()

            # While the stream is still in flight the replica stops listening: new connections are refused, and
            # requests through HAProxy go to the other replicas.
            wait_for("the terminating replica to refuse connections", lambda: port_refuses(victim.port), timeout=3)
            assert victim.process.poll() is None, "the replica must stay up for its in-flight stream"
            for _ in range(4):
                listed = api.http.get("/statestore/v1/threads")
                assert listed.status_code == 200
                assert listed.headers[REPLICA_HEADER] != victim.name

            events.extend(event.type for event in iterator)
            finished_at = time.monotonic()
            reply = stream.get_final_message()

        assert events[0] == "message_start"
        assert events[-1] == "message_stop", events
        assert finished_at - terminated_at < GRACE_SECONDS
        assert reply.content[0].type == "text"
        assert reply.content[0].text == "echo: a slow one"

        # The replica exits once the stream is done, well within the grace.
        victim.process.wait(timeout=GRACE_SECONDS)
        assert victim.process.returncode in (0, -signal.SIGTERM), victim.log()
        assert time.monotonic() - terminated_at < GRACE_SECONDS
        assert "Waiting for connections to close" in victim.log()

        # The streamed turn was stored (before message_stop reached the client) and the thread goes on elsewhere.
        info = api.thread(thread_id)
        assert info["message_count"] == 4
        assert info["head_message_id"] == reply.id == thread.previous_message_id
        thread.send(user("after the shutdown"))
        assert client.turns()[-1].thread_id == thread_id  # continued, not replayed under a new thread
        assert client.turns()[-1].replica != victim.name
        assert api.thread(thread_id)["message_count"] == 6
        assert first.id != reply.id
