"""The few Redis commands the history cache sends, behind one interface with two implementations: the lean client
of statestore/store/resp.py for a standalone Redis (the hot path), and redis-py's RedisCluster for `?cluster=1`
(slot routing and redirections are its job)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from redis.asyncio import RedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.commands.core import AsyncScript
from redis.exceptions import ConnectionError as RedisConnectionError

from statestore.retry_policy import STALE_CONNECTION_RETRIES
from statestore.store.resp import RespClient, Script
from statestore.store.resp_reader import RespError


class RedisCommands(Protocol):
    async def mget(self, keys: Sequence[str]) -> list[Any]: ...

    async def run(self, script: Script, keys: Sequence[str], args: Sequence[bytes | str | int]) -> Any: ...

    async def delete(self, keys: Sequence[str]) -> None: ...

    async def delete_each(self, groups: Sequence[Sequence[str]]) -> None:
        """One DEL per group, sent together; not a transaction (each group stands alone)."""

    async def ping(self) -> bool: ...

    async def aclose(self) -> None: ...


class StandaloneCommands:
    def __init__(self, url: str, *, timeout_s: float, connections: int = 4) -> None:
        self.client = RespClient(url, timeout_s=timeout_s, connections=connections)

    async def mget(self, keys: Sequence[str]) -> list[Any]:
        replies: list[Any] = await self.client.execute("MGET", *keys)
        return replies

    async def run(self, script: Script, keys: Sequence[str], args: Sequence[bytes | str | int]) -> Any:
        return await script.run(self.client, keys, args)

    async def delete(self, keys: Sequence[str]) -> None:
        await self.client.execute("DEL", *keys)

    async def delete_each(self, groups: Sequence[Sequence[str]]) -> None:
        # Purges, erasures and the deletions owed since an outage: no turn waits for them, so they probe Redis even
        # while turns skip it (store/resp.py, RedisBreaker), and bring it back for them as soon as it answers.
        for reply in await self.client.pipeline([("DEL", *group) for group in groups], probe=True):
            if isinstance(reply, RespError):
                raise reply

    async def ping(self) -> bool:
        return bool(await self.client.execute("PING") == b"PONG")

    async def aclose(self) -> None:
        await self.client.aclose()


class ClusterCommands:
    def __init__(self, url: str, *, timeout_s: float, max_connections: int) -> None:
        # statestore/retry_policy.py: at once, only on connection errors (a pooled connection that died with a node's
        # restart); a timeout is not retried, so a hung node costs a request one timeout.
        self._client = RedisCluster.from_url(
            url,
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
            max_connections=max_connections,  # per node; cluster pools fail fast when full
            decode_responses=False,
            retry=Retry(NoBackoff(), STALE_CONNECTION_RETRIES, supported_errors=(RedisConnectionError,)),
        )
        self._scripts: dict[str, AsyncScript] = {}

    async def mget(self, keys: Sequence[str]) -> list[Any]:
        return list(await self._client.mget(list(keys)))

    async def run(self, script: Script, keys: Sequence[str], args: Sequence[bytes | str | int]) -> Any:
        # register_script reloads the script on NOSCRIPT (a node restarted, SCRIPT FLUSH) and retries.
        registered = self._scripts.get(script.sha)
        if registered is None:
            registered = self._scripts[script.sha] = self._client.register_script(script.source)
        return await registered(keys=list(keys), args=list(args))

    async def delete(self, keys: Sequence[str]) -> None:
        await self._client.delete(*keys)

    async def delete_each(self, groups: Sequence[Sequence[str]]) -> None:
        pipe = self._client.pipeline(transaction=False)
        for group in groups:
            pipe.delete(*group)
        await pipe.execute()

    async def ping(self) -> bool:
        return bool(await self._client.ping())

    async def aclose(self) -> None:
        await self._client.aclose()
