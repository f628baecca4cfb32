"""The backup and restore drill (docs/deployment.md, "Backups, restores and erasure"): `pg_dump` while clients keep
turning, then a restore into a fresh database with Redis flushed, served by a new statestore process.

A dump is one snapshot, so the restore must be a point-in-time view: every turn acknowledged before the dump began is
there, no turn that began after the dump ended is, each thread's history is a prefix of what it became on the
original, no removed thread returns, and every thread continues from its restored head."""

from __future__ import annotations

import asyncio
import subprocess
import time
from pathlib import Path

import pytest

from tests.campaign.campaign import owner_threads
from tests.campaign.checker import op_of
from tests.campaign.cluster import REPLICA_SETTINGS, running_cluster
from tests.campaign.history import History, Op
from tests.campaign.workload import NEVER_STORED, Client, ThreadState
from tests.reliability.support import PG_BIN, ServerProcess
from tests.support.fake_backend import FakeBackend

CLIENTS = 8


def _run(*command: str) -> None:
    done = subprocess.run(command, capture_output=True, timeout=120, check=False)
    assert done.returncode == 0, f"{command[0]} failed: {done.stderr.decode(errors='replace')}"


async def _load(clients: list[Client], seconds: float) -> None:
    stop = asyncio.Event()
    tasks = [asyncio.create_task(client.run(stop)) for client in clients]
    await asyncio.sleep(seconds)
    stop.set()
    await asyncio.gather(*tasks)


async def _histories(clients: list[Client]) -> dict[str, tuple[Client, str, list[str]]]:
    found: dict[str, tuple[Client, str, list[str]]] = {}
    for client in clients:
        for key, (thread_id, texts) in (await owner_threads(client)).items():
            found[key] = (client, thread_id, texts)
    return found


def _turns_before(history: History, moment: float) -> dict[str, list[Op]]:
    by_key: dict[str, list[Op]] = {}
    for op in history.ops:
        if op.is_turn and op.outcome == "ok" and op.end < moment:
            by_key.setdefault(op.thread_key, []).append(op)
    return by_key


@pytest.mark.timeout(240)
async def test_dump_under_load_restores_a_point_in_time_that_continues(tmp_path: Path) -> None:
    with running_cluster(replicas=2) as cluster:
        history = History()
        clients = [Client(index, cluster.url, history, cluster.backend, seed=77) for index in range(CLIENTS)]
        for client in clients:
            client.settings.backend_fault_rate = 0.0
        dump = tmp_path / "statestore.dump"
        port = str(cluster.pg.port)

        async def dump_midway() -> tuple[float, float]:
            await asyncio.sleep(4)
            began = history.now()
            await asyncio.to_thread(
                _run, str(PG_BIN / "pg_dump"), "-h", "127.0.0.1", "-p", port, "-U", "postgres", "-Fc", "-f", str(dump),
                "postgres",
            )  # fmt: skip
            return began, history.now()

        (began, ended), _ = await asyncio.gather(dump_midway(), _load(clients, 9))
        original = await _histories(clients)

        # The restore: a fresh database, the dump loaded into it, Redis emptied, a new process on them.
        _run(str(PG_BIN / "createdb"), "-h", "127.0.0.1", "-p", port, "-U", "postgres", "restored")
        _run(str(PG_BIN / "pg_restore"), "-h", "127.0.0.1", "-p", port, "-U", "postgres", "-d", "restored", str(dump))
        with cluster.redis.client() as redis_client:
            redis_client.flushall()
        restored_url = cluster.database_url.rsplit("/", 1)[0] + "/restored"
        server = ServerProcess(
            database_url=restored_url,
            upstream_url=cluster.backend.url,
            redis_url=cluster.redis.url,
            env=REPLICA_SETTINGS,
        )
        try:
            await _check_restore(clients, history, original, server.url, began, ended, cluster.backend)
        finally:
            server.stop()
            for client in clients:
                await client.close()


async def _check_restore(
    clients: list[Client],
    history: History,
    original: dict[str, tuple[Client, str, list[str]]],
    url: str,
    began: float,
    ended: float,
    backend: FakeBackend,
) -> None:
    for client in clients:
        client.http.base_url = url
    restored = await _histories(clients)
    ops = {op.id: op for op in history.ops}
    problems: list[str] = []
    # A removal acknowledged before the dump began is in the snapshot; one that overlapped the dump may be.
    maybe_removed = {
        op.thread_key
        for op in history.ops
        if op.kind in ("delete", "erase") and op.outcome != "fail" and op.start < ended
    }
    removed_before = {
        op.thread_key for op in history.ops if op.kind in ("delete", "erase") and op.outcome == "ok" and op.end < began
    }
    for key, turns in _turns_before(history, began).items():
        if key in removed_before or key in maybe_removed:
            continue
        if key not in restored:
            problems.append(f"{key}: acknowledged before the dump, missing after the restore")
            continue
        texts = restored[key][2]
        problems += [
            f"{key}: {op.id} acknowledged before the dump, not restored" for op in turns if op.text() not in texts
        ]
    for key, (_, _, texts) in restored.items():
        if key in removed_before:
            problems.append(f"{key}: removed before the dump, back after the restore")
        for text in texts:
            op = ops.get(op_of(text)[1])
            if op is None or op.outcome == "fail" or op.backend_fault in NEVER_STORED:
                problems.append(f"{key}: {text!r} was never stored")
            elif op.start > ended:
                problems.append(f"{key}: {op.id} began after the dump ended, yet restored")
        if key in original and original[key][2][: len(texts)] != texts:
            problems.append(f"{key}: restored history is not a prefix of the original's")
    assert not problems, (problems, [op.brief() for op in history.ops if op.thread_key in str(problems)][:40])
    # Every restored thread continues from its restored head; a lease the dump caught runs out within its time.
    backend.reset()
    deadline = time.monotonic() + float(REPLICA_SETTINGS["STATESTORE_LEASE_SECONDS"]) + 10
    for key, (client, thread_id, texts) in restored.items():
        # A keyed thread of the keyed workload (KT…) is not among the client's own: its state is made here, as the
        # campaign's heal does.
        state = next((t for t in client.all_threads if t.key == key), None) or ThreadState(
            key=key, user_id="", thread_id=thread_id
        )
        while True:
            if key.startswith("S"):
                op = await client.turn("heal", state, previous_id=None, session=key)
            else:
                head = (await client.http.get(f"/statestore/v1/threads/{thread_id}")).json()["head_message_id"]
                op = await client.turn("heal", state, previous_id=head)
            if op.outcome == "ok" or op.error != "thread_continue_in_flight" or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.5)
        assert op.outcome == "ok", (key, op.brief())
        sent = [m["content"] for m in backend.requests()[-1].json()["messages"] if m["role"] == "user"]
        assert sent == [*texts, op.text()], f"{key}: the continue did not rebuild the restored history"
