"""A commit carried out whose acknowledgement never comes back, as both the campaign (tests/campaign/nemesis.py)
and its regression tests (tests/campaign/test_lost_commit.py) arrange it: a FaultProxy between statestore and
PostgreSQL, the URL that goes through it, and the proxy armed to withhold one commit's answer."""

from __future__ import annotations

from collections.abc import Callable
from urllib.parse import urlsplit

from tests.campaign.network import FaultProxy


def through(url: str, port: int) -> str:
    """`url` (a database's or Redis's) with its host and port those of a proxy on 127.0.0.1:`port`."""
    parts = urlsplit(url)
    return parts._replace(
        netloc=f"{parts.username}@127.0.0.1:{port}" if parts.username else f"127.0.0.1:{port}"
    ).geturl()


def lose_commit(
    proxy: FaultProxy, marker: bytes, *, alone: bool = False, then: Callable[[], None] | None = None
) -> None:
    """Once: the transaction that carries `marker` is committed and its acknowledgement withheld, and the connection
    reset. `alone`: only a statement that commits by itself carries it (not one inside BEGIN ... COMMIT); `then`:
    run as the acknowledgement is withheld, before the connection is reset. The proxy clears the marker once hit."""
    proxy.faults.lose_commit_alone = alone
    proxy.faults.on_commit_lost = then
    proxy.faults.lose_commit_reply_after = marker


def commit_lost(proxy: FaultProxy) -> bool:
    """Whether the commit armed by `lose_commit` went through the proxy (its acknowledgement withheld)."""
    return proxy.faults.lose_commit_reply_after is None


def disarm(proxy: FaultProxy) -> None:
    proxy.faults.lose_commit_reply_after = None
    proxy.faults.lose_commit_alone = False
    proxy.faults.on_commit_lost = None
