"""The leased log: one conversation's turns, appended by one request at a time. Every kind of conversation is one
(a thread, with or without a session name; a Responses conversation); a response chain has no lease, since a
response may be continued any number of times, and its commit is an insert that takes no token.

A turn takes the log's lease under a token of its own, until a time (one conditional update: no live lease, the log
not expired, for a thread also the expected head), renews it while a long reply runs (core/lease_keeper.py), and
either commits with its token (the commit checks it, so a turn whose lease ran out and was taken over stores
nothing) or releases it. A lost lease is the same in every log: `renew` and `commit_*` return False (None for a
Responses turn), having changed nothing. A log that cannot be taken is None from `take_*`; why is asked apart, on
the refusal path only (ThreadStore.why_not_continuable, ConversationStore.refusal), so the take stays one statement.

Both doors' turns, and a conversation's appends of items, go through one log; the statements, and running each of
them, are store/lease_statements.py.
"""

from __future__ import annotations

from collections.abc import Sequence

from statestore.store.lease_statements import (
    CONVERSATIONS,
    THREADS,
    LeaseStatements,
    LogTable,
    Release,
    Renew,
    TakeConversation,
    TakeThreadByResponse,
    TakeThreadBySession,
)
from statestore.store.response_commit import AppendItems
from statestore.store.response_records import NewResponse, ResponseRow, StoredItem
from statestore.store.turn_records import HeadAfter, LeasedThread, TurnCommit

# Which log a renewal or a release is of.
__all__ = ["CONVERSATIONS", "THREADS", "LeasedLog", "LogTable"]


class LeasedLog:
    """Take, renew, release and commit, for every kind of log."""

    __slots__ = ("_statements",)

    def __init__(self, statements: LeaseStatements) -> None:
        self._statements = statements

    async def take_thread(
        self, *, owner: str, thread_id: str, head: str, token: str, now_ms: int, until_ms: int
    ) -> LeasedThread | None:
        """The thread whose head is `head`, leased to `token` until `until_ms`, its system and tools opened; None when
        it is not free (or not there)."""
        take = TakeThreadByResponse(
            thread_id=thread_id, owner=owner, head_message_id=head, now_ms=now_ms, token=token, until_ms=until_ms
        )
        return await self._statements.take_thread(take)

    async def take_session(
        self, *, owner: str, session: str, token: str, now_ms: int, until_ms: int
    ) -> LeasedThread | None:
        """The thread the session name is bound to, at whatever head, leased as `take_thread` leases one."""
        take = TakeThreadBySession(owner=owner, session=session, now_ms=now_ms, token=token, until_ms=until_ms)
        return await self._statements.take_thread(take)

    async def take_conversation(
        self, *, owner: str, conversation_id: str, token: str, now_ms: int, until_ms: int
    ) -> tuple[int, int, int] | None:
        """The conversation's next position, leased, with the backend's token count of its last turn and the bytes it
        counted (0, 0 before any: docs/protocol.md §9's measured ratio); None when it is not free (or not there)."""
        take = TakeConversation(
            conversation_id=conversation_id, owner=owner, now_ms=now_ms, token=token, until_ms=until_ms
        )
        return await self._statements.take_conversation(take)

    async def renew(self, log: LogTable, log_id: str, token: str, *, until_ms: int) -> bool:
        """Extend a lease `token` still holds (a long reply) to `until_ms`; False when it was lost."""
        return await self._statements.renew(log, Renew(log_id=log_id, token=token, until_ms=until_ms))

    async def release(self, log: LogTable, log_id: str, token: str) -> None:
        """Give the lease back after a turn that stored nothing, so the log can be continued from where it was (a
        lease another token holds now stays its)."""
        await self._statements.release(log, Release(log_id=log_id, token=token))

    async def commit_thread_turn(self, commit: TurnCommit) -> HeadAfter | bool:
        """Append the turn's messages and move the head, atomically, if the turn still holds the lease (a claimed turn:
        if the head is still the one it was sent with and no lease is live); False (nothing changed) otherwise. On
        PostgreSQL the row as the commit left it."""
        return await self._statements.commit_thread_turn(commit)

    async def commit_response(self, new: NewResponse, token: str | None) -> ResponseRow | None:
        """Store a Responses turn and return its row as a read of it would: on a conversation only if the turn still
        holds the lease `token`, else None (nothing changed); a chained turn has no lease and is always stored."""
        return await self._statements.commit_response(new, token)

    async def commit_append(self, append: AppendItems, items: Sequence[StoredItem]) -> bool:
        """Append items to a conversation without a turn (`POST /v1/conversations/{id}/items`, its lease taken with
        `take_conversation`), the lease given back with them, if the append still holds it; False (nothing changed)
        otherwise. Once stored the lease is gone, so the same append carried out again stores nothing."""
        return await self._statements.commit_append(append, items)
