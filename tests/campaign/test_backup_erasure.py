"""Erasure reaches the backups (docs/encryption.md): with content sealed under a data key per erasure scope
and the keys in a key store of their own, a `pg_dump` of the content holds no content byte in clear, and once a tenant
and a user id are erased, a restore of a dump taken before the erasure, served next to the live key store, cannot
read or continue their conversations (a clear 404) while every other conversation continues from its restored head,
through both doors."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import anthropic
import openai
import pytest

from tests.campaign.cluster import running_cluster
from tests.reliability.proof_support import ADMIN_TOKEN
from tests.reliability.support import PG_BIN, ServerProcess
from tests.support.admin_api import MODEL, AdminApi, unique, user

MARKER = "plaintext-marker-5c1e"
UPSTREAM_KEY = "sk-backend-drill"


def _run(*command: str) -> None:
    done = subprocess.run(command, capture_output=True, timeout=120, check=False)
    assert done.returncode == 0, f"{command[0]} failed: {done.stderr.decode(errors='replace')}"


class Conversation:
    """One scope's thread (Messages door) and Responses chain, two turns each, every input carrying MARKER."""

    def __init__(self, label: str, key: str, user_id: str | None) -> None:
        self.label, self.key, self.user_id = label, key, user_id
        self.texts: list[str] = []
        self.thread_head = ""
        self.response_id = ""

    def metadata(self) -> dict[str, Any]:
        return {"metadata": {"user_id": self.user_id}} if self.user_id else {}

    def make(self, url: str) -> None:
        with anthropic.Anthropic(base_url=url, api_key=self.key, max_retries=0) as sdk:
            thread = sdk.beta.messages.thread(model=MODEL, max_tokens=64, system=f"system {MARKER}", **self.metadata())
            for n in range(2):
                self.texts.append(f"{self.label} turn {n} {MARKER}")
                thread.send(user(self.texts[-1]))
            self.thread_head = thread.previous_message_id or ""
        with openai.OpenAI(base_url=url + "/v1", api_key=self.key, max_retries=0) as client:
            previous = None
            for n in range(2):
                previous = client.responses.create(
                    model="echo-1", input=f"{self.label} response {n} {MARKER}", previous_response_id=previous,
                    **self.metadata(),
                ).id  # fmt: skip
            assert previous is not None
            self.response_id = previous

    def continue_thread(self, url: str) -> anthropic.types.beta.BetaMessage:
        with anthropic.Anthropic(base_url=url, api_key=self.key, max_retries=0) as sdk:
            return sdk.beta.messages.create(
                model=MODEL,
                max_tokens=64,
                messages=[user(f"{self.label} after the restore")],
                extra_body={"thread": {"type": "continue", "previous_message_id": self.thread_head}},
                betas=["message-threads-2026-08-12"],
            )

    def continue_chain(self, url: str) -> str:
        with openai.OpenAI(base_url=url + "/v1", api_key=self.key, max_retries=0) as client:
            client.responses.retrieve(self.response_id)
            return client.responses.create(
                model="echo-1", input=f"{self.label} after the restore", previous_response_id=self.response_id
            ).output_text


@pytest.mark.timeout(240)
def test_an_erasure_reaches_a_backup_taken_before_it(tmp_path: Path) -> None:
    keys_mode = {"STATESTORE_AUTH_MODE": "keys", "STATESTORE_UPSTREAM_API_KEY": UPSTREAM_KEY}
    with (
        running_cluster(replicas=1, encryption=True, keystore_database="keys", extra_settings=keys_mode) as cluster,
        AdminApi(cluster.url, ADMIN_TOKEN) as admin,
    ):
        erased_tenant, erased_key = admin.tenant_with_key()
        _, kept_key = admin.tenant_with_key()
        erased_user = unique("gone")
        conversations = {
            "erased-tenant": Conversation("erased-tenant", erased_key, None),
            "erased-tenant-user": Conversation("erased-tenant-user", erased_key, unique("u")),
            "erased-user": Conversation("erased-user", kept_key, erased_user),
            "kept-user": Conversation("kept-user", kept_key, unique("kept")),
            "kept": Conversation("kept", kept_key, None),
        }
        for conversation in conversations.values():
            conversation.make(cluster.url)

        port = str(cluster.pg.port)
        dump = tmp_path / "content.dump"
        # Uncompressed (-Z0), so a content byte in clear would be found by a plain search of the file.
        _run(str(PG_BIN / "pg_dump"), "-h", "127.0.0.1", "-p", port, "-U", "postgres", "-Fc", "-Z0", "-f", str(dump),
             "postgres")  # fmt: skip
        assert MARKER.encode() not in dump.read_bytes()
        assert b"plaintext-marker" not in dump.read_bytes()

        admin.erase({"tenant": erased_tenant["id"]})
        admin.erase({"user_id": erased_user})

        _run(str(PG_BIN / "createdb"), "-h", "127.0.0.1", "-p", port, "-U", "postgres", "restored")
        _run(str(PG_BIN / "pg_restore"), "-h", "127.0.0.1", "-p", port, "-U", "postgres", "-d", "restored", str(dump))
        with cluster.redis.client() as redis_client:
            redis_client.flushall()
        restored = ServerProcess(
            database_url=cluster.database_url.rsplit("/", 1)[0] + "/restored",
            upstream_url=cluster.backend.url,
            redis_url=cluster.redis.url,
            env={**cluster.settings, "STATESTORE_CHAT_UPSTREAM_URL": cluster.backend.url},
        )
        try:
            for label, conversation in conversations.items():
                if label.startswith("erased"):
                    with pytest.raises(anthropic.NotFoundError) as thread_refused:
                        conversation.continue_thread(restored.url)
                    assert "erased" in str(thread_refused.value.message), label
                    assert thread_refused.value.response.json()["error"]["details"]["error_code"] == "content_erased"
                    with pytest.raises(openai.NotFoundError) as chain_refused:
                        conversation.continue_chain(restored.url)
                    assert "erased" in str(chain_refused.value.message), label
                    assert chain_refused.value.code == "content_erased", label
                    continue
                cluster.backend.reset()
                conversation.continue_thread(restored.url)
                [request] = cluster.backend.requests()
                sent = [m["content"] for m in request.json()["messages"] if m["role"] == "user"]
                assert sent[: len(conversation.texts)] == [
                    [{"type": "text", "text": t}] for t in conversation.texts
                ] or (sent[: len(conversation.texts)] == conversation.texts), label
                assert conversation.continue_chain(restored.url), label
        finally:
            restored.stop()
