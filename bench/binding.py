"""What binding a statement by name costs (store/statement.py): a thread turn's commit (30 values) and its lease take
(6), each from its typed parameter object, against the same values written out as a positional tuple, the way the
commit bound them before. CPU only, in this process; the two are timed alternately and the best of each is kept.

    python -m bench.binding [--repeats 15] [--number 50000]
"""

from __future__ import annotations

import argparse
import timeit
from collections.abc import Callable
from typing import Any

from statestore.store.lease_statements import TAKE_THREAD_BY_RESPONSE, TakeThreadByResponse
from statestore.store.thread_commit import COMMIT_THREAD_TURN, CommitThreadTurn, usage_key
from statestore.store.turn_records import TurnCommit, TurnUsage

COMMIT = TurnCommit(
    thread_id="thr_0123456789abcdef",
    lease_token="0123456789abcdef",
    start_position=40,
    rows=[(b'{"role":"user","content":"' + b"x" * 200 + b'"}', None), (b'{"role":"assistant"}', "msg_1")],
    head_message_id="msg_1",
    expires_ms=2_000_000,
    ttl_seconds=300,
    now_ms=1_000_000,
    metadata_user_id=None,
    reply_backend_id="msg_backend",
    usage=TurnUsage(1200, 80, 0, 1100),
    model="m",
    max_tokens=1024,
    context_tokens=1280,
)


_COMMIT_PG = COMMIT_THREAD_TURN.on_pg()
_TAKE_PG = TAKE_THREAD_BY_RESPONSE.on_pg()


def commit_as_tuple() -> tuple[Any, ...]:
    """The positional expressions the commit was bound from, the context part inlined."""
    commit = COMMIT
    return (
        commit.thread_id,
        commit.lease_token,
        commit.expected_head,
        commit.head_message_id,
        sum(len(body) for body, _ in commit.rows),
        commit.ttl_seconds,
        commit.now_ms,
        commit.expires_ms,
        commit.metadata_user_id,
        len(commit.rows),
        [commit.start_position + offset for offset in range(len(commit.rows))],
        [body for body, _ in commit.rows],
        [response_id for _, response_id in commit.rows],
        [commit.reply_backend_id if response_id is not None else None for _, response_id in commit.rows],
        commit.usage.input_tokens,
        commit.usage.output_tokens,
        commit.usage.cache_creation_input_tokens,
        commit.usage.cache_read_input_tokens,
        *usage_key(commit),
        *(commit.context_tokens, False, 0, 0, None, 0, 0, 0),
        commit.model,
        commit.max_tokens,
    )


def commit_by_name() -> tuple[Any, ...]:
    return _COMMIT_PG.bind(CommitThreadTurn.of(COMMIT))


def take_as_tuple() -> tuple[Any, ...]:
    return ("thr_0123456789abcdef", "owner", "msg_1", 1_000_000, "0123456789abcdef", 1_030_000)


def take_by_name() -> tuple[Any, ...]:
    return _TAKE_PG.bind(
        TakeThreadByResponse(
            thread_id="thr_0123456789abcdef",
            owner="owner",
            head_message_id="msg_1",
            now_ms=1_000_000,
            token="0123456789abcdef",
            until_ms=1_030_000,
        )
    )


def best_us(pair: tuple[Callable[[], object], Callable[[], object]], repeats: int, number: int) -> tuple[float, float]:
    best = [float("inf"), float("inf")]
    for _ in range(repeats):
        for i, function in enumerate(pair):
            best[i] = min(best[i], timeit.timeit(function, number=number) / number * 1e6)
    return best[0], best[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--number", type=int, default=50_000)
    args = parser.parse_args()
    assert len(commit_as_tuple()) == len(commit_by_name()) == 30
    for name, pair in (("commit", (commit_as_tuple, commit_by_name)), ("take", (take_as_tuple, take_by_name))):
        positional, by_name = best_us(pair, args.repeats, args.number)
        extra = by_name - positional
        print(f"{name:7s} positional {positional:5.2f} us   by name {by_name:5.2f} us   (+{extra:.2f} us)")


if __name__ == "__main__":
    main()
