"""The wheel as a user installs it: `pip install statestore-….whl` into a fresh environment outside the checkout, then
`statestore migrate` and `statestore serve` with no other setting, and a threaded conversation through the SDK."""

from __future__ import annotations

import subprocess
from pathlib import Path

import anthropic
import httpx
import orjson
import pytest
import websockets.sync.client

from statestore.threads.ids import thread_of_response
from tests.packaging.conftest import REPO, run
from tests.support.fake_backend import FakeBackend
from tests.support.server import OWNER_SECRET, StatestoreServer

# Building the wheel and installing it twice from the package index (the image's pins, the lower bounds) takes
# a minute or two on a quiet machine, more on a busy one.
pytestmark = pytest.mark.timeout(900)


def test_the_installed_package_runs_its_own_code_and_migrations(installed: Path, outside_env: dict[str, str]) -> None:
    python = installed.parent / "python"
    probe = run(
        [str(python), "-c", "import statestore.store.migrate as m; print(m.__file__); print(m.migrations_dir())"],
        cwd=installed.parent,
        env=outside_env,
    )
    module, migrations = (Path(line) for line in probe.stdout.splitlines())
    environment = installed.parent.parent
    assert module.is_relative_to(environment)
    assert migrations.is_relative_to(environment)
    assert not migrations.is_relative_to(REPO)
    shipped = sorted(path.name for path in (migrations / "versions").glob("0*.py"))
    assert shipped == sorted(path.name for path in (REPO / "migrations" / "versions").glob("0*.py"))
    assert (migrations / "script.py.mako").is_file()
    # Every file of the package ships, Python or not (templates, static assets, py.typed), and nothing else.
    installed_root = module.parent.parent

    def files(root: Path) -> set[str]:
        return {
            str(path.relative_to(root))
            for path in root.rglob("*")
            if path.is_file() and "__pycache__" not in path.parts and path.suffix != ".pyc"
        }

    package = {name for name in files(installed_root) if not name.startswith("migrations/")}
    assert package == files(REPO / "statestore")


@pytest.mark.parametrize("store", ["postgres", "sqlite"])
def test_installed_wheel_migrates_serves_and_keeps_a_thread(
    store: str,
    installed: Path,
    outside_env: dict[str, str],
    fresh_pg_url: str,
    redis_url: str,
    redis_prefix: str,
    fake_backend: FakeBackend,
    tmp_path: Path,
) -> None:
    if store == "postgres":
        database_url, redis = fresh_pg_url, redis_url
    else:
        database_url, redis = f"sqlite:///{tmp_path / 'data' / 'statestore.db'}", None
        (tmp_path / "data").mkdir()
    migrated = run(
        [str(installed), "migrate"], cwd=tmp_path, env={**outside_env, "STATESTORE_DATABASE_URL": database_url}
    )
    assert "created the schema at revision" in migrated.stdout, migrated.stdout

    server = StatestoreServer(
        database_url=database_url,
        upstream_url=fake_backend.url,
        redis_url=redis,
        redis_prefix=redis_prefix,
        command=[str(installed)],
        cwd=tmp_path,
        env={"PYTHONPATH": "", "STATESTORE_CHAT_UPSTREAM_URL": fake_backend.url},
    )
    try:
        # WebSocket mode, on the WebSocket protocol of the uvicorn and websockets installed (the lowest allowed, too).
        socket_url = server.url.replace("http://", "ws://") + "/v1/responses"
        with websockets.sync.client.connect(socket_url, additional_headers={"x-api-key": "sk-test-wheel"}) as socket:
            socket.send(orjson.dumps({"type": "response.create", "model": "echo-1", "input": "Socket"}).decode())
            events = [orjson.loads(socket.recv(timeout=30)) for _ in range(2)]
            assert [event["type"] for event in events] == ["response.created", "response.in_progress"]
        with anthropic.Anthropic(base_url=server.url, api_key="sk-test-wheel", max_retries=0) as client:
            thread = client.beta.messages.thread(model="claude-test", max_tokens=64)
            first = thread.send({"role": "user", "content": "Hello"})
            second = thread.send({"role": "user", "content": "Again"})
            with thread.stream({"role": "user", "content": "Streamed"}) as stream:
                assert stream.get_final_text() == "echo: Streamed"
            assert first.content[0].type == "text" and first.content[0].text == "echo: Hello"
            assert second.content[0].type == "text" and second.content[0].text == "echo: Again"
            thread_id = thread_of_response(thread.previous_message_id or "")
        exported = httpx.get(
            f"{server.url}/statestore/v1/threads/{thread_id}/messages", headers={"x-api-key": "sk-test-wheel"}
        )
        assert exported.status_code == 200, exported.text
        assert [m["role"] for m in exported.json()["messages"]] == ["user", "assistant"] * 3
        assert httpx.get(f"{server.url}/docs").status_code == 200
    finally:
        server.stop()
    # The installed command never looked at the checkout.
    assert not (tmp_path / "statestore.db").exists()


def test_serve_before_migrate_says_to_migrate(installed: Path, outside_env: dict[str, str], tmp_path: Path) -> None:
    database = tmp_path / "never-migrated.db"
    result = subprocess.run(
        [str(installed), "serve"],
        cwd=tmp_path,
        env={
            **outside_env,
            "STATESTORE_DATABASE_URL": f"sqlite:///{database}",
            "STATESTORE_UPSTREAM_URL": "http://127.0.0.1:9",
            "STATESTORE_OWNER_SECRET": OWNER_SECRET,
        },
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )
    assert result.returncode != 0
    assert "statestore migrate" in result.stderr
    assert str(database) in result.stderr
    assert not database.exists()
