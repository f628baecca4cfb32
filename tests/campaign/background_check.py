"""The checker's part for background responses (tests/campaign/background.py drives them): from what each client
was told of a response (its create, polls, cancels, the events it read, how it ended once the cluster had healed)
and its conversation's items at the end. Kinds:

- `stuck`: a response still `queued` or `in_progress` at the end, after the cluster healed and a grace of a few lease
  periods.
- `mixed-stream`: the events a client read of one response (its original stream and its resumes end to end, or a
  whole stream read again at the end) with a sequence number repeated or missing, two different final events, text
  deltas that do not add up to the final event's output text, or a final event other than the status the response
  ends with. Deltas short of the final text (never different from it) are allowed only once the response's events
  may have been lost: after Redis was flushed or killed, or its connections cut or refused (a connection a reset
  broke fails on its first use, perhaps much later); statestore then tells the rest from storage, the final event.
- `lost-response`: a response whose create was acknowledged (the client was told its id) unknown (404) at the end or
  to any request before a delete of it; one that completed on a conversation without its input among the
  conversation's items.
- `resurrected-after-cancel`: a response the client cancelled and was told `cancelled`, later told `completed` or
  `incomplete`, or its input found in its conversation.
- `status-changed`: a response told one final status, later told another (or told it is running again).
- `phantom`, `duplicated`: a failed or cancelled turn's input in its conversation; a turn's input there twice.
- `unhealed`: a response that could not be read at all once the cluster had healed.

A `cancel` answered `completed` (it raced the commit) is fine, as is `failed` with `server_error` (the replica running
it died)."""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from tests.campaign.background import FINAL_EVENTS, OPEN
from tests.campaign.history import Op

if TYPE_CHECKING:
    from tests.campaign.checker import Anomalies

CREATES = frozenset({"bg-create", "bg-stream"})
STREAMS = frozenset({"bg-stream", "bg-resume", "bg-tail"})  # laid end to end
REPLAYS = frozenset({"bg-replay"})  # each a whole stream on its own
TELLERS = frozenset({"bg-create", "bg-poll", "bg-cancel", "bg-final", *STREAMS, *REPLAYS})
STORED = frozenset({"completed", "incomplete"})
# Faults that may take a response's published events with them.
EVENT_LOSS = frozenset({"redis-flushall", "redis-kill", "redis-reset", "redis-drop", "redis-refuse"})


class BackgroundCheck:
    def __init__(self, ops: Sequence[Op], faults: Sequence[dict[str, Any]], anomalies: Anomalies) -> None:
        self.anomalies = anomalies
        self.losses = [fault["t"] for fault in faults if fault["fault"] in EVENT_LOSS]
        self.responses: dict[str, list[Op]] = defaultdict(list)
        self.items: dict[str, list[str]] = {}
        for op in ops:
            if op.kind.startswith("bg-") and op.response_id is not None:
                self.responses[op.response_id].append(op)
            if op.kind == "bg-items" and op.outcome == "ok" and op.read is not None:
                self.items[op.thread_key] = op.read

    def check(self) -> None:
        for ops in self.responses.values():
            create = next((op for op in ops if op.kind in CREATES and op.outcome == "ok"), None)
            if create is not None:
                self._response(create, sorted(ops, key=lambda op: op.start))

    def _events_lost(self, end: float) -> bool:
        """Whether a fault that may take events with it came before `end`: a connection a reset broke fails on its
        first use, which may be long after the fault, and the batch it carried is lost."""
        return any(at <= end for at, _ in self.losses)

    def _response(self, create: Op, ops: list[Op]) -> None:
        deleted_at = min((op.start for op in ops if op.kind == "bg-delete" and op.status != 404), default=math.inf)
        live = [op for op in ops if op.start < deleted_at]
        unknown = next((op for op in live if op.status == 404), None)
        if unknown is not None:
            self.anomalies.add("lost-response", "an acknowledged background response unknown (404)", [create, unknown])
            return
        final = next((op for op in reversed(live) if op.kind == "bg-final"), None)
        end_status = final.response_status if final is not None and final.outcome == "ok" else None
        if deleted_at == math.inf:
            if end_status is None:
                self.anomalies.add("unhealed", "a background response unreadable at the end", [create, final])
            elif end_status in OPEN:
                self.anomalies.add("stuck", f"a background response still {end_status} at the end", [create, final])
        self._statuses(create, live)
        self._stream(create, [op for op in live if op.kind in STREAMS and op.events], end_status)
        for replay in (op for op in live if op.kind in REPLAYS and op.events):
            self._stream(create, [replay], end_status)
        if create.thread_key.startswith("C") and deleted_at == math.inf and end_status is not None:
            self._conversation(create, live, end_status)

    def _statuses(self, create: Op, ops: list[Op]) -> None:
        """Once a response was told finished, every later answer tells the same."""
        told = [op for op in ops if op.kind in TELLERS and op.outcome == "ok" and op.response_status is not None]
        for first in told:
            if first.response_status in OPEN:
                continue
            for later in told:
                if later.start > first.end and later.response_status != first.response_status:
                    resurrected = first.response_status == "cancelled" and later.response_status in STORED
                    kind = "resurrected-after-cancel" if resurrected else "status-changed"
                    what = f"told {first.response_status}, then {later.response_status}"
                    self.anomalies.add(kind, what, [create, first, later])
                    return

    def _stream(self, create: Op, reads: list[Op], end_status: str | None) -> None:
        """One reading of a response's events: its ops' events end to end."""
        if not reads:
            return
        events = [event for op in reads for event in op.events or ()]
        numbers = [seq for seq, _, _ in events]
        first = reads[0].after + 1 if reads[0].after is not None else 0
        if numbers != list(range(first, first + len(numbers))):
            self.anomalies.add("mixed-stream", f"sequence numbers {numbers} read from {first}", [create, *reads])
            return
        finals = [(op, kind) for op in reads for _, kind, _ in op.events or () if kind in FINAL_EVENTS]
        if not finals:
            return
        if len(finals) > 1:
            self.anomalies.add("mixed-stream", f"final events {[kind for _, kind in finals]}", [create, *reads])
            return
        holder, kind = finals[0]
        if end_status is not None and holder.response_status != end_status:
            what = f"the stream ended {kind} ({holder.response_status}), the response ends {end_status}"
            self.anomalies.add("mixed-stream", what, [create, holder])
            return
        if holder.response_status not in STORED:
            return
        deltas = "".join(text for _, name, text in events if name == "response.output_text.delta")
        text = holder.output_text or ""
        if deltas == text:
            return
        if text.startswith(deltas) and self._events_lost(holder.end):
            return
        what = f"text deltas {deltas!r} do not add up to the final output text {text!r}"
        self.anomalies.add("mixed-stream", what, [create, *reads])

    def _conversation(self, create: Op, ops: list[Op], end_status: str) -> None:
        items = self.items.get(create.thread_key)
        if items is None:
            return
        count = items.count(create.text())
        if count > 1:
            self.anomalies.add("duplicated", f"a background turn's input {count} times in its conversation", [create])
        if end_status in STORED and count == 0:
            self.anomalies.add("lost-response", f"{end_status}, but its input is not in its conversation", [create])
        cancelled = next((op for op in ops if op.kind == "bg-cancel" and op.response_status == "cancelled"), None)
        if end_status not in STORED and count > 0:
            kind = "resurrected-after-cancel" if cancelled is not None else "phantom"
            self.anomalies.add(kind, f"{end_status}, yet its input is in its conversation", [create, cancelled])
