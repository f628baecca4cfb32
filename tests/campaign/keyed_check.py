"""The checker's part for keyed writes (tests/campaign/keyed.py drives them): from what each write was answered,
the database once the cluster has healed (every Response stored with a keyed write's `metadata.user_id`, every item of
each keyed conversation) and each keyed conversation's items as listed at the end. Kinds:

- `duplicated`: a keyed write stored more than once: two Responses with its `metadata.user_id`, its text twice among
  its conversation's items, or one item id twice in the database.
- `lost`: an acknowledged (2xx) keyed write missing at the end: the Response it was told not in the database, its
  text not among its conversation's items, an item id it was told not in the database.
- `phantom`: a keyed write refused with a 4xx (nothing stored) found stored.
- `replay-differs`: a later answer under one key that tells other ids or text than the first, or that does not say
  `idempotent-replayed` (the write ran again).
- `key-reused`: a retry of the same request refused as another request under its key (422).
- `unhealed`: a keyed conversation that could not be listed once the cluster had healed.

A keyed thread's turns (key-message) are turns: the thread checks (tests/campaign/checker.py) find one stored twice
(`duplicated`), an acknowledged one missing (`lost`), a refused one stored (`phantom`); here only their answers are
compared."""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tests.campaign.history import Op
from tests.reliability.support import query

if TYPE_CHECKING:
    from tests.campaign.checker import Anomalies

WRITES = frozenset({"key-respond", "key-chain", "key-append", "key-message"})
ON_CONVERSATION = frozenset({"key-respond", "key-append"})


@dataclass
class KeyedState:
    """What the database holds of the keyed writes at the end."""

    responses: dict[str, list[str]] = field(default_factory=dict)  # op id -> ids of the Responses stored for it
    items: dict[str, list[str]] = field(default_factory=dict)  # conversation id -> its items' ids, one per row


def keyed_state(database_url: str, conversation_ids: Sequence[str]) -> KeyedState:
    """Read from PostgreSQL directly (with encryption on, the ids and `metadata_user_id` are stored in clear)."""
    state = KeyedState()
    rows = query(database_url, "SELECT metadata_user_id, id FROM responses WHERE metadata_user_id LIKE 'keyed:%'")
    for user_id, response_id in rows:
        state.responses.setdefault(user_id.removeprefix("keyed:"), []).append(response_id)
    if conversation_ids:
        rows = query(
            database_url,
            "SELECT conversation_id, item_id FROM conversation_items WHERE conversation_id = ANY(:ids)",
            {"ids": list(conversation_ids)},
        )
        for conversation_id, item_id in rows:
            state.items.setdefault(conversation_id, []).append(item_id)
    return state


class KeyedCheck:
    def __init__(self, ops: Sequence[Op], state: KeyedState, anomalies: Anomalies) -> None:
        self.ops = [op for op in ops if op.kind in WRITES]
        self.state = state
        self.anomalies = anomalies
        self.listed: dict[str, list[str]] = {}  # conversation key -> user texts listed at the end
        self.conversations: dict[str, str] = {}  # conversation key -> id
        for op in ops:
            if op.kind == "key-items" and op.outcome == "ok" and op.read is not None:
                self.listed[op.thread_key] = op.read
            if op.kind == "key-conversation" and op.thread_id:
                self.conversations[op.thread_key] = op.thread_id

    def check(self) -> None:
        for key in self.conversations:
            if key not in self.listed:
                self.anomalies.add("unhealed", f"keyed conversation {key} could not be listed at the end")
        for conversation_id, ids in self.state.items.items():
            for item_id, count in Counter(ids).items():
                if count > 1:
                    self.anomalies.add("duplicated", f"item {item_id} {count} times in {conversation_id}")
        for op in self.ops:
            self._answers(op)
            if op.kind in ON_CONVERSATION:
                self._listed(op)
            if op.kind in ("key-respond", "key-chain"):
                self._responses(op)
            elif op.kind == "key-append" and op.outcome == "ok" and op.answers:
                stored = set(self.state.items.get(op.thread_id or "", []))
                told = [part.split(" ", 1)[0] for part in op.answers[0][0].split(" | ")]
                if missing := [item_id for item_id in told if item_id not in stored]:
                    self.anomalies.add("lost", f"acknowledged items {missing} not in the database", [op])

    def _answers(self, op: Op) -> None:
        if op.error == "idempotency_key_reused":
            self.anomalies.add("key-reused", "a retry of the same request refused as another under its key", [op])
        if not op.answers:
            return
        first = op.answers[0][0]
        for told, replayed in op.answers[1:]:
            if told != first:
                self.anomalies.add("replay-differs", f"answered {told!r} after {first!r}", [op])
            elif not replayed:
                self.anomalies.add("replay-differs", "answered again without idempotent-replayed: it ran again", [op])

    def _listed(self, op: Op) -> None:
        listed = self.listed.get(op.thread_key)
        if listed is None:
            return
        count = listed.count(op.text())
        if count > 1:
            self.anomalies.add("duplicated", f"{op.kind} {count} times among {op.thread_key}'s items", [op])
        elif count == 0 and op.outcome == "ok":
            self.anomalies.add("lost", f"acknowledged {op.kind} missing from {op.thread_key}'s items", [op])
        elif count and op.outcome == "fail":
            self.anomalies.add("phantom", f"refused {op.kind} among {op.thread_key}'s items", [op])

    def _responses(self, op: Op) -> None:
        stored = self.state.responses.get(op.id, [])
        if len(stored) > 1:
            self.anomalies.add("duplicated", f"{op.kind} stored as {len(stored)} Responses {stored}", [op])
        if op.outcome == "ok" and op.response_id not in stored:
            self.anomalies.add("lost", f"acknowledged {op.kind} {op.response_id} not in the database", [op])
        elif op.outcome == "fail" and stored:
            self.anomalies.add("phantom", f"refused {op.kind} stored as {stored}", [op])


def keyed_counts(ops: Sequence[Op], faults: Sequence[dict[str, Any]]) -> dict[str, int]:
    """For the report: keyed writes by outcome, with the requests sent, the writes sent more than once and the
    answers replayed; and the commit nemesis's lost commits that hit one, `killed` those whose replica it killed."""
    counts: dict[str, int] = defaultdict(int)
    for fault in faults:
        if fault["fault"].startswith("lost-commit") and fault.get("hit"):
            counts["killed" if fault["fault"] == "lost-commit-kill" else "lost-commits"] += 1
    for op in ops:
        if op.kind in WRITES:
            counts[op.outcome] += 1
            counts["requests"] += op.attempts
            counts["retried"] += op.attempts > 1
            counts["replayed"] += sum(1 for _, replayed in op.answers or [] if replayed)
    return dict(sorted(counts.items()))
