"""The history of a campaign: every operation a client invoked, with when it started and ended, its outcome and what
it was acknowledged. The checker (tests/campaign/checker.py) decides afterwards whether the history could have
happened.

Outcomes: `ok`; `fail` (a definite refusal: a 4xx, or a backend error statestore relayed, so nothing was stored);
`unknown` (a timeout, a cut connection, a 5xx of statestore's own: the turn may or may not have been stored)."""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from typing import Any, Literal

Outcome = Literal["ok", "fail", "unknown"]
# Turns: create, continue, stale (a continue from an id that is not the head), race (one of several concurrent
# continues from one id), session. Others: read (thread export), head (thread metadata), delete, erase, heal (the
# continue that proves a thread continues once the faults have stopped). Background responses (tests/campaign/
# background.py): bg-create (JSON) and bg-stream (stream: true) create one, bg-resume reads its stream on, bg-poll and
# bg-cancel tell where it stands, bg-delete deletes it; at the end bg-final reads how it ended, bg-tail the rest of its
# stream and bg-replay its whole stream again; bg-conversation creates a conversation, bg-items lists its user texts.
# Keyed writes (tests/campaign/keyed.py), each sent with an Idempotency-Key and retried with it until answered:
# key-respond (a Response on the client's keyed conversation), key-chain (a Response continuing a keyed chain),
# key-append (items appended to the keyed conversation), key-message (a Messages turn creating or continuing a keyed
# thread: a turn, as the thread checks see it); key-conversation creates that conversation, key-items lists its user
# texts at the end.
Kind = Literal[
    "create",
    "continue",
    "stale",
    "race",
    "session",
    "read",
    "head",
    "delete",
    "erase",
    "heal",
    "bg-create",
    "bg-stream",
    "bg-resume",
    "bg-poll",
    "bg-cancel",
    "bg-delete",
    "bg-final",
    "bg-tail",
    "bg-replay",
    "bg-conversation",
    "bg-items",
    "key-respond",
    "key-chain",
    "key-append",
    "key-message",
    "key-conversation",
    "key-items",
]
TURN_KINDS = frozenset({"create", "continue", "stale", "race", "session", "heal", "key-message"})


_SHOWN = ("status", "error", "previous_id", "message_id", "backend_fault")


@dataclass
class Op:
    id: str
    client: int
    kind: Kind
    thread_key: str
    start: float
    end: float = 0.0
    outcome: Outcome = "unknown"
    status: int | None = None
    error: str | None = None
    stream: bool = False
    previous_id: str | None = None
    # What was acknowledged: the reply's message id, the thread id, the history a read returned (op ids in order).
    message_id: str | None = None
    thread_id: str | None = None
    read: list[str] | None = None
    # A backend fault this turn met on purpose (the fake backend's action kind): such a turn is never stored.
    backend_fault: str | None = None
    # A background response: its id, the status (and output text, error code) a reply or final event told, each
    # event of its stream read by this op (sequence number, type, text delta), and the number it resumed after.
    response_id: str | None = None
    response_status: str | None = None
    output_text: str | None = None
    response_error: str | None = None
    events: list[tuple[int, str, str]] | None = None
    after: int | None = None
    # A keyed write: its key, the number of requests sent under it, and each 2xx answer (what it told: the ids and
    # text, and whether it said `idempotent-replayed`).
    key: str | None = None
    attempts: int = 0
    answers: list[tuple[str, bool]] | None = None

    @property
    def is_turn(self) -> bool:
        return self.kind in TURN_KINDS

    def text(self) -> str:
        """The user message of a turn: names its thread and itself, so any request or read can be traced back."""
        return f"{self.thread_key} {self.id}"

    def brief(self) -> dict[str, Any]:
        shown: dict[str, Any] = {"op": self.id, "kind": self.kind, "thread": self.thread_key, "outcome": self.outcome}
        for name in (*_SHOWN, "response_id", "response_status", "after", "key", "answers"):
            if getattr(self, name) is not None:
                shown[name] = getattr(self, name)
        if self.events:
            shown["events"] = [f"{seq} {kind}" for seq, kind, _ in self.events]
        shown["t"] = [round(self.start, 3), round(self.end, 3)]
        return shown


@dataclass
class History:
    started: float = field(default_factory=time.monotonic)
    ops: list[Op] = field(default_factory=list)
    faults: list[dict[str, Any]] = field(default_factory=list)
    _ids: itertools.count[int] = field(default_factory=itertools.count)

    def now(self) -> float:
        return time.monotonic() - self.started

    def begin(self, client: int, kind: Kind, thread_key: str, **fields: Any) -> Op:
        op = Op(id=f"o{next(self._ids)}", client=client, kind=kind, thread_key=thread_key, start=self.now(), **fields)
        self.ops.append(op)
        return op

    def finish(self, op: Op, outcome: Outcome, **fields: Any) -> Op:
        op.end = self.now()
        op.outcome = outcome
        for name, value in fields.items():
            setattr(op, name, value)
        return op

    def fault(self, kind: str, at: float, **details: Any) -> None:
        """A nemesis fault, from `at` until now (seconds into the run)."""
        self.faults.append({"fault": kind, "t": [round(at, 3), round(self.now(), 3)], **details})

    def turns(self) -> list[Op]:
        return [op for op in self.ops if op.is_turn]
