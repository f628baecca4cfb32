"""The console's sign-in throttle and server-side sign-outs, in the database so every replica sees the same counts
and the same ended sessions."""

from __future__ import annotations

from sqlalchemy import delete, select
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.ext.asyncio import AsyncEngine

from statestore.store.schema import console_sign_ins, console_sign_outs

# Attempts are counted in fixed windows of this length (STATESTORE_CONSOLE_SIGN_IN_FAILURES and
# STATESTORE_CONSOLE_SIGN_INS_PER_TOKEN are per window).
WINDOW_MS = 15 * 60_000


class ConsoleGuard:
    def __init__(self, engine: AsyncEngine, window_ms: int = WINDOW_MS) -> None:
        self._engine = engine
        self._window_ms = window_ms
        self._insert = postgresql.insert if engine.dialect.name == "postgresql" else sqlite.insert

    def window_of(self, now_ms: int) -> int:
        return now_ms - now_ms % self._window_ms

    def retry_after_ms(self, now_ms: int) -> int:
        """How long until the window `now_ms` falls in ends, and its counts with it."""
        return self.window_of(now_ms) + self._window_ms - now_ms

    async def attempts(self, scope: str, now_ms: int) -> int:
        """Attempts counted for `scope` in the window `now_ms` falls in."""
        async with self._engine.connect() as conn:
            found = await conn.scalar(
                select(console_sign_ins.c.attempts).where(
                    console_sign_ins.c.scope == scope, console_sign_ins.c.window_ms == self.window_of(now_ms)
                )
            )
        return int(found or 0)

    async def count(self, scope: str, now_ms: int) -> int:
        """One more attempt for `scope`; the window's count with it. Windows that have ended are dropped on the way."""
        window = self.window_of(now_ms)
        stmt = self._insert(console_sign_ins).values(scope=scope, window_ms=window, attempts=1)
        upsert = stmt.on_conflict_do_update(
            index_elements=[console_sign_ins.c.scope, console_sign_ins.c.window_ms],
            set_={"attempts": console_sign_ins.c.attempts + 1},
        ).returning(console_sign_ins.c.attempts)
        async with self._engine.begin() as conn:
            await conn.execute(delete(console_sign_ins).where(console_sign_ins.c.window_ms < window))
            return int((await conn.execute(upsert)).scalar_one())

    async def sign_out(self, nonce: str, expires_ms: int, now_ms: int) -> None:
        stmt = self._insert(console_sign_outs).values(nonce=nonce, expires_ms=expires_ms).on_conflict_do_nothing()
        async with self._engine.begin() as conn:
            await conn.execute(delete(console_sign_outs).where(console_sign_outs.c.expires_ms < now_ms))
            await conn.execute(stmt)

    async def signed_out(self, nonce: str) -> bool:
        async with self._engine.connect() as conn:
            found = await conn.scalar(select(console_sign_outs.c.nonce).where(console_sign_outs.c.nonce == nonce))
        return found is not None
