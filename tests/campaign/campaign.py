"""One campaign: clients and the nemesis against a cluster, then healing, a continue of every live thread, the final
state collected, and the checker's verdict."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import orjson

from tests.campaign.checker import Anomalies, Checker, FinalState, op_of
from tests.campaign.cluster import REPLICA_SETTINGS, Cluster, read_after_heal
from tests.campaign.history import History, Op
from tests.campaign.keyed_check import keyed_counts, keyed_state
from tests.campaign.nemesis import CommitNemesis, Nemesis
from tests.campaign.workload import Client, ThreadState
from tests.reliability.support import query

HEAL_WITHIN = 30.0
# How long after healing a background response may still be queued or running (a killed replica's claims run out
# within a lease, and another replica then claims them): a few lease periods.
BACKGROUND_GRACE = 3 * float(REPLICA_SETTINGS["STATESTORE_LEASE_SECONDS"])


@dataclass(frozen=True)
class Plan:
    seed: int
    clients: int
    min_ops: int
    min_faults: int
    min_seconds: float
    max_seconds: float
    mean_gap: float
    mean_hold: float
    commit_gap: float  # the commit nemesis's mean gap between faults (tests/campaign/nemesis.py)


@dataclass
class Report:
    plan: Plan
    ops: int
    turns: int
    faults: int
    backend_faults: int
    threads: int
    seconds: float
    outcomes: dict[str, int]
    background: dict[str, int]
    keyed: dict[str, int]
    anomalies: Anomalies
    history_file: Path

    def summary(self) -> str:
        return (
            f"campaign seed={self.plan.seed}: {self.ops} ops ({self.turns} turns, outcomes {self.outcomes}), "
            f"{self.faults} nemesis faults + {self.backend_faults} backend faults, {self.threads} threads, "
            f"background responses by how they ended {self.background}, keyed writes {self.keyed}, "
            f"{self.seconds:.0f} s; anomalies: {self.anomalies.counts() or 'none'}; history: {self.history_file}"
        )


async def _workload(cluster: Cluster, plan: Plan, history: History, clients: list[Client]) -> None:
    stop = asyncio.Event()
    nemesis = Nemesis(cluster, history, plan.seed, mean_gap=plan.mean_gap, mean_hold=plan.mean_hold)
    commits = CommitNemesis(cluster, history, plan.seed, mean_gap=plan.commit_gap, mean_hold=plan.mean_hold)
    tasks = [asyncio.create_task(client.run(stop)) for client in clients]
    chaos = asyncio.gather(nemesis.run(stop), commits.run(stop))
    started = time.monotonic()
    while True:
        await asyncio.sleep(0.5)
        elapsed = time.monotonic() - started
        enough = len(history.ops) >= plan.min_ops and len(history.faults) >= plan.min_faults
        if elapsed >= plan.max_seconds or (enough and elapsed >= plan.min_seconds):
            break
    stop.set()
    for client in clients:
        client.stopping()
    await chaos
    await asyncio.gather(*tasks)


async def _heal_thread(client: Client, state: ThreadState) -> Op | None:
    """Continue a live thread once the faults have stopped: its head from the thread API, then a continue from it.
    A lease left by a killed replica holds the thread for at most the lease time; that refusal is retried."""
    deadline = time.monotonic() + HEAL_WITHIN
    op: Op | None = None
    while time.monotonic() < deadline:
        if state.key.startswith("S"):
            op = await client.turn("heal", state, previous_id=None, session=state.key)
        else:
            head = await client.head(state)
            if head.outcome == "fail":
                return None
            if head.outcome == "unknown":
                await asyncio.sleep(0.5)
                continue
            op = await client.turn("heal", state, previous_id=head.message_id)
        # Retried: a lease a killed replica left (held for at most the lease time), and a 5xx or a cut connection
        # while the replicas' pools replace the connections the faults broke. Anything else is the verdict.
        if op.outcome == "ok" or (op.outcome == "fail" and op.error != "thread_continue_in_flight"):
            return op
        await asyncio.sleep(0.5)
    return op


def _erased(reply: httpx.Response) -> bool:
    with contextlib.suppress(ValueError, KeyError, TypeError):
        return bool(reply.json()["error"]["details"]["error_code"] == "content_erased")
    return False


def _removal_in_doubt(client: Client, thread_id: str) -> bool:
    return any(
        op.thread_id == thread_id and op.kind in ("delete", "erase") and op.outcome == "unknown"
        for op in client.history.ops
    )


async def owner_threads(client: Client) -> dict[str, tuple[str, list[str]]]:
    """Every live thread of the client's owner: thread key -> (thread id, history texts). A second thread for one
    key is returned under the key with a `#` suffix, which the checker reports."""
    found: dict[str, tuple[str, list[str]]] = {}
    reply = await read_after_heal(client.http, "/statestore/v1/threads", {"limit": 1000})
    reply.raise_for_status()
    for item in reply.json()["data"]:
        exported = await read_after_heal(client.http, f"/statestore/v1/threads/{item['id']}/messages")
        if exported.status_code == 404 and _erased(exported):
            # An erasure that failed after destroying the thread's data key (encryption at rest destroys keys first):
            # its content is erased, its rows left for the next erasure; the thread counts as gone.
            continue
        if exported.status_code == 404 and _removal_in_doubt(client, item["id"]):
            # A delete whose answer was lost may still be running (a request a replica held while its database was
            # cut off, going on once healed) and end between the list and this read: the thread counts as gone, as
            # the checker allows for a removal of unknown outcome.
            continue
        exported.raise_for_status()
        texts = [m["content"] for m in exported.json()["messages"] if m["role"] == "user"]
        key = op_of(texts[0])[0] if texts else f"empty:{item['id']}"
        while key in found:
            key += "#"
        found[key] = (item["id"], texts)
    return found


def _backend_rebuilds(cluster: Cluster) -> list[list[dict[str, Any]]]:
    rebuilds = []
    for request in cluster.backend.requests():
        if request.method == "POST" and request.path == "/v1/messages":
            rebuilds.append(orjson.loads(request.body)["messages"])
    return rebuilds


def _removed_left(cluster: Cluster, history: History) -> dict[str, list[str]]:
    """Where each removed thread still is: its rows in PostgreSQL, keys naming it in Redis."""
    removed: dict[str, set[str]] = {}
    for op in history.ops:
        if op.kind in ("delete", "erase") and op.outcome == "ok" and op.thread_id:
            removed.setdefault(op.thread_key, set()).add(op.thread_id)
    ids = {thread_id: key for key, thread_ids in removed.items() for thread_id in thread_ids}
    left: dict[str, list[str]] = {}
    if not ids:
        return left
    rows = query(cluster.database_url, "SELECT id FROM threads WHERE id = ANY(:ids)", {"ids": list(ids)})
    rows += query(
        cluster.database_url,
        "SELECT DISTINCT thread_id FROM thread_messages WHERE thread_id = ANY(:ids)",
        {"ids": list(ids)},
    )
    for (thread_id,) in rows:
        left.setdefault(ids[thread_id], []).append(f"postgres ({thread_id})")
    with cluster.redis.client() as client:
        for raw in client.scan_iter(count=1000):
            name = raw.decode(errors="replace")
            for thread_id, key in ids.items():
                if thread_id in name:
                    left.setdefault(key, []).append(f"redis key {name}")
    return left


async def _final_state(cluster: Cluster, clients: Sequence[Client], history: History) -> FinalState:
    histories: dict[str, list[str] | None] = {}
    unexpected: list[str] = []
    for client in clients:
        for key, (_, texts) in (await owner_threads(client)).items():
            if key.endswith("#") or key.startswith("empty:"):
                unexpected.append(texts[0] if texts else key)
            else:
                histories[key] = texts
    for key in {op.thread_key for op in history.ops if op.is_turn or op.kind in ("read", "head", "delete", "erase")}:
        histories.setdefault(key, None)
    conversations = [client.keyed.conversation_id for client in clients if client.keyed.conversation_id]
    return FinalState(
        keyed=await asyncio.to_thread(keyed_state, cluster.database_url, conversations),
        faults=history.faults,
        histories=histories,
        removed_left=await asyncio.to_thread(_removed_left, cluster, history),
        unexpected_threads=unexpected,
        rebuilds=await asyncio.to_thread(_backend_rebuilds, cluster),
    )


def _background_ends(history: History) -> dict[str, int]:
    """Background responses by the status each was read with at the end (`deleted`: deleted by the workload)."""
    ends: dict[str, str] = {}
    for op in history.ops:
        if op.response_id is None:
            continue
        if op.kind == "bg-final" and op.outcome == "ok" and op.response_status:
            ends[op.response_id] = op.response_status
        elif op.kind == "bg-delete":
            ends[op.response_id] = "deleted"
    counts: dict[str, int] = {}
    for status in ends.values():
        counts[status] = counts.get(status, 0) + 1
    return dict(sorted(counts.items()))


def _write_history(history: History, plan: Plan, anomalies: Anomalies) -> Path:
    path = Path(f"/tmp/statestore-campaign-{plan.seed}-{int(time.time())}.json")
    document = {
        "plan": dataclasses.asdict(plan),
        "faults": history.faults,
        "anomalies": anomalies.found,
        "ops": [dataclasses.asdict(op) for op in history.ops],
    }
    path.write_text(json.dumps(document, default=str))
    return path


async def run_campaign(cluster: Cluster, plan: Plan) -> Report:
    print(f"campaign seed={plan.seed} (replay: STATESTORE_CAMPAIGN_SEED={plan.seed})", flush=True)
    history = History()
    replicas = [replica.url for replica in cluster.replicas]
    clients = [
        Client(index, cluster.url, history, cluster.backend, plan.seed, replicas) for index in range(plan.clients)
    ]
    try:
        await _workload(cluster, plan, history, clients)
        await asyncio.to_thread(cluster.heal)
        for client in clients:
            client.settings.backend_fault_rate = 0.0
        heal_ops: dict[str, Op] = {}

        async def heal_all(client: Client) -> None:
            for key, (thread_id, _) in (await owner_threads(client)).items():
                op = await _heal_thread(client, ThreadState(key=key.rstrip("#"), user_id="", thread_id=thread_id))
                if op is not None:
                    heal_ops[key] = op

        # Each client heals its own threads one after another, settles its background responses, and sends again under
        # its key each keyed write left unanswered; the clients run side by side. Then each lists its keyed
        # conversation.
        await asyncio.gather(
            *(heal_all(client) for client in clients),
            *(client.background.settle(BACKGROUND_GRACE) for client in clients),
            *(client.keyed.settle(HEAL_WITHIN) for client in clients),
        )
        await asyncio.gather(*(client.keyed.conversation_items() for client in clients))
        final = await _final_state(cluster, clients, history)
    finally:
        for client in clients:
            await client.close()
    checker = Checker(history.ops, final)
    anomalies = checker.check()
    checker.heal(heal_ops)
    outcomes: dict[str, int] = {}
    for op in history.ops:
        outcomes[op.outcome] = outcomes.get(op.outcome, 0) + 1
    return Report(
        plan=plan,
        ops=len(history.ops),
        turns=len(history.turns()),
        faults=len(history.faults),
        backend_faults=sum(1 for op in history.ops if op.backend_fault),
        threads=len(final.histories),
        seconds=history.now(),
        outcomes=outcomes,
        background=_background_ends(history),
        keyed=keyed_counts(history.ops, history.faults),
        anomalies=anomalies,
        history_file=_write_history(history, plan, anomalies),
    )
