"""The few Redis commands the history cache sends, on statestore's one Redis client: store/resp.py for a standalone
Redis, store/resp_cluster.py for a Redis Cluster (`?cluster=1`), chosen by the URL (resp_cluster.redis_client)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from statestore.store.resp import RedisClient, Script
from statestore.store.resp_reader import RespError


class RedisCommands:
    def __init__(self, client: RedisClient) -> None:
        self.client = client

    async def mget(self, keys: Sequence[str]) -> list[Any]:
        replies: list[Any] = await self.client.execute("MGET", *keys)
        return replies

    async def run(self, script: Script, keys: Sequence[str], args: Sequence[bytes | str | int]) -> Any:
        return await script.run(self.client, keys, args)

    async def delete(self, keys: Sequence[str]) -> None:
        await self.client.execute("DEL", *keys)

    async def delete_each(self, groups: Sequence[Sequence[str]]) -> None:
        """One DEL per group, sent together; not a transaction (each group stands alone, in one slot)."""
        # Purges, erasures and the deletions owed since an outage: no turn waits for them, so they probe Redis even
        # while turns skip it (store/resp.py, RedisBreaker), and bring it back for them as soon as it answers.
        for reply in await self.client.pipeline([("DEL", *group) for group in groups], probe=True):
            if isinstance(reply, RespError):
                raise reply

    async def ping(self) -> bool:
        return bool(await self.client.execute("PING") == b"PONG")
