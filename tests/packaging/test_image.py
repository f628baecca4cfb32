"""The container image built from deploy/Dockerfile and run as an operator would: `migrate`, then `serve`, against
this machine's PostgreSQL and Redis, with a threaded conversation through the SDK. `make test` runs this module when
podman is installed (CI installs it); scripts/image.sh builds the image on a debootstrap'd Debian base."""

from __future__ import annotations

import secrets
import time
from collections.abc import Iterator
from pathlib import Path

import anthropic
import httpx
import pytest

from statestore.threads.ids import thread_of_response
from tests.packaging.podman import build_image, podman
from tests.support.fake_backend import FakeBackend
from tests.support.server import OWNER_SECRET, free_port, wait_until_up

IMAGE = "localhost/statestore:test"
pytestmark = pytest.mark.timeout(1500)


@pytest.fixture(scope="module")
def image() -> str:
    build_image(IMAGE)
    return IMAGE


def _container_env(database_url: str, **more: str) -> list[str]:
    settings = {"STATESTORE_DATABASE_URL": database_url, **more}
    return [arg for key, value in settings.items() for arg in ("--env", f"{key}={value}")]


@pytest.fixture
def container(
    image: str, fresh_pg_url: str, redis_url: str, redis_prefix: str, fake_backend: FakeBackend
) -> Iterator[tuple[str, str]]:
    """The image's `migrate`, then its default command with the host's network: (container name, base URL)."""
    migrated = podman("run", "--rm", "--network", "host", *_container_env(fresh_pg_url), image, "migrate")
    assert "created the schema at revision" in migrated.stdout, migrated.stdout

    port = free_port()
    name = f"statestore-test-{secrets.token_hex(4)}"
    env = _container_env(
        fresh_pg_url,
        STATESTORE_REDIS_URL=redis_url,
        STATESTORE_REDIS_PREFIX=redis_prefix,
        STATESTORE_UPSTREAM_URL=fake_backend.url,
        STATESTORE_OWNER_SECRET=OWNER_SECRET,
        STATESTORE_PORT=str(port),
    )
    podman("run", "--detach", "--name", name, "--network", "host", *env, image)
    try:
        url = f"http://127.0.0.1:{port}"
        _wait_for(url, name)
        yield name, url
    finally:
        podman("rm", "--force", "--time", "10", name, check=False)


def _wait_for(url: str, name: str) -> None:
    class _Running:
        # A `podman inspect` costs some 50 ms of CPU, more than the poll of /healthz it goes with: once a second.
        asked = 0.0

        def poll(self) -> int | None:
            if time.monotonic() - self.asked < 1.0:
                return None
            self.asked = time.monotonic()
            state = podman("inspect", "--format", "{{.State.Running}}", name).stdout.strip()
            return None if state == "true" else 1

    try:
        wait_until_up(url + "/healthz", _Running())  # type: ignore[arg-type]
    except RuntimeError:
        raise AssertionError(podman("logs", name, check=False).stderr) from None


def test_image_migrates_serves_a_threaded_conversation_as_non_root(container: tuple[str, str]) -> None:
    name, url = container
    with anthropic.Anthropic(base_url=url, api_key="sk-test-image", max_retries=0) as client:
        thread = client.beta.messages.thread(model="claude-test", max_tokens=64, system="Be brief.")
        texts = []
        for text in ("one", "two"):
            reply = thread.send({"role": "user", "content": text})
            assert reply.content[0].type == "text"
            texts.append(reply.content[0].text)
        with thread.stream({"role": "user", "content": "three"}) as stream:
            texts.append(stream.get_final_text())
        assert texts == ["echo: one", "echo: two", "echo: three"]
        thread_id = thread_of_response(thread.previous_message_id or "")

    exported = httpx.get(f"{url}/statestore/v1/threads/{thread_id}/messages", headers={"x-api-key": "sk-test-image"})
    assert exported.status_code == 200, exported.text
    assert len(exported.json()["messages"]) == 6

    # The server process (PID 1 of the container) runs as the image's service user, not root.
    status = podman("exec", name, "cat", "/proc/1/status").stdout
    uids = next(line for line in status.splitlines() if line.startswith("Uid:")).split()[1:]
    assert set(uids) == {"10001"}
    # The image's HEALTHCHECK command answers.
    health = podman("healthcheck", "run", name, check=False)
    assert health.returncode == 0, health.stdout + health.stderr
    # SIGTERM is a graceful stop: uvicorn exits 0.
    podman("stop", "--time", "30", name)
    assert podman("inspect", "--format", "{{.State.ExitCode}}", name).stdout.strip() == "0"


def test_image_ships_no_build_tools(image: str) -> None:
    listing = podman(
        "run", "--rm", "--network", "host", "--entrypoint", "/bin/sh", image, "-c", "ls /opt/statestore/bin; id -u"
    ).stdout.split()
    assert "statestore" in listing and "pip" not in listing
    assert listing[-1] == "10001"


def test_dockerfile_needs_no_migrations_setting() -> None:
    dockerfile = (Path(__file__).resolve().parents[2] / "deploy" / "Dockerfile").read_text()
    assert "STATESTORE_MIGRATIONS_DIR" not in dockerfile
