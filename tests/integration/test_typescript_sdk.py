"""The official TypeScript SDK (`@anthropic-ai/sdk`, installed in tests/node by `make test`) drives statestore's
threads: send, stream, and an expired thread that the SDK replays under a new thread (docs/protocol.md §2, §5); and
counts the tokens a continue would send (§11)."""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
from pathlib import Path
from typing import Any

import orjson
import pytest

from statestore.threads.ids import thread_of_response
from tests.integration.test_threads import advance_clock, echo, forwarded, said, user
from tests.support.fake_backend import FakeBackend
from tests.support.server import REPO, StatestoreServer

NODE_TESTS = REPO / "tests" / "node"


def run_node(script: Path, env: dict[str, str]) -> dict[str, Any]:
    node = shutil.which("node")
    assert node is not None, "node is not on PATH: install Node.js 20 (Debian: apt-get install nodejs)"
    assert (NODE_TESTS / "node_modules" / "@anthropic-ai" / "sdk").is_dir(), (
        "the TypeScript SDK is not installed: run `make test` (or `npm ci --prefix tests/node`)"
    )
    done = subprocess.run(
        [node, str(script)], env={**os.environ, **env}, capture_output=True, timeout=60, cwd=NODE_TESTS, check=False
    )
    assert done.returncode == 0, done.stderr.decode(errors="replace")
    result: dict[str, Any] = orjson.loads(done.stdout.strip().splitlines()[-1])
    return result


@pytest.fixture
def frozen_clock(clock_offset_file: Path) -> Path:
    advance_clock(clock_offset_file, 0)  # the file exists, so the script only adds to it
    return clock_offset_file


def test_typescript_thread_send_stream_and_replay(
    clock_server: StatestoreServer, backend: FakeBackend, frozen_clock: Path
) -> None:
    seen = run_node(
        NODE_TESTS / "threads.mjs",
        {
            "STATESTORE_URL": clock_server.url,
            "API_KEY": f"sk-ts-{secrets.token_hex(8)}",
            "CLOCK_OFFSET_FILE": str(frozen_clock),
            "EXPIRE_SECONDS": "61",  # the clock_server's threads live 60 seconds
        },
    )

    first, second, third = seen["first"], seen["second"], seen["third"]
    thread_id = thread_of_response(first["id"])
    assert thread_id is not None
    assert first["previous"] == first["id"]
    assert first["text"] == "echo: one"
    # A streamed continue of the same thread; the SDK moves its anchor to the streamed reply's minted id.
    assert thread_of_response(second["id"]) == thread_id
    assert second["text"] == second["streamed"] == "echo: two"
    assert second["previous"] == second["id"]
    # The thread expired before the third turn: statestore said thread_not_found, and the SDK replayed the whole
    # conversation as a create, which made a new thread.
    replayed_thread = thread_of_response(third["id"])
    assert replayed_thread is not None and replayed_thread != thread_id
    assert third["text"] == "echo: three"
    assert seen["messages"] == 6

    requests = backend.requests()
    assert [r.path for r in requests] == ["/v1/messages"] * 3  # the refused continue never reached the backend
    assert forwarded(backend, 0)["messages"] == [user("one")]
    streamed = forwarded(backend, 1)
    assert streamed["stream"] is True
    assert streamed["system"] == "Be brief."
    assert streamed["messages"] == [user("one"), said(echo("one")), user("two")]
    replay = forwarded(backend, 2)
    assert replay["system"] == "Be brief."
    assert replay["messages"] == [user("one"), said(echo("one")), user("two"), said(echo("two")), user("three")]


def test_typescript_count_tokens_over_a_thread(pg_server: StatestoreServer, backend: FakeBackend) -> None:
    seen = run_node(
        NODE_TESTS / "token_counts.mjs", {"STATESTORE_URL": pg_server.url, "API_KEY": f"sk-ts-{secrets.token_hex(8)}"}
    )
    assert seen["source"] == "backend"
    assert seen["counted"] == seen["input_tokens"] > 0
    # Counted again from the id the continue moved past: refused as that continue would be.
    assert seen["refused"] == {"status": 400, "code": "thread_already_continued"}
    counts = [request for request in backend.requests() if request.path == "/v1/messages/count_tokens"]
    assert len(counts) == 1
    assert counts[0].json()["messages"][-1] == user("two")
    assert "thread" not in counts[0].json()
