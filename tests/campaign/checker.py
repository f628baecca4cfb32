"""The history checker: decides whether what the clients observed, what the backend received and what is left at the
end could have happened in a correct statestore, and names each anomaly by kind with the operations involved.

A thread's final history is its export once every fault has stopped (the op ids of its user turns, in order). Kinds:

- `lost`: an acknowledged turn missing from its thread's final history (or from a read that began after it ended).
- `duplicated`: a turn twice in one history, read or rebuild.
- `phantom`: a refused turn, or one whose backend reply was cut or failed, in a history, read or rebuild; a thread
  whose create was refused, found at the end.
- `nonlinear`: an acknowledged continue not right after the turn that produced its `previous_message_id` (two
  acknowledged continues from one id, or a continue from a stale id that succeeded); a create not first.
- `realtime`: two acknowledged turns of a thread in the opposite order of their real-time order.
- `stale-read`: a read that is not a prefix of the final history.
- `foreign`: a message of another thread (or not the echo of its own user turn) in a rebuild or read.
- `gap`: a rebuild that is not a prefix of the final history, or whose last turn is not the one continued from.
- `resurrected`: a deleted or erased thread served after the removal was acknowledged, or still in PostgreSQL or
  Redis at the end.
- `unhealed`: a live thread that did not continue once the faults had stopped.

Background responses have kinds of their own (`stuck`, `mixed-stream`, `lost-response`, `resurrected-after-cancel`,
`status-changed`): tests/campaign/background_check.py; keyed writes (`replay-differs`, `key-reused`, and `duplicated`,
`lost`, `phantom` of their own): tests/campaign/keyed_check.py.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from tests.campaign.background_check import BackgroundCheck
from tests.campaign.history import Op
from tests.campaign.keyed_check import KeyedCheck, KeyedState
from tests.campaign.workload import NEVER_STORED


@dataclass
class FinalState:
    histories: dict[str, list[str] | None]  # thread key -> final history (texts), None when the thread is gone
    removed_left: dict[str, list[str]] = field(default_factory=dict)  # thread key -> where a removed thread remains
    unexpected_threads: list[str] = field(default_factory=list)  # texts of first turns of threads found at the end
    rebuilds: list[list[dict[str, Any]]] = field(default_factory=list)  # `messages` of each backend request
    faults: list[dict[str, Any]] = field(default_factory=list)  # the nemesis's, as the history has them
    keyed: KeyedState = field(default_factory=KeyedState)  # what the database holds of the keyed writes


@dataclass
class Anomalies:
    found: dict[str, list[dict[str, Any]]] = field(default_factory=lambda: defaultdict(list))

    def add(self, kind: str, what: str, ops: Iterable[Op | None] = ()) -> None:
        self.found[kind].append({"what": what, "ops": [op.brief() for op in ops if op is not None]})

    def counts(self) -> dict[str, int]:
        return {kind: len(items) for kind, items in sorted(self.found.items())}

    def __bool__(self) -> bool:
        return any(self.found.values())


def op_of(text: str) -> tuple[str, str]:
    key, _, op_id = text.partition(" ")
    return key, op_id


class Checker:
    def __init__(self, ops: Sequence[Op], final: FinalState) -> None:
        self.ops = {op.id: op for op in ops}
        self.final = final
        self.anomalies = Anomalies()
        self.by_key: dict[str, list[Op]] = defaultdict(list)
        self.produced: dict[str, Op] = {}
        for op in ops:
            self.by_key[op.thread_key].append(op)
            if op.is_turn and op.message_id:
                self.produced[op.message_id] = op
        # When each thread's removal was acknowledged (the earliest acknowledged delete or erase).
        self.removed_at: dict[str, float] = {}
        for op in ops:
            if op.kind in ("delete", "erase") and op.outcome == "ok":
                self.removed_at[op.thread_key] = min(self.removed_at.get(op.thread_key, op.end), op.end)

    def _produced(self, before: Op | None, message_id: str) -> bool:
        """Whether `before` can be the turn whose reply id is `message_id`: the turn that was told that id, or, for
        an id a client learned only from the thread API (its turn's outcome unknown to it), a turn of unknown
        outcome that was told no id."""
        if before is None:
            return False
        known = self.produced.get(message_id)
        if known is not None:
            return known.id == before.id
        return before.message_id is None and before.outcome == "unknown"

    def never_stored(self, op: Op) -> bool:
        return op.outcome == "fail" or op.backend_fault in NEVER_STORED

    def check(self) -> Anomalies:
        for key, texts in self.final.histories.items():
            if texts is not None:
                self._history(key, texts)
        for key, ops in self.by_key.items():
            self._reads(key, ops)
            self._removal(key, ops)
        for messages in self.final.rebuilds:
            self._rebuild(messages)
        for text in self.final.unexpected_threads:
            self.anomalies.add("phantom", f"a thread that should not exist, first turn {text!r}", [self._op(text)])
        BackgroundCheck(list(self.ops.values()), self.final.faults, self.anomalies).check()
        KeyedCheck(list(self.ops.values()), self.final.keyed, self.anomalies).check()
        return self.anomalies

    def _op(self, text: str) -> Op | None:
        return self.ops.get(op_of(text)[1])

    def _members(self, key: str, texts: Sequence[str], where: str) -> list[Op | None]:
        """The ops of a history, with duplicated, foreign and phantom entries reported."""
        members = [self._op(text) for text in texts]
        for text, count in Counter(texts).items():
            if count > 1:
                self.anomalies.add("duplicated", f"{where}: {text!r} {count} times", [self._op(text)])
        for text, op in zip(texts, members, strict=True):
            if op is None or op.thread_key != key or op_of(text)[0] != key:
                self.anomalies.add("foreign", f"{where} of {key}: {text!r}", [op])
            elif self.never_stored(op):
                self.anomalies.add("phantom", f"{where} of {key} holds a turn that was never stored", [op])
        return members

    def _history(self, key: str, texts: list[str]) -> None:
        members = self._members(key, texts, "final history")
        position = {op.id: index for index, op in enumerate(members) if op is not None}
        turns = [op for op in self.by_key[key] if op.is_turn]
        for op in turns:
            if op.outcome == "ok" and op.id not in position:
                self.anomalies.add("lost", f"acknowledged turn missing from the final history of {key}", [op])
        for op in turns:
            if op.outcome != "ok" or op.id not in position:
                continue
            if op.kind == "create" and position[op.id] != 0:
                self.anomalies.add("nonlinear", f"create at position {position[op.id]} of {key}", [op])
            if op.previous_id is None:
                continue
            index = position[op.id]
            before = members[index - 1] if index else None
            if not self._produced(before, op.previous_id):
                self.anomalies.add("nonlinear", f"continue not right after the turn it continued ({key})", [op, before])
        acknowledged = sorted((op for op in turns if op.outcome == "ok" and op.id in position), key=lambda o: o.end)
        for index, first in enumerate(acknowledged):
            for later in acknowledged[index + 1 :]:
                if first.end < later.start and position[first.id] > position[later.id]:
                    self.anomalies.add("realtime", f"{key}: a later turn stored before an earlier one", [first, later])

    def _reads(self, key: str, ops: list[Op]) -> None:
        final = self.final.histories.get(key)
        for read in ops:
            if read.kind != "read" or read.outcome != "ok" or read.read is None:
                continue
            texts = [f"{key} {op_id}" for op_id in read.read]
            self._members(key, texts, f"read {read.id}")
            if final is not None and final[: len(texts)] != texts:
                self.anomalies.add("stale-read", f"read of {key} is not a prefix of its final history", [read])
            seen = set(read.read)
            for op in ops:
                if op.is_turn and op.outcome == "ok" and op.end < read.start and op.id not in seen:
                    self.anomalies.add("lost", f"read of {key} misses a turn acknowledged before it began", [read, op])

    def _removal(self, key: str, ops: list[Op]) -> None:
        removed = self.removed_at.get(key)
        if removed is None:
            return
        remover = min((op for op in ops if op.kind in ("delete", "erase") and op.outcome == "ok"), key=lambda o: o.end)
        for op in ops:
            served = op.outcome == "ok" and op.kind not in ("delete", "erase")
            if served and op.start > removed:
                self.anomalies.add("resurrected", f"{key} served after its removal was acknowledged", [remover, op])
        if self.final.histories.get(key) is not None:
            self.anomalies.add("resurrected", f"{key} readable at the end after its removal", [remover])
        for where in self.final.removed_left.get(key, []):
            self.anomalies.add("resurrected", f"{key} still in {where} at the end", [remover])

    def _rebuild(self, messages: list[dict[str, Any]]) -> None:
        texts: list[str] = []
        for index, message in enumerate(messages):
            content = message.get("content")
            if message.get("role") == "user" and isinstance(content, str):
                texts.append(content)
            elif message.get("role") == "assistant":
                previous = messages[index - 1].get("content") if index else None
                shown = content[0].get("text") if isinstance(content, list) and content else None
                if shown != f"echo: {previous}":
                    self.anomalies.add("foreign", f"assistant turn {shown!r} after {previous!r} in a rebuild")
        if not texts:
            return
        key = op_of(texts[-1])[0]
        own = self._op(texts[-1])
        prior = texts[:-1]
        self._members(key, prior, f"rebuild for {op_of(texts[-1])[1]}")
        final = self.final.histories.get(key)
        if final is not None and final[: len(prior)] != prior:
            self.anomalies.add("gap", f"rebuild of {key} is not a prefix of its final history", [own])
        if own is not None and own.previous_id is not None:
            before = self._op(prior[-1]) if prior else None
            if not self._produced(before, own.previous_id):
                self.anomalies.add("gap", f"rebuild of {key} does not end with the turn continued from", [own, before])

    def heal(self, heal_ops: Mapping[str, Op]) -> None:
        for key, texts in self.final.histories.items():
            op = heal_ops.get(key)
            if texts is not None and (op is None or op.outcome != "ok"):
                self.anomalies.add("unhealed", f"{key} did not continue after the faults stopped", [op])
