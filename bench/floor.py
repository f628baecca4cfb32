"""Arm F: the floor of a threaded turn in Python. What any server must do to continue a thread durably, and nothing
else, written as cheaply as this stack allows, so that statestore's continue (arm C) can be set beside it.

Per continue, as statestore does: read the small request and find its thread; take the thread's lease with one
conditional UPDATE (an asyncpg prepared statement, asynchronous commit) while the history is read from Redis (one
MGET, raw RESP); forward the history joined with the new turn to the backend; parse the reply to store it; commit
the new messages and move the head in one durable statement; append them to the Redis copy; answer with the reply
under the next id. Connections come from statestore's own lean pool, Redis client and HTTP client
(upstream/http1.py), the cheapest this stack has. No routing, validation, auth, policy, logging, metrics, limits,
fingerprints, usage counters or context policy: those are what statestore adds on top of this floor.

With `--lease redis` the lease is a Redis claim instead (SET NX PX, sent in the one pipeline that reads the history,
released by a compare-and-delete sent with the append), and the durable commit's guard is a compare-and-set on the
head: the PostgreSQL round trip of the lease is gone, which is what this arm measures.

    python -m bench.floor --port 8092 --upstream http://127.0.0.1:8090 --database postgresql://… --redis redis://…
"""

from __future__ import annotations

import argparse
import asyncio
import secrets

import orjson
from starlette.types import Receive, Scope, Send

from bench.relay import StatestoreUpstream, serve_bare
from statestore.store.pg_pool import LeanPool
from statestore.store.resp import Arg, RespClient

SCHEMA = """
CREATE TABLE IF NOT EXISTS floor_threads (
    id text PRIMARY KEY, head text NOT NULL, position integer NOT NULL, lease text, lease_until bigint
);
CREATE TABLE IF NOT EXISTS floor_messages (
    thread_id text NOT NULL, position integer NOT NULL, body bytea NOT NULL, PRIMARY KEY (thread_id, position)
);
"""
LEASE = """
UPDATE floor_threads SET lease = $3, lease_until = $4 WHERE id = $1 AND head = $2 AND lease IS NULL
RETURNING position
"""
COMMIT = """
WITH moved AS (
    UPDATE floor_threads SET head = $3, position = position + 2, lease = NULL WHERE id = $1 AND lease = $2
    RETURNING id, position
)
INSERT INTO floor_messages (thread_id, position, body)
SELECT moved.id, moved.position - 2 + m.i, m.body FROM moved, unnest($4::bytea[]) WITH ORDINALITY AS m(body, i)
"""
COMMIT_ON_HEAD = """
WITH moved AS (
    UPDATE floor_threads SET head = $3, position = position + 2 WHERE id = $1 AND head = $2 AND lease IS NULL
    RETURNING id, position
)
INSERT INTO floor_messages (thread_id, position, body)
SELECT moved.id, moved.position - 2 + m.i, m.body FROM moved, unnest($4::bytea[]) WITH ORDINALITY AS m(body, i)
"""
RELEASE = "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end return 0"
CREATE = "INSERT INTO floor_threads (id, head, position) VALUES ($1, $2, $3)"
INSERT_MESSAGES = (
    "INSERT INTO floor_messages (thread_id, position, body) "
    "SELECT $1, m.i - 1, m.body FROM unnest($2::bytea[]) WITH ORDINALITY AS m(body, i)"
)
_RESPONSE_HEADERS = [(b"content-type", b"application/json")]


class Floor:
    def __init__(self, upstream: str, database: str, redis: str, prefix: str, *, redis_lease: bool = False) -> None:
        self._prefix = prefix
        self._redis_lease = redis_lease
        self._upstream_url = upstream.rstrip("/") + "/v1/messages"
        self._database = database
        self._client = StatestoreUpstream(upstream)
        self._redis = RespClient(redis)
        self._leases: LeanPool | None = None
        self._durable: LeanPool | None = None

    async def _start(self) -> None:
        await self._client.start()
        self._leases = LeanPool(self._database, max_size=8, timeout=10, server_settings={"synchronous_commit": "off"})
        self._durable = LeanPool(self._database, max_size=8, timeout=10, server_settings={})
        async with self._durable.acquire() as conn:
            await conn.execute(SCHEMA)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            while True:
                event = await receive()
                if event["type"] == "lifespan.startup":
                    await self._start()
                    await send({"type": "lifespan.startup.complete"})
                elif event["type"] == "lifespan.shutdown":
                    await self._client.stop()
                    await self._redis.aclose()
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        if scope["type"] != "http":
            return
        if scope["path"] != "/v1/messages":
            await send({"type": "http.response.start", "status": 404, "headers": []})
            await send({"type": "http.response.body", "body": b""})
            return
        parts = []
        while True:
            message = await receive()
            parts.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        request = orjson.loads(b"".join(parts))
        thread = request.pop("thread")
        new = [orjson.dumps(m) for m in request.pop("messages")]
        if thread["type"] == "create":
            reply, status = await self._create(request, new)
        else:
            continue_ = self._continue_claimed if self._redis_lease else self._continue
            reply, status = await continue_(request, new, thread["previous_message_id"])
        await send({"type": "http.response.start", "status": status, "headers": _RESPONSE_HEADERS})
        await send({"type": "http.response.body", "body": reply, "more_body": False})

    async def _forward(self, request: dict[str, object], history: bytes) -> dict[str, object]:
        request["messages"] = orjson.Fragment(b"[" + history + b"]")
        _status, _, chunks = await self._client.request(
            "POST", self._upstream_url, [(b"content-type", b"application/json")], orjson.dumps(request)
        )
        body = b"".join([chunk async for chunk in chunks])
        reply: dict[str, object] = orjson.loads(body)
        return reply

    async def _create(self, request: dict[str, object], new: list[bytes]) -> tuple[bytes, int]:
        thread_id = secrets.token_hex(8)
        reply = await self._forward(request, b",".join(new))
        stored = orjson.dumps({"role": "assistant", "content": reply["content"]})
        head = f"{thread_id}.{len(new) + 1}"
        assert self._durable is not None
        async with self._durable.acquire() as conn, conn.transaction():
            await conn.execute(CREATE, thread_id, head, len(new) + 1)
            await conn.execute(INSERT_MESSAGES, thread_id, [*new, stored])
        await self._redis.pipeline(
            [
                ("SET", f"{self._prefix}{thread_id}:h", b",".join([*new, stored])),
                ("SET", f"{self._prefix}{thread_id}:n", len(new) + 1),
            ]
        )
        reply["id"] = head
        return orjson.dumps(reply), 200

    async def _reply(
        self, request: dict[str, object], history: bytes, new: list[bytes]
    ) -> tuple[dict[str, object], bytes]:
        """The backend's reply to the history and the new turn, and the assistant message to store."""
        reply = await self._forward(request, b",".join([history, *new]))
        return reply, orjson.dumps({"role": "assistant", "content": reply["content"]})

    def _appended(self, thread_id: str, added: list[bytes], count: int) -> list[tuple[Arg, ...]]:
        """The Redis commands that append a turn's messages to the cached history and set its count."""
        return [
            ("APPEND", f"{self._prefix}{thread_id}:h", b"," + b",".join(added)),
            ("SET", f"{self._prefix}{thread_id}:n", count),
        ]

    async def _continue(self, request: dict[str, object], new: list[bytes], previous: str) -> tuple[bytes, int]:
        thread_id = previous.partition(".")[0]
        token = secrets.token_hex(8)
        assert self._leases is not None and self._durable is not None
        leases = self._leases

        async def lease() -> int | None:
            async with leases.acquire() as conn:
                position: int | None = await conn.fetchval(LEASE, thread_id, previous, token, 1)
                return position

        position, (history, count) = await asyncio.gather(
            lease(), self._redis.execute("MGET", f"{self._prefix}{thread_id}:h", f"{self._prefix}{thread_id}:n")
        )
        if position is None or count is None or int(count) != position:
            return b'{"error":"not continuable or not cached"}', 409
        reply, stored = await self._reply(request, history, new)
        head = f"{thread_id}.{position + len(new) + 1}"
        async with self._durable.acquire() as conn:
            await conn.execute(COMMIT, thread_id, token, head, [*new, stored])
        await self._redis.pipeline(self._appended(thread_id, [*new, stored], position + len(new) + 1))
        reply["id"] = head
        return orjson.dumps(reply), 200

    async def _continue_claimed(self, request: dict[str, object], new: list[bytes], previous: str) -> tuple[bytes, int]:
        thread_id, _, at = previous.partition(".")
        position = int(at)
        token = secrets.token_hex(8)
        claim_key = f"{self._prefix}{thread_id}:lease"
        assert self._durable is not None
        claimed, (history, count) = await self._redis.pipeline(
            [
                ("SET", claim_key, token, "NX", "PX", 30_000),
                ("MGET", f"{self._prefix}{thread_id}:h", f"{self._prefix}{thread_id}:n"),
            ]
        )
        if claimed is None or count is None or int(count) != position:
            return b'{"error":"not continuable or not cached"}', 409
        reply, stored = await self._reply(request, history, new)
        head = f"{thread_id}.{position + len(new) + 1}"
        async with self._durable.acquire() as conn:
            moved = await conn.execute(COMMIT_ON_HEAD, thread_id, previous, head, [*new, stored])
        if moved.endswith(" 0"):
            return b'{"error":"the head moved"}', 409
        appended = self._appended(thread_id, [*new, stored], position + len(new) + 1)
        await self._redis.pipeline([*appended, ("EVAL", RELEASE, 1, claim_key, token)])
        reply["id"] = head
        return orjson.dumps(reply), 200


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.floor", description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--upstream", required=True)
    parser.add_argument("--database", required=True, help="a postgresql:// URL of a scratch database")
    parser.add_argument("--redis", required=True)
    parser.add_argument("--redis-prefix", required=True)
    parser.add_argument(
        "--lease",
        choices=("postgres", "redis"),
        default="postgres",
        help="where a turn takes its lease (default postgres)",
    )
    args = parser.parse_args()
    floor = Floor(args.upstream, args.database, args.redis, args.redis_prefix, redis_lease=args.lease == "redis")
    serve_bare(floor, "127.0.0.1", args.port)


if __name__ == "__main__":
    main()
