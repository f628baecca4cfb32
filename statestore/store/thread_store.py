"""What the threaded turn needs from its store (threads/service.py) beside the leased log (core/leased_log.py), as an
interface: ThreadRepository (store/thread_repository.py) implements it, and so does the traced wrapper
(statestore/traced.py), explicitly, so that mypy checks every method of a wrapper against the one it stands for."""

from __future__ import annotations

from typing import Protocol

from statestore.store.turn_records import ContinueRefusal, LeasedThread, NewThread


class ThreadStore(Protocol):
    async def why_not_continuable(
        self, *, owner: str, thread_id: str, response_id: str, now_ms: int
    ) -> ContinueRefusal:
        """Why the leased log's take found nothing (or a claimed commit was refused)."""
        ...

    async def backend_id_of(self, *, owner: str, thread_id: str, response_id: str, now_ms: int) -> str | None: ...

    async def read_by_response(
        self, *, owner: str, thread_id: str, response_id: str, now_ms: int
    ) -> LeasedThread | None:
        """The live thread whose head is `response_id`, read without taking its lease (a token count)."""
        ...

    async def read_by_session(self, *, owner: str, session: str, now_ms: int) -> LeasedThread | None:
        """The session's live thread, read without taking its lease (a token count)."""
        ...

    async def session_is_busy(self, *, owner: str, session: str, now_ms: int) -> bool: ...

    async def begin_create(
        self, thread: NewThread, *, token: str, now_ms: int, lease_until_ms: int, bind_session: bool = True
    ) -> bool: ...

    async def abandon_create(self, *, thread_id: str, token: str) -> None: ...

    async def is_stored(self, *, thread_id: str, response_id: str) -> bool: ...

    async def load_context(self, thread_id: str, *, owner: str) -> list[tuple[int, bytes]]:
        """Opened: the plaintext of every row (`owner` names the thread's rows in their associated data)."""
        ...
