"""Redis Cluster through statestore's own client (store/resp.py): a RespClient per node, each command sent to the node
that serves its key's slot.

The slot map is read with CLUSTER SLOTS from any node that answers (the URL's node first). A MOVED reply (the slot
has moved for good: a failover, a resharding) is followed at once to the node it names, the map noted for that slot and
read again in the background; an ASK reply (a slot half-way through a migration) is followed once with ASKING, the
map untouched; TRYAGAIN (a multi-key command during a migration) is sent again after a moment. A node that cannot be
reached fails its commands as a standalone Redis does, and the next call reads the map again first, so a replica
promoted after a failover is found.

Every key statestore sends carries a hash tag (`<prefix>{<thread or response>}:…`), so the keys of one command, one
pipeline of a turn or one script are in one slot, on one node. Scripts are run by EVALSHA and loaded with EVAL on the
node that answers NOSCRIPT (store/resp.py's Script, unchanged). The breaker and the retry policy are the standalone
client's (statestore/retry_policy.py), held by each node's client: a command that failed on a connection found dead is
sent once more by it, and a node that timed out or refused is skipped for a pause while the others serve their slots.
One breaker for the whole cluster would fail every slot's cache operations for one black-holed node's sake, when a
cluster spreads threads over masters precisely so that one failing master costs only its own; a whole cluster gone
costs one timeout per node and pause instead of one.
"""

from __future__ import annotations

import asyncio
import logging
from binascii import crc_hqx
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from statestore.retry_policy import CLUSTER_REDIRECTIONS, CLUSTER_TRY_AGAIN_S
from statestore.store.resp import (
    COMMAND_TIMEOUT_S,
    OUTAGES,
    Arg,
    Endpoint,
    RedisBreaker,
    RedisClient,
    RedisSkipped,
    RespClient,
    parse_url,
    split_cluster_flag,
)
from statestore.store.resp_reader import RedisConnectionError, RespError

log = logging.getLogger(__name__)

SLOTS = 16384

# Commands that name no key: sent to any node (the node of slot 0).
_KEYLESS = frozenset({"PING", "CLUSTER", "SCRIPT", "INFO", "ASKING"})


def key_slot(key: Arg) -> int:
    """The slot Redis Cluster puts `key` in: CRC16 (XMODEM, which binascii.crc_hqx computes from 0) of the key, or of
    its hash tag, the text between the first `{` and the next `}` when not empty."""
    data = key.encode() if isinstance(key, str) else key if isinstance(key, bytes) else str(key).encode()
    start = data.find(b"{")
    if start >= 0:
        end = data.find(b"}", start + 1)
        if end > start + 1:
            data = data[start + 1 : end]
    return crc_hqx(data, 0) % SLOTS


def command_key(command: Sequence[Arg]) -> Arg | None:
    """The key a command is routed by (its keys share one slot), or None for a command that names none."""
    name = command[0].decode() if isinstance(command[0], bytes) else str(command[0])
    name = name.upper()
    if name in ("EVALSHA", "EVAL"):
        return command[3] if int(command[2]) > 0 else None
    if name == "XREAD":
        for i, arg in enumerate(command):
            if isinstance(arg, (str, bytes)) and arg in ("STREAMS", b"STREAMS"):
                return command[i + 1]
        return None
    if name in _KEYLESS or len(command) < 2:
        return None
    return command[1]


def _address(text: str, fallback: str) -> tuple[str, int]:
    """host:port as a redirection names a node (an empty host: the node's address is unknown to itself, so the one we
    reached it by)."""
    host, _, port = text.rpartition(":")
    return host or fallback, int(port)


Node = tuple[str, int]


class ClusterClient:
    """RespClient's calls (pipeline, execute, blocking) on a Redis Cluster: `connections` connections per node, and a
    breaker per node made by `breakers`."""

    def __init__(
        self,
        url: str,
        *,
        timeout_s: float = COMMAND_TIMEOUT_S,
        connections: int = 4,
        breakers: Callable[[], RedisBreaker] = RedisBreaker,
    ) -> None:
        seed = parse_url(url)
        if seed.path is not None or seed.db:
            raise ValueError("a redis cluster is reached over TCP and has only database 0")
        assert seed.host is not None
        self._seed = seed
        self._timeout_s = timeout_s
        self._connections = connections
        self._breakers = breakers
        self._nodes: dict[Node, RespClient] = {}
        self._slots: list[Node | None] | None = None  # None: not read yet, or to be read again before the next call
        self._refreshing: asyncio.Future[None] | None = None

    def _node(self, node: Node) -> RespClient:
        client = self._nodes.get(node)
        if client is None:
            endpoint: Endpoint = replace(self._seed, host=node[0], port=node[1])
            client = self._nodes[node] = RespClient(
                endpoint, timeout_s=self._timeout_s, connections=self._connections, breaker=self._breakers()
            )
        return client

    # -- the slot map ------------------------------------------------------------------------------------------------

    async def _slot_map(self) -> list[Node | None]:
        if self._slots is None:
            await self._refresh()
        assert self._slots is not None
        return self._slots

    async def _refresh(self) -> None:
        """Read the slot map; callers at the same moment share one read, which ends even if they are cancelled."""
        pending = self._refreshing
        if pending is None:
            pending = self._refreshing = asyncio.ensure_future(self._read_slots())

            def settle(_: asyncio.Future[None]) -> None:
                self._refreshing = None

            pending.add_done_callback(settle)
        await asyncio.shield(pending)

    def _refresh_later(self) -> None:
        if self._refreshing is None:
            self._refreshing = asyncio.ensure_future(self._read_slots())

            def settle(done: asyncio.Future[None]) -> None:
                self._refreshing = None
                if not done.cancelled() and done.exception() is not None:
                    failure = type(done.exception()).__name__
                    log.debug("could not read the redis cluster's slots", extra={"error": failure})

            self._refreshing.add_done_callback(settle)

    async def _read_slots(self) -> None:
        seed = (self._seed.host or "localhost", self._seed.port)
        candidates = [seed, *(node for node in self._nodes if node != seed)]
        failure: BaseException | None = None
        for node in candidates:
            try:
                reply = await self._node(node).execute("CLUSTER", "SLOTS")
            except OUTAGES as exc:
                failure = exc
                continue
            slots: list[Node | None] = [None] * SLOTS
            for entry in reply:
                start, end, master = entry[0], entry[1], entry[2]
                host = master[0].decode() if isinstance(master[0], bytes) else str(master[0])
                owner = (host if host and host != "?" else node[0], int(master[1]))
                slots[start : end + 1] = [owner] * (end - start + 1)
            self._slots = slots
            return
        raise RedisConnectionError(f"no node of the redis cluster answers: {type(failure).__name__}") from None

    # -- routing -------------------------------------------------------------------------------------------------------

    async def _route(self, command: Sequence[Arg]) -> Node:
        slots = await self._slot_map()
        key = command_key(command)
        node = slots[key_slot(key) if key is not None else 0]
        if node is None:
            raise RespError("CLUSTERDOWN Hash slot not served")
        return node

    async def _send(
        self, node: Node, commands: Sequence[Sequence[Arg]], timeout_s: float | None, probe: bool = False
    ) -> list[Any]:
        try:
            return await self._node(node).pipeline(commands, probe=probe, timeout_s=timeout_s)
        except RedisSkipped:
            # The node failed moments ago and the map was let go then: reading it again at each skip would add a round
            # trip to every call of the pause, the other nodes' too.
            raise
        except OUTAGES:
            self._slots = None  # a failover may have moved its slots: read the map before the next call
            raise

    async def _follow(
        self, command: Sequence[Arg], reply: Any, timeout_s: float | None, wait_s: float | None = None
    ) -> Any:
        """The reply to `command` once its redirections are followed (`wait_s`: a blocking command's wait)."""
        for _ in range(CLUSTER_REDIRECTIONS):
            if not isinstance(reply, RespError):
                return reply
            kind, _, rest = str(reply).partition(" ")
            asking = kind == "ASK"
            if kind in ("MOVED", "ASK"):
                slot, _, address = rest.partition(" ")
                node = _address(address, self._seed.host or "localhost")
                if kind == "MOVED":
                    if self._slots is not None:
                        self._slots[int(slot)] = node
                    self._refresh_later()
            elif kind == "TRYAGAIN":
                await asyncio.sleep(CLUSTER_TRY_AGAIN_S)
                node = await self._route(command)
            else:
                return reply
            reply = await self._send_one(node, command, asking, timeout_s, wait_s)
        return reply

    async def _send_one(
        self, node: Node, command: Sequence[Arg], asking: bool, timeout_s: float | None, wait_s: float | None
    ) -> Any:
        if wait_s is None:
            return (await self._send(node, [("ASKING",), command] if asking else [command], timeout_s))[-1]
        try:
            return await self._node(node).blocking(*command, wait_s=wait_s, timeout_s=timeout_s, asking=asking)
        except RespError as exc:
            return exc
        except RedisSkipped:
            raise
        except OUTAGES:
            self._slots = None
            raise

    async def _routed(self, commands: Sequence[Sequence[Arg]], timeout_s: float | None, probe: bool) -> list[Any]:
        groups: dict[Node, list[int]] = {}
        for i, command in enumerate(commands):
            groups.setdefault(await self._route(command), []).append(i)
        replies: list[Any] = [None] * len(commands)
        if len(groups) == 1:  # a turn's pipeline: one thread, one slot
            ((node, _),) = groups.items()
            replies = await self._send(node, commands, timeout_s, probe)
        else:
            sent = [
                self._send(node, [commands[i] for i in indexes], timeout_s, probe) for node, indexes in groups.items()
            ]
            for indexes, answers in zip(groups.values(), await asyncio.gather(*sent), strict=True):
                for i, answer in zip(indexes, answers, strict=True):
                    replies[i] = answer
        for i, reply in enumerate(replies):
            if isinstance(reply, RespError):
                replies[i] = await self._follow(commands[i], reply, timeout_s)
        return replies

    # -- RespClient's calls --------------------------------------------------------------------------------------------

    async def pipeline(
        self, commands: Sequence[Sequence[Arg]], *, probe: bool = False, timeout_s: float | None = None
    ) -> list[Any]:
        """As RespClient.pipeline; commands for several nodes go to each at once, their replies back in order. Each
        node's breaker judges the commands for it."""
        return await self._routed(commands, timeout_s, probe)

    async def execute(self, *command: Arg, timeout_s: float | None = None) -> Any:
        (reply,) = await self.pipeline([command], timeout_s=timeout_s)
        if isinstance(reply, RespError):
            raise reply
        return reply

    async def blocking(self, *command: Arg, wait_s: float, timeout_s: float | None = None) -> Any:
        """As RespClient.blocking, on the node of the command's key (and that node's breaker)."""
        node = await self._route(command)
        first = await self._send_one(node, command, False, timeout_s, wait_s)
        reply = await self._follow(command, first, timeout_s, wait_s)
        if isinstance(reply, RespError):
            raise reply
        return reply

    async def aclose(self) -> None:
        if self._refreshing is not None:
            self._refreshing.cancel()
        for client in self._nodes.values():
            await client.aclose()
        self._nodes.clear()


def redis_client(url: str, *, timeout_s: float = COMMAND_TIMEOUT_S, connections: int = 4) -> RedisClient:
    """The client for a Redis URL: a Cluster's with `cluster=1` among its options, else a standalone Redis's. A
    process builds one (statestore/resources.py), which everything it keeps in Redis shares."""
    plain, cluster = split_cluster_flag(url)
    if cluster:
        return ClusterClient(plain, timeout_s=timeout_s, connections=connections)
    return RespClient(plain, timeout_s=timeout_s, connections=connections)
